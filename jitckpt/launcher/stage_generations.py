"""The launcher's side of ``jitckpt run --recovery stage``: the job store, generations, budget.

Workers re-form their process group as a new *generation* after every replacement (see
:mod:`jitckpt.swift.pipeline.stage_membership`). With several nodes, each launcher replaces its own dead
ranks, so generation numbers and the restart budget live in the job store, not in a launcher:

* ``pg_gen``: counter handing out generations (a replacement takes the next one; a whole-job
  restart takes one too, chosen by node 0 and read by the others under ``launch<L>/pg_gen``).
* ``replacements``: replacements so far, on any node (counted against ``--max-restarts``
  together with whole-job restarts, which every launcher counts alike).
* ``launch<L>/catching_up``: replacements of launch ``L`` that have not yet replayed up to the
  survivors. Only one at a time: a replacement replays from its neighbours' logs while they wait
  for it, so a second death before it has caught up (two stages at once, on one node or two, or
  the replacement itself) leaves a generation that no stage set can complete. That death falls
  back to the whole-job restart from the global checkpoint, as SWIFT does when logs cannot
  cover a failure.

One node: the store is a TCPStore served by the launcher on loopback. Several nodes: the
rendezvous store of :class:`~jitckpt.launcher.node_coordinator.NodeCoordinator` (node 0's launcher serves
it), under the job's prefix. Either way it outlives every worker, rank 0 included.
"""
from __future__ import annotations

import datetime
from typing import Any, Optional

from jitckpt.protocol.worker_spec import StageSpec
from jitckpt.launcher.config import LaunchConfig


class StageGenerations:
    """Job store handle, generation counter and replacement count of one launcher."""

    def __init__(self, cfg: LaunchConfig, coord: Any) -> None:
        import torch.distributed as dist

        self.cfg = cfg
        if coord.store is None:  # one node: serve the job store here (workers are Popen'ed)
            server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=cfg.rdzv_timeout))
            self._server = server
            self.store = server
            self.endpoint, self.prefix = f"127.0.0.1:{server.port}", ""
        else:
            self._server = None
            self.prefix = f"{coord.prefix}/stage"
            self.store = dist.PrefixStore("stage", coord.store)
            self.endpoint = cfg.rdzv_endpoint

    def worker_spec(self, role: str) -> StageSpec:
        """A worker's part of the job (:meth:`StageMembership.from_launcher` reads it)."""
        return StageSpec(store=self.endpoint, prefix=self.prefix, role=role)

    def for_launch(self, launch: int) -> int:
        """The generation the workers of whole-job launch ``launch`` start in (all nodes agree)."""
        if launch == 0:
            return 0
        key = f"launch{launch}/pg_gen"
        if self.cfg.node_rank == 0:
            self.store.set(key, str(self.store.add("pg_gen", 1)))
        try:  # the store's whole timeout (--rdzv-conf timeout), then a clear error
            self.store.wait([key])
        except (RuntimeError, LookupError) as e:  # c10d's DistStoreError, torch's EtcdStore's LookupError
            raise RuntimeError(f"job {self.cfg.run_id}: node 0 did not say which generation launch {launch}'s "
                               f"workers start in within the rendezvous timeout ({self.cfg.rdzv_timeout:.0f}s; "
                               "--rdzv-conf timeout): is node 0's launcher running, with this --rdzv-id? "
                               f"({e})") from None
        return int(self.store.get(key))

    def replace(self, rank: int, launch: int) -> Optional[int]:
        """Start generation ``g`` for a replacement of ``rank``: raise the failure flag of
        ``g - 1`` (survivors waiting on a live peer stop), count the replacement; return ``g``.
        Call :meth:`announce` once the replacement process is started.

        Returns ``None`` (nothing changed) when another replacement of whole-job launch
        ``launch`` is still catching up: the caller restarts the whole job instead."""
        from jitckpt.swift.pipeline.failure_flag import failure_key

        key = f"launch{launch}/catching_up"
        if self.store.add(key, 1) > 1:  # atomic across nodes: one replacement at a time
            self.store.add(key, -1)
            return None
        gen = self.store.add("pg_gen", 1)
        self.store.set(failure_key(gen - 1), "1")
        self.store.add("replacements", 1)
        return gen

    def caught_up(self, launch: int) -> None:
        """A replacement of launch ``launch`` replayed up to the survivors: the next death can
        be replaced alone again."""
        self.store.add(f"launch{launch}/catching_up", -1)

    def announce(self, gen: int, rank: int) -> None:
        """Tell the survivors that generation ``gen`` starts with a replacement of ``rank``."""
        from jitckpt.swift.pipeline.failure_flag import announce_key

        self.store.set(announce_key(gen), str(rank))

    def replacements(self) -> int:
        """Replacements so far, on every node."""
        return int(self.store.add("replacements", 0))
