"""SWIFT (Zhong et al.) failure-recovery mechanisms.

``UpdateUndo`` inverts the last (possibly interrupted) optimizer step so data-parallel
survivors return to one consistent state without snapshots; ``Lamb`` is a LAMB optimizer that
keeps the per-tensor trust ratios its inverse needs.

Logging-based recovery for pipeline parallelism: ``SendLogger`` logs a stage's point-to-point
messages (sender side, chunked, in bubbles), ``LogIndex`` serves them back in order for replay
and detects divergence, ``PipelineStage``/``PipelineChannel`` run an iteration live or from the
logs, ``parallel_replay_iteration`` re-computes a lost stage's micro-batches on several
workers, and ``plan_groups`` is the selective-logging grouping of SWIFT §5.3.
``StageMembership`` is a worker's rank, generation, role and job store under
``jitckpt run --plugin logging`` (= ``--recovery stage``: the launcher replaces a dead stage alone).
"""
from jitckpt.swift.undo.errors import NotInvertibleError, UndoError
from jitckpt.swift.undo.lamb_optimizer import Lamb
from jitckpt.swift.pipeline.logging_determinism import DeterminismMismatchError, apply_determinism, check_determinism
from jitckpt.swift.pipeline.logging_records import MessageKey
from jitckpt.swift.pipeline.logging_replay import LogIndex, MissingLogError, ReplayDivergenceError
from jitckpt.swift.pipeline.logging_sender import SendLogger
from jitckpt.swift.pipeline.channel import PeerFailure, PipelineChannel
from jitckpt.swift.pipeline.parallel_recovery import parallel_replay_iteration
from jitckpt.swift.pipeline.recovery import partition_micro_batches
from jitckpt.swift.pipeline.stage import PipelineStage
from jitckpt.swift.pipeline.selective_logging import GroupPlan, logged_peers, plan_groups
from jitckpt.swift.pipeline.stage_membership import StageMembership
from jitckpt.swift.undo.update_undo import UpdateUndo

__all__ = ["UpdateUndo", "Lamb", "NotInvertibleError", "UndoError",
           "SendLogger", "LogIndex", "MessageKey", "ReplayDivergenceError", "MissingLogError",
           "DeterminismMismatchError", "apply_determinism", "check_determinism",
           "PipelineStage", "PipelineChannel", "PeerFailure", "parallel_replay_iteration",
           "partition_micro_batches", "plan_groups", "GroupPlan", "logged_peers", "StageMembership"]
