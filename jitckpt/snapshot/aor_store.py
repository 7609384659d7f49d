"""ZeRO-1 optimizer partitions in the snapshot keepers (AOR storage) and their restore.

For snapshot step ``s`` each rank ``r`` writes two keeper objects on its node: ``aor.z{r}``, its
own partition state (``zero.optim.state_dict()``), and ``aor.z{p}``, its :class:`OptimizerReplica`
of peer ``p``'s partition (or, with :class:`PartitionCopier`, the peer's own, received). Both
are the state at the *start* of step ``s`` (after ``s`` updates), written straight into the
keeper's memory as a JSON layout and the tensors' bytes (:func:`write_partition`; no pickle) and
checksummed by the writer while it copies. Every partition therefore lives on two nodes. The
parameters are replicated and go through :class:`SnapshotTaker` as usual (``state_fn``
returning ``{"step", "model"}``).

Order in the training loop (one rank)::

    due = snap.begin(step)          # SnapshotTaker: parameters
    if due:
        aor.begin(step)             # queued on the replica's worker, after the pending update
    ... forward, backward, all-reduce ...
    aor.wait()                      # before snap.wait(): SnapshotTaker's "every rank committed
    snap.wait()                     #   step s" check then covers the AOR objects of s too
    replica.capture()
    zero.step()

After a failure every rank calls :func:`restore_with_aor`, which picks the newest step whose
parameters *and* every partition survive, loads this rank's partition into ``zero`` (from its own
node, or from the node of the rank that kept a replica) and returns the peer's state for a new
replica.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from jitckpt.snapshot.aor import OptimizerReplica, successor_peer
from jitckpt.snapshot.aor_log import (BASE_PREFIX, GRAD_PREFIX, INBAND, base_key, log_header, read_ring_entry,
                                      replay_partition, ring_entries, ring_key)
from jitckpt.snapshot.checksum import Checksum, checksum_of
from jitckpt.snapshot.client import Topology
from jitckpt.snapshot.keeper_client import KeeperClient, KeeperError
from jitckpt.snapshot.keeper_object import read_object, write_object
from jitckpt.snapshot.object_exchange import exchange
from jitckpt.snapshot.restore import gather_json, restore

log = logging.getLogger("jitckpt.snapshot")

PREFIX = "aor.z"
FORMAT = 2  # 1 was torch.save bytes


def partition_key(rank: int) -> str:
    """Keeper object key of ZeRO group rank ``rank``'s optimizer partition."""
    return f"{PREFIX}{rank}"


def _header(*, owner: int, world: int, step: int, zero: ZeroRedundancyOptimizer) -> dict:
    return {"format": FORMAT, "owner": owner, "world": world, "step": step,
            "optimizer": type(zero.optim).__name__}


def write_partition(keeper: KeeperClient, *, owner: int, world: int, step: int,
                    zero: ZeroRedundancyOptimizer, state: dict) -> tuple[Any, int, Checksum]:
    """:func:`write_object` of partition ``owner``'s ``state`` as keeper object ``aor.z{owner}``."""
    return write_object(keeper, key=partition_key(owner), step=step, state=state,
                        header=_header(owner=owner, world=world, step=step, zero=zero))


def save_own_partition(zero: ZeroRedundancyOptimizer, *, step: int, socket_path: Optional[str] = None,
                       still_valid: Any = None) -> str:
    """Write this rank's own partition, as it is at the start of ``step`` (call it between optimizer
    steps), into its node's keeper as ``aor.z{rank}`` of ``step``: a survivor's just-in-time save
    after a failure, so that a restore to ``step`` replays only the lost ranks' partitions.
    ``still_valid()`` (if given) is checked after the copy: the object is committed only if the
    partition did not change meanwhile. Returns what it did."""
    key = partition_key(zero.rank)
    keeper = KeeperClient(socket_path)
    try:
        if any(e["key"] == key and e["step"] == step for e in keeper.listing()):
            return f"partition of step {step} already in the keeper (a copy step)"
        _, _, h = write_partition(keeper, owner=zero.rank, world=zero.world_size, step=step, zero=zero,
                                  state=zero.optim.state_dict())
        if still_valid is not None and not still_valid():
            return f"no partition saved: training entered the optimizer step of step {step} meanwhile"
        keeper.commit([{"key": key, "step": step, "checksum": h.value(), "algo": h.algorithm}])
        return f"partition of step {step} saved to the keeper"
    finally:
        keeper.close()


