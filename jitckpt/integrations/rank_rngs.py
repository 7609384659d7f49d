"""Every rank's RNG at a minibatch's start, for a survivor's save in a framework's layout.

A framework's checkpoint holds each rank's own RNG (a Trainer's ``rng_state_<rank>.pth``, the
per-rank states jitckpt adds to a Lightning ``.ckpt``), but after a failure only survivors write
it. Each rank posts its RNG at every minibatch start on the node's rank-state board
(:mod:`jitckpt.runtime.rank_state`); a survivor's save takes the lost rank's from there, derives
it where the lost rank posted only the previous minibatch's (it equalled the survivor's then, and
the ranks run the same program), and otherwise says, naming the rank, that it is not known: the
framework then resumes that rank with a fresh RNG, never with another rank's.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from jitckpt.runtime.rank_state import RankStateBoard

log = logging.getLogger("jitckpt.integrations")


def same_state(a: Any, b: Any) -> bool:
    """Whether two RNG states (tensors in dicts, tuples and lists) are equal."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same_state(x, y) for x, y in zip(a, b)))
    return a == b


class RankRngs:
    """This rank's RNG at its last two minibatch starts, posted to ``board``; every rank's on demand."""

    def __init__(self, *, rank: int, world_size: int, board: Optional[RankStateBoard]) -> None:
        self.rank, self.world_size, self.board = rank, world_size, board
        self._own: dict[int, dict] = {}

    @classmethod
    def of_job(cls, *, rank: int, world_size: int) -> "RankRngs":
        """With the board ``jitckpt run`` made for this job (none outside it)."""
        return cls(rank=rank, world_size=world_size, board=RankStateBoard.of_job(rank))

    def started(self, step: int, rng: dict) -> None:
        """Minibatch ``step`` starts with this rank's RNG ``rng`` (the state its resume loads)."""
        self._own = {s: r for s, r in self._own.items() if s == step - 1}
        self._own[step] = rng
        if self.board is not None:
            self.board.publish(step, rng)

    def at(self, step: int, own: dict, *, unknown: str = "the resume starts rank {rank} with a fresh RNG, so its "
           "random draws (dropout) differ from an uninterrupted run") -> dict[int, Any]:
        """Every rank's RNG at the start of minibatch ``step`` that is known, by rank (``own``:
        this rank's); a rank left out is logged as not known, with ``unknown`` (what its resume
        does then; ``{rank}`` is filled in)."""
        out: dict[int, Any] = {self.rank: own}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            seen = self.board.read(r) if self.board is not None else None
            if seen is not None and seen.step == step:
                out[r] = seen.state
            elif (seen is not None and seen.step == step - 1 and step - 1 in self._own
                  and same_state(seen.state, self._own[step - 1])):
                # Rank r was lost in minibatch step-1's optimizer step, after its last post.
                log.warning("rank %d's RNG at step %d is derived: it equalled rank %d's at step %d", r, step,
                            self.rank, step - 1)
                out[r] = own
            else:
                where = ("jitckpt run's rank-state board has no entry for it" if seen is None else
                         f"its last entry is of step {seen.step}")
                log.warning("JIT checkpoint of step %d: rank %d's RNG state is not known (%s); %s", step, r, where,
                            unknown.format(rank=r))
        return out
