"""The hang timeout policy and its one text grammar, shared by the launcher (``--hang-timeout``),
the worker spec, the worker's watchdog and (parsed again in C++) libjit.so.

``"30"`` is a fixed timeout in seconds; ``"auto[:floor=S,mult=X,startup=S,window=N,warmup=N]"``
is adaptive (see :class:`HangTimeout`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


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
