"""The in-memory snapshot tier inside a ``jitckpt run`` worker, as ``jitckpt.protect()`` uses it.

``jitckpt run --snapshot-every N`` starts a keeper per node and puts it in each worker's spec
(:class:`~jitckpt.protocol.worker_spec.SnapshotSpec`); :meth:`SnapshotTier.from_spec` reads it. ``protect()`` then snapshots the same state it saves
(:meth:`Protected.state_dict`) at the start of every N-th minibatch (from the model's forward
pre-hook; the copy overlaps the forward and backward) and waits for it in an optimizer step
pre-hook, before parameters change (see :mod:`jitckpt.snapshot.client`).

Resume (:meth:`SnapshotTier.resolve`, collective, once per process): every rank calls
:func:`jitckpt.snapshot.restore.restore`, which compares the newest in-memory step that can be rebuilt
(decoding a lost node's part from parity/replicas) with the newest complete on-disk checkpoint of
any kind (jit, periodic, flushed snapshot). One rule: the newest complete step wins; at equal
steps memory wins (the same state as a JIT checkpoint of that step, without reading the disk).
The first caller is DDP's constructor (the bucket-layout pinning of :mod:`jitckpt.runtime.ddp_layout` needs the
restore point) or ``state.restore()``; both run on every rank in the same order.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from jitckpt.protocol.worker_spec import SnapshotSpec

log = logging.getLogger("jitckpt.snapshot")

LAYOUT_KEY = "ddp_layout"   # the DDP bucket layout, as JSON text, stored with each snapshot


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed worker continues from: ``state`` is the full protected state dict."""

    source: str              # "memory" | "disk"
    step: int
    state: Any
    path: Optional[str]      # the checkpoint directory (disk tier)
    seconds: float
    decoded: list            # data parts rebuilt from parity (memory tier)
    aor: Any = None          # AorCatalogue when the keepers hold ZeRO partitions (AOR)


