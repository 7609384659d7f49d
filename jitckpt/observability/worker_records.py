"""Records the workers' libjit.so appends to the job's event log behind the launcher's back.

Under ``jitckpt run --transparent`` each worker's libjit.so writes ``transparent_recovery`` and
``transparent_validation`` records straight into ``events.jsonl`` (native code has no channel to
the launcher). :class:`WorkerRecords` follows the file from where it was when the launcher opened
it and hands the launcher each such record once, so metrics count them and the console says when
replay validation turned transparent recovery off for a rank, or a rank's recovery was refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

WORKER_EVENTS = ("transparent_recovery", "transparent_validation", "stage_caught_up")
MAX_READ = 1 << 20  # per poll: a burst of records is taken over several polls, never all at once


class WorkerRecords:
    """New records of :data:`WORKER_EVENTS` in ``path``, from its current end on."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._offset = self.path.stat().st_size
        except OSError:
            self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict]:
        """The worker records appended since the last call (whole lines only; never raises)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(MAX_READ)
        except OSError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line torn by a full disk
            if isinstance(rec, dict) and rec.get("event") in WORKER_EVENTS:
                out.append(rec)
        return out


def console_line(rec: dict) -> str | None:
    """What the launcher's console says of a worker record, or None (a recovery that worked is
    in the summary libjit.so prints on the worker's stderr)."""
    rank = rec.get("rank", "?")
    if rec.get("event") == "transparent_validation" and not rec.get("matched", True):
        return (f"rank {rank}: replay validation at minibatch {rec.get('minibatch')} found a difference "
                f"({rec.get('detail', '')}); transparent recovery is off for it, and a failure now "
                "goes to user-level recovery")
    if rec.get("event") == "transparent_recovery" and not rec.get("recovered", False):
        return f"rank {rank}: not recovered transparently: {rec.get('reason', '')}"
    return None
