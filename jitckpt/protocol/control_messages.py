"""The messages of the launcher <-> worker control channel, one frozen class each.

On the wire a message is one JSON line (:mod:`jitckpt.protocol.wire`): its fields plus
``"type"`` (the class's :attr:`TYPE`); each end decodes with its table, :data:`TO_LAUNCHER` or
:data:`TO_WORKER`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

# Message, ProtocolError and decode are this channel's API too (re-exported).
from jitckpt.protocol.wire import Message, ProtocolError, decode, table  # noqa: F401


# ---- worker -> launcher ------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready(Message):
    """A standby finished importing torch and waits for its assignment."""
    TYPE: ClassVar[str] = "ready"


@dataclass(frozen=True)
class Hello(Message):
    """A worker registered with the launcher. ``can_save``: something in it answers a SaveNow (the
    Python runtime always does, with Saved or SaveFailed). libjit.so registers a ``--no-python``
    program with False (interposer/src/launcher_hello.cc): a native program has no save path, so
    after a failure the launcher does not wait for its JIT checkpoint. A later Hello with True (a
    Python runtime started in that process) adds a save path."""
    TYPE: ClassVar[str] = "hello"
    rank: int
    pid: int
    gen: int
    can_save: bool = True


@dataclass(frozen=True)
class FailureReport(Message):
    """A failure this rank detected: its own exception, a hang, a collective error, a preemption.
    ``culprit``: the failed rank when the reporter knows it."""
    TYPE: ClassVar[str] = "failure"
    rank: int
    kind: str
    detail: str = ""
    step: Optional[int] = None
    detect_s: Optional[float] = None
    culprit: Optional[int] = None


@dataclass(frozen=True)
class Saved(Message):
    TYPE: ClassVar[str] = "saved"
    rank: int
    path: str
    step: int
    bytes: int
    seconds: float
    shard_id: int = 0
    num_shards: int = 1
    kind: str = "jit"             # or "periodic"
    undone: Optional[int] = None  # parameters a SWIFT undo rolled back before the save


@dataclass(frozen=True)
class SaveFailed(Message):
    TYPE: ClassVar[str] = "save_failed"
    rank: int
    reason: str
    kind: str = "jit"
    step: Optional[int] = None


@dataclass(frozen=True)
class Restored(Message):
    TYPE: ClassVar[str] = "restored"
    rank: int
    step: int
    path: str
    seconds: Optional[float]
    source: str = "disk"          # or "memory"
    decoded: list = field(default_factory=list)
    fetched: list = field(default_factory=list)


@dataclass(frozen=True)
class Resumed(Message):
    """The first optimizer step after a restart is done."""
    TYPE: ClassVar[str] = "resumed"
    rank: int
    step: int


@dataclass(frozen=True)
class WorkerWarning(Message):
    TYPE: ClassVar[str] = "warning"
    rank: int
    reason: str


@dataclass(frozen=True)
class ExitReady(Message):
    """This rank reached its exit barrier."""
    TYPE: ClassVar[str] = "exit_ready"
    rank: int
    step: Optional[int]


@dataclass(frozen=True)
class StageCaughtUp(Message):
    """A replacement stage (``--recovery stage``) replayed up to the survivors."""
    TYPE: ClassVar[str] = "stage_caught_up"
    rank: int
    generation: int
    checkpoint: int
    replayed: int


# ---- launcher -> worker ------------------------------------------------------------------------
@dataclass(frozen=True)
class Assign(Message):
    """Standby only: become this rank (environment, argv, working directory, ``-m`` module, and
    jitckpt's settings for it: the worker spec)."""
    TYPE: ClassVar[str] = "assign"
    env: dict                   # torchrun's variables for the rank
    argv: list
    cwd: str
    module: Optional[str] = None
    spec: dict = field(default_factory=dict)  # jitckpt.protocol.worker_spec.WorkerSpec.to_dict()
    stdout: str = ""            # a file for fd 1 (--redirects/--tee), os.devnull, or "" (inherited)
    stderr: str = ""


@dataclass(frozen=True)
class SaveNow(Message):
    """Another rank failed (``rank`` None: not known yet), or the job is preempted: save.
    ``step``: the minibatch the failed rank was in (its last report); with the rank not known, the
    furthest minibatch any rank began. A survivor behind it finishes its own minibatch."""
    TYPE: ClassVar[str] = "failure"
    kind: str
    rank: Optional[int]
    detail: str = ""
    step: Optional[int] = None


@dataclass(frozen=True)
class Verdict(Message):
    """Every rank reached its exit barrier (ok) or not: the barrier's outcome."""
    TYPE: ClassVar[str] = "verdict"
    ok: bool


@dataclass(frozen=True)
class PeerExit(Message):
    """That rank reached its exit barrier: a peer waiting for it in a collective will hang."""
    TYPE: ClassVar[str] = "peer_exit"
    rank: int
    step: Optional[int]


@dataclass(frozen=True)
class RankLost(Message):
    """That rank's process is gone, seen after the failure was reported (a peer's collective error
    came first): a survivor saving its share of a shard need not wait for that rank's part."""
    TYPE: ClassVar[str] = "rank_lost"
    rank: int


@dataclass(frozen=True)
class Unwind(Message):
    """In-process recovery: every survivor saved; leave the script now (cut the groups' connections,
    unwind the training thread). Not before: a survivor that cut its connections while another was
    still in a collective with it could make that one save an older step than the rest."""
    TYPE: ClassVar[str] = "unwind"


@dataclass(frozen=True)
class Unwound(Message):
    """In-process recovery: this survivor left its script after its JIT save, released its process
    groups, and waits in the same process for its next Assign."""
    TYPE: ClassVar[str] = "unwound"
    rank: int
    pid: int
    seconds: float  # from the JIT save's report to this message


TO_LAUNCHER = table(Ready, Hello, FailureReport, Saved, SaveFailed, Restored, Resumed,
                    WorkerWarning, ExitReady, StageCaughtUp, Unwound)
TO_WORKER = table(Assign, SaveNow, Verdict, PeerExit, RankLost, Unwind)
