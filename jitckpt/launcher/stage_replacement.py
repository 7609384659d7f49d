"""The ``--recovery stage`` strategy (SWIFT logging): replace one dead pipeline stage alone.

The survivors keep running; the launcher starts one replacement for the dead rank in a new
process-group generation, and the replacement replays its lost iterations from its
neighbours' logs. When a replacement is impossible (restarts used up, a rank already at the
exit barrier, another replacement still catching up) the supervisor falls back to the
whole-job recovery of :mod:`jitckpt.launcher.jit_recovery`. The job store's side (generation
numbers, the budget across nodes) is :mod:`jitckpt.launcher.stage_generations`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from jitckpt.launcher.jit_recovery import FailureRecord
from jitckpt.launcher.stage_generations import StageGenerations
from jitckpt.launcher.worker_handle import Worker
from jitckpt.protocol.control_messages import StageCaughtUp

log = logging.getLogger("jitckpt.launcher.stage_replacement")


class StageReplacement:
    """One node's stage replacements: when to replace, and the summary once one caught up."""

    def __init__(self, *, generations: StageGenerations, node_rank: int,
                 emit: Callable[..., None], show_summary: Callable[[dict], None]) -> None:
        self.generations = generations
        self.node_rank = node_rank
        self.emit, self.show_summary = emit, show_summary
        self.replacing: dict[int, tuple[str, float, float]] = {}  # rank -> (kind, t_detect, t_start)

    def begin(self, launch: int, old: Worker, workers: list[Worker], *,
              restarts_left: bool) -> Optional[int]:
        """The generation a replacement of the dead ``old`` starts in, or None: fall back to
        the whole-job recovery (restarts used up, a rank already stands at the exit barrier and
        no longer takes part in a recovery, or a replacement of this launch is still catching
        up: the survivors wait for it in a process group that cannot form)."""
        if not restarts_left or any(w.exit_ready for w in workers):
            return None
        kind, detail = old.death()
        gen = self.generations.replace(old.rank, launch)
        if gen is None:
            log.warning("rank %d died (%s) while another stage's replacement is still catching up "
                        "from the logs; restarting every rank from the global checkpoint",
                        old.rank, detail)
            return None
        log.warning("rank %d died (%s); replacing it alone (--recovery stage)", old.rank, detail)
        self.replacing[old.rank] = (kind, time.time(), 0.0)
        self.emit("failure_detected", kind=kind, rank=old.rank, node=self.node_rank,
                  pid=old.proc.pid, detail=detail, reporter=None)
        return gen

    def started(self, gen: int, rank: int, restart_count: int) -> None:
        """The replacement of ``rank`` runs: tell the survivors generation ``gen`` starts."""
        self.generations.announce(gen, rank)
        kind, t_detect, _ = self.replacing[rank]
        self.replacing[rank] = (kind, t_detect, time.time())
        self.emit("stage_replaced", rank=rank, generation=gen, restart_count=restart_count)

    def caught_up(self, launch: int, w: Worker, msg: StageCaughtUp) -> None:
        """A replacement replayed up to the survivors: report its recovery (one rank redid
        steps); the next death can be replaced alone again."""
        pending = self.replacing.pop(w.rank, None)
        if pending is None:
            return
        self.generations.caught_up(launch)
        kind, t_detect, t_start = pending
        now = time.time()
        summary = dict(failure_kind=kind, failed_ranks=[w.rank], detect_s=0.0, save_s=0.0,
                       restart_s=t_start - t_detect, restore_s=now - t_start,
                       total_s=now - t_detect, checkpoint_bytes=0, step_failed=None,
                       step_resumed=msg.checkpoint, steps_redone=msg.replayed,
                       scope="stage")
        self.emit("recovery_summary", **summary)
        self.show_summary(summary)

    def fold_into(self, failure: FailureRecord) -> None:
        """The whole-job recovery took over: a death still being replaced is part of
        ``failure`` (and was detected first)."""
        for rank, (_, t_detect, _) in self.replacing.items():
            if rank not in failure.failed_ranks:
                failure.failed_ranks.append(rank)
            failure.t_detect = min(failure.t_detect, t_detect)

    def reset(self) -> None:
        """Every worker was killed for a whole-job restart: nothing is being replaced."""
        self.replacing.clear()
