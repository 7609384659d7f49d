"""``torch.compile`` and ``protect()``: the forward pre-hook must run eagerly at every step.

Under ``torch.compile`` dynamo traces a module's hooks into its graph. protect()'s hook is the
minibatch boundary (a safe point, periodic checkpoints, the RNG and buffer records), so traced it
would run once, at trace time, and a save from it would be traced too (found from outside: every
periodic save of a compiled model failed inside dynamo). A hook wrapped in ``torch._dynamo.disable``
is a graph break that runs eagerly at each call. Importing dynamo costs about a second, so this is
done only when the job compiles: at ``protect()`` if dynamo is already imported, else when
``torch.compile`` is first called.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable

import torch

_watched: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _eager(module: torch.nn.Module, handle: Any, hook: Callable) -> None:
    import torch._dynamo

    hooks = module._forward_pre_hooks
    if handle.id in hooks and not getattr(hooks[handle.id], "_torchdynamo_disable", False):
        hooks[handle.id] = torch._dynamo.disable(hook)  # the same slot: hook order is kept


def watch(state: Any) -> None:
    """Keep ``state``'s forward pre-hook (``state.model``, ``state.forward_hook``) out of dynamo's
    graphs from the job's first ``torch.compile`` on (or now, if it compiled already)."""
    if "torch._dynamo" in sys.modules:
        _eager(state.model, state.forward_hook, state._on_forward)
        return
    _watched.add(state)
    compile_fn = torch.compile
    if getattr(compile_fn, "__jitckpt_wrapped__", None) is not None:
        return

    @functools.wraps(compile_fn)
    def compile(*args: Any, **kwargs: Any) -> Any:
        for s in list(_watched):
            _eager(s.model, s.forward_hook, s._on_forward)
        _watched.clear()
        return compile_fn(*args, **kwargs)

    compile.__jitckpt_wrapped__ = compile_fn  # type: ignore[attr-defined]
    torch.compile = compile
