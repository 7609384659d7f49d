"""jitckpt's own lines on stderr, alike in the launcher and the workers: ``[jitckpt 12:00:01] ...``
from the launcher, ``[jitckpt 12:00:01 rank 1] ...`` from a worker, so a log interleaving both says
who said what and when."""
from __future__ import annotations

import logging
import sys
import time
from typing import Optional


def stamp(rank: Optional[int] = None) -> str:
    """The prefix of a line said now: ``[jitckpt HH:MM:SS]`` or ``[jitckpt HH:MM:SS rank R]``."""
    who = "" if rank is None else f" rank {rank}"
    return f"[jitckpt {time.strftime('%H:%M:%S')}{who}]"


class _Prefix(logging.Formatter):
    def __init__(self, rank: Optional[int]) -> None:
        super().__init__("%(message)s")
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        return f"{stamp(self.rank)} {super().format(record)}"


def configure(*, rank: Optional[int] = None, level: int = logging.INFO) -> None:
    """Send the ``jitckpt`` loggers' records to stderr with the prefix (once per process)."""
    logger = logging.getLogger("jitckpt")
    for h in list(logger.handlers):
        if getattr(h, "_jitckpt", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Prefix(rank))
    handler._jitckpt = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
