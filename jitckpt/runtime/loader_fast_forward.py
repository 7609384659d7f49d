"""A plain ``DataLoader``'s position, which it cannot save itself: where its current epoch's
iterator began, and a resume that reads past the batches of that epoch already trained on.

``protect(..., dataloader=loader)`` with a ``torch.utils.data.DataLoader`` that has no
``state_dict()`` gives the loader a subclass of its own class (``isinstance`` still holds) whose
``iter()`` records the step and the RNG it was made at; a resume inside an epoch makes the epoch's
iterator again from that RNG (a shuffling sampler draws its order from it, or from its epoch) and
reads the batches already trained on, which costs their loading: the warning says how long it took.
A ``StatefulDataLoader`` resumes without reading them.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, Optional

from jitckpt.runtime.ddp_buffers import rng_state

log = logging.getLogger("jitckpt.protect")

_classes: dict[type, type] = {}


def _watched(base: type) -> type:
    """``base`` with an ``__iter__`` that goes through the loader's :class:`FastForward`."""
    cls = _classes.get(base)
    if cls is None:
        def __iter__(self: Any) -> Iterator:
            return self._jitckpt_fast_forward.iterate(lambda: base.__iter__(self))

        cls = _classes[base] = type(f"FastForwarded{base.__name__}", (base,), {"__iter__": __iter__})
    return cls


class FastForward:
    """The position of a plain ``DataLoader`` (see the module docstring); ``step_fn`` gives the
    number of optimizer steps done, which advances by one per batch."""

    def __init__(self, loader: Any, step_fn: Callable[[], int]) -> None:
        self.loader, self._step_fn = loader, step_fn
        self.began: Optional[tuple[int, dict]] = None  # the current epoch's iter(): its step, the RNG before it
        self._skip = 0  # a resume's: batches the next iter() reads past
        loader._jitckpt_fast_forward = self
        loader.__class__ = _watched(type(loader))

    def iterate(self, make: Callable[[], Iterator]) -> Iterator:
        """An ``iter()`` of the loader: ``make()`` makes its iterator."""
        skip, self._skip = self._skip, 0
        self.began = (self._step_fn() - skip, rng_state())
        it = make()
        if skip:
            t0 = time.monotonic()
            for _ in range(skip):
                next(it)
            log.warning("resuming inside an epoch: read past the %d batches of it already trained on (%.2f s); "
                        "torchdata's StatefulDataLoader resumes without reading them", skip, time.monotonic() - t0)
        return it

    def position(self, step: int) -> Optional[dict]:
        """What a resume at ``step`` needs: the batches of its epoch before it and the RNG the epoch's
        iterator was made from; None when that epoch is drawn out (the next iter() begins the next)."""
        if self.began is None:
            return None
        skip = step - self.began[0]
        try:
            if skip >= len(self.loader):
                return None
        except TypeError:  # an iterable dataset without a length: its epoch ends where its data does
            pass
        return {"skip": skip, "iter_rng": self.began[1]}

    def resume_at(self, skip: int) -> None:
        """The next ``iter()`` reads past its first ``skip`` batches."""
        self._skip = int(skip)
