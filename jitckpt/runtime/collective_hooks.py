"""Where the worker runtime sees the training loop: every wait on other ranks, backward, optimizer steps.

A thread that waits for other ranks does so in one of few places, whoever issued the collective,
so those places are wrapped (at class or module level) as *regions*: the runtime knows the main
thread is blocked there (hang detection, a save while it is held) and sees a transport error
(gloo raises when a peer dies) before the user's code does.

* ``Work.wait()`` and ``Future.wait()``: every torch.distributed collective issued from Python ends
  in one, synchronous ones (all_reduce, barrier, object collectives, ...) inside the call and
  ``async_op=True`` ones wherever the work handle or its future is waited for later.
* ``wait_tensor()`` of functional collectives (DTensor, tensor parallel), for DTensor jobs.
* Point-to-point calls (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``: pipeline
  stages): gloo raises in the call when the peer is gone.
* Collectives that C++ issues and waits for itself: DDP's constructor (parameter broadcast), DDP's
  ``_pre_forward``/``_post_forward`` (bucket rebuild, buffer broadcast), backward (DDP's gradient
  all-reduce runs and is waited for inside it) and ``monitored_barrier``.
* Global optimizer step pre/post hooks mark the optimizer phase, the one interval in which
  parameters and optimizer state change and a save would be torn.

DDP's numerics are untouched (no comm hook): they are exactly those of plain DDP. A resumed job's
DDP constructor skips its parameter broadcast while a checkpoint is about to be loaded
(:mod:`~jitckpt.runtime.ddp_init_sync`). The
:class:`~jitckpt.runtime.ddp_layout.LayoutTracker` records each DDP model's bucket layout on the training
thread, so every checkpoint can carry it; :class:`~jitckpt.runtime.ddp_buffers.BufferTracker` the buffers
and RNG state a JIT save must record.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from jitckpt.runtime.ddp_buffers import BufferTracker
from jitckpt.runtime.ddp_init_sync import DeferredInitSync
from jitckpt.runtime.ddp_layout import LayoutTracker


class RegionSink(Protocol):
    def region_enter(self, kind: str) -> int: ...
    def region_exit(self, token: int, exc: BaseException | None) -> None: ...
    def optimizer_pre_step(self) -> None: ...
    def optimizer_post_step(self) -> None: ...


def run_region(sink: RegionSink, kind: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` inside a region of the given kind."""
    tok = sink.region_enter(kind)
    try:
        out = fn()
    except BaseException as e:
        sink.region_exit(tok, e)
        raise
    sink.region_exit(tok, None)
    return out


