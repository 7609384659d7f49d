"""A call after a protected scheduler's ``step()``, leaving the scheduler object as it was.

A DTensor job's shard snapshot of the next minibatch is complete once the scheduler has stepped
(``optimizer.step(); scheduler.step()``), and LR schedulers have no hook for that. An attribute on
the instance would land in ``scheduler.state_dict()`` (which returns its ``__dict__``) and break
the user's own pickling of it, so the scheduler's class gets a wrapper (once) that looks the
instance up in a weak registry: other instances, and the class's behaviour, are unchanged.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

_AFTER: "weakref.WeakKeyDictionary[Any, Callable[[], None]]" = weakref.WeakKeyDictionary()
_MARK = "_jitckpt_after_step"


def after_step(scheduler: Any, fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn()`` after each ``scheduler.step()``; returns the function that stops it. Raises
    TypeError for an object that cannot be registered weakly (no ``__weakref__`` slot)."""
    cls = type(scheduler)
    own = cls.__dict__.get("step")
    if not getattr(own, _MARK, False):
        stepped = cls.step

        @functools.wraps(stepped)
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = stepped(self, *args, **kwargs)
            then = _AFTER.get(self)
            if then is not None:
                then()
            return out

        setattr(step, _MARK, True)
        cls.step = step
    _AFTER[scheduler] = fn
    return lambda: _AFTER.pop(scheduler, None)
