"""The one-line verdict `jitckpt run` ends with: how the job ended, the steps done, the failures and
the time they cost."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class JobTally:
    """Counts a job's failures and recovery time from its event records."""

    def __init__(self) -> None:
        self.start = time.time()
        self.failures = 0
        self.recovery_s = 0.0
        self.redone = 0
        self._open = False  # a failure_detected not yet closed by its recovery_summary

    def add(self, rec: dict) -> None:
        """Take a ``failure_detected`` or ``recovery_summary`` record (several ranks reporting one
        failure count once, as the metrics' failures counter)."""
        if rec["event"] == "failure_detected":
            if not self._open:
                self.failures += 1
            self._open = True
            return
        if not self._open:  # a recovery whose failure was never reported separately
            self.failures += 1
        self._open = False
        total = rec.get("total_s")
        if isinstance(total, (int, float)) and total > 0:
            self.recovery_s += total
        redone = rec.get("steps_redone")
        if isinstance(redone, int) and redone > 0:
            self.redone += redone

    def verdict(self, end: dict, workers: list[Any], run_dir: Path) -> str:
        """``job_end`` record in, one line out."""
        steps = max((w.step for w in workers if w.step is not None and w.step >= 0), default=None)
        done = "no step reported" if steps is None else f"at step {steps}"
        status = {"ok": "job finished", "failed": "job FAILED", "preempted": "job preempted"}.get(end.get("status"),
                                                                                               "job ended")
        lost = (f"{self.failures} failure{'s' if self.failures != 1 else ''}, {self.recovery_s:.1f} s in recovery, "
                f"{self.redone} minibatch{'es' if self.redone != 1 else ''} redone") if self.failures else "no failure"
        return (f"{status} (exit code {end.get('exit_code')}) after {time.time() - self.start:.1f} s: {done}, "
                f"{lost}; `jitckpt report {run_dir}` for the details")
