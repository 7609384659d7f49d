"""The just-in-time recovery strategy (the default): save from the survivors, restart the job.

On the first failure every other worker is told to save a JIT checkpoint of its current
minibatch; the launcher waits (bounded by ``--save-timeout``) until at least one data-parallel
replica of every shard has saved, plus a short grace for more replicas, then the supervisor
kills what is left and starts the next whole-job generation, which resumes from those
checkpoints. This module owns that decision and the recovery summary it reports; the
supervisor owns the processes (:mod:`jitckpt.launcher.supervisor`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from jitckpt.checkpoint_store import prune
from jitckpt.launcher.checkpoint_flush import CheckpointFlusher
from jitckpt.launcher.config import LaunchConfig
from jitckpt.launcher.controller_lease import LEASE_TTL_S
from jitckpt.launcher.worker_handle import Worker, pid_of
from jitckpt.protocol.control_messages import SaveNow
from jitckpt.protocol.exit_codes import EXIT_JIT_SAVED, EXIT_NO_SAVE

log = logging.getLogger("jitckpt.launcher.jit_recovery")
# Exit codes of ranks that ended because of another rank's failure (saved, or gave up saving).
NOT_A_CULPRIT = (0, EXIT_JIT_SAVED, EXIT_NO_SAVE)


@dataclass
class FailureRecord:
    """What the launcher knows about one failure and the recovery from it."""

    gen: int
    kind: str
    rank: Optional[int]
    detail: str
    t_detect: float                      # time.time() when the launcher learned of it
    step_failed: Optional[int] = None    # highest step any rank had reached
    t_covered: Optional[float] = None    # every shard had a saved JIT checkpoint
    t_killed: Optional[float] = None     # old workers gone
    checkpoint_bytes: int = 0
    save_s: Optional[float] = None
    saved_ranks: list = field(default_factory=list)
    save_failed: dict = field(default_factory=dict)  # rank -> why its JIT save gave up
    failed_ranks: list = field(default_factory=list)
    unsaving_ranks: list = field(default_factory=list)  # registered no save path: not waited for
    detect_s: float = 0.0                # failure -> detection, when known (a hang: its timeout)
    reporter: Optional[int] = None       # the healthy rank that detected it (a hang, an error)
    first_kind: Optional[str] = None     # of the failure this one interrupted the recovery from
    during_recovery: int = 0             # how many failures in a row hit the recovery
    timed_out: bool = False              # --save-timeout passed before every shard was covered (said once)
    in_memory: Optional[int] = None      # the step every rank's shard snapshot is in the keeper of
    not_ready: list = field(default_factory=list)  # "rank r: why", each restarted rank without a ready standby
    kept_ranks: list = field(default_factory=list)  # --recovery inprocess: ranks that went on in their processes

    @property
    def label(self) -> str:
        """The kind, and for failures during a recovery which one, once (not chained)."""
        n = self.during_recovery
        if n == 0:
            return self.kind
        if n == 1:
            return f"{self.kind} during recovery from {self.first_kind}"
        nth = {2: "2nd", 3: "3rd"}.get(n, f"{n}th")
        return f"{self.kind}, the {nth} failure during recovery from {self.first_kind}"

    def saw_step(self, step: Optional[int]) -> None:
        """A rank began (or saved) minibatch ``step`` before it stopped."""
        if step is not None:
            self.step_failed = max(self.step_failed or 0, step)


class JitRecovery:
    """Drives one node's JIT recoveries: who saves, when to restart, what to report.

    ``coord`` is the :class:`~jitckpt.launcher.node_coordinator.NodeCoordinator` (failures and
    saved shards across nodes), ``emit`` writes an event, ``display`` shows the console lines.
    """

    def __init__(self, *, cfg: LaunchConfig, coord: Any, emit: Callable[..., None],
                 display: Any, flusher: Optional[CheckpointFlusher] = None,
                 keeper_socket: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.cfg, self.coord, self.emit, self.display = cfg, coord, emit, display
        self.flusher = flusher  # one node: JIT checkpoints reach the disk after the restart began
        # One node under --snapshot-every: its keeper's socket (DTensor shard snapshots, see
        # jitckpt.launcher.keeper_coverage).
        self.keeper_socket = keeper_socket
        # The failure whose recovery has not yet been summarized (the workers did not resume).
        self.pending: Optional[FailureRecord] = None

    def on_failure(self, gen: int, workers: list[Worker], kind: str, rank: Optional[int],
                   detail: str, *, reporter: Optional[int] = None,
                   remote: bool = False) -> FailureRecord:
        """Record a failure of ``rank`` (None: not known yet) and tell every other worker to save.

        ``reporter`` is the healthy rank that detected it (a hang or a collective error); it is
        never taken for the failed rank. ``remote``: another node announced it already."""
        steps = [w.step for w in workers if w.step is not None and w.step >= 0]
        rec = FailureRecord(gen=gen, kind=kind, rank=rank, detail=detail, t_detect=time.time(),
                            step_failed=max(steps) if steps else None, reporter=reporter)
        if rank is None and reporter is not None and not all(w.exit_ready for w in workers):
            # Ranks that already left (exit barrier) while the others hang waiting for them.
            rec.failed_ranks.extend(w.rank for w in workers if w.exit_ready)
        elif rank is not None:
            rec.failed_ranks.append(rank)
        if rank is not None:
            by = f" (detected by rank {reporter})" if reporter not in (None, rank) else ""
            log.warning("failure detected (%s) on rank %d%s: %s", kind, rank, by, detail)
        elif rec.failed_ranks:
            log.warning("failure detected (%s) by rank %d: %s; rank(s) %s left the job before it "
                        "finished", kind, reporter, detail, rec.failed_ranks)
        elif reporter is not None:
            log.warning("failure detected (%s) by rank %d, failed rank not known yet: %s", kind,
                        reporter, detail)
        else:
            log.warning("failure detected (%s) on unknown rank: %s", kind, detail)
        self.emit("failure_detected", kind=kind, rank=rank, node=self.cfg.node_rank,
                  pid=pid_of(workers, rank), detail=detail, reporter=reporter)
        # The minibatch the failed rank was in: a survivor behind it can still finish its own.
        # Failed rank not known yet (a survivor's collective error came first): the furthest
        # minibatch any rank began. A rank that began it completed every collective before it,
        # so each rank contributed to those, the failed one included.
        failed_step = (next((w.step for w in workers if w.rank == rank), None) if rank is not None
                       else rec.step_failed)
        for w in workers:
            if w.live and w.rank not in rec.failed_ranks:
                w.channel.send(SaveNow(kind=kind, rank=rank, detail=detail, step=failed_step))
        if not remote:
            self.coord.announce_failure(gen, {"kind": kind, "rank": rank, "detail": detail,
                                              "reporter": reporter})
        self._note_unsaving(workers, rec)
        return rec

    def _note_unsaving(self, workers: list[Worker], failure: FailureRecord) -> None:
        """Say once of each live worker that registered no save path that it is not waited for.
        Only libjit.so registers a worker so (a --no-python program): the Python runtime always
        answers a SaveNow."""
        for w in workers:
            if (w.no_save_path and w.live and w.rank not in failure.failed_ranks
                    and w.rank not in failure.unsaving_ranks):
                failure.unsaving_ranks.append(w.rank)
                said = "registered no save path: not waiting for its JIT checkpoint"
                log.warning("rank %d (a native program) %s", w.rank, said)
                self.emit("warning", rank=w.rank, reason=f"a native program {said}")

    def _nothing_to_wait_for(self, workers: list[Worker], failure: FailureRecord) -> bool:
        """Every local worker is gone, registered no save path, or is stopped: none of them will
        save more. (A stopped rank of a layout with no replica of its shard was waited for until
        --save-timeout, found from outside: SIGSTOP to an FSDP2+TP worker cost 120 s.)"""
        self._note_unsaving(workers, failure)  # a Hello read after the failure was announced
        waiting = [w for w in workers if w.exit_code is None and not w.no_save_path]
        if not waiting or not all(w.stopped for w in waiting):
            return not waiting
        for w in waiting:
            if w.rank not in failure.unsaving_ranks:
                failure.unsaving_ranks.append(w.rank)
                said = "is stopped (SIGSTOP?) and cannot save: not waiting for its JIT checkpoint"
                log.warning("rank %d %s", w.rank, said)
                self.emit("warning", rank=w.rank, reason=said)
        return True

    def can_proceed(self, gen: int, workers: list[Worker], failure: FailureRecord) -> bool:
        """All local workers gone (or left with no save path: a native program is not waited
        for), or the restart decided: by the job's controller (this launcher with one node) once
        every shard is covered plus a short grace for more replicas, or once --save-timeout
        passed. The others follow its decision, bounded by the lease's TTL more should the
        controller itself be lost."""
        now = time.time()
        self.covered(gen, workers, failure)
        if self.coord.leads:
            decided = self._restart_due(failure, now)
            if decided:
                self.coord.decide_restart(gen)
        else:
            decided = self.coord.restart_decided(gen)
        if self._nothing_to_wait_for(workers, failure):
            if self.coord.node_done(gen, ok=False, wait=True):
                return True
            # Bounded: a node lost with its launcher never says its workers are gone.
            if now - failure.t_detect > self.cfg.save_timeout:
                log.error("not every node's launcher said its workers are gone within --save-timeout %.0fs (a node "
                          "lost with its launcher?); going on without it", self.cfg.save_timeout)
                return True
            return False
        return decided or now - failure.t_detect > self.cfg.save_timeout + LEASE_TTL_S

    def covered(self, gen: int, workers: list[Worker], failure: FailureRecord) -> bool:
        """Every shard is saved: by the survivors' JIT checkpoints, or (a layout without replicas,
        --snapshot-every) in the snapshot keeper; noted in ``failure.t_covered``."""
        if failure.t_covered is None and (self.coord.shards_covered(gen) or self._covered_in_memory(workers, failure)):
            failure.t_covered = time.time()
        return failure.t_covered is not None

    def _covered_in_memory(self, workers: list[Worker], failure: FailureRecord) -> bool:
        """The keeper holds every rank's shard snapshot of the newest minibatch any rank began: a
        restart resumes from there, and no JIT save can make a newer complete state."""
        sock = self.keeper_socket() if self.keeper_socket is not None else None
        began = [w.step for w in workers if w.step is not None and w.step >= 0]
        if sock is None or not began:
            return False
        from jitckpt.launcher.keeper_coverage import newest_common_shard_step

        step = newest_common_shard_step(sock, [w.rank for w in workers])
        if step is None or step < max(began):
            return False
        failure.in_memory = step
        said = f"every rank's shard of step {step} is in the snapshot keeper: restarting without waiting for JIT checkpoints"
        log.warning("%s", said)
        self.emit("warning", rank=None, reason=said)
        return True

    def _restart_due(self, failure: FailureRecord, now: float) -> bool:
        if failure.in_memory is not None and (failure.rank is not None or failure.failed_ranks):
            return True  # a hang's culprit not known yet: the grace below lets the others save, so it shows
        if failure.t_covered is not None and now - failure.t_covered > max(1.0, failure.save_s or 0.0):
            return True
        if now - failure.t_detect > self.cfg.save_timeout:
            if not failure.timed_out:
                failure.timed_out = True
                log.error("no complete JIT checkpoint from every shard within %.0fs; restarting from "
                          "the newest complete checkpoint", self.cfg.save_timeout)
            return True
        return False

    def finish(self, workers: list[Worker], failure: FailureRecord, *, restarting: bool) -> None:
        """The old workers are gone: settle who failed and say so (``restarting``: a restart
        follows). A failure during the recovery from an earlier one is reported as one
        recovery, from the first detection, counting the steps lost since the first failure."""
        prev = self.pending
        if prev is not None:
            failure.t_detect = prev.t_detect
            failure.detect_s = max(failure.detect_s, prev.detect_s)
            failure.first_kind = prev.first_kind or prev.kind
            failure.during_recovery = prev.during_recovery + 1
            steps = [s for s in (failure.step_failed, prev.step_failed) if s is not None]
            failure.step_failed = max(steps) if steps else None
            failure.failed_ranks = sorted(set(prev.failed_ranks) | set(failure.failed_ranks))
        self.pending = failure
        for w in workers:
            if w.exit_code not in (*NOT_A_CULPRIT, None) and w.rank not in failure.failed_ranks:
                if w.rank not in failure.saved_ranks and (not w.killed or failure.kind == "hang"):
                    # Died on its own, or (after a hang) was still silent when killed: a culprit.
                    failure.failed_ranks.append(w.rank)
        self.display.show_failure(failure, restarting=restarting)

    def pending_kind(self) -> Optional[str]:
        """The kind of the failure being recovered from (None: none)."""
        return self.pending.kind if self.pending is not None else None

    def generation_started(self, t_start: float, not_ready: list) -> None:
        """The next generation's workers were started at ``t_start``; ``not_ready``: "rank r: why"
        for each that found no ready standby (the recovery summary says so)."""
        if self.pending is not None:
            self.pending.t_killed = self.pending.t_killed or t_start
            self.pending.not_ready = not_ready

    def note_kept(self, rank: int) -> None:
        """--recovery inprocess: ``rank`` goes on in its own process (the summary names it)."""
        if self.pending is not None:
            self.pending.kept_ranks.append(rank)

    def maybe_summarize(self, workers: list[Worker]) -> None:
        """Once every worker of the new generation resumed: report the recovery, prune the
        checkpoints older than the one resumed from (node 0)."""
        f = self.pending
        if f is None or not all(w.resumed for w in workers):
            return
        now = time.time()
        restored = [w.restored for w in workers if w.restored is not None]
        # A worker that restored nothing (no checkpoint was left) starts from step 0.
        step_resumed = min(w.restored.step if w.restored is not None else 0 for w in workers)
        restore_s = max((r.seconds or 0.0 for r in restored), default=0.0)
        save_s = (f.t_covered - f.t_detect) if f.t_covered else None
        restart_s = now - (f.t_killed or now)
        redone = None
        if f.step_failed is not None:  # the failed minibatch and every one since the restore point
            redone = max(0, f.step_failed - step_resumed) + 1
        summary = dict(failure_kind=f.label, failed_ranks=sorted(f.failed_ranks), detect_s=f.detect_s,
                       save_s=save_s, restart_s=restart_s, restore_s=restore_s,
                       total_s=now - f.t_detect, checkpoint_bytes=f.checkpoint_bytes,
                       step_failed=f.step_failed, step_resumed=step_resumed, steps_redone=redone,
                       standbys="ready" if not f.not_ready else "not ready: " + "; ".join(f.not_ready))
        if f.kept_ranks:  # --recovery inprocess: who went on in its own process
            summary.update(scope="inprocess", kept_ranks=sorted(f.kept_ranks))
        self.emit("resumed", step=step_resumed, steps_redone=redone)
        self.emit("recovery_summary", **summary)
        self.display.show_summary(summary)
        self.pending = None
        if not self.coord.leads:  # one launcher prunes: the job's controller
            return

        def prune_older() -> None:
            try:
                prune(self.cfg.checkpoint_dir, older_than_step=step_resumed)
            except OSError as e:
                log.warning("could not prune old checkpoints: %s", e)

        if self.flusher is None:
            prune_older()
        else:  # not before the checkpoint resumed from is on disk
            self.flusher.then(prune_older, what=f"pruning the checkpoints older than step {step_resumed}")
