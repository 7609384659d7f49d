"""The ``--recovery inprocess`` strategy: the survivors keep their processes.

The failure is handled as by :mod:`jitckpt.launcher.jit_recovery` up to the survivors' JIT saves;
then, instead of exiting, each survivor leaves its script and waits in its process
(:mod:`jitckpt.runtime.inprocess`, :class:`~jitckpt.protocol.control_messages.Unwound`). The
failed rank is killed at once, so that a survivor blocked on it in a collective gets gloo's error
there rather than after a timeout; once every survivor saved, they are told to leave their scripts
(:class:`~jitckpt.protocol.control_messages.Unwind`). Once every rank of the node is a survivor
that unwound or is gone, the next generation starts: each survivor is given its own rank again, in the same process,
and a warm standby each lost rank. A survivor that does not unwind in time (a training thread
stuck outside any collective) is killed and restarted from its checkpoint like a lost rank: its
JIT checkpoint is written before it tries, so the fallback loses nothing.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from jitckpt.launcher.jit_recovery import FailureRecord
from jitckpt.launcher.worker_handle import Worker
from jitckpt.protocol.control_messages import Unwind, Unwound

log = logging.getLogger("jitckpt.launcher.inprocess")
# How long after every shard is saved the launcher waits for the survivors to unwind (a survivor's
# saver waits 10 s for its training thread, jitckpt.runtime.worker_runtime.UNWIND_GRACE, then exits).
UNWIND_WAIT = 15.0
# A hang with no culprit named: how long after its detection a rank that saved nothing, while every
# other one saved, is taken for the hung one (a healthy rank saves within the runtime's 2 s grace).
SILENT_GRACE = 2.0


class InProcessRecovery:
    """One node's in-process recoveries: whom to kill, who is kept, and for which rank."""

    def __init__(self, *, emit: Callable[..., None]) -> None:
        self.emit = emit
        self.parked: dict[int, Worker] = {}  # rank -> survivor waiting for its next Assign
        self._killed: set = set()  # pids of failed ranks killed for this failure
        self._told = False  # the survivors were sent Unwind for this failure

    def failed(self, failure: FailureRecord, workers: list[Worker]) -> None:
        """Kill the failed ranks still running (the culprit named, or a stopped process): the
        survivors' collectives with them then fail at once. Called on every poll while a failure
        is being recovered from."""
        culprits = set(failure.failed_ranks) | ({failure.rank} if failure.rank is not None else set())
        culprits |= self._silent(workers, failure)
        for w in workers:
            if w.proc.pid in self._killed or w.exit_code is not None or w.rank in self.parked:
                continue
            if w.rank in culprits or w.stopped:
                self._killed.add(w.proc.pid)
                log.warning("rank %d (pid %d) failed: killing it so that the survivors leave their collectives "
                            "with it", w.rank, w.proc.pid)
                w.kill()

    @staticmethod
    def _silent(workers: list[Worker], failure: FailureRecord) -> set:
        """A hang whose culprit is not known (a rank stuck holding the GIL): once every other rank
        saved, the ranks that did not, :data:`SILENT_GRACE` after the detection, are the hung ones."""
        if failure.kind != "hang" or time.time() - failure.t_detect < SILENT_GRACE:
            return set()
        live = [w for w in workers if w.exit_code is None]
        silent = {w.rank for w in live if w.rank not in failure.saved_ranks}
        return silent if 0 < len(silent) < len(live) else set()

    def unwound(self, w: Worker, msg: Unwound) -> None:
        """Survivor ``w`` left its script and waits in its process."""
        self.parked[w.rank] = w
        self.emit("survivor_unwound", rank=w.rank, pid=msg.pid, seconds=msg.seconds)

    def decide(self, workers: list[Worker], failure: FailureRecord, covered: bool) -> str:
        """``go``: the next generation starts now (every shard saved, ``covered``; some survivor
        kept; every other worker gone). ``wait``: survivors are still saving or leaving their
        scripts. ``jit``: nothing to keep, or past :data:`UNWIND_WAIT`: the JIT recovery's own
        decision applies (it kills the survivors still running; they restart from their checkpoints).

        The survivors are told to leave their scripts (:class:`Unwind`) once every one of them saved
        (or, :data:`UNWIND_WAIT` / 2 after every shard was, those that did), not before: one that cut
        its connections while another was still in a collective with it would make that one fail
        there and save an older step than the rest (found on HSDP: the job lost every shard's step)."""
        if not covered:
            return "jit"
        since = time.time() - (failure.t_covered or time.time())
        if since > UNWIND_WAIT:
            return "jit"
        culprits = set(failure.failed_ranks) | ({failure.rank} if failure.rank is not None else set())
        live = [w for w in workers if w.exit_code is None and w.rank not in culprits and w.rank not in self.parked]
        saved = [w for w in live if w.rank in failure.saved_ranks]
        if not self._told and saved and (len(saved) == len(live) or since > UNWIND_WAIT / 2):
            self._told = True
            for w in saved:
                w.channel.send(Unwind())
        if live:
            return "wait"
        return "go" if self.parked else "jit"

    def keeps(self, w: Worker) -> bool:
        """``w`` is a survivor that goes on in its process: not killed with the generation."""
        return self.parked.get(w.rank) is w

    def take(self, rank: int) -> Optional[Worker]:
        """The survivor that runs ``rank`` again, or None (a standby takes it). The next generation
        starts: its failure's survivors are told to unwind anew."""
        self._told = False
        return self.parked.pop(rank, None)

    def reset(self) -> None:
        """Nobody is kept (the job ends, or every worker was killed)."""
        self.parked.clear()
        self._killed.clear()
        self._told = False
