"""Job-wide failure flag in the rendezvous store (SWIFT §6 failure detection).

A stage that sees a point-to-point error, or the supervisor that sees a stage die, sets the
flag of the current process-group generation. Stages waiting on a *live* peer (not adjacent to
the dead one) poll it so they stop waiting at once instead of running into the gloo timeout:
aborting a gloo group does not interrupt a pending receive, and a gloo wait with a short
timeout breaks the connection. Polling is rate-limited and only happens while a stage waits.
"""
from __future__ import annotations

import time

import torch.distributed as dist


def failure_key(generation: int) -> str:
    """Store key of the failure flag of one process-group generation."""
    return f"gen{generation}/failure"


def announce_key(generation: int) -> str:
    """Store key naming the stage whose replacement starts ``generation``."""
    return f"gen{generation}/announced"


class FailureFlag:
    """The failure flag of ``generation`` in ``store``; :meth:`is_set` is cheap to call often
    (it asks the store at most once per ``min_interval`` seconds)."""

    def __init__(self, *, store: dist.Store, generation: int,
                 min_interval: float = 0.02) -> None:
        self.key = failure_key(generation)
        self._store = store
        self._min_interval = min_interval
        self._next = 0.0
        self._set = False

    def is_set(self) -> bool:
        """Whether any stage or the supervisor reported a failure in this generation."""
        if not self._set:
            now = time.monotonic()
            if now >= self._next:
                self._next = now + self._min_interval
                self._set = self._store.check([self.key])
        return self._set

    def raise_flag(self) -> None:
        """Tell every stage of this generation that a peer failed."""
        self._store.set(self.key, "1")
        self._set = True