def _decode(data: Any, *, owner: int, world: int, step: int, zero: ZeroRedundancyOptimizer) -> dict:
    """The partition state in ``data`` (a writable buffer the returned tensors keep viewing)."""
    return read_object(data, key=partition_key(owner), step=step,
                       want=_header(owner=owner, world=world, step=step, zero=zero))


def _finish(job: Optional[tuple[int, concurrent.futures.Future]], timeout: float, what: str) -> Optional[int]:
    """Wait for a queued (step, future) keeper job; its step, or None when there was none."""
    if job is None:
        return None
    step, fut = job
    try:
        fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{what} of step {step} not done after {timeout} s") from None
    return step


class AorSnapshotter:
    """Writes this rank's ZeRO partition and its peer replica into the node keeper, per snapshot.

    The write runs on the replica's worker thread (after its pending update). :meth:`wait` must
    come before ``SnapshotTaker.wait()`` and the replica's :meth:`~OptimizerReplica.capture`
    (which also waits for it, so ``zero.step()`` never changes the state being written).
    """

    def __init__(self, *, replica: OptimizerReplica, socket_path: Optional[str] = None,
                 wait_timeout: float = 120.0) -> None:
        if not isinstance(replica, OptimizerReplica):
            raise TypeError(f"replica must be an OptimizerReplica, got {type(replica).__name__}")
        if wait_timeout <= 0:
            raise ValueError(f"wait_timeout must be > 0, got {wait_timeout}")
        self.replica, self.zero, self.wait_timeout = replica, replica.zero, wait_timeout
        self.keeper = KeeperClient(socket_path)
        self._job: Optional[tuple[int, concurrent.futures.Future]] = None
        self.bytes_written, self.write_seconds = 0, 0.0  # on the worker thread

    def begin(self, step: int) -> None:
        """Queue the write of the state at the start of ``step`` (call when the parameter
        snapshot of ``step`` was started, i.e. ``SnapshotTaker.begin(step)`` returned True)."""
        if self._job is not None:
            raise RuntimeError("AorSnapshotter.begin: the previous write was not waited for")
        if step != self.replica.step:
            raise ValueError(f"AOR snapshot of step {step}, but the replica has applied "
                             f"{self.replica.step} updates: call replica.capture() once per "
                             "optimizer step, before zero.step()")
        self._job = (step, self.replica.after_updates(lambda peer_state: self._write(step, peer_state)))

    def wait(self) -> Optional[int]:
        """Block until the running write is committed; the step, or None if none was running."""
        job, self._job = self._job, None
        return _finish(job, self.wait_timeout, "AOR snapshot")

    def close(self) -> None:
        """Finish a running write and drop the keeper connection."""
        try:
            self.wait()
        finally:
            self.keeper.close()

    def _write(self, step: int, peer_state: dict) -> None:
        t0 = time.perf_counter()
        world, me = self.zero.world_size, self.zero.rank
        items = []
        for owner, state in ((me, self.zero.optim.state_dict()), (self.replica.peer, peer_state)):
            _, size, h = write_partition(self.keeper, owner=owner, world=world, step=step, zero=self.zero,
                                         state=state)
            items.append({"key": partition_key(owner), "step": step, "checksum": h.value(), "algo": h.algorithm})
            self.bytes_written += size
        self.keeper.commit(items)
        self.write_seconds += time.perf_counter() - t0