def _tracked(fn: Callable, kind: str, sink: RegionSink, applies: Optional[Callable[..., bool]] = None,
             after: Optional[Callable[..., None]] = None) -> Callable:
    """``fn`` wrapped so each call that ``applies`` runs inside a region; ``after(*args)`` runs
    once the call returned (outside the region)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if applies is not None and not applies(*args, **kwargs):
            return fn(*args, **kwargs)
        out = run_region(sink, kind, lambda: fn(*args, **kwargs))
        if after is not None:
            after(*args)
        return out

    wrapper.__jitckpt_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _distributed(*args: Any, **kwargs: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class CollectiveHooks:
    """Installs the wrappers and hooks once per process; ``remove()`` restores the originals."""

    def __init__(self, sink: RegionSink, *, resuming: Callable[[], bool] = lambda: False) -> None:
        self._sink = sink
        self.init_sync = DeferredInitSync(resuming)
        self._saved: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []
        self.layouts = LayoutTracker()
        self.buffers = BufferTracker()
        self._ddp_models: list[Any] = []
        self._depth = threading.local()  # nesting of backward calls (reentrant checkpointing)
        self._step_depth = 0  # nesting of the training thread's optimizer steps (ZeRO's wraps its local one)

    def _wrap(self, owner: Any, name: str, kind: str, applies: Optional[Callable[..., bool]] = None,
              after: Optional[Callable[..., None]] = None) -> None:
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None or hasattr(fn, "__jitckpt_wrapped__"):
            return
        self._saved.append((owner, name, fn))
        setattr(owner, name, _tracked(fn, kind, self._sink, applies, after))

    def install(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not hasattr(DDP.__init__, "__jitckpt_wrapped__"):  # inside the regions wrapped next
            for name, wrap in (("__init__", self.init_sync.wrap_init),
                               ("_pre_forward", self.init_sync.wrap_pre_forward)):
                self._saved.append((DDP, name, DDP.__dict__[name]))
                setattr(DDP, name, wrap(DDP.__dict__[name]))
        self._wrap(dist.Work, "wait", "collective", _distributed)
        # torch.futures.Future.wait calls this one: wrapping it covers both.
        self._wrap(torch._C.Future, "wait", "collective", _distributed)
        self._wrap(dist, "monitored_barrier", "collective")
        # Point to point (pipeline stages): gloo posts a send or receive at once, so a peer already
        # gone raises in the call itself, before any wait.
        for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv"):
            self._wrap(dist, name, "collective", _distributed)
        # P2POp accepts only the c10d module's own isend/irecv (torch.distributed.pipelining passes
        # dist.isend): they become the same wrappers, or every P2POp of a pipeline job would raise.
        from torch.distributed import distributed_c10d as c10d

        for name in ("isend", "irecv"):
            wrapped = getattr(dist, name, None)
            if hasattr(wrapped, "__jitckpt_wrapped__") and getattr(c10d, name, None) is not wrapped:
                self._saved.append((c10d, name, getattr(c10d, name)))
                setattr(c10d, name, wrapped)
        self._wrap(DDP, "__init__", "ddp_init", after=self._ddp_constructed)
        sink = self._sink
        self._wrap(DDP, "_pre_forward", "ddp_forward", after=self._ddp_forward_began)
        self._wrap(DDP, "_post_forward", "ddp_forward",
                   after=lambda ddp, *_: self.buffers.forward_done(
                       ddp, lambda fn: run_region(sink, "ddp_buffers", fn)))
        bw = torch.autograd.backward
        if not hasattr(bw, "__jitckpt_wrapped__"):
            self._saved.append((torch.autograd, "backward", bw))
            torch.autograd.backward = self._backward(bw)
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)

        from jitckpt.runtime.step_closure import begin_after_closure
        self._handles.append(register_optimizer_step_pre_hook(
            lambda opt, args, kwargs: begin_after_closure(args, kwargs, self._step_began)))
        self._handles.append(register_optimizer_step_post_hook(lambda *a, **k: self._step_done()))

    def install_functional_waits(self) -> None:
        """DTensor's collectives (tensor parallel's all-reduces, redistributes) are functional
        collectives, waited for in ``wait_tensor()``, not in a ``Work.wait()``: wrapped too, once a
        DTensor job is protected (other jobs do not pay for the module's import). Not while
        torch.compile traces: the compiled graph waits by itself."""
        import torch.distributed._functional_collectives as funcol

        def applies(*args: Any, **kwargs: Any) -> bool:
            return not torch.compiler.is_compiling() and _distributed()

        self._wrap(funcol, "wait_tensor", "collective", applies)

    def _ddp_constructed(self, ddp: Any, *_: Any) -> None:
        # Kept alive until the interpreter exits, after the exit barrier: freeing a DDP model when
        # the script's main() returns destroys its ProcessGroupGloo with the GIL held, which can
        # deadlock with gloo's worker thread releasing its last work (it needs the GIL).
        self._ddp_models.append(ddp)
        self.layouts.constructed(ddp)

    def _ddp_forward_began(self, ddp: Any, *_: Any) -> None:
        self.layouts.forward_began(ddp)
        self.buffers.forward_began(ddp)

    # The optimizer phase is the training thread's outermost step: ZeroRedundancyOptimizer.step()
    # runs its local optimizer's step (hooks and all), then all-gathers the updated parameters, and
    # AOR's replica steps its own optimizer on a worker thread meanwhile. Ending the phase with
    # either let a save land in that all-gather, the parameters half updated (found from outside:
    # a preempted ZeRO job's ranks saved shards with different parameters).
    def _step_began(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._step_depth += 1
        if self._step_depth == 1:
            self._sink.optimizer_pre_step()

    def _step_done(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._step_depth = max(self._step_depth - 1, 0)
        if self._step_depth == 0:
            self.buffers.step_done()
            self._sink.optimizer_post_step()

    def _backward(self, bw: Callable) -> Callable:
        """Backward as a region; after the outermost one, DDP's one-time bucket rebuild (see
        :meth:`LayoutTracker.rebuild_after_backward`), itself a collective, in a region too."""
        region = _tracked(bw, "backward", self._sink, _distributed)
        sink = self._sink

        @functools.wraps(bw)
        def backward(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            try:
                out = region(*args, **kwargs)
            finally:
                self._depth.n = depth
            if depth == 0 and _distributed():
                self.layouts.rebuild_after_backward(lambda fn: run_region(sink, "ddp_rebuild", fn))
            return out

        backward.__jitckpt_wrapped__ = bw  # type: ignore[attr-defined]
        return backward

    def remove(self) -> None:
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
