"""A pipeline run on one machine without the launcher: :func:`run_pipeline` forks one process per
stage around a TCPStore, supervises them and returns a :class:`RunResult`.

When the planned stage dies (SIGKILL in generation 0, see
:class:`~jitckpt.swift.pipeline.fault_plan.FaultPlan`), ``recovery="logging"`` starts one
replacement for it (the survivors go on), ``recovery="restart"`` kills every stage and restarts
them all from the last global checkpoint (the baseline). Any other death fails the run with the
stage's traceback (``run_dir/errors/stage<s>.txt``). Every wait has a deadline
(``PipelineRun.timeout``) and every stage process is killed by PID on the way out. Several
failures need ``jitckpt run --recovery stage``, whose launcher supervises instead (each worker
calls :func:`~jitckpt.swift.pipeline.stage_runtime.run_stage` itself).
"""
from __future__ import annotations

import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

# Imported before the stage processes are forked, so they start at once (jitckpt.swift pulls in
# heavy torch modules).
import torch._dynamo  # noqa: F401  (use_deterministic_algorithms imports it: ~4 s per process)
import torch.distributed as dist

from jitckpt.swift.pipeline.failure_flag import announce_key, failure_key
from jitckpt.swift.pipeline.fault_plan import FAILURE_TIME_KEY, FaultPlan, reached_key
from jitckpt.swift.pipeline.run_config import PipelineRun
from jitckpt.swift.pipeline.stage_runtime import StageBuilder, run_stage
from jitckpt.swift.pipeline.store import StoreServer


@dataclass
class RunResult:
    """What a supervised run produced."""

    ok: bool
    wall_time: float
    stats: dict = field(default_factory=dict)  # stage -> stats json
    failure_time: Optional[float] = None
    reached_time: dict = field(default_factory=dict)  # stage -> time fail_iteration completed
    exit_codes: list = field(default_factory=list)

    @property
    def recovery_time(self) -> Optional[float]:
        """Seconds from the failure until every stage had completed the failed iteration."""
        if self.failure_time is None or not self.reached_time:
            return None
        return max(self.reached_time.values()) - self.failure_time


def run_pipeline(cfg: PipelineRun, *, build_stage: StageBuilder,
                 faults: FaultPlan = FaultPlan()) -> RunResult:
    """Run the pipeline in forked stage processes (each builds its model with ``build_stage``,
    which need not be picklable) with ``faults`` injected; every process is killed by PID on exit."""
    faults.check(cfg)
    if faults.fails_more_than_once:
        raise ValueError("later_failures/also_fail: this supervisor handles one failure; for more "
                         "run the stages under jitckpt run --recovery stage (see run_stage)")
    with StoreServer() as server:  # master in its own process: forking stages stays safe
        return _supervise(cfg, server, build_stage, faults)


def _stage_entry(cfg: PipelineRun, s: int, generation: int, role: str, port: int,
                 build_stage: StageBuilder, faults: FaultPlan) -> None:
    # A stage still alive near the deadline prints its Python stacks (diagnosing hangs).
    faulthandler.dump_traceback_later(max(1.0, cfg.group_timeout * 0.9), exit=False)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=cfg.timeout))
        run_stage(cfg, s, generation, role, store, build_stage=build_stage, faults=faults)
    except BaseException:
        text = traceback.format_exc()
        sys.stderr.write(text)
        errors = Path(cfg.run_dir) / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        (errors / f"stage{s}.txt").write_text(text)
        os._exit(3)
    os._exit(0)


def _supervise(cfg: PipelineRun, server: StoreServer, build_stage: StageBuilder,
               faults: FaultPlan) -> RunResult:
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    store = server.client(timeout=cfg.timeout)
    ctx = multiprocessing.get_context("fork")
    procs: dict[int, multiprocessing.Process] = {}
    exit_codes: list = []
    gen = 0

    def spawn(s: int, role: str) -> None:
        p = ctx.Process(target=_stage_entry, daemon=True,
                        args=(cfg, s, gen, role, store.port, build_stage, faults))
        p.start()
        procs[s] = p

    t0 = time.monotonic()
    deadline = t0 + cfg.timeout
    ok = False
    try:
        for s in range(cfg.num_stages):
            spawn(s, "initial")
        while procs:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"pipeline run did not finish within {cfg.timeout}s")
            multiprocessing.connection.wait([p.sentinel for p in procs.values()], left)
            for s, p in list(procs.items()):
                if p.exitcode is None:
                    continue
                del procs[s]
                exit_codes.append((s, p.exitcode))
                if p.exitcode == 0:
                    continue
                if p.exitcode == -signal.SIGKILL and gen == 0 and s == faults.fail_stage:
                    store.set(failure_key(gen), "1")
                    gen += 1
                    if cfg.recovery == "logging":
                        spawn(s, "replacement")
                        store.set(announce_key(gen), str(s))
                    else:  # baseline: restart every stage from the global checkpoint
                        for q in list(procs.values()):
                            os.kill(q.pid, signal.SIGKILL)
                            q.join(cfg.timeout)
                        procs.clear()
                        for q in range(cfg.num_stages):
                            spawn(q, "restart")
                        break  # the snapshot being iterated holds the killed processes
                    continue
                err = run / "errors" / f"stage{s}.txt"
                detail = err.read_text() if err.exists() else "(no traceback; see stderr)"
                raise RuntimeError(f"stage {s} exited with code {p.exitcode}:\n{detail}")
        ok = True
    finally:
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    return _collect(cfg, store, ok, time.monotonic() - t0, exit_codes)


def _collect(cfg: PipelineRun, store: dist.Store, ok: bool, wall: float,
             exit_codes: list) -> RunResult:
    run = Path(cfg.run_dir)
    res = RunResult(ok=ok, wall_time=wall, exit_codes=exit_codes)
    for s in range(cfg.num_stages):
        f = run / "final" / f"stage{s}.json"
        if f.exists():
            res.stats[s] = json.loads(f.read_text())
        key = reached_key(s)
        if store.check([key]):
            res.reached_time[s] = float(store.get(key))
    if store.check([FAILURE_TIME_KEY]):
        res.failure_time = float(store.get(FAILURE_TIME_KEY))
    return res
