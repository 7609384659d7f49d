"""DDP's parameter broadcast at construction, deferred while a resumed job loads a checkpoint.

DDP's constructor broadcasts rank 0's parameters and buffers so that every replica starts alike.
In a job that resumes from a checkpoint that broadcast is wasted: ``state.restore()`` overwrites
the same tensors on every rank with the same bytes right after. On the bench model (33 MB of
parameters) it was 0.1 s of a restarted worker's 0.3 s to get back to training. So, when the
worker knows a checkpoint to resume from, DDP is built with ``init_sync=False`` (the parameter
shapes are still verified across ranks), and the broadcast is owed until either
``Protected.restore()`` loads the checkpoint on this rank (:meth:`DeferredInitSync.loaded`: every
replica now holds the same state, nothing is owed) or the model's first forward, which then does
DDP's broadcast itself before anything reads the parameters. A script that loads its own
checkpoint, or none, thus still starts from rank 0's tensors, only later. A ``DDP(...)`` call that
sets ``init_sync`` itself is left alone.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes


def init_syncs_buffers(ddp: Any, kwargs: dict) -> bool:
    """Whether DDP's own init sync would include the buffers. torch 2.13: unless
    ``broadcast_buffers=False`` was given without ``forward_sync_buffers`` (which, given, always
    syncs them at init); 2.11 and 2.12 have ``broadcast_buffers`` only."""
    if hasattr(ddp, "forward_sync_buffers"):
        return kwargs.get("forward_sync_buffers") is not None or bool(ddp.forward_sync_buffers)
    return bool(ddp.broadcast_buffers)


class DeferredInitSync:
    """Wraps ``DDP.__init__``/``_pre_forward``; ``resuming()`` says whether to defer (per call)."""

    def __init__(self, resuming: Callable[[], bool]) -> None:
        self._resuming = resuming
        self._owed: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()

    def wrap_init(self, init: Callable) -> Callable:
        @functools.wraps(init)
        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            # args: module, device_ids, output_device, dim, broadcast_buffers, init_sync, ...
            if "init_sync" in kwargs or len(args) > 5 or not self._resuming():
                return init(ddp, *args, **kwargs)
            init(ddp, *args, init_sync=False, **kwargs)
            params = [p for n, p in ddp.module.named_parameters()
                      if p.requires_grad and n not in ddp.parameters_to_ignore]
            _verify_param_shape_across_processes(ddp.process_group, params)
            self._owed[ddp] = init_syncs_buffers(ddp, kwargs)

        return __init__

    def wrap_pre_forward(self, pre_forward: Callable) -> Callable:
        @functools.wraps(pre_forward)
        def _pre_forward(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            if self._owed:
                self.pay(ddp)
            return pre_forward(ddp, *args, **kwargs)

        return _pre_forward

    def pay(self, ddp: Any) -> None:
        """Do the broadcast ``ddp``'s constructor skipped, if it is still owed."""
        buffers = self._owed.pop(ddp, None)
        if buffers is None:
            return
        _sync_module_states(module=ddp.module, process_group=ddp.process_group,
                            broadcast_bucket_size=ddp.broadcast_bucket_size, src=0,
                            params_and_buffers_to_ignore=ddp.parameters_to_ignore,
                            broadcast_buffers=bool(buffers))

    def loaded(self) -> None:
        """This rank loaded the checkpoint every replica loads: no broadcast is owed any more."""
        self._owed.clear()

    @property
    def owed(self) -> int:
        return len(self._owed)
