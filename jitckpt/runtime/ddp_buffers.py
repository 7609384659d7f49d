"""The model buffers (BatchNorm statistics) and RNG state a JIT checkpoint must hold, per DDP model.

With DDP's default ``broadcast_buffers``, every rank's forward *i* starts from rank 0's buffers as
they were after its forward *i-1* (DDP broadcasts them at the start of forward *i*). A survivor
saving after a failure holds its own buffers, not rank 0's, and after forward *i* they are already
advanced by it. So, for every DDP model, after each training forward every rank receives a copy of
rank 0's buffers (one extra broadcast of the buffers, inside a region: the start state of the next
minibatch, also when rank 0 is the rank lost), and when a minibatch's first forward begins, those
become that minibatch's start state. Right before a JIT save the runtime puts the live buffers (and,
in the middle of a minibatch, the RNG states) back to that start state, whatever the save function
(``protect()`` or ``jitckpt.init(save_fn)``): the process exits after the save, so nothing runs on
with them. With ``broadcast_buffers=False``, Join, or no DDP, buffers are per-rank state and are
saved as they are.
"""
from __future__ import annotations

import random
import weakref
from typing import Any, Callable, Optional

import torch


def rng_state() -> dict:
    """Every RNG a training step may draw from (torch CPU and CUDA, Python, NumPy)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)
    except ImportError:
        pass
    return state


def numpy_state(state: dict) -> tuple:
    """NumPy's part of an :func:`rng_state` as ``np.random.get_state()`` gives it."""
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    return kind, keys.numpy(), pos, has_gauss, gauss


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(numpy_state(state))


def _clone(ddp: Any) -> dict:
    return {k: b.detach().clone() for k, b in ddp.module.named_buffers()}


class BufferTracker:
    """Start-of-minibatch buffers of each live DDP model and the RNG state, on the training thread."""

    def __init__(self) -> None:
        self._next: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        self._start: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        self._rng: Optional[dict] = None
        self._mid = False  # a minibatch's first forward began and its optimizer step has not ended

    def forward_began(self, ddp: Any, *_: Any) -> None:
        """After DDP's ``_pre_forward`` (its buffer broadcast done): the first forward of a
        minibatch records that minibatch's start state."""
        if self._mid or not torch.is_grad_enabled() or not ddp.training:
            return
        self._mid = True
        self._rng = rng_state()
        if any(True for _ in ddp.module.buffers()):
            self._start[ddp] = self._next.pop(ddp, None) or _clone(ddp)

    def forward_done(self, ddp: Any, in_region: Callable[[Callable[[], Any]], Any]) -> None:
        """After DDP's forward: rank 0's buffers as they are now, the next minibatch's start."""
        if not torch.is_grad_enabled() or not any(True for _ in ddp.module.buffers()):
            return
        join = getattr(getattr(ddp, "_join_config", None), "enable", False)
        if join or not ddp._check_sync_bufs_pre_fwd():
            self._next.pop(ddp, None)  # the next forward broadcasts nothing (or Join picks the rank)
            return
        copy = _clone(ddp)
        import torch.distributed as dist

        in_region(lambda: dist._broadcast_coalesced(ddp.process_group, list(copy.values()),
                                                    ddp.broadcast_bucket_size, 0))
        self._next[ddp] = copy

    def step_done(self) -> None:
        """After an optimizer step: the minibatch is over."""
        self._mid = False

    def next_of(self, ddp: Any) -> Optional[dict]:
        """Rank 0's buffers after ``ddp``'s last training forward (None: not shared)."""
        return self._next.get(ddp)

    def rewind_for_save(self) -> None:
        """Put every DDP model's buffers (and mid-minibatch, the RNG states) to the start state of
        the minibatch a JIT save records. Only right before a save after which the process exits."""
        with torch.no_grad():
            for ddp in {*self._start.keys(), *self._next.keys()}:
                target = self._start.get(ddp) if self._mid else self._next.get(ddp)
                if target is None:
                    continue
                for name, buf in ddp.module.named_buffers():
                    if name in target:
                        buf.copy_(target[name])
        if self._mid and self._rng is not None:
            set_rng_state(self._rng)