class SnapshotTier:
    """Snapshots and the tiered resume for one worker (created from ``jitckpt run``'s env)."""

    def __init__(self, *, socket_path: str, every: int, protection: str, flush_every: int,
                 ranks_per_node: int, checkpoint_dir: str, gen: int, zero: str = "recompute",
                 zero_copy_every: int = 20) -> None:
        if every < 1 or flush_every < 0 or ranks_per_node < 1:
            raise ValueError(f"snapshot tier: every={every} must be >= 1, flush_every={flush_every} "
                             f">= 0, ranks_per_node={ranks_per_node} >= 1")
        self.socket_path, self.every, self.protection = socket_path, every, protection
        self.flush_every, self.ranks_per_node = flush_every, ranks_per_node
        self.checkpoint_dir, self.gen = checkpoint_dir, gen
        from jitckpt.protocol.worker_spec import SNAPSHOT_ZERO_MODES

        if zero not in SNAPSHOT_ZERO_MODES:
            raise ValueError(f"snapshot tier: zero must be one of {SNAPSHOT_ZERO_MODES}, got {zero!r}")
        if zero_copy_every < 1 or (zero == "log" and every != 1):
            raise ValueError(f"snapshot tier: zero_copy_every={zero_copy_every} must be >= 1, and the log "
                             f"mode needs every=1 (got {every})")
        self.zero = zero  # how ZeRO partitions are protected (docs/aor.md)
        self.zero_copy_every = zero_copy_every  # log mode: the partition copy interval
        self.taker: Any = None
        # A client whose keeper buffers a warm standby mapped ahead (jitckpt.snapshot.premap):
        # the resume uses it, then closes it.
        self.premapped: Any = None
        self._resolved = False
        self._resume: Optional[ResumePoint] = None
        self.rejected: list[str] = []  # what resolve() found but could not use ("memory step 9: ...")

    @classmethod
    def from_spec(cls, spec: Optional["SnapshotSpec"], *, checkpoint_dir: str,
                  gen: int) -> Optional["SnapshotTier"]:
        """The tier ``jitckpt run --snapshot-every`` configured, or None when it is off."""
        if spec is None:
            return None
        return cls(socket_path=spec.socket, every=spec.every, protection=spec.protection,
                   flush_every=spec.flush_every, ranks_per_node=spec.ranks_per_node,
                   checkpoint_dir=checkpoint_dir, gen=gen, zero=spec.zero,
                   zero_copy_every=spec.zero_copy_every)

    @staticmethod
    def _check_group() -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("jitckpt snapshots (--snapshot-every) need torch.distributed: call "
                               "dist.init_process_group() before state.restore() and the first forward")

    # Resume -------------------------------------------------------------------------------------
    def resolve(self, into: Any = None) -> Optional[ResumePoint]:
        """The newest usable state over all tiers (collective on the first call; cached).

        ``into``: the trainer's live state (one node: an in-memory snapshot is loaded straight into
        its tensors; see :func:`jitckpt.snapshot.restore.restore`)."""
        if self._resolved:
            return self._resume
        self._check_group()
        from jitckpt.snapshot.restore import restore

        aor = self._survey_partitions()
        zero_job = aor is not None and aor.present
        memory_lost = zero_job and not aor.restorable
        if memory_lost:
            # No step has every partition (or a log to replay it from): nothing in memory can be
            # resumed from. Dropped, so the shards on disk (a preemption's, --periodic-every) are.
            self._clear_keepers()
        one_rank = not (dist.is_initialized() and dist.get_world_size() > 1)
        try:
            res = restore(socket_path=self.socket_path, ranks_per_node=self.ranks_per_node,
                          checkpoint_dir=self.checkpoint_dir, into=into, keeper=self.premapped)
        finally:
            if self.premapped is not None:
                self.premapped.close()
                self.premapped = None
        self._resolved = True
        for what, why in res.skipped:
            log.warning("resume: skipped %s: %s", what, why)
        # Checkpoints that were there but unusable (not an unreachable tier): a fresh start is loud.
        self.rejected = [f"{what}: {why}" for what, why in res.skipped
                         if what.startswith(("memory step", "disk")) and not why.startswith("rejected;")]
        # A ZeRO job resumes from a step whose partitions the keepers hold, or from the shards its
        # ranks saved (a preemption's, a periodic one: each with its partition), not from parameters alone.
        from_shards = res.source == "disk" and res.state is not None and res.state.get("optimizer") is not None
        if memory_lost and not from_shards:
            raise RuntimeError("resume: the snapshot keepers held ZeRO optimizer partitions but no step had "
                               "all of them, nor a gradient log to replay a missing one from (more than one "
                               "node of a protection pair was lost, or with --snapshot-zero log the failure "
                               "came inside an optimizer step), and the checkpoint directory has no shards "
                               "to resume from: this job cannot resume consistently. Start it again from "
                               "scratch; --periodic-every N keeps shards on disk to fall back to")
        from_keepers = zero_job and not from_shards
        if from_keepers and (res.state is None or res.step not in aor.restorable):
            why = "; ".join(self.rejected) or f"memory tier: {res.source} step {res.step}"
            resized = any(", this job has " in r for r in self.rejected)
            raise RuntimeError(f"resume: ZeRO optimizer partitions survive for steps {aor.restorable} but "
                               f"the parameters for none of them ({why}); this job cannot resume consistently"
                               + ("; a ZeroRedundancyOptimizer's state is sharded by the world size, so the job "
                                  "cannot go on with another number of nodes: start a launcher in the lost node's "
                                  "place (the job then grows back), or run ZeRO jobs with a fixed --nnodes"
                                  if resized else ""))
        if res.state is not None:
            state = res.state
            if res.source == "memory" and one_rank and into is None:
                # One rank: the tensors view the keeper's buffers, which later snapshots reuse.
                state = _clone(state)
            self._resume = ResumePoint(res.source, int(res.step), state, res.path, res.seconds,
                                       list(res.decoded), aor if from_keepers else None)
            log.warning("resume from %s step %d (%.3fs)%s%s", res.source, res.step, res.seconds,
                        f"; decoded {res.decoded} from parity" if res.decoded else "",
                        "; its buffers were mapped ahead by the warm standby" if res.mapped_ahead else "")
        return self._resume

    def peer(self) -> Optional[int]:
        """The rank whose ZeRO partition this rank replicates (AOR), or None with one node."""
        from jitckpt.snapshot.aor import successor_peer

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            return successor_peer(rank, world, self.ranks_per_node)
        except ValueError:
            return None

    def _survey_partitions(self) -> Any:
        """Collective: the keepers' AOR objects (None when AOR cannot apply: fewer than 2 nodes)."""
        peer = self.peer()
        if peer is None:
            return None
        from jitckpt.snapshot.aor_store import survey_partitions

        # Replayable steps count (log mode): Protected loads the parameters before the partitions,
        # and load_zero_partitions replays against them.
        return survey_partitions(peer=peer, socket_path=self.socket_path,
                                 ranks_per_node=self.ranks_per_node, replay=True)

    def load_zero_partitions(self, zero: Any, point: ResumePoint) -> Any:
        """Collective: load this rank's ZeRO partition of ``point`` into ``zero`` (first replaying
        from the gradient logs those that only they hold: the model must hold the parameters of
        ``point`` already); return the :class:`~jitckpt.snapshot.aor_store.LoadedPartitions` (the
        peer's state, for the replica) and the partitions replayed."""
        from jitckpt.snapshot.aor_store import load_partitions, replay_missing
        from jitckpt.snapshot.keeper_client import KeeperClient

        cat, replayed = point.aor, []
        if point.step not in cat.complete:
            cat, replayed = replay_missing(zero=zero, catalogue=cat, step=point.step, socket_path=self.socket_path)
            if cat is None:
                keeper = KeeperClient(self.socket_path)
                try:  # never offered again: the next attempt resumes from what else survives
                    keeper.reject(point.step)
                finally:
                    keeper.close()
                raise RuntimeError(f"resume: ZeRO partitions of step {point.step} could not be replayed from "
                                   f"the gradient logs ({'; '.join(replayed)}); the step is rejected and the "
                                   "job restarts from what else the keepers hold")
        loaded = load_partitions(zero=zero, peer=self.peer(), step=point.step, catalogue=cat,
                                 socket_path=self.socket_path, ranks_per_node=self.ranks_per_node)
        return loaded, replayed

    def ddp_layout(self) -> Optional[dict]:
        """The DDP bucket layout of the resume point (for :func:`jitckpt.runtime.ddp_layout.install_pinning`)."""
        rp = self.resolve()
        if rp is None:
            return None
        if rp.source == "disk":
            from jitckpt.runtime import ddp_layout

            return ddp_layout.load(rp.path)
        text = rp.state.get(LAYOUT_KEY) if isinstance(rp.state, dict) else None
        return json.loads(text) if text else None

    # Snapshots ----------------------------------------------------------------------------------
    def start(self, state_fn: Callable[[], Any], *, resumed_step: Optional[int]) -> None:
        """Create the snapshot taker (collective: a side process group); once, on every rank.

        ``resumed_step`` is the step the state was loaded from (None: training starts afresh,
        so whatever the keepers hold is stale and is dropped; a keeper refuses to begin a step
        it holds complete).
        """
        if self.taker is not None:
            return
        self._check_group()
        from jitckpt.snapshot.client import SnapshotTaker

        if resumed_step is None:
            self._clear_keepers()
        self.taker = SnapshotTaker(state_fn=state_fn, socket_path=self.socket_path,
                                   scheme=self.protection, every=self.every,
                                   ranks_per_node=self.ranks_per_node,
                                   flush_dir=self.checkpoint_dir if self.flush_every else None,
                                   flush_every=self.flush_every, gen=self.gen)
        if resumed_step is not None:
            # In the keepers already (memory), or a keeper may hold a complete copy of it (disk
            # won at this step): never begun twice.
            self.taker.skip(resumed_step)

    def _clear_keepers(self) -> None:
        """Collective: every node's keeper drops all it holds (local rank 0 asks); no rank goes on
        before its node's keeper is cleared."""
        from jitckpt.snapshot.client import Topology
        from jitckpt.snapshot.keeper_client import KeeperClient

        if Topology.detect(self.ranks_per_node).local_rank == 0:
            keeper = KeeperClient(self.socket_path)
            try:
                keeper.discard_newer(-1)
            finally:
                keeper.close()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def begin(self, step: int, *, pin: bool = False) -> bool:
        return bool(self.taker.begin(step, pin=pin))

    def uniform(self, parts: list) -> list:
        """Collective (in the taker's ``state_fn``): ``parts`` with rank 0's tensors (see
        :mod:`jitckpt.snapshot.uniform`)."""
        from jitckpt.snapshot.uniform import share_rank0

        return share_rank0(parts, group=self.taker.side_group)

    def wait(self) -> Optional[int]:
        return self.taker.wait()

    def close(self) -> None:
        if self.taker is not None:
            self.taker.close()
            self.taker = None


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return obj
