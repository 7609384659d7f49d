"""Where an optimizer step begins when it is given a closure.

``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) runs the step's pre-hooks
before the closure's forward and backward, which leave parameters and optimizer state untouched;
the update begins once the closure returns. A pre-hook that marks the step's beginning (a save
after it would be torn) uses :func:`begin_after_closure` so that a failure in the backward's
collectives still saves the minibatch's start.
"""
from __future__ import annotations

from typing import Any, Callable, Optional


def begin_after_closure(args: tuple, kwargs: dict, begin: Callable[[], None]) -> Optional[tuple]:
    """For ``register_step_pre_hook``: with no closure, call ``begin()`` now and return None;
    otherwise return the step's (args, kwargs) with the closure wrapped to call ``begin()`` when
    it first returns (LBFGS calls it again inside its update). ``args[0]`` is the optimizer."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        begin()
        return None
    begun = False

    def closure_then_step() -> Any:
        nonlocal begun
        loss = closure()
        if not begun:
            begun = True
            begin()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_step}
    return (args[0], closure_then_step, *args[2:]), kwargs
