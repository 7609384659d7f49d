"""Recovery decisions for logging-based pipeline recovery (SWIFT §5.1-§5.2).

After a failure each survivor reports the last iteration it completed (optimizer step done).
In a synchronous pipeline those differ by at most one: stages that finished iteration H keep
their state (no roll back), stages at H-1 re-run H (the catch-up), and the replacement loads
the last global checkpoint and replays from the logs up to H-1 alone, then joins the catch-up.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

import torch


def recovery_targets(completed: Mapping[int, int]) -> tuple[int, int]:
    """``(low, high)`` of the survivors' completed iterations; high - low must be <= 1."""
    if not completed:
        raise ValueError("no survivor reported its completed iteration")
    low, high = min(completed.values()), max(completed.values())
    if high - low > 1:
        raise RuntimeError(
            f"survivors' completed iterations {dict(completed)} differ by more than one; a "
            "synchronous pipeline cannot be in that state (a stage skipped an iteration?)")
    return low, high


def catch_up_peers(completed: Mapping[int, int], *, iteration: int) -> frozenset[int]:
    """Stages that already completed ``iteration``: in the catch-up their messages come from
    the logs and messages to them are checked, not sent."""
    return frozenset(s for s, c in completed.items() if c >= iteration)


def partition_micro_batches(num_micro_batches: int, num_workers: int) -> list[list[int]]:
    """Parallel recovery (§5.2): micro-batches of the lost stage split over ``num_workers``
    data-parallel re-computers round-robin (worker w gets w, w+d, ...), as in SWIFT Fig. 7.
    Each worker gets m/d micro-batches (the first m mod d workers one more)."""
    if num_micro_batches < 1 or num_workers < 1:
        raise ValueError(f"need >= 1 micro-batches and workers, got {num_micro_batches}, "
                         f"{num_workers}")
    return [list(range(w, num_micro_batches, num_workers)) for w in range(num_workers)]


def checkpoint_path(directory: Path, iteration: int, stage: int) -> Path:
    """Where stage ``stage`` keeps its part of the global checkpoint after ``iteration``."""
    return Path(directory) / f"it{iteration:08d}" / f"stage{stage}.pt"


def save_stage_checkpoint(directory: Path, iteration: int, stage: int, state: dict) -> None:
    """Atomically save one stage's part of a global checkpoint."""
    path = checkpoint_path(directory, iteration, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def latest_global_checkpoint(directory: Path, num_stages: int) -> Optional[int]:
    """Newest iteration for which every stage saved its part (a complete global checkpoint)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    best = None
    for d in directory.iterdir():
        if d.name.startswith("it") and d.name[2:].isdigit():
            it = int(d.name[2:])
            if all(checkpoint_path(directory, it, s).exists() for s in range(num_stages)):
                best = it if best is None else max(best, it)
    return best
