"""What the launcher tells a worker, once: one frozen, validated :class:`WorkerSpec` per process.

``jitckpt run`` builds the spec when it starts a rank and sends it with the rank's assignment
(:class:`~jitckpt.protocol.control_messages.Assign`); the worker runtime, the snapshot tier and
the stage membership read it from there, and the runtime hands libjit.so its hang timeout through
``jitckpt._native``. A process the launcher did not start reads the same settings from the
environment (:meth:`WorkerSpec.from_env`): a script under torchrun or plain python, and a
``--no-python`` program, whose ``LD_PRELOAD``-ed libjit.so reads ``JITCKPT_HANG_TIMEOUT`` itself.
:data:`ENVIRONMENT` is that table, in one place.

torchrun's own variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_*``, ...) are
set for every worker as torchrun sets them: user scripts and ``init_process_group`` read them.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from jitckpt.hang_timeout import HangTimeout

# The variables a process without the launcher may set, and what they mean (docs: recovery.md).
ENVIRONMENT = {
    "JITCKPT_CHECKPOINT_DIR": "where JIT and periodic checkpoints go (default ./jitckpt-checkpoints)",
    "JITCKPT_RUN_DIR": "where the event log goes (set by jitckpt run)",
    "JITCKPT_HANG_TIMEOUT": "seconds, or auto[:floor=S,mult=X,startup=S,window=N,warmup=N] (default auto); "
                            "read by the worker and by libjit.so",
    "JITCKPT_PERIODIC_EVERY": "take a periodic checkpoint every N steps (default 0: off)",
    "JITCKPT_SAVE_TIMEOUT": "seconds the exit barrier and a save may wait (default 120)",
    "JITCKPT_PLUGINS": "recovery plugins, comma-separated (undo, logging)",
    "JITCKPT_GEN": "the generation (restart count) of this process (default TORCHELASTIC_RESTART_COUNT)",
}
SNAPSHOT_PROTECTIONS = ("aec", "arc", "none")
SNAPSHOT_ZERO_MODES = ("recompute", "copy", "log")  # how ZeRO partitions are protected (docs/aor.md)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class SnapshotSpec:
    """``jitckpt run --snapshot-every``: the node's keeper and what to snapshot."""

    socket: str
    every: int
    protection: str = "none"
    flush_every: int = 0
    ranks_per_node: int = 1
    zero: str = "recompute"
    zero_copy_every: int = 20  # log mode: the partition copy interval (steps)

    def __post_init__(self) -> None:
        _check(bool(self.socket), "snapshot spec: the keeper's socket path is empty")
        _check(self.zero_copy_every > 0, f"snapshot spec: zero_copy_every must be > 0, got {self.zero_copy_every}")
        _check(self.zero in SNAPSHOT_ZERO_MODES,
               f"snapshot spec: zero {self.zero!r} is not one of {SNAPSHOT_ZERO_MODES}")
        _check(self.every > 0, f"snapshot spec: every must be > 0, got {self.every}")
        _check(self.protection in SNAPSHOT_PROTECTIONS,
               f"snapshot spec: protection {self.protection!r} is not one of {SNAPSHOT_PROTECTIONS}")
        _check(self.flush_every >= 0 and self.ranks_per_node >= 1,
               "snapshot spec: flush_every must be >= 0 and ranks_per_node >= 1")


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """``jitckpt run --recovery stage``: the job store and this worker's role in it."""

    store: str                 # HOST:PORT of the job store
    prefix: str = ""           # several nodes: the job's prefix in the rendezvous store
    role: str = "initial"      # initial, restart or replacement

    def __post_init__(self) -> None:
        host, _, port = self.store.rpartition(":")
        _check(bool(host) and port.isdigit(), f"stage spec: store {self.store!r}: expected HOST:PORT")


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything jitckpt needs to know in a worker beyond torchrun's variables."""

    rank: int = 0
    world_size: int = 1
    gen: int = 0
    checkpoint_dir: str
    run_dir: str = ""
    hang_timeout: str = "auto"
    periodic_every: int = 0
    save_timeout: float = 120.0
    plugins: tuple = ()
    host_store: bool = False   # rank 0 serves the generation's c10d store on MASTER_ADDR only
    snapshot: Optional[SnapshotSpec] = None
    stage: Optional[StageSpec] = None
    # One node: a JIT save returns once its files are in the page cache; the launcher fsyncs them
    # after the restart has begun (jitckpt.launcher.checkpoint_flush), for every JIT save reported.
    launcher_fsyncs: bool = False
    # This node's rank-state board (jitckpt.runtime.rank_state), made by the launcher ("": none).
    rank_state_dir: str = ""
    # --recovery inprocess: after a peer's failure this rank saves, leaves its script and waits for
    # its next assignment in the same process (jitckpt.runtime.inprocess), instead of exiting.
    in_process: bool = False

    def __post_init__(self) -> None:
        _check(self.world_size >= 1 and 0 <= self.rank < self.world_size,
               f"worker spec: rank {self.rank} is not in [0, world_size={self.world_size})")
        _check(self.gen >= 0 and self.periodic_every >= 0, "worker spec: gen and periodic_every must be >= 0")
        _check(bool(self.checkpoint_dir), "worker spec: checkpoint_dir is empty")
        _check(math.isfinite(self.save_timeout) and self.save_timeout > 0,
               f"worker spec: save_timeout must be a finite number of seconds > 0, got {self.save_timeout}")
        # One text for the policy everywhere (the grammar is HangTimeout's).
        object.__setattr__(self, "hang_timeout", HangTimeout.parse(self.hang_timeout).to_text())
        object.__setattr__(self, "plugins", tuple(self.plugins))
        from jitckpt.plugins import get as get_plugins

        get_plugins(self.plugins)  # unknown names: ValueError

    # ---- over the control channel --------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "WorkerSpec":
        d = dict(d)
        snap, stage = d.pop("snapshot", None), d.pop("stage", None)
        return cls(**d, snapshot=SnapshotSpec(**snap) if snap else None,
                   stage=StageSpec(**stage) if stage else None)

    # ---- processes without the launcher --------------------------------------------------------
    def to_env(self) -> dict:
        """The variables of :data:`ENVIRONMENT` for this spec (a ``--no-python`` program's)."""
        return {"JITCKPT_CHECKPOINT_DIR": self.checkpoint_dir, "JITCKPT_RUN_DIR": self.run_dir,
                "JITCKPT_HANG_TIMEOUT": self.hang_timeout,
                "JITCKPT_PERIODIC_EVERY": str(self.periodic_every),
                "JITCKPT_SAVE_TIMEOUT": repr(self.save_timeout), "JITCKPT_PLUGINS": ",".join(self.plugins),
                "JITCKPT_GEN": str(self.gen)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "WorkerSpec":
        """The spec of a process the launcher did not start (torchrun, plain python)."""
        def number(name: str, default: str, kind=int):
            text = env.get(name) or default
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"${name}={text!r}: expected a number") from None

        gen = number("JITCKPT_GEN", env.get("TORCHELASTIC_RESTART_COUNT") or "0")
        return cls(rank=number("RANK", "0"), world_size=number("WORLD_SIZE", "1"), gen=gen,
                   checkpoint_dir=env.get("JITCKPT_CHECKPOINT_DIR") or os.path.abspath("jitckpt-checkpoints"),
                   run_dir=env.get("JITCKPT_RUN_DIR", ""),
                   hang_timeout=env.get("JITCKPT_HANG_TIMEOUT") or "auto",
                   periodic_every=number("JITCKPT_PERIODIC_EVERY", "0"),
                   save_timeout=number("JITCKPT_SAVE_TIMEOUT", "120", float),
                   plugins=tuple(filter(None, env.get("JITCKPT_PLUGINS", "").split(","))))
