"""DTensor shards in the snapshot keepers (``jitckpt run --snapshot-every N`` with FSDP2, TP, HSDP).

A DTensor-sharded rank holds state no other rank has (full sharding, tensor parallel) or shares it
with its replica group only (HSDP), so the replicated snapshots of :mod:`jitckpt.snapshot.client`
do not apply. Here every rank writes its *own* shard (its local parameter, buffer and optimizer
tensors, with the scheduler, RNG and step) into its node's keeper as one self-describing object,
``dt.r<rank>`` (:func:`~jitckpt.snapshot.keeper_object.write_object`: JSON header, never pickle).
The keeper outlives the trainers, so a rank killed with its shard comes back from the keeper.

The snapshot of step ``s`` is written synchronously at the end of minibatch ``s - 1`` (after the
scheduler's step, or the optimizer's when there is no scheduler), and no rank begins minibatch
``s`` (its first forward) before every rank has committed it (one small all-reduce on a side
group, issued asynchronously right after the commit and waited for there). So a rank lost anywhere in minibatch ``s`` has it committed, and one lost inside its
optimizer step of ``s - 1`` (its updated shard exists nowhere else) holds the others at the start
of ``s``, a safe point, with the end of ``s - 1`` done: the job resumes at the minibatch the lost
rank was in (with ``--snapshot-every 1``: at most it is done again). (A later pipeline stage's
first forward waits for the earlier stage's output: the agreement, issued before, never waits on
it.) The keeper keeps two versions
per object, and the agreement keeps every rank within one snapshot of the others, so some step has
every shard.

Resume (collective, :meth:`ShardSnapshots.survey` then :meth:`ShardSnapshots.load`): each rank
verifies its own objects (checksums, into private memory) and all-gather a catalogue; the newest
step with every shard of this mesh wins against the newest complete DCP set on disk (memory at equal
steps). A rank whose own object is gone (a lost node) gets a replica's (HSDP) from its node's keeper
or, sent point to point, from the rank that verified it.

Across nodes (``--snapshot-protection``): ``arc`` sends each snapshot to the same local rank of
the next node, which keeps it as the owner's object; ``aec`` with 3 or more nodes keeps XOR parity
instead (:mod:`jitckpt.snapshot.shard_parity`: ``1/(m-1)`` of an object per node), from which a
lost node's objects are decoded at restore (with 2 nodes the parity would be the other node's
object: ARC). The memory tier restores on the same mesh only; another mesh resumes from disk (DCP
reshards).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from jitckpt.snapshot.checksum import Checksum, checksum_of, copy_verified
from jitckpt.snapshot.client import Topology
from jitckpt.snapshot.keeper_client import KeeperClient, KeeperError
from jitckpt.snapshot.keeper_object import object_header, read_object, write_object
from jitckpt.snapshot.restore import gather_json
from jitckpt.snapshot.object_exchange import exchange
from jitckpt.snapshot.shard_keys import parity_key, shard_key
from jitckpt.snapshot import shard_parity

log = logging.getLogger("jitckpt.snapshot")

FORMAT = 1
KIND = "dtensor-shard"


@dataclass(frozen=True)
class ShardChoice:
    """The newest in-memory step with every shard of this mesh, and which object each rank loads."""

    step: int
    sources: dict            # rank -> catalogue entry of the object it loads
    catalogue: list = field(default_factory=list)  # every rank's gathered entry


class ShardSnapshots:
    """Writes this rank's shard into its node's keeper; finds and loads the newest complete step."""

    def __init__(self, *, socket_path: str, every: int, ranks_per_node: int, shard_id: int,
                 num_shards: int, replica_id: int, mesh: str, protection: str = "none") -> None:
        if every < 1:
            raise ValueError(f"shard snapshots: every={every} must be >= 1")
        if protection not in ("none", "arc", "aec"):
            raise ValueError(f"shard snapshots: protection {protection!r} is not one of none, arc, aec")
        self.socket_path, self.every = socket_path, every
        self.topo = Topology.detect(ranks_per_node)
        nodes = self.topo.num_nodes
        # ARC for shards: each snapshot also goes to the same local rank of the next node, whose
        # keeper keeps it as the owner's object; this rank keeps the previous node's (its peer's).
        # AEC with two nodes would keep exactly that copy as its parity.
        self.copying = nodes > 1 and (protection == "arc" or (protection == "aec" and nodes == 2))
        self.parity = protection == "aec" and nodes >= 3
        rpn, world, rank = self.topo.ranks_per_node, self.topo.world, self.topo.rank
        self.protector, self.peer = (rank + rpn) % world, (rank - rpn) % world
        self.shard_id, self.num_shards, self.replica_id, self.mesh = shard_id, num_shards, replica_id, mesh
        self._keeper: Optional[KeeperClient] = None
        self._kept: dict = {}        # (key, step) -> this rank's verified private copy (restore)
        self.bytes_written = 0
        # The commit agreement's own group (created here: protect() runs on every rank alike).
        self._side = dist.new_group(backend="gloo") if self.topo.world > 1 else None
        self._agreeing: Optional[tuple] = None  # (step, tensor, work) of the agreement under way

    @property
    def keeper(self) -> KeeperClient:
        if self._keeper is None:
            self._keeper = KeeperClient(self.socket_path)
        return self._keeper

    @property
    def waits_on_peers(self) -> bool:
        """Whether a snapshot's write exchanges with other ranks (copies or parity across nodes)."""
        return self.copying or self.parity

    def header(self, step: int) -> dict:
        return {"format": FORMAT, "kind": KIND, "step": step, "world": self.topo.world,
                "shard_id": self.shard_id, "num_shards": self.num_shards, "mesh": self.mesh}

    def due(self, step: int) -> bool:
        """Whether the state at the start of minibatch ``step`` is snapshotted."""
        return step > 0 and step % self.every == 0

    # Snapshots ----------------------------------------------------------------------------------
    def take(self, step: int, state: dict) -> None:
        """Write ``state`` (this rank's shard at the start of minibatch ``step``) and commit it;
        with copies to the next node, exchange them (a collective of the side group)."""
        key = shard_key(self.topo.rank)
        m, size, h = write_object(self.keeper, key=key, step=step, header=self.header(step), state=state)
        self.keeper.commit([{"key": key, "step": step, "checksum": h.value(), "algo": h.algorithm}])
        self.bytes_written += size
        if self.copying:
            self._exchange(step, m, size, h)
        if self.parity:
            entry, psize = shard_parity.exchange_parity(
                self.keeper, own=m, own_size=size, own_checksum=h, step=step, rank=self.topo.rank,
                ranks_per_node=self.topo.ranks_per_node, nodes=self.topo.num_nodes, group=self._side,
                header=self.header(step))
            self.keeper.commit([entry])
            self.bytes_written += psize

    def _exchange(self, step: int, mine: object, size: int, h: Checksum) -> None:
        """Send this rank's object of ``step`` to its protector and keep its peer's (see
        :mod:`jitckpt.snapshot.object_exchange`)."""
        key = shard_key(self.peer)
        peer_size, want = exchange(self.keeper, own=mine, own_size=size, own_checksum=h, peer_key=key, step=step,
                                   protector=self.protector, peer=self.peer, group=self._side)
        self.keeper.commit([{"key": key, "step": step, "checksum": want, "algo": h.algorithm}])
        self.bytes_written += peer_size

    def agree_begin(self, step: int) -> None:
        """Start the agreement that every rank has committed its snapshot of ``step`` (an
        asynchronous all-reduce on the side group, issued right after this rank's commit)."""
        if self._side is None:
            return
        self._agreeing = (step, torch.tensor([step], dtype=torch.int64))
        self._agreeing += (dist.all_reduce(self._agreeing[1], op=dist.ReduceOp.MIN, group=self._side,
                                           async_op=True),)

    def agree_wait(self) -> None:
        """Block until the agreement begun last is reached (every rank committed that step)."""
        job, self._agreeing = self._agreeing, None
        if job is None:
            return
        step, t, work = job
        work.wait()
        if int(t) != step:
            raise RuntimeError(f"shard snapshot of step {step}: some rank has committed only step {int(t)}")

    # Resume -------------------------------------------------------------------------------------
    def survey(self) -> Optional[ShardChoice]:
        """Collective: the newest step whose every shard of this mesh survives in some keeper."""
        mine = self._verify_own()
        gathered = gather_json({"rank": self.topo.rank, "node": self.topo.node, "shard": self.shard_id,
                                "objects": mine}, self.topo, None)
        want = {k: v for k, v in self.header(0).items() if k not in ("step", "shard_id")}
        by_step: dict = {}
        for g in gathered:
            for e in g["objects"]:
                if {k: e["header"].get(k) for k in want} == want:
                    by_step.setdefault(int(e["step"]), {}).setdefault(e["header"]["shard_id"], []).append(e)
        if self.parity:
            for step, shards in by_step.items():
                for g in gathered:
                    entry = self._decodable(g["rank"], step, gathered)
                    if entry is not None:
                        shards.setdefault(g["shard"], []).append(entry)
        complete = [s for s, shards in by_step.items() if set(shards) == set(range(self.num_shards))]
        if not complete:
            return None
        step = max(complete)
        sources = {}
        for g in gathered:
            same = by_step[step][g["shard"]]
            held = [e for e in same if not e.get("decode")]  # a copy someone holds beats decoding
            own = [e for e in held if e["key"] == shard_key(g["rank"])]
            near = [e for e in held if e["node"] == g["node"]]
            sources[g["rank"]] = (own or near or sorted(held, key=lambda e: e["rank"]) or same)[0]
        return ShardChoice(step, sources, gathered)

    def _decodable(self, rank: int, step: int, gathered: list) -> Optional[dict]:
        """A catalogue entry for ``rank``'s object of ``step`` decoded from its group's parity
        (``decode``), when its own is gone and every part is verified and agrees with what each
        parity covers; else None."""
        def entry(r: int, key: str) -> Optional[dict]:
            return next((e for e in gathered[r]["objects"] if e["key"] == key and int(e["step"]) == step), None)

        if entry(rank, shard_key(rank)) is not None:
            return None
        rpn, nodes = self.topo.ranks_per_node, self.topo.num_nodes
        covers = None
        for holder, others in shard_parity.decode_sources(rank, ranks_per_node=rpn, nodes=nodes):
            par = entry(holder, parity_key(holder))
            if par is None or par["header"].get("nodes") != nodes:
                return None
            mine = par["header"]["covers"].get(str(rank))
            if covers is not None and (mine, par["header"]["size"]) != covers:
                return None  # the parities were not written over the same objects
            covers = (mine, par["header"]["size"])
            for r in others:
                own = entry(r, shard_key(r))
                if own is None or [own["size"], own["checksum"]] != par["header"]["covers"].get(str(r)):
                    return None
        if covers is None or covers[0] is None:
            return None
        (size, checksum), padded = covers
        return {"key": shard_key(rank), "step": step, "size": size, "checksum": checksum, "padded": padded,
                "algo": par["header"]["algo"], "rank": rank, "node": rank // rpn, "decode": True}

    def _verify_own(self) -> list:
        """This rank's own objects in its keeper, and the copies it keeps of its peer's,
        checksum-verified into private memory (kept for the load and for ranks that need them)."""
        keys = ({shard_key(self.topo.rank)} | ({shard_key(self.peer)} if self.copying else set())
                | ({parity_key(self.topo.rank)} if self.parity else set()))
        out = []
        try:
            entries = [e for e in self.keeper.listing() if e["key"] in keys]
        except KeeperError as e:
            log.warning("shard snapshots: the keeper cannot be read (%s); resuming from disk", e)
            return []
        for e in sorted(entries, key=lambda e: -int(e["step"])):
            key = e["key"]
            try:
                m, info = self.keeper.open(key, int(e["step"]))
            except KeeperError:
                continue  # reused since the listing
            data, value = copy_verified(torch.frombuffer(m, dtype=torch.uint8, count=e["size"]), info.algo)
            if value != info.checksum:
                log.warning("shard snapshot %s of step %s fails its checksum; not used", key, e["step"])
                continue
            try:
                header = object_header(data.numpy())
            except ValueError as err:
                log.warning("shard snapshot %s of step %s: %s; not used", key, e["step"], err)
                continue
            self._kept[(key, int(e["step"]))] = data
            out.append({"key": key, "step": int(e["step"]), "size": int(e["size"]), "checksum": info.checksum,
                        "algo": info.algo, "rank": self.topo.rank, "node": self.topo.node,
                        "header": {k: header.get(k) for k in ("format", "kind", "world", "shard_id", "num_shards",
                                                              "mesh", "nodes", "size", "algo", "covers")
                                   if k in header}})
        return out

    def load(self, choice: ShardChoice) -> tuple[dict, Optional[str]]:
        """Collective: this rank's state of ``choice.step`` (tensors in private memory), and where
        it came from when not from this node (None). Raises ValueError if it is damaged or not this job's."""
        me, step = self.topo.rank, choice.step
        works, sending = [], []
        for rank, src in sorted(choice.sources.items()):
            if src.get("decode") and rank != me:
                for w, t in self._send_for_decode(rank, src, step):
                    works.append(w)
                    sending.append(t)
            elif src["rank"] == me and rank != me and src["node"] != choice.catalogue[rank]["node"]:
                sending.append(self._kept[(src["key"], choice.step)])
                works.append(dist.isend(sending[-1], dst=rank))
        src = choice.sources[me]
        remote = src["node"] != self.topo.node
        how = f"{src['key']} from rank {src['rank']}" if remote else None
        if src.get("decode"):
            data = shard_parity.receive_decoded(lost=me, ranks_per_node=self.topo.ranks_per_node,
                                                nodes=self.topo.num_nodes, size=src["padded"])[:src["size"]]
            how = f"{src['key']} decoded from parity"
        elif src["rank"] == me:
            data = self._kept[(src["key"], choice.step)]
        elif not remote:  # another rank's object on this node: read from the keeper
            m, info = self.keeper.open(src["key"], choice.step)
            data, value = copy_verified(torch.frombuffer(m, dtype=torch.uint8, count=src["size"]), info.algo)
            if value != src["checksum"]:
                raise ValueError(f"shard snapshot {src['key']} of step {choice.step} changed since it was verified")
        else:
            data = torch.empty(src["size"], dtype=torch.uint8)
            works.append(dist.irecv(data, src=src["rank"]))
        for w in works:
            w.wait()
        if (remote or src.get("decode")) and checksum_of(data.numpy(), src["algo"]) != src["checksum"]:
            raise ValueError(f"shard snapshot {src['key']} of step {choice.step} from rank {src['rank']} "
                             + ("decoded from parity differs from the one its owner wrote" if src.get("decode")
                                else "changed in transit"))
        self._kept.clear()
        return read_object(data.numpy(), key=src["key"], step=choice.step, want=self.header(choice.step)), how

    def _send_for_decode(self, lost: int, src: dict, step: int) -> list:
        """This rank's parity and own segments toward ``lost``'s decoding, if it is in its group."""
        rpn = self.topo.ranks_per_node
        if lost % rpn != self.topo.local_rank:
            return []
        own = self._kept[(shard_key(self.topo.rank), step)]
        par = self._kept[(parity_key(self.topo.rank), step)]
        parity = read_object(par.numpy(), key=parity_key(self.topo.rank), step=step,
                             want={"kind": shard_parity.KIND})["parity"]
        return shard_parity.send_for_decode(lost=lost, rank=self.topo.rank, ranks_per_node=rpn,
                                            nodes=self.topo.num_nodes, size=src["padded"], own=own, parity=parity)

    def settle(self, step: int) -> None:
        """Collective, once the resume point is chosen (``step``; -1: a fresh start): every keeper
        drops the newer snapshots, which belong to a timeline the job does not continue."""
        self._kept.clear()
        if self.topo.local_rank == 0:
            try:
                self.keeper.discard_newer(step)
            except KeeperError as e:
                log.warning("shard snapshots: the keeper cannot be cleared (%s)", e)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def reject(self, step: int) -> None:
        """A restore from ``step`` failed: it is never offered again."""
        try:
            self.keeper.reject(step)
        except KeeperError:
            pass

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
