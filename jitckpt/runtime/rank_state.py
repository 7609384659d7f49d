"""Each rank's own state at its last minibatch start (RNG, data loader position), where a survivor
on its node can read it after the rank is lost.

A JIT checkpoint is written by survivors, but a framework's resume (a Trainer's
``rng_state_<rank>.pth``) wants every rank's own RNG: a lost rank's is on this board. Each rank
replaces its file at every minibatch start (tmpfs, a few KB: no disk, no collective); a rank
killed mid-write leaves the previous file, never a torn one (write, then rename). ``jitckpt run``
makes the directory (0700, removed when the job ends) and names it in each worker's spec
(``WorkerSpec.rank_state_dir``); without it there is no board and a lost rank's state is said to
be missing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

@dataclass(frozen=True)
class RankState:
    """One rank's state at the start of minibatch ``step``."""

    rank: int
    step: int
    state: dict


class RankStateBoard:
    """This node's ranks' files in ``directory``: :meth:`publish` this rank's, :meth:`read` any."""

    def __init__(self, *, directory: str, rank: int) -> None:
        if not os.path.isdir(directory):
            raise ValueError(f"rank-state board {directory}: not a directory")
        self.directory, self.rank = Path(directory), rank
        self._tmp = self.directory / f".rank{rank}.tmp"

    @classmethod
    def of_job(cls, rank: int) -> Optional["RankStateBoard"]:
        """The board ``jitckpt run`` made for this job (its worker spec names it), or None outside it."""
        from jitckpt.runtime.current import runtime_or_none

        rt = runtime_or_none()
        directory = rt.spec.rank_state_dir if rt is not None and rt.spec is not None else ""
        return cls(directory=directory, rank=rank) if directory else None

    def _path(self, rank: int) -> Path:
        return self.directory / f"rank{rank}.pt"

    def publish(self, step: int, state: dict) -> None:
        """This rank's state at the start of minibatch ``step`` (replaces the previous one)."""
        import torch  # here, not at the top: the launcher imports ENV without torch

        torch.save({"rank": self.rank, "step": step, "state": state}, self._tmp)
        os.replace(self._tmp, self._path(self.rank))

    def read(self, rank: int) -> Optional[RankState]:
        """``rank``'s last published state, or None (none published, or unreadable)."""
        import torch

        try:
            # Written by this job's ranks into a 0700 directory of this user: plain tensors and
            # containers only (weights_only), like every other load of jitckpt's.
            raw: Any = torch.load(self._path(rank), weights_only=True)
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001  a torn or foreign file (the unpickler raises many kinds) is no entry
            return None
        if not isinstance(raw, dict) or raw.get("rank") != rank:
            return None
        return RankState(rank=rank, step=int(raw["step"]), state=raw["state"])
