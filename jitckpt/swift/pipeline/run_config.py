"""The configuration of one pipeline run with SWIFT logging-based recovery: :class:`PipelineRun`.

It says what to train (iterations, stages, micro-batches, schedule), where the checkpoints and
logs go, how a failure is recovered and how long any wait may take. It does not say which model
each stage holds (a stage builder, e.g.
:class:`~jitckpt.swift.pipeline.reference_model.MlpStages`, is passed next to it) nor which
failures to inject (:class:`~jitckpt.swift.pipeline.fault_plan.FaultPlan`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

RECOVERY_MODES = ("logging", "restart")


@dataclass(frozen=True, kw_only=True)
class PipelineRun:
    """One run of a pipeline: what to train, where it writes, and how it recovers a failure.

    ``recovery``: ``"logging"`` replaces a dead stage alone (it loads the last global
    checkpoint and replays its lost iterations from its neighbours' logs; survivors keep their
    state), ``"restart"`` is the baseline that restarts every stage from the checkpoint.
    ``timeout`` bounds every store wait and the whole supervised run, ``group_timeout`` each
    gloo process group. Keyword-only, validated at construction (``ValueError``).
    """

    run_dir: str
    iterations: int = 12
    checkpoint_every: int = 5
    num_stages: int = 4
    micro_batches: int = 4
    schedule: str = "1f1b"
    logging: bool = True
    recovery: str = "logging"  # or "restart"
    timeout: float = 60.0
    group_timeout: float = 45.0
    log_root: Optional[str] = None  # shared log store (default run_dir/logs), e.g. on tmpfs
    # Selective logging (SWIFT §5.3): machines (stages) grouped; only inter-group messages are
    # logged and a failure rolls back the failed stage's whole group. Default: one per stage.
    groups: Optional[tuple[tuple[int, ...], ...]] = None

    def __post_init__(self) -> None:
        if self.num_stages < 2:
            raise ValueError("num_stages must be >= 2")
        if self.groups is not None:
            flat = [m for g in self.groups for m in g]
            if flat != list(range(self.num_stages)):
                raise ValueError(f"groups {self.groups} must be contiguous runs covering stages "
                                 f"0..{self.num_stages - 1} in order, e.g. ((0,), (1, 2), (3,))")
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"recovery must be 'logging' or 'restart', got {self.recovery!r}")

    def group_of(self, stage: int) -> tuple[int, ...]:
        """The selective-logging group holding ``stage``."""
        for g in self.groups or tuple((m,) for m in range(self.num_stages)):
            if stage in g:
                return tuple(g)
        raise ValueError(f"stage {stage} is in no group")
