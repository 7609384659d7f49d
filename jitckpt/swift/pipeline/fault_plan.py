"""Failure injection into a pipeline run (tests, benchmarks, the demo): :class:`FaultPlan`.

A plan names the stage that SIGKILLs itself and where (iteration, op), the stages that die with
it or in later process-group generations, and a test hook that perturbs a replacement's replay.
The stage runtime calls the plan's hooks (:meth:`FaultPlan.on_op`, :meth:`~FaultPlan.on_completed`,
:meth:`~FaultPlan.after_restore`); the supervisor reads the store keys they set
(:data:`FAILURE_TIME_KEY`, :func:`reached_key`) to measure the recovery time.

Why a plan apart from :class:`~jitckpt.swift.pipeline.run_config.PipelineRun`: a real job
configures a run and never injects a failure, so the run's fields stay what a user sets, and
the failure injection is in one place instead of spread over the runtime. The price is one
cross check: where a failure may be injected depends on the run (its stages and iterations),
so :meth:`FaultPlan.check` validates a plan against a run, and the runtime and the supervisor
call it before they start.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from jitckpt.swift.pipeline.run_config import PipelineRun
from jitckpt.swift.pipeline.stage import PipelineStage

FAILURE_TIME_KEY = "failure_time"  # store key: wall-clock time of the (first) injected death


def reached_key(stage: int) -> str:
    """Store key: wall-clock time ``stage`` completed the plan's ``fail_iteration``."""
    return f"reached/{stage}"


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Which stages die where; the default plan injects nothing.

    ``fail_stage`` SIGKILLs itself before op ``fail_op`` of iteration ``fail_iteration``
    (process-group generation 0), once the stages in ``fail_after`` have completed that
    iteration. Under ``jitckpt run --recovery stage`` only: ``also_fail`` stages die at the same
    point (overlapping failures), and ``later_failures[k - 1]`` = (stage, iteration, op) dies in
    generation ``k``, after ``k`` earlier replacements. ``tamper_replay`` (a test hook) makes a
    replacement perturb a weight after loading the checkpoint, so its replay must diverge.
    Keyword-only, validated at construction and against a run by :meth:`check`.
    """

    fail_stage: Optional[int] = None
    fail_iteration: int = 0
    fail_op: int = 0
    fail_after: tuple[int, ...] = ()  # die only once these stages completed fail_iteration
    also_fail: tuple[int, ...] = ()
    later_failures: tuple[tuple[int, int, int], ...] = ()
    tamper_replay: bool = False

    def __post_init__(self) -> None:
        if (self.later_failures or self.also_fail) and self.fail_stage is None:
            raise ValueError("later_failures and also_fail need a first failure (fail_stage)")

    def check(self, run: PipelineRun) -> None:
        """Raise ``ValueError`` unless this plan fits ``run`` (its stages, iterations, recovery)."""
        if run.recovery == "logging" and self.fail_stage is not None and not run.logging:
            raise ValueError("recovery='logging' needs logging=True")
        if self.fail_stage is not None:
            if not 0 <= self.fail_stage < run.num_stages:
                raise ValueError(f"fail_stage {self.fail_stage} outside 0..{run.num_stages-1}")
            if not 1 <= self.fail_iteration <= run.iterations:
                raise ValueError(f"fail_iteration must be in 1..{run.iterations}")
        for stage in self.also_fail:
            if not 0 <= stage < run.num_stages or stage == self.fail_stage:
                raise ValueError(f"also_fail stage {stage}: outside 0..{run.num_stages - 1} "
                                 "or the same as fail_stage")
        for stage, it, _ in self.later_failures:
            if not (0 <= stage < run.num_stages and 1 <= it <= run.iterations):
                raise ValueError(f"later failure of stage {stage} at iteration {it}: outside "
                                 f"stages 0..{run.num_stages - 1} or iterations 1..{run.iterations}")

    @property
    def fails_more_than_once(self) -> bool:
        """Whether more than one stage dies (``also_fail`` or ``later_failures``)."""
        return bool(self.later_failures or self.also_fail)

    def on_op(self, store: dist.Store, *, stage: int, generation: int, iteration: int,
              op: int) -> None:
        """Before each op of a stage: SIGKILL this process if the plan has ``stage`` die here in
        ``generation`` (first noting the time under :data:`FAILURE_TIME_KEY`)."""
        if self.fail_stage is None:
            return
        plan = [(self.fail_stage, self.fail_iteration, self.fail_op), *self.later_failures]
        first = generation == 0 and stage in self.also_fail and (iteration, op) == plan[0][1:]
        if first or generation < len(plan) and plan[generation] == (stage, iteration, op):
            if generation == 0:
                store.wait([reached_key(p) for p in self.fail_after])
            store.set(FAILURE_TIME_KEY, repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_completed(self, store: dist.Store, *, stage: int, iteration: int) -> None:
        """After ``stage`` completed ``iteration``: note the time if it is the failed one."""
        if iteration == self.fail_iteration:
            store.set(reached_key(stage), repr(time.time()))

    def after_restore(self, stage: PipelineStage) -> None:
        """After a stage loaded the checkpoint: perturb a weight if ``tamper_replay``."""
        if self.tamper_replay:
            with torch.no_grad():
                next(stage.module.parameters()).view(-1)[0] += 1e-3
