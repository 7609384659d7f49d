"""What a node's daemon knows: the jobs of this node (their launcher, workers, proxies, keepers),
their last checkpoints, the node's last failures, and whether it is being drained.

Every request is checked whole before anything changes: a bad one raises :class:`BadRequest`
naming the field and what it takes, and leaves the state as it was.
"""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psutil

MAX_TEXT = 4096          # a failure's detail, a checkpoint's path
MAX_PROCESSES = 1024     # per job and node
MAX_JOBS = 64
FAILURES_KEPT = 50
PROCESS_KINDS = ("worker", "proxy", "keeper")
RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
JOB_STATUSES = ("ok", "failed", "preempted")


class BadRequest(ValueError):
    """A request that cannot apply; its text names the field."""


class Draining(RuntimeError):
    """The node takes no new jobs."""


def _run_id(value: str) -> str:
    if not RUN_ID.match(value):
        raise BadRequest(f"run_id {value[:80]!r}: 1-128 letters, digits, '.', '_' or '-'")
    return value


def _int(name: str, value: int, lo: int, hi: int = 2**31 - 1) -> int:
    if not lo <= value <= hi:
        raise BadRequest(f"{name} {value}: must be in [{lo}, {hi}]")
    return value


def _text(name: str, value: str, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise BadRequest(f"{name}: {len(value)} characters, at most {limit}")
    return value


@dataclass
class JobRecord:
    run_id: str
    node_rank: int
    launcher_pid: int
    world_size: int
    generation: int
    processes: list[tuple[int, int, str]] = field(default_factory=list)  # (rank, pid, kind)
    last_checkpoint_step: int = -1
    last_checkpoint_path: str = ""
    status: str = "running"


class NodeState:
    """Thread-safe: the gRPC server calls it from its worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.jobs: dict[str, JobRecord] = {}
        self.failures: deque = deque(maxlen=FAILURES_KEPT)
        self.draining = False
        self.started = time.time()
        self.proxies: dict[int, tuple[str, int]] = {}  # pid -> (run id, rank): started by the broker, running

    def register_job(self, req: Any) -> None:
        run_id = _run_id(req.run_id)
        node_rank = _int("node_rank", req.node_rank, 0)
        launcher_pid = _int("launcher_pid", req.launcher_pid, 1)
        world_size = _int("world_size", req.world_size, 1)
        generation = _int("generation", req.generation, 0)
        if len(req.processes) > MAX_PROCESSES:
            raise BadRequest(f"processes: {len(req.processes)}, at most {MAX_PROCESSES}")
        procs = []
        for i, p in enumerate(req.processes):
            if p.kind not in PROCESS_KINDS:
                raise BadRequest(f"processes[{i}].kind {p.kind[:40]!r}: one of {', '.join(PROCESS_KINDS)}")
            procs.append((_int(f"processes[{i}].rank", p.rank, -1, world_size - 1),
                          _int(f"processes[{i}].pid", p.pid, 1), p.kind))
        with self._lock:
            job = self.jobs.get(run_id)
            if job is None or job.status != "running":
                if self.draining:
                    raise Draining("this node is being drained (jitckpt daemon drain): start the job on another node")
                if job is None and len(self.jobs) >= MAX_JOBS:
                    self._forget_ended()
                    if len(self.jobs) >= MAX_JOBS:
                        raise BadRequest(f"this daemon already tracks {MAX_JOBS} running jobs")
            self.jobs[run_id] = JobRecord(run_id, node_rank, launcher_pid, world_size, generation, procs,
                                          job.last_checkpoint_step if job else -1,
                                          job.last_checkpoint_path if job else "")

    def report_failure(self, req: Any) -> None:
        run_id = _run_id(req.run_id)
        entry = dict(run_id=run_id, generation=_int("generation", req.generation, 0),
                     kind=_text("kind", req.kind, 64) or "unknown", rank=_int("rank", req.rank, -1),
                     detail=_text("detail", req.detail), time=time.time())
        with self._lock:
            self._job(run_id)
            self.failures.append(entry)

    def report_checkpoint(self, req: Any) -> None:
        run_id = _run_id(req.run_id)
        _int("rank", req.rank, 0)
        step = _int("step", req.step, 0, 2**63 - 1)
        if req.kind not in ("jit", "periodic"):
            raise BadRequest(f"kind {req.kind[:40]!r}: 'jit' or 'periodic'")
        path = _text("path", req.path)
        _int("bytes", req.bytes, 0, 2**63 - 1)
        with self._lock:
            job = self._job(run_id)
            if step >= job.last_checkpoint_step:
                job.last_checkpoint_step, job.last_checkpoint_path = step, path

    def end_job(self, req: Any) -> None:
        run_id = _run_id(req.run_id)
        if req.status not in JOB_STATUSES:
            raise BadRequest(f"status {req.status[:40]!r}: one of {', '.join(JOB_STATUSES)}")
        with self._lock:
            self._job(run_id).status = req.status

    def drain(self, on: bool) -> None:
        with self._lock:
            self.draining = bool(on)

    def dead_processes(self) -> list[tuple[str, int, int, str]]:
        """(run id, rank, pid, kind) of running jobs' processes that no longer exist."""
        with self._lock:
            procs = [(j.run_id, r, pid, kind) for j in self.jobs.values() if j.status == "running"
                     for r, pid, kind in j.processes]
        return [p for p in procs if not psutil.pid_exists(p[2])]

    def proxy_started(self, pid: int, run_id: str, rank: int) -> None:
        """The proxy broker started ``pid`` for rank ``rank`` of job ``run_id`` (as its environment says)."""
        with self._lock:
            self.proxies[pid] = (run_id, rank)

    def proxy_ended(self, pid: int, status: int) -> None:
        with self._lock:
            self.proxies.pop(pid, None)

    def snapshot(self) -> tuple[bool, list[JobRecord], list[dict]]:
        """The jobs (with the running proxies the broker started for them), failures, draining."""
        with self._lock:
            jobs = [JobRecord(**{**vars(j), "processes": list(j.processes) + [
                (rank if 0 <= rank < j.world_size else -1, pid, "proxy")
                for pid, (run_id, rank) in sorted(self.proxies.items()) if run_id == j.run_id]})
                for j in self.jobs.values()]
            return self.draining, jobs, list(self.failures)

    def _job(self, run_id: str) -> JobRecord:
        job = self.jobs.get(run_id)
        if job is None:
            raise BadRequest(f"run_id {run_id!r}: no such job on this node (register it first)")
        return job

    def _forget_ended(self) -> None:
        for run_id in [r for r, j in self.jobs.items() if j.status != "running"]:
            del self.jobs[run_id]
