"""Hang detection: a thread that flags a blocking region (collective, backward) that runs too long.

The timeout follows a :class:`~jitckpt.hang_timeout.HangTimeout` policy: fixed, or adaptive, a
multiple of the longest recent duration of the same kind of region, never below a floor, and a
generous start-up value until enough samples exist (the first collectives wait for every rank to
finish start-up and restore).
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

from jitckpt.hang_timeout import HangTimeout


class DurationHistory:
    """Recent durations per region kind, for the adaptive timeout."""

    def __init__(self, policy: HangTimeout) -> None:
        self.policy = policy
        self._hist: dict[str, collections.deque] = {}

    def add(self, kind: str, seconds: float) -> None:
        self._hist.setdefault(kind, collections.deque(maxlen=self.policy.window)).append(seconds)

    def timeout_for(self, kind: str) -> float:
        p = self.policy
        if p.fixed is not None:
            return p.fixed
        h = self._hist.get(kind)
        if not h or len(h) < p.warmup:
            return max(p.floor, p.startup)
        return max(p.floor, p.multiplier * max(h))


class Watchdog(threading.Thread):
    """Polls ``oldest()`` -> (kind, age_s) of the oldest open region; calls ``on_hang`` once.

    ``on_hang`` returning False means "not a hang of mine yet" (libjit.so is recovering the device
    state transparently): the region is looked at again at the next poll."""

    def __init__(self, *, oldest: Callable[[], Optional[tuple[str, float]]],
                 history: DurationHistory, on_hang: Callable[[str, float, float], Optional[bool]],
                 poll_interval: float = 0.1) -> None:
        super().__init__(name="jitckpt-watchdog", daemon=True)
        self._oldest = oldest
        self._history = history
        self._on_hang = on_hang
        self._poll = poll_interval
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.wait(self._poll):
            cur = self._oldest()
            if cur is None:
                continue
            kind, age = cur
            limit = self._history.timeout_for(kind)
            if age > limit and self._on_hang(kind, age, limit) is not False:
                return

    def stop(self) -> None:
        self._stop_evt.set()


def monotonic() -> float:
    return time.monotonic()
