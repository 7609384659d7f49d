"""Structured job event log: one JSON object per line in ``<run_dir>/events.jsonl``.

Every record has ``t`` (Unix time, seconds, float), ``event`` (one of :data:`EVENT_TYPES`) and
``gen`` (restart generation, 0 for the first launch); the other fields depend on the event:

========================  ======================================================================
event                     fields
========================  ======================================================================
``job_start``             nproc, nnodes, world_size, script, checkpoint_dir, hang_timeout, run_id
``worker_start``          rank, pid, warm (bool: a ready warm standby, torch imported), role;
                          not_ready (why not, when warm is false)
                          (initial|restart|replacement|survivor: --recovery inprocess, the same
                          process runs its rank's script again)
``standby_ready``         count, seconds (the refilled warm standby pool finished importing)
``step``                  rank, step, step_time (s) -- sampled, not every step
``failure_detected``      kind (exit|signal|hang|error|exception), rank (the failed rank, null
                          while not known, e.g. a hang), reporter (the healthy rank that detected
                          it, if any), pid, node, detail, detect_time (s from the failure to its
                          detection, when known)
``checkpoint_saved``      rank, step, bytes, seconds, path, kind (jit|periodic), undone (parameters
                          --plugin undo rolled back before this JIT save, else null)
``checkpoint_failed``     rank, reason; kind (jit|periodic) and step for a failed periodic save
                          (the job goes on), e.g. reason "no space left on <dir>: N bytes needed"
``checkpoint_durable``    path, seconds (one node: the launcher's fsync of a JIT checkpoint the
                          worker left in the page cache, done while the restart runs)
``checkpoint_flush_failed`` path, reason (that fsync failed: older checkpoints are no longer pruned)
``restart``               reason, restart_count
``restore``               rank, step, path, seconds, source (disk|memory), decoded (snapshot
                          parts rebuilt from parity), fetched (ZeRO partitions this rank got
                          from another node's replica, AOR)
``resumed``               step, steps_redone
``recovery_summary``      failure_kind, failed_ranks, detect_s, save_s, restart_s, restore_s,
                          total_s, checkpoint_bytes, step_failed, step_resumed, steps_redone,
                          standbys ("ready", or "not ready: rank r: why; ..." for the restarted
                          ranks that found no ready warm standby);
                          scope "stage" for a --recovery stage replacement (restore_s: its
                          checkpoint load and replay; steps_redone: by that rank alone);
                          scope "inprocess" and kept_ranks (the survivors that went on in their
                          own processes) for --recovery inprocess
``survivor_unwound``      rank, pid, seconds (--recovery inprocess: a survivor left its script
                          after its JIT save and released its process groups, in that time)
``job_end``               status (ok|failed|preempted), exit_code, restarts; signal (preempted:
                          SIGTERM|SIGINT; exit_code is then 128 + its number); reason (failed
                          because the job's cross-node store stopped taking writes)
``warning``               rank, reason (a worker cannot do what a flag asks, e.g. --periodic-every
                          without a safe point to save at; or, after a failure, a native program
                          that registered no save path, whose JIT checkpoint is not waited for)
``death_after_verdict``   rank, pid, detail (a worker died after every rank passed the exit
                          barrier: a warning, the job is complete)
``snapshot_keeper_start`` node, pid, socket, replaced (bool: the previous keeper died),
                          previous_exit (its exit code)
``stage_replaced``        rank, generation, restart_count (--recovery stage: the dead rank got a
                          replacement; the other ranks kept running)
``stage_caught_up``       rank, pid, checkpoint, replayed (--no-python --plugin logging: written by
                          libjit.so when a replacement stage, having replayed its receives of
                          ``replayed`` iterations after global checkpoint ``checkpoint`` from its
                          neighbours' send logs, makes its first call live with the survivors)
``transparent_validation`` rank, pid, minibatch, matched (bool), detail (the first difference, or
                          why it could not run, when not matched), calls, bytes, seconds
                          (--transparent: libjit.so replayed a minibatch into a scratch proxy and
                          compared the device buffers; a mismatch turns transparent recovery off)
``transparent_recovery``  rank, pid, cause, recovered (bool), reason (when not), calls,
                          minibatch_calls (of them, the current minibatch's), undone (launches
                          of the optimizer step undone by --plugin undo first), bytes, save_s,
                          agree_s (waiting for the peers' word that they recover too),
                          new_proxy_s, recreate_s (of it communicators_s: the communicators'
                          inits, with their peers), restore_s, replay_s, synchronize_s,
                          total_s (--transparent: written by libjit.so when it replaced a worker's
                          device proxy and replayed the worker's calls into the new one, or why
                          it could not; the worker was not restarted if it did)
========================  ======================================================================

Writers append whole lines with one ``write`` on a file opened with O_APPEND, so lines from
several processes never interleave (each line is well under PIPE_BUF-sized atomic limits on
local file systems in practice). Writing never raises: when the file system is full (or the file
is otherwise unwritable) records are kept in memory, a warning is logged once, and they are
written, in order, by a later ``emit`` or :meth:`EventLog.close`. A line torn by a full disk is
ended with a newline before anything else is written, and readers skip undecodable lines
anywhere in the file.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("jitckpt.observability.events")

EVENT_TYPES = (
    "job_start",
    "worker_start",
    "standby_ready",
    "step",
    "failure_detected",
    "checkpoint_saved",
    "checkpoint_failed",
    "checkpoint_durable",
    "checkpoint_flush_failed",
    "restart",
    "restore",
    "resumed",
    "survivor_unwound",
    "recovery_summary",
    "job_end",
    "snapshot_keeper_start",
    "stage_replaced",
    "death_after_verdict",
    "warning",
    "transparent_recovery",
    "transparent_validation",
    "stage_caught_up",
    "generation_nodes",
)

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Append-only JSON-lines event log shared by the launcher and its workers."""

    MAX_PENDING = 10000  # records kept in memory while the file is unwritable

    def __init__(self, path: str | os.PathLike, *, gen: int = 0) -> None:
        self.path = Path(path)
        self.gen = gen
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._torn = False       # the file ends in a partial line (a write cut short)
        self._failing = False    # warned about the current spell of write errors
        self._dropped = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise  # a wrong path or permissions: the caller reports it before the job starts
            self._write_failed(e)

    def emit(self, event: str, **fields: Any) -> dict:
        """Append one record; never raises for a write error (the record is kept and retried)."""
        if event not in EVENT_TYPES:
            raise ValueError(f"unknown event type {event!r}; expected one of {EVENT_TYPES}")
        record = {"t": time.time(), "event": event, "gen": self.gen, **fields}
        line = (json.dumps(record, default=str) + "\n").encode()
        with self._lock:
            self._pending.append(line)
            if len(self._pending) > self.MAX_PENDING:
                del self._pending[0]
                self._dropped += 1
            self._flush_locked()
        return record

    def close(self) -> None:
        """Write what is still pending; log what could not be written."""
        with self._lock:
            self._flush_locked()
            if self._pending or self._dropped:
                log.warning("event log %s: %d events could not be written (%d dropped earlier)",
                            self.path, len(self._pending), self._dropped)

    def _flush_locked(self) -> None:
        try:
            if not self.path.parent.is_dir():
                self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            self._write_failed(e)
            return
        written = 0
        try:
            while self._pending:
                if self._torn:  # end the partial line so that readers skip it alone
                    if os.write(fd, b"\n") != 1:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    self._torn = False
                line = self._pending[0]
                n = os.write(fd, line)
                if n < len(line):
                    self._torn = True
                    if n == len(line) - 1:  # only the newline is missing: the record is whole
                        self._pending.pop(0)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self._pending.pop(0)
                written += 1
        except OSError as e:
            self._write_failed(e)
        else:
            if self._failing:
                log.warning("event log %s: writable again; %d delayed events written", self.path,
                            written)
                self._failing = False
        finally:
            try:
                os.close(fd)
            except OSError:
                pass  # e.g. NFS reporting a deferred write error: the records were handled above

    def _write_failed(self, e: OSError) -> None:
        if not self._failing:
            self._failing = True
            log.warning("event log %s: cannot write (%s); keeping events in memory and retrying "
                        "(the job goes on)", self.path, e.strerror or e)


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the records of an event log (a file, or a run dir holding ``events.jsonl``).

    Lines that do not decode (torn by a process killed mid-write or by a full disk) are skipped;
    a record appended after a torn fragment on the same line is still read.
    """
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    with open(p, "rb") as f:
        for raw in f:
            rec = _decode(raw)
            if rec is not None:
                yield rec


def _decode(raw: bytes) -> Any:
    try:
        rec = json.loads(raw)
    except ValueError:
        start = raw.rfind(b'{"t": ', 1)  # every record starts so (json.dumps of emit's dict)
        if start < 0:
            return None
        try:
            rec = json.loads(raw[start:])
        except ValueError:
            return None
    return rec if isinstance(rec, dict) else None