class PartitionCopier:
    """Protects ZeRO partitions by sending each to its protector at every snapshot (no replica).

    The alternative to :class:`OptimizerReplica` + :class:`AorSnapshotter`, writing the same two
    keeper objects per rank and snapshot (so :func:`restore_with_aor` is unchanged): rank ``r``
    writes ``aor.z{r}`` (its own partition) and ``aor.z{peer}``, received from its peer
    (``successor_peer``), while sending its own partition to the rank that protects it. The cost is
    one transfer of the partition state per *snapshot* instead of one recomputed optimizer step per
    *training step*: cheaper when the host's cores are busy training and snapshots are not taken
    every step (docs/aor.md). Same loop order as :class:`AorSnapshotter` (``begin`` when the
    parameter snapshot began, ``wait`` before ``SnapshotTaker.wait()`` and ``zero.step()``); the
    exchange runs on a worker thread over its own gloo group (created here: a collective, so every
    rank constructs it at the same point).
    """

    def __init__(self, *, zero: ZeroRedundancyOptimizer, ranks_per_node: Optional[int] = None,
                 socket_path: Optional[str] = None, wait_timeout: float = 120.0) -> None:
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError(f"PartitionCopier protects a ZeroRedundancyOptimizer, got {type(zero).__name__}")
        if wait_timeout <= 0:
            raise ValueError(f"wait_timeout must be > 0, got {wait_timeout}")
        if not dist.is_initialized() or zero.world_size != dist.get_world_size():
            raise ValueError("PartitionCopier needs torch.distributed initialized and the ZeRO group to be "
                             "the whole world (hybrid parallel groups are not supported yet)")
        topo = Topology.detect(ranks_per_node)
        self.zero, self.wait_timeout, self.rank, self.world = zero, wait_timeout, topo.rank, topo.world
        self.peer = successor_peer(topo.rank, topo.world, topo.ranks_per_node)
        self.protector = (topo.rank - topo.ranks_per_node) % topo.world  # the rank whose peer we are
        self.keeper = KeeperClient(socket_path)
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_timeout))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jitckpt-aor-copy")
        self._job: Optional[tuple[int, concurrent.futures.Future]] = None
        self.bytes_written, self.bytes_received, self.write_seconds = 0, 0, 0.0  # on the worker

    def begin(self, step: int) -> None:
        """Queue the exchange of the partitions as they are at the start of ``step``."""
        if self._job is not None:
            raise RuntimeError("PartitionCopier.begin: the previous exchange was not waited for")
        self._job = (step, self._pool.submit(self._exchange, step))

    def wait(self) -> Optional[int]:
        """Block until both objects of the running exchange are committed; its step, or None."""
        job, self._job = self._job, None
        return _finish(job, self.wait_timeout, "AOR partition copy")

    def close(self) -> None:
        """Finish a running exchange, stop the worker and drop the keeper connection."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.keeper.close()

    def _exchange(self, step: int) -> None:
        t0 = time.perf_counter()
        m_own, own_size, h = write_partition(self.keeper, owner=self.rank, world=self.world, step=step,
                                             zero=self.zero, state=self.zero.optim.state_dict())
        own_key, peer_key = partition_key(self.rank), partition_key(self.peer)
        size, want = exchange(self.keeper, own=m_own, own_size=own_size, own_checksum=h, peer_key=peer_key, step=step,
                              protector=self.protector, peer=self.peer, group=self._group)
        self.keeper.commit([{"key": own_key, "step": step, "checksum": h.value(), "algo": h.algorithm},
                            {"key": peer_key, "step": step, "checksum": want, "algo": h.algorithm}])
        self.bytes_written += own_size + size
        self.bytes_received += size
        self.write_seconds += time.perf_counter() - t0


# Restore ---------------------------------------------------------------------------------------

@dataclass
class AorRestore:
    """What :func:`restore_with_aor` did. ``state`` is the parameter snapshot (``{"step", "model"}``)
    or None when no step survived whole; ``peer_state`` goes to ``OptimizerReplica.load_state_dict``."""

    source: str                       # "memory" | "none"
    step: Optional[int]
    state: Any
    peer_state: Optional[dict]
    own_from: Optional[int] = None    # rank whose keeper held this rank's partition
    remote: list = field(default_factory=list)    # keys fetched from another node
    decoded: list = field(default_factory=list)   # parameter parts rebuilt from parity
    skipped: list = field(default_factory=list)
    replayed: list = field(default_factory=list)  # partitions replayed from a gradient log
    seconds: float = 0.0


def _local_partitions(keeper: KeeperClient, topo: Topology) -> list[dict]:
    """This rank's share of the node keeper's AOR objects, checksum-verified. A gradient ring
    appears as one entry per verified slot, keyed ``aor.g{owner}.{ring start}.{slot}`` with the
    step it leads to (the step after its gradients')."""
    out = []
    listing = keeper.listing()
    entries = [e for e in listing if e["key"].startswith((PREFIX, BASE_PREFIX))]
    for i, e in enumerate(entries):
        if i % topo.ranks_per_node != topo.local_rank:
            continue
        try:
            m, info = keeper.open(e["key"], e["step"])
        except KeeperError:
            continue
        if checksum_of(memoryview(m)[:e["size"]], info.algo) != info.checksum:
            log.warning("AOR object %s step %s fails its checksum; not used", e["key"], e["step"])
            continue
        out.append({**e, "rank": topo.rank})
    rings: dict = {}
    for e in listing:
        if e["key"].startswith(GRAD_PREFIX) and e["algo"] == INBAND:
            rings.setdefault(int(e["key"][len(GRAD_PREFIX):]), []).append(e)
    for owner, versions in sorted(rings.items()):
        if owner % topo.ranks_per_node != topo.local_rank:
            continue
        starts = sorted(int(e["step"]) for e in versions)
        for e in versions:
            # Ring G holds this timeline's steps from G until the next ring's start.
            start = int(e["step"])
            end = min((g for g in starts if g > start), default=None)
            try:
                m, info = keeper.open(e["key"], start)
                _, slots = ring_entries(np.frombuffer(m, dtype=np.uint8, count=info.size), owner=owner,
                                        world=topo.world)
            except (KeeperError, ValueError) as err:
                log.warning("AOR gradient ring %s of step %s not used: %s", e["key"], start, err)
                continue
            out += [{"key": f"{e['key']}.{start}.{x['slot']}", "step": x["step"] + 1, "rank": topo.rank}
                    for x in slots if x["step"] >= start and (end is None or x["step"] < end)]
    return out


def _holders(catalogues: list) -> dict:
    """(key, step) -> {rank: entry}."""
    out: dict = {}
    for cat in catalogues:
        for e in cat:
            out.setdefault((e["key"], int(e["step"])), {})[e["rank"]] = e
    return out


def load_zero_partition(zero: ZeroRedundancyOptimizer, state: dict) -> None:
    """Load a partition state (a ``zero.optim.state_dict()``) into this rank's ZeRO optimizer,
    after checking that it fits the partition tensor by tensor."""
    groups = zero.optim.param_groups
    if len(state["param_groups"]) != len(groups) or any(
            len(sg["params"]) != len(g["params"]) for sg, g in zip(state["param_groups"], groups)):
        raise ValueError("AOR partition state does not match this rank's ZeRO partition (different "
                         "model, world size or parameter groups)")
    params = [p for g in groups for p in g["params"]]
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                raise ValueError(f"AOR partition state {name} of parameter {index} has shape "
                                 f"{tuple(value.shape)}, the parameter {tuple(params[index].shape)}")
    zero.optim.load_state_dict(state)
    # ZeRO copies its global groups' hyperparameters into the local optimizer before each step,
    # so the partition's are those of the last step taken: a scheduler that stepped after it
    # (the usual order) changed the global ones since. This copy is only a fallback; a caller
    # that saved the global groups (jitckpt.protect() does) puts them back after this call.
    for g, lg in zip(zero.param_groups, zero.optim.param_groups):
        g.update({k: v for k, v in lg.items() if k != "params"})


def _fetch_partitions(keeper: KeeperClient, topo: Topology, step: int, holders: dict,
                      peers: list) -> tuple[dict, int, list]:
    """Collective: every rank gets its own partition object and its peer's (by key), from
    its node's keeper if that holds them, else from the lowest rank that does (point to point).
    Returns (objects, rank the own partition came from, keys fetched from another node)."""
    me, rpn = topo.rank, topo.ranks_per_node
    plan = []  # (receiver, key, sender, catalogue entry); the same on every rank
    for r in range(topo.world):
        for key in (partition_key(r), partition_key(peers[r])):
            have = holders[(key, step)]
            local = [h for h in have if h // rpn == r // rpn]  # verified by a rank of r's node
            src = min(local or have)
            plan.append((r, key, r if local else src, have[src]))
    received: dict[str, np.ndarray] = {}  # private, writable copies: the loaded state views them
    works, sending, receiving = [], [], {}
    for tag, (dst, key, src, entry) in enumerate(plan):
        if src == dst == me:
            m, _ = keeper.open(key, step)
            received[key] = np.frombuffer(m, dtype=np.uint8, count=entry["size"]).copy()
        elif src == me:
            m, _ = keeper.open(key, step)
            sending.append(torch.frombuffer(m, dtype=torch.uint8, count=entry["size"]))
            works.append(dist.isend(sending[-1], dst=dst, tag=tag))
        elif dst == me:
            receiving[key] = (torch.empty(entry["size"], dtype=torch.uint8), entry)
            works.append(dist.irecv(receiving[key][0], src=src, tag=tag))
    for w in works:
        w.wait()
    remote = []
    for key, (t, entry) in receiving.items():
        data = t.numpy()
        if checksum_of(data, entry["algo"]) != entry["checksum"]:
            raise ValueError(f"AOR object {key} step {step} from rank {entry['rank']} changed in transit")
        received[key] = data
        if entry["rank"] // topo.ranks_per_node != topo.node:
            remote.append(key)
    own_from = next(e["rank"] for dst, key, _, e in plan if dst == me and key == partition_key(me))
    return received, own_from, sorted(remote)


@dataclass(frozen=True)
class AorCatalogue:
    """Which AOR objects survive in the keepers (the same on every rank): ``holders`` maps
    (key, step) to {rank: verified entry}, ``peers[r]`` is the peer rank ``r`` protects, and
    ``complete`` the steps at which every partition survives somewhere, newest first."""

    holders: dict
    peers: list
    complete: list
    replays: dict = field(default_factory=dict)  # step -> {owner: (node, copy step)} (log mode)
    ranks_per_node: int = 1

    @property
    def present(self) -> bool:
        """Whether any keeper holds AOR partition objects (the job protects ZeRO partitions)."""
        return any(k.startswith(PREFIX) for k, _ in self.holders)

    @property
    def restorable(self) -> list:
        """Steps whose every partition survives or can be replayed from a gradient log, newest first."""
        return sorted(set(self.complete) | set(self.replays), reverse=True)


def _replay_index(holders: dict, rpn: int) -> dict:
    """owner -> {"grads": {(node, step led to)}, "copies": [(C, node)] with a copy and a base of C
    on that node}: what a replay of each partition could start from (one pass over the holders)."""
    index: dict = {}
    for (key, s), have in holders.items():
        if key.startswith(GRAD_PREFIX):
            owner = int(key[len(GRAD_PREFIX):].split(".")[0])
            index.setdefault(owner, {"grads": set(), "copies": []})["grads"].update((r // rpn, s) for r in have)
        elif key.startswith(PREFIX):
            owner = int(key[len(PREFIX):])
            base = {r // rpn for r in holders.get((base_key(owner), s), {})}
            index.setdefault(owner, {"grads": set(), "copies": []})["copies"] += [
                (s, node) for node in sorted({r // rpn for r in have} & base)]
    return index


def _replay_source(index: dict, owner: int, step: int) -> Optional[tuple[int, int]]:
    """(node, copy step C) from which partition ``owner`` of ``step`` can be replayed: a node holding
    its copy and base of C and its logged gradients of C .. step-1 (the newest such C); or None."""
    entry = index.get(owner)
    if entry is None:
        return None
    for c, node in sorted(entry["copies"], reverse=True):
        if c < step and all((node, t + 1) in entry["grads"] for t in range(c, step)):
            return node, c
    return None


def _replay_plans(holders: dict, world: int, rpn: int) -> dict:
    """step -> {owner: (node, C)} for the steps where every partition missing is replayable."""
    index = _replay_index(holders, rpn)
    if not any(e["grads"] for e in index.values()):
        return {}  # no gradient log: not the log mode
    steps = {s for (k, s) in holders if k.startswith((PREFIX, GRAD_PREFIX))}
    plans = {}
    for s in steps:
        plan = {}
        for r in range(world):
            if (partition_key(r), s) in holders:
                continue
            src = _replay_source(index, r, s)
            if src is None:
                break
            plan[r] = src
        else:
            if plan:
                plans[s] = plan
    return plans


def survey_partitions(*, peer: int, socket_path: Optional[str] = None,
                      ranks_per_node: Optional[int] = None, replay: bool = False) -> AorCatalogue:
    """Collective: gather every keeper's verified AOR objects; when some step has every
    partition (or, with ``replay``, every partition or a log to replay it from), discard newer
    steps from the keepers so the parameter restore that follows cannot pick one of them."""
    topo = Topology.detect(ranks_per_node)
    keeper = KeeperClient(socket_path)
    try:
        # JSON bytes, not all_gather_object (which unpickles what peers send).
        gathered = gather_json({"peer": peer, "objects": _local_partitions(keeper, topo)}, topo, None)
        holders = _holders(g["objects"] for g in gathered)
        complete = sorted({s for (k, s) in holders if k.startswith(PREFIX)
                           and all((partition_key(r), s) in holders for r in range(topo.world))},
                          reverse=True)
        cat = AorCatalogue(holders, [g["peer"] for g in gathered], complete,
                           _replay_plans(holders, topo.world, topo.ranks_per_node), topo.ranks_per_node)
        usable = cat.restorable if replay else cat.complete
        if usable and topo.local_rank == 0:
            keeper.discard_newer(usable[0])  # newer steps lack a partition: not restorable
        dist.barrier()
        return cat
    finally:
        keeper.close()


def replay_missing(*, zero: ZeroRedundancyOptimizer, catalogue: AorCatalogue, step: int,
                   socket_path: Optional[str] = None) -> tuple[Optional[AorCatalogue], list]:
    """Collective: make the partitions of ``step`` that only a gradient log holds (the catalogue's
    ``replays[step]``). The lowest rank of the node holding a partition's copy, base and log
    replays it (:func:`replay_partition`), checks it against the live parameters (the model must
    hold those of ``step`` already) and writes it into its keeper as the partition object of
    ``step``. Returns (the catalogue with them, the owners replayed), or (None, the reasons) when
    a replay failed on any rank."""
    topo = Topology.detect(catalogue.ranks_per_node)
    rpn, world, me = topo.ranks_per_node, topo.world, topo.rank
    made, failed = [], []
    keeper = KeeperClient(socket_path)
    try:
        for owner, (node, c) in sorted(catalogue.replays.get(step, {}).items()):
            if node * rpn != me:
                continue
            try:
                made.append(_replay_one(keeper, zero=zero, catalogue=catalogue, owner=owner, c=c, step=step,
                                        node=node, me=me, world=world))
            except (ValueError, KeyError, KeeperError) as e:
                failed.append(f"partition {owner}: {e}")
    finally:
        keeper.close()
    everyone = gather_json({"made": made, "failed": failed}, topo, None)
    reasons = [f for g in everyone for f in g["failed"]]
    if reasons:
        return None, reasons
    holders = dict(catalogue.holders)
    for g in everyone:
        for e in g["made"]:
            holders[(e["key"], int(e["step"]))] = {e["rank"]: e}
    owners = sorted(catalogue.replays.get(step, {}))
    return AorCatalogue(holders, catalogue.peers, sorted(set(catalogue.complete) | {step}, reverse=True),
                        catalogue.replays, rpn), owners


def _replay_one(keeper: KeeperClient, *, zero: ZeroRedundancyOptimizer, catalogue: AorCatalogue, owner: int,
                c: int, step: int, node: int, me: int, world: int) -> dict:
    def read(key: str, at: int, want: dict, private: bool = False) -> Any:
        m, info = keeper.open(key, at)
        data = np.frombuffer(m, dtype=np.uint8, count=info.size)
        # The optimizer's load_state_dict keeps same-dtype tensors as they are: a replay on views
        # of the keeper's memory would change the copy it reads.
        return read_object(data.copy() if private else data, key=key, step=at, want=want)

    state = read(partition_key(owner), c, _header(owner=owner, world=world, step=c, zero=zero), private=True)
    base = read(base_key(owner), c, log_header(kind="base", owner=owner, world=world, step=c))["params"]
    entries = []
    prefix = f"{GRAD_PREFIX}{owner}."
    for t in range(c, step):
        key = next(k for (k, s), have in catalogue.holders.items()
                   if k.startswith(prefix) and s == t + 1 and any(r // catalogue.ranks_per_node == node for r in have))
        start, slot = (int(x) for x in key[len(prefix):].split("."))
        m, info = keeper.open(ring_key(owner), start)
        entries.append(read_ring_entry(np.frombuffer(m, dtype=np.uint8, count=info.size), owner=owner,
                                       world=world, slot=slot, step=t))
    live = [p.detach() for g in zero._partition_parameters()[owner] for p in g["params"]]
    replayed = replay_partition(zero=zero, owner=owner, state=state, base=base, entries=entries, live=live)
    if replayed is None:
        raise ValueError(f"replayed from step {c} through {step - 1}, its parameters differ from the "
                         f"snapshot of step {step}")
    _, size, h = write_partition(keeper, owner=owner, world=world, step=step, zero=zero, state=replayed)
    keeper.commit([{"key": partition_key(owner), "step": step, "checksum": h.value(), "algo": h.algorithm}])
    return {"key": partition_key(owner), "step": step, "size": size, "checksum": h.value(),
            "algo": h.algorithm, "rank": me}


@dataclass(frozen=True)
class LoadedPartitions:
    """This rank's partitions after :func:`load_partitions`: its own is in ``zero`` already."""

    peer_state: dict
    own_from: int
    remote: list


def load_partitions(*, zero: ZeroRedundancyOptimizer, peer: int, step: int, catalogue: AorCatalogue,
                    socket_path: Optional[str] = None,
                    ranks_per_node: Optional[int] = None) -> LoadedPartitions:
    """Collective: load this rank's partition of ``step`` into ``zero`` (from its node's keeper,
    or sent by a rank that holds it, checksum re-verified) and return the peer's partition state
    for :meth:`OptimizerReplica.load_state_dict`."""
    if step not in catalogue.complete:
        raise ValueError(f"step {step} does not have every ZeRO partition in the keepers "
                         f"(complete steps: {catalogue.complete})")
    topo = Topology.detect(ranks_per_node)
    world, me = topo.world, topo.rank
    keeper = KeeperClient(socket_path)
    try:
        received, own_from, remote = _fetch_partitions(keeper, topo, step, catalogue.holders,
                                                       catalogue.peers)
    finally:
        keeper.close()
    own = _decode(received[partition_key(me)], owner=me, world=world, step=step, zero=zero)
    peer_state = _decode(received[partition_key(peer)], owner=peer, world=world, step=step, zero=zero)
    load_zero_partition(zero, own)
    return LoadedPartitions(peer_state, own_from, remote)


def restore_with_aor(*, zero: ZeroRedundancyOptimizer, peer: int, socket_path: Optional[str] = None,
                     ranks_per_node: Optional[int] = None,
                     model: Optional[torch.nn.Module] = None) -> AorRestore:
    """Collective (every rank): restore parameters and every ZeRO-1 partition from the keepers.

    Picks the newest step whose parameter snapshot can be rebuilt and whose every partition object
    survives on some node, or, given ``model`` (log mode, :mod:`jitckpt.snapshot.aor_log`), can be
    replayed from a gradient log: the parameters are then loaded into ``model`` first, to check
    the replay against. Discards newer, incomplete steps; loads this rank's partition into
    ``zero``; returns the parameter state and the peer's partition state (``peer`` as given to
    :class:`OptimizerReplica`).
    """
    t0 = time.monotonic()
    if not dist.is_initialized() or zero.world_size != dist.get_world_size():
        raise ValueError("restore_with_aor needs torch.distributed initialized and the ZeRO group to be "
                         "the whole world (hybrid parallel groups are not supported yet)")
    topo = Topology.detect(ranks_per_node)
    world, me = topo.world, topo.rank
    if not 0 <= peer < world or peer == me:
        raise ValueError(f"peer must be another rank (0..{world - 1}, not {me}), got {peer}")
    cat = survey_partitions(peer=peer, socket_path=socket_path, ranks_per_node=ranks_per_node,
                            replay=model is not None)
    usable = cat.restorable if model is not None else cat.complete
    if not usable:
        return AorRestore("none", None, None, None, skipped=[("memory tier", "no step with every "
                                                              "ZeRO partition")],
                          seconds=time.monotonic() - t0)
    res = restore(socket_path=socket_path, ranks_per_node=ranks_per_node)
    skipped = list(res.skipped)
    if res.source != "memory" or res.step not in usable:
        skipped.append((f"memory step {res.step}", "parameters and partitions survive at no common step"))
        return AorRestore("none", None, None, None, skipped=skipped, seconds=time.monotonic() - t0)
    if res.step < usable[0] and topo.local_rank == 0:
        # The gradients logged for the restored step and later are logged again by the resumed run.
        keeper = KeeperClient(socket_path)
        try:
            keeper.discard_newer(res.step)
        finally:
            keeper.close()
    replayed: list = []
    if res.step not in cat.complete:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(res.state["model"])
        cat, replayed = replay_missing(zero=zero, catalogue=cat, step=res.step, socket_path=socket_path)
        if cat is None:
            model.load_state_dict(before)  # "none" leaves the model as it was
            skipped += [(f"memory step {res.step}", f"replay failed: {r}") for r in replayed]
            if topo.local_rank == 0:
                # Nothing here is restorable, and the older parameters are gone: free it all, so the
                # run that starts again (from disk or step 0) does not meet objects of its steps.
                keeper = KeeperClient(socket_path)
                try:
                    keeper.discard_newer(-1)
                finally:
                    keeper.close()
            dist.barrier()
            return AorRestore("none", None, None, None, skipped=skipped, seconds=time.monotonic() - t0)
    loaded = load_partitions(zero=zero, peer=peer, step=res.step, catalogue=cat,
                             socket_path=socket_path, ranks_per_node=ranks_per_node)
    return AorRestore("memory", res.step, res.state, loaded.peer_state, own_from=loaded.own_from,
                      remote=loaded.remote, decoded=res.decoded, skipped=skipped, replayed=replayed,
                      seconds=time.monotonic() - t0)
