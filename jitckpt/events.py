"""Structured job event log: one JSON object per line in ``<run_dir>/events.jsonl``.

Every record has ``t`` (Unix time, seconds, float), ``event`` (one of :data:`EVENT_TYPES`) and
``gen`` (restart generation, 0 for the first launch); the other fields depend on the event:

========================  ======================================================================
event                     fields
========================  ======================================================================
``job_start``             nproc, nnodes, world_size, script, checkpoint_dir, hang_timeout
``worker_start``          rank, pid, warm (bool: taken from the warm standby pool), role
                          (initial|restart|replacement)
``standby_ready``         count, seconds (the refilled warm standby pool finished importing)
``step``                  rank, step, step_time (s) -- sampled, not every step
``failure_detected``      kind (exit|signal|hang|error|exception), rank, pid, node, detail,
                          detect_time (s from the failure to its detection, when known)
``checkpoint_saved``      rank, step, bytes, seconds, path, kind (jit|periodic), undone (parameters
                          --plugin undo rolled back before this JIT save, else null)
``checkpoint_failed``     rank, reason
``restart``               reason, restart_count
``restore``               rank, step, path, seconds, source (disk|memory), decoded (snapshot
                          parts rebuilt from parity), fetched (ZeRO partitions this rank got
                          from another node's replica, AOR)
``resumed``               step, steps_redone
``recovery_summary``      failure_kind, failed_ranks, detect_s, save_s, restart_s, restore_s,
                          total_s, checkpoint_bytes, step_failed, step_resumed, steps_redone;
                          scope "stage" for a --recovery stage replacement (restore_s: its
                          checkpoint load and replay; steps_redone: by that rank alone)
``job_end``               status (ok|failed), exit_code, restarts
``snapshot_keeper_start`` node, pid, socket, replaced (bool: the previous keeper died),
                          previous_exit (its exit code)
``stage_replaced``        rank, generation, restart_count (--recovery stage: the dead rank got a
                          replacement; the other ranks kept running)
========================  ======================================================================

Writers append whole lines with one ``write`` on a file opened with O_APPEND, so lines from
several processes never interleave (each line is well under PIPE_BUF-sized atomic limits on
local file systems in practice; readers skip a torn last line).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

EVENT_TYPES = (
    "job_start",
    "worker_start",
    "standby_ready",
    "step",
    "failure_detected",
    "checkpoint_saved",
    "checkpoint_failed",
    "restart",
    "restore",
    "resumed",
    "recovery_summary",
    "job_end",
    "snapshot_keeper_start",
    "stage_replaced",
)

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Append-only JSON-lines event log shared by the launcher and its workers."""

    def __init__(self, path: str | os.PathLike, *, gen: int = 0) -> None:
        self.path = Path(path)
        self.gen = gen
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict:
        if event not in EVENT_TYPES:
            raise ValueError(f"unknown event type {event!r}; expected one of {EVENT_TYPES}")
        record = {"t": time.time(), "event": event, "gen": self.gen, **fields}
        line = (json.dumps(record, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the records of an event log (a file, or a run dir holding ``events.jsonl``)."""
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    with open(p, "rb") as f:
        for raw in f:
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                continue  # a torn last line from a process killed mid-write
