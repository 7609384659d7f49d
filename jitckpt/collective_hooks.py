"""Where the worker runtime sees the training loop: blocking collectives, backward, optimizer steps.

* Synchronous ``torch.distributed`` collectives (all_reduce, barrier, ...) are wrapped so the
  runtime knows when the main thread is blocked in one, and catches a collective that raises
  (gloo raises when a peer dies) before the user's code sees it.
* ``torch.autograd.backward`` (what ``loss.backward()`` calls) is wrapped the same way: DDP's
  gradient all-reduce runs and is waited for inside backward, so a hung or failed DDP all-reduce
  shows up as a long or failing backward. DDP itself is untouched (no comm hook), so gradient
  numerics are exactly those of plain DDP.
* Global optimizer step pre/post hooks mark the optimizer phase, the one interval in which
  parameters and optimizer state change and a save would be torn.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

# Synchronous collectives wrapped when called with async_op=False (the default).
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "send", "recv", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "monitored_barrier",
)


class RegionSink(Protocol):
    def region_enter(self, kind: str) -> int: ...
    def region_exit(self, token: int, exc: BaseException | None) -> None: ...
    def optimizer_pre_step(self) -> None: ...
    def optimizer_post_step(self) -> None: ...


def is_collective_failure(exc: BaseException) -> bool:
    """True for errors raised because a peer or the transport failed (not user bugs)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(s in text for s in (
            "gloo", "connection reset", "connection closed", "connection refused", "broken pipe",
            "nccl", "timed out", "peer", "socket"))
    return False


def _tracked(fn: Callable, kind: str, sink: RegionSink, applies: Callable[..., bool]) -> Callable:
    """``fn`` wrapped so each call that ``applies`` runs inside a region of the given kind."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not applies(*args, **kwargs):
            return fn(*args, **kwargs)
        tok = sink.region_enter(kind)
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            sink.region_exit(tok, e)
            raise
        sink.region_exit(tok, None)
        return out

    wrapper.__jitckpt_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _synchronous(*args: Any, **kwargs: Any) -> bool:
    return not kwargs.get("async_op")


def _distributed(*args: Any, **kwargs: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class CollectiveHooks:
    """Installs the wrappers and hooks once per process; ``remove()`` restores the originals."""

    def __init__(self, sink: RegionSink) -> None:
        self._sink = sink
        self._saved: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []

    def install(self) -> None:
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or hasattr(fn, "__jitckpt_wrapped__"):
                continue
            self._saved.append((dist, name, fn))
            setattr(dist, name, _tracked(fn, name, self._sink, _synchronous))
        bw = torch.autograd.backward
        if not hasattr(bw, "__jitckpt_wrapped__"):
            self._saved.append((torch.autograd, "backward", bw))
            torch.autograd.backward = _tracked(bw, "backward", self._sink, _distributed)
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        sink = self._sink
        self._handles.append(register_optimizer_step_pre_hook(lambda *a, **k: sink.optimizer_pre_step()))
        self._handles.append(register_optimizer_step_post_hook(lambda *a, **k: sink.optimizer_post_step()))

    def remove(self) -> None:
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
