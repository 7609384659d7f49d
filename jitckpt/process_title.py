"""Process titles that say what each jitckpt process is, so ``ps`` tells the PIDs apart.

``jitckpt launcher <run id> node <n>``, ``jitckpt standby`` (a warm process waiting for a rank;
``jitckpt standby (snapshots mapped ahead)`` once it maps the node keeper's snapshot buffers),
``jitckpt rank <r>/<world> gen <g>`` (a worker: rank, world size, launch generation). setproctitle
rewrites the argv area ``ps`` reads and the thread name ``top`` shows.
"""
from __future__ import annotations

import setproctitle


def set_title(title: str) -> None:
    """Set this process's title (what ``ps -o args`` and ``ps -o comm`` show)."""
    setproctitle.setproctitle(title)


def worker_title(rank: int, world_size: int, gen: int) -> str:
    """The title of a worker process: ``jitckpt rank 1/2 gen 0``."""
    return f"jitckpt rank {rank}/{world_size} gen {gen}"
