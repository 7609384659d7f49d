"""Hang detection: a thread that flags a blocking region (collective, backward) that runs too long.

The timeout is fixed, or adaptive: a multiple of the longest recent duration of the same kind of
region, never below a floor, and a generous start-up value until enough samples exist (the first
collectives wait for every rank to finish start-up and restore).
"""
from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class HangTimeout:
    """Hang timeout policy. ``fixed`` seconds, or adaptive when ``fixed`` is None.

    Adaptive: ``max(floor, multiplier * max(last `window` durations))`` once ``warmup`` samples
    exist, ``max(floor, startup)`` before that. All values in seconds. The default, ``"auto"``, is
    the one default everywhere (launcher, workers, libjit.so): floor 30 s, 10x, 120 s at start.
    libjit.so parses the same text (interposer/src/hang_timeout.h).
    """

    fixed: Optional[float] = None
    floor: float = 30.0
    multiplier: float = 10.0
    startup: float = 120.0
    window: int = 64
    warmup: int = 3

    def __post_init__(self) -> None:
        # inf would turn hang detection off and nan compares false everywhere: refuse both.
        for name in ("floor", "multiplier", "startup"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"hang timeout {name} must be a finite number > 0, got "
                                 f"{getattr(self, name)}")
        if self.fixed is not None and not 0 < self.fixed < math.inf:
            raise ValueError(f"hang timeout must be a finite number of seconds > 0, got {self.fixed}")
        if self.window < 1 or self.warmup < 1:
            raise ValueError("hang timeout window and warmup must be >= 1")

    @classmethod
    def parse(cls, text: str) -> "HangTimeout":
        """``"30"`` (fixed seconds), ``"auto"`` or ``"auto:floor=5,mult=10,startup=60"``."""
        text = str(text).strip()
        if text == "auto" or text.startswith("auto:"):
            kwargs: dict = {"fixed": None}
            names = {"floor": "floor", "mult": "multiplier", "multiplier": "multiplier",
                     "startup": "startup", "window": "window", "warmup": "warmup"}
            for part in filter(None, text[5:].split(",")):
                key, _, val = part.partition("=")
                if key not in names or not val:
                    raise ValueError(
                        f"bad hang timeout option {part!r}; use auto:floor=S,mult=X,startup=S")
                field_name = names[key]
                try:
                    kwargs[field_name] = int(val) if field_name in ("window", "warmup") else float(val)
                except ValueError:
                    raise ValueError(f"bad hang timeout option {part!r}: {val!r} is not a number") from None
            return cls(**kwargs)
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(
                f"--hang-timeout {text!r}: expected seconds (e.g. 30) or 'auto[:floor=S,mult=X]'"
            ) from None
        return cls(fixed=seconds)

    def to_text(self) -> str:
        """The text :meth:`parse` reads back; libjit.so writes the same (``%.12g`` numbers)."""
        if self.fixed is not None:
            return f"{self.fixed:.12g}"
        return (f"auto:floor={self.floor:.12g},mult={self.multiplier:.12g},"
                f"startup={self.startup:.12g},window={self.window},warmup={self.warmup}")


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
    """Polls ``oldest()`` -> (kind, age_s) of the oldest open region; calls ``on_hang`` once."""

    def __init__(self, *, oldest: Callable[[], Optional[tuple[str, float]]],
                 history: DurationHistory, on_hang: Callable[[str, float, float], None],
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
            if age > limit:
                self._on_hang(kind, age, limit)
                return

    def stop(self) -> None:
        self._stop_evt.set()


def monotonic() -> float:
    return time.monotonic()
