"""A worker's place in a ``jitckpt run --recovery stage`` job (single-stage replacement).

With ``--recovery stage`` the launcher does not end the job when a worker dies: the survivors
keep running and keep their state, and the launcher starts one replacement for the dead rank.
It tells each worker what it needs in the worker spec sent with its rank
(:class:`~jitckpt.protocol.worker_spec.StageSpec`), and keeps a job-wide TCPStore that the
launcher hosts (so the store outlives any worker, rank 0 included):

* ``store`` (``host:port``) and ``prefix`` (the job's key prefix when the store is the rendezvous
  store of several nodes); the spec's ``gen``: the process-group generation this process starts in;
* ``role``: ``initial`` (first start), ``replacement`` (a dead rank's successor: load the
  last global checkpoint and replay from the neighbours' logs) or ``restart`` (the launcher fell
  back to restarting every rank from the global checkpoint).

On a death in generation ``g`` the launcher sets ``failure_key(g)`` (survivors waiting on a live
peer stop waiting) and then ``announce_key(g + 1)`` = the dead rank. Survivors re-form their
process group as generation ``g + 1``.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from jitckpt.protocol.control_messages import StageCaughtUp
from jitckpt.swift.pipeline.failure_flag import FailureFlag, announce_key

ROLES = ("initial", "replacement", "restart")


@dataclass(frozen=True)
class StageMembership:
    """Rank, generation and role of this worker, and the launcher's job store.

    ``StageMembership.from_launcher()`` returns ``None`` outside ``jitckpt run --recovery stage``.
    ``failure_flag(g)`` is the job-wide failure flag of generation ``g``;
    ``failed_rank(g)`` waits (bounded by the store timeout) until the launcher names the rank
    whose replacement starts generation ``g`` and returns it. A replacement calls
    ``report_caught_up(...)`` once it has replayed up to the survivors (the launcher then logs
    the recovery, with its time, as a ``recovery_summary`` event). ``mark_iteration`` (each
    iteration) and ``report_restored`` (after loading a checkpoint) let the launcher follow
    progress and report a whole-job restart's recovery. ``exit(code)`` ends the process once
    the stage is done (see its docstring for why not a normal exit).
    """

    rank: int
    world_size: int
    generation: int
    role: str
    store: dist.Store

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r}: expected one of {', '.join(ROLES)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} outside 0..{self.world_size - 1}")
        if self.generation < 0:
            raise ValueError(f"generation {self.generation} must be >= 0")

    @classmethod
    def from_launcher(cls, *, timeout: float = 300.0) -> Optional["StageMembership"]:
        """This worker's membership, from the worker spec ``jitckpt run --recovery stage`` sent
        with its rank; None in any other process."""
        from jitckpt.runtime.current import runtime_or_none

        rt = runtime_or_none()  # under jitckpt run, the standby started it from the spec
        spec = rt.spec if rt is not None else None
        if spec is None or spec.stage is None:
            return None
        host, _, port = spec.stage.store.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
        if spec.stage.prefix:  # several nodes: the rendezvous store, under the job's prefix
            store = dist.PrefixStore(spec.stage.prefix, store)
        return cls(rank=spec.rank, world_size=spec.world_size, generation=spec.gen,
                   role=spec.stage.role, store=store)

    def failure_flag(self, generation: int) -> FailureFlag:
        """The failure flag of ``generation`` (cheap to poll while waiting on a peer)."""
        return FailureFlag(store=self.store, generation=generation)

    def failed_rank(self, generation: int) -> int:
        """The rank replaced at the start of ``generation`` (waits for the launcher's word)."""
        self.store.wait([announce_key(generation)])
        return int(self.store.get(announce_key(generation)))

    def mark_iteration(self, completed: int) -> None:
        """At the top of each iteration, with the number of iterations completed: the launcher's
        progress heartbeat (``jitckpt.mark_step``); after a restart it also tells the launcher
        that training runs again, which ends the recovery it reports."""
        from jitckpt.runtime.current import get_runtime

        get_runtime().mark_step(completed)

    def report_restored(self, *, path: str, step: int, seconds: float) -> None:
        """Tell the launcher this worker loaded the global checkpoint ``path`` of ``step``."""
        from jitckpt.runtime.current import get_runtime

        get_runtime().report_restored(str(path), int(step), float(seconds))

    def report_caught_up(self, *, checkpoint: int, replayed: int) -> None:
        """Tell the launcher this replacement loaded ``checkpoint`` and replayed ``replayed``
        iterations from the logs, so it is back with the survivors."""
        from jitckpt.runtime.current import get_runtime

        rt = get_runtime()
        if rt.channel is not None:
            rt.channel.send(StageCaughtUp(rank=self.rank, generation=self.generation,
                                          checkpoint=int(checkpoint), replayed=int(replayed)))

    @staticmethod
    def exit(code: int = 0) -> None:
        """Flush stdio and end the process without C++ static destructors.

        A survivor may leave a receive pending on an aborted gloo group (an abort does not
        interrupt it); the thread waiting on it is still joinable at exit, and destroying it
        there aborts the process (std::terminate, seen as SIGABRT after a successful run).
        """
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
