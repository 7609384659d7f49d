"""Restore from the newest usable tier: in-memory snapshot (REFT-load) or an on-disk checkpoint.

Collective: every rank of the job calls :func:`restore` after ``init_process_group``.

1. Steps are tried newest first (the keeper holds two versions; the older one is hashed only if
   the newer one is unusable): each node's ranks verify their keeper's objects of that step
   (checksums, split among the node's ranks) and all-gather a catalogue of what survived.
2. :func:`latest_memory_step` decides whether the whole state can be rebuilt from that step:
   every data part present on some node, or (AEC) decodable from parity, or (ARC) present on the
   successor. The newest verified on-disk checkpoint (:func:`jitckpt.checkpoint_store.find_latest`, all
   kinds: jit, periodic, flushed snapshots) is compared with it and the newer one wins; at equal
   steps memory wins (faster).
3. Objects are broadcast from a node that holds them (gloo), missing parts are decoded from XOR
   parity, and the state is rebuilt bit for bit, straight into the trainer's tensors when it passes
   them (``into``) and no part was decoded. On one node every rank reads them from the node's
   keeper instead.
4. A state with NaN/Inf in a floating tensor, or one whose load fails anywhere, is not used: its
   step is rejected in every keeper (never offered again, so a restart cannot loop on it) and the
   next tier is tried once. :func:`reject_snapshot` does the same when the trainer finds a NaN loss
   right after resuming.
"""
from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from jitckpt.checkpoint_store import CheckpointError, find_latest, list_candidates, read_meta
from jitckpt.snapshot.checksum import checksum_of, copy_verified
from jitckpt.snapshot.client import META_KEY, STATE_FILE, Topology, parse_meta
from jitckpt.snapshot.keeper_client import KeeperClient, KeeperError
from jitckpt.snapshot.layout import rebuild
from jitckpt.snapshot.protection import ProtectionPlan

log = logging.getLogger("jitckpt.snapshot")


@dataclass
class RestoreResult:
    """What :func:`restore` loaded: ``state`` is None when no tier had a usable checkpoint.

    The state's tensors own their memory (never the keeper's): ``Optimizer.load_state_dict``
    keeps the tensors it is given, and the keeper's buffers are rewritten by later snapshots.
    """

    source: str                 # "memory" | "disk" | "none"
    step: Optional[int]
    state: Any
    seconds: float
    decoded: list = field(default_factory=list)    # data parts rebuilt from parity
    remote: list = field(default_factory=list)     # objects fetched from another node
    skipped: list = field(default_factory=list)    # (tier/step, reason)
    path: Optional[str] = None
    mapped_ahead: bool = False  # memory: every keeper buffer read was mapped before the call


@dataclass(frozen=True)
class MemoryChoice:
    """The newest in-memory step that can be rebuilt, and where each needed object lives."""

    step: int
    plan: ProtectionPlan
    holders: dict       # key -> (rank, size)
    decoded: list
    checksums: dict = field(default_factory=dict)  # key -> (checksum, algorithm), as its writer hashed it
    covers: dict = field(default_factory=dict)     # parity key -> (its ranges' checksums, algorithm)


def _newest_disk(root: str, topo: Topology) -> Optional[tuple[Path, Any]]:
    """The newest complete on-disk checkpoint: of the whole state, or this rank's shard of one that
    every rank saved as its own shard (a ZeRO job's, at a preemption or a periodic save: each with
    its rank's optimizer partition), whichever the newest readable checkpoint is."""
    world = dist.get_world_size() if _is_initialized() else 1
    for c in list_candidates(root):
        try:
            if world > 1 and read_meta(c.path).num_shards == world:
                return find_latest(root, shard_id=topo.rank, num_shards=world)
            break
        except CheckpointError:
            continue
    return find_latest(root)


def _is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def local_catalogue(keeper: KeeperClient, topo: Topology, *, share: Optional[tuple] = None,
                    keep: Optional[dict] = None, steps: Optional[set] = None,
                    listing: Optional[list] = None, verify: bool = True) -> list[dict]:
    """This rank's share of its keeper's complete objects, checksum-verified.

    ``share=(i, n)`` verifies every n-th object starting at i (default: split among the node's
    ranks, which all call this on the same keeper). With ``keep`` (a dict), data objects are
    verified while being copied into private memory (:func:`copy_verified`) and the verified
    copies are kept there by (key, step), so a restore reads each byte from the keeper once. ``steps``
    limits the catalogue to those steps; ``listing`` is the keeper's listing if already fetched.
    ``verify=False`` hashes only the metadata objects (which are parsed here): the caller verifies
    the data objects as it loads them.
    """
    index, count = share or (topo.local_rank, topo.ranks_per_node)
    entries = [e for e in (keeper.listing() if listing is None else listing)
               if (steps is None or e["step"] in steps) and _SNAPSHOT_KEY.fullmatch(e["key"])]
    out = []
    for i, e in enumerate(entries):
        if i % count != index:
            continue
        if not verify and e["key"] != META_KEY:  # the listing has what its writer recorded
            out.append({**e, "rank": topo.rank, "node": topo.node})
            continue
        try:
            m, info = keeper.open(e["key"], e["step"])
        except KeeperError:
            continue  # dropped since the listing (a newer snapshot reused the buffer)
        copy = keep is not None and e["key"] != META_KEY
        if copy:
            data, value = copy_verified(torch.frombuffer(m, dtype=torch.uint8, count=e["size"]), info.algo)
        else:
            value = checksum_of(memoryview(m)[:e["size"]], info.algo)
        if value != info.checksum:
            log.warning("in-memory snapshot object %s step %s fails its checksum; not used",
                        e["key"], e["step"])
            continue
        if copy:
            keep[(e["key"], e["step"])] = data
        entry = {**e, "rank": topo.rank, "node": topo.node}
        if e["key"] == META_KEY:
            try:
                entry["plan"] = parse_meta(m[:e["size"]])["plan"]
            except ValueError as err:
                log.warning("in-memory snapshot step %s: %s; not used", e["step"], err)
                continue
        out.append(entry)
    return out


def latest_memory_step(catalogues: list, topo: Topology, skipped: Optional[list] = None) -> Optional[MemoryChoice]:
    """Newest step rebuildable from the gathered catalogues for this job's topology, or None."""
    by_step: dict[int, dict] = {}
    for cat in catalogues:
        for e in cat:
            slot = by_step.setdefault(int(e["step"]), {})
            if e["key"] not in slot or e["rank"] < slot[e["key"]]["rank"]:
                slot[e["key"]] = e
    for step in sorted(by_step, reverse=True):
        objs = by_step[step]
        meta = objs.get(META_KEY)
        if meta is None:
            _skip(skipped, f"memory step {step}", "no surviving metadata object")
            continue
        p = meta["plan"]
        if (p["num_nodes"], p["ranks_per_node"]) != (topo.num_nodes, topo.ranks_per_node):
            _skip(skipped, f"memory step {step}",
                  f"taken on {p['num_nodes']} nodes x {p['ranks_per_node']} ranks, this job has "
                  f"{topo.num_nodes} x {topo.ranks_per_node}")
            continue
        plan = ProtectionPlan(**p)
        need = plan.fetch_list(set(objs))
        if need is None:
            _skip(skipped, f"memory step {step}", "more objects lost than the protection scheme covers")
            continue
        holders = {k: (objs[k]["rank"], objs[k]["size"]) for k in need + [META_KEY]}
        decoded = sorted(f"x{k}.{l}" for k in range(plan.m) for l in range(plan.r)
                         if f"x{k}.{l}" not in objs)
        checksums = {k: (objs[k]["checksum"], objs[k]["algo"]) for k in need if "checksum" in objs[k]}
        covers = {k: (objs[k]["covers"], objs[k]["algo"]) for k in need if objs[k].get("covers")}
        return MemoryChoice(step, plan, holders, decoded, checksums, covers)
    return None


def _skip(skipped: Optional[list], what: str, why: str) -> None:
    log.info("restore: skipping %s: %s", what, why)
    if skipped is not None:
        skipped.append((what, why))


def _all_true(flag: bool, group: Any) -> bool:
    if not _is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _finite(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        if not state.is_floating_point() or state.numel() == 0:
            return True
        # A NaN or Inf element makes the sum non-finite; the sum is one fast pass with no
        # tensor-sized temporary. Only a non-finite sum (possibly overflow) needs the exact check.
        if bool(torch.isfinite(state.sum())):
            return True
        return bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return True


def _data_keys(plan: ProtectionPlan) -> list[str]:
    return [plan.data_spec(k, l).key for k in range(plan.m) for l in range(plan.r)]


def _verified_in_load(choice: MemoryChoice) -> bool:
    """Whether :func:`_load_memory` with ``into`` copies ``choice`` straight into the tensors, hashing
    every data part as it goes: every part is at hand (none decoded from parity) and hashed alike."""
    parts = _data_keys(choice.plan)
    algos = {choice.checksums[k][1] if k in choice.checksums else None for k in parts}
    return not choice.decoded and len(algos) == 1 and None not in algos


def _load_memory(choice: MemoryChoice, keeper: Optional[KeeperClient], topo: Topology, group: Any,
                 remote: list, kept: Optional[dict] = None,
                 into: Any = None) -> tuple[Any, bool, Optional[bool]]:
    """The state of ``choice`` (its objects gathered from their holders; None if one fails its
    checksum here), whether ``into``'s tensors were written, and whether its floats are all
    finite (None: not checked here).

    With ``into`` and every data part at hand (nothing to decode from parity), the parts are
    copied straight into its tensors, with no assembled private copy (``load_state_dict`` of the
    result then copies nothing), and every byte is hashed and checked for NaN/Inf behind the
    copy while in cache: the parts received from other nodes are verified end to end."""
    # One node: every rank reads every object from the node's keeper (verified by one of them),
    # not through a broadcast over the process group.
    local = topo.num_nodes == 1 and _all_true(keeper is not None, group)
    objects: dict[str, torch.Tensor] = {}
    for key in sorted(choice.holders):
        holder, size = choice.holders[key]
        if kept and (key, choice.step) in kept:
            t = kept[(key, choice.step)]  # verified private copy: the state views it
        elif holder == topo.rank or local:
            m, _ = keeper.open(key, choice.step)
            t = torch.frombuffer(m, dtype=torch.uint8, count=size)
        else:
            t = torch.empty(size, dtype=torch.uint8)
            if holder // topo.ranks_per_node != topo.node:
                remote.append(key)
        if topo.world > 1 and not local:
            dist.broadcast(t, src=dist.get_global_rank(group, holder) if group is not None else holder,
                           group=group)
        objects[key] = t
    meta = parse_meta(objects.pop(META_KEY).numpy())
    plan = choice.plan
    parts = _data_keys(plan)
    if into is not None and _verified_in_load(choice):
        from jitckpt.snapshot.direct_load import copy_parts_into, targets_in
        from jitckpt.snapshot.layout import parse_layout

        algos = {choice.checksums[k][1] for k in parts}
        doc = parse_layout(meta["layout"])
        targets = targets_in(doc, into)
        # The parts laid end to end are the flat state. Hashing them all costs less than a
        # separate pass over the state for NaN/Inf would (torch's sum: ~3 GB/s on one core).
        tensors, sums, finite = copy_parts_into(doc, [objects[k].numpy() for k in parts], algos.pop(), targets,
                                                share=(0, 1), check_finite=True)
        wrote = any(t is not None for t in targets)
        bad = [k for i, k in enumerate(parts) if sums[i] != choice.checksums[k][0]]
        if bad:
            log.warning("in-memory snapshot step %s: %s fail their checksum here", choice.step, bad)
            return None, wrote, None
        return rebuild(doc, tensors=tensors), wrote, finite
    flat = plan.assemble(objects, choice.covers)
    return rebuild(meta["layout"], flat.numpy()), False, None


# Bytes of each rank's JSON sent in the first (and usually only) all-gather of gather_json: a
# catalogue of one step is a few hundred bytes per object; a longer document costs a second round.
GATHER_INLINE_BYTES = 4096
# The parameter snapshot's own objects (SnapshotTaker's data and parity parts, its metadata); the
# keepers also hold AOR's (aor.*), which restore_with_aor surveys and verifies itself.
_SNAPSHOT_KEY = re.compile(rf"{META_KEY}|[xp][0-9]+\.[0-9]+")


def gather_json(obj: Any, topo: Topology, group: Any) -> list:
    """Every rank's JSON-able ``obj`` (as JSON bytes: all_gather_object would unpickle them).

    One all-gather of fixed-size slots (a length, then up to GATHER_INLINE_BYTES of the text);
    only when some rank's text is longer does a second all-gather carry the whole of every text.
    Every rank sees the same lengths, so all take the second round or none does."""
    if topo.world == 1:
        return [obj]
    data = json.dumps(obj).encode()
    slot = torch.zeros(8 + GATHER_INLINE_BYTES, dtype=torch.uint8)
    slot[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    inline = data[:GATHER_INLINE_BYTES]
    if inline:
        slot[8:8 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
    slots = [torch.empty_like(slot) for _ in range(topo.world)]
    dist.all_gather(slots, slot, group=group)
    sizes = [int(s[:8].view(torch.int64)) for s in slots]
    longest = max(sizes)
    if longest <= GATHER_INLINE_BYTES:
        texts = [s[8:8 + n] for s, n in zip(slots, sizes)]
    else:
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        texts = [torch.empty(longest, dtype=torch.uint8) for _ in range(topo.world)]
        dist.all_gather(texts, buf, group=group)
        texts = [t[:n] for t, n in zip(texts, sizes)]
    return [json.loads(t.numpy().tobytes()) for t in texts]


def _newest_memory_step(keeper: Optional[KeeperClient], topo: Topology, group: Any,
                        skipped: list, kept: Optional[dict], verify: bool = True) -> Optional[MemoryChoice]:
    """Collective: verify and agree on steps newest first, so older copies (the keeper holds
    two versions) are hashed only when every newer step is unusable. ``verify=False``: the data
    objects are not hashed (the caller's load does it), and one gather carries every step's
    catalogue."""
    try:
        listing = keeper.listing() if keeper is not None else []
    except KeeperError as e:
        _skip(skipped, "memory tier", str(e))
        listing = []
    if not verify:
        mine = []
        if keeper is not None:
            try:
                mine = local_catalogue(keeper, topo, listing=listing, verify=False)
            except (KeeperError, ValueError) as e:
                _skip(skipped, "memory tier", str(e))
        return latest_memory_step(gather_json(mine, topo, group), topo, skipped)
    listed = {int(e["step"]) for e in listing}
    steps = sorted(set().union(*gather_json(sorted(listed), topo, group)), reverse=True)
    for step in steps:  # the same sequence on every rank: one gather per step tried
        mine: list = []
        if keeper is not None and step in listed:
            try:
                mine = local_catalogue(keeper, topo, keep=kept, steps={step}, listing=listing)
            except (KeeperError, ValueError) as e:
                _skip(skipped, f"memory step {step}", str(e))
        choice = latest_memory_step(gather_json(mine, topo, group), topo, skipped)
        if choice is not None:
            return choice
    return None


def _quietly(call: Any, step: int) -> None:
    """A keeper request whose failure must not leave this rank out of the next collective."""
    try:
        call(step)
    except KeeperError as e:
        log.warning("restore: keeper request for step %s failed: %s", step, e)


def _direct_step(keeper: Optional[KeeperClient], into: Any, newer_than: Optional[int], skipped: list,
                 check_finite: bool, topo: Topology,
                 group: Any) -> tuple[Optional[tuple[int, Any]], bool, bool]:
    """Collective, one node: the newest in-memory step (newer than ``newer_than``, the disk tier's),
    read from the node's keeper straight into ``into``'s tensors (:mod:`jitckpt.snapshot.direct_load`).

    One rank hashes and checks it for NaN/Inf on a second thread beside the copy (the other core is
    idle after a failure). Several ranks each copy the whole state, and hash and check their share
    of its parts (one per rank) right behind their copy; then one all-reduce per step tried both
    combines the verdicts and checks that every rank tried the same step (they list one keeper).

    Returns ((step, state) or None, whether ``into``'s tensors were written, whether the ranks took
    this path: False when some rank has no keeper or the ranks tried different steps, and the
    general path is to run)."""
    import numpy as np

    from jitckpt.snapshot.direct_load import copy_parts_into, copy_verified_into, targets_in
    from jitckpt.snapshot.layout import parse_layout

    r = topo.ranks_per_node
    parts = [f"x0.{l}" for l in range(r)]
    listing: list = []
    if keeper is not None:
        try:
            listing = keeper.listing()
        except KeeperError as e:
            _skip(skipped, "memory tier", str(e))
            keeper = None
    if keeper is None and topo.world == 1:
        return None, False, False
    steps = sorted({int(e["step"]) for e in listing
                    if newer_than is None or int(e["step"]) >= newer_than}, reverse=True)
    written = False
    for i in range(2):  # the keeper holds two versions; every rank runs both rounds' collective
        step = steps[i] if i < len(steps) and keeper is not None else None
        objs = {e["key"]: e for e in listing if e["step"] == step}
        state, why, finite = None, "", True
        if step is None:
            pass
        elif set(objs) != {META_KEY, *parts}:
            why = f"not {r} data objects (one per rank of this node) and a metadata object"
        else:
            try:
                # No round trip for buffers mapped ahead; the data's pages are faulted in behind the copy.
                (m, info), *data = keeper.open_listed([objs[META_KEY]] + [objs[k] for k in parts],
                                                      sequential=tuple(parts))
                if checksum_of(memoryview(m)[:objs[META_KEY]["size"]], info.algo) != info.checksum:
                    raise ValueError("its metadata object fails its checksum")
                meta = parse_meta(m[:objs[META_KEY]["size"]])
                plan = ProtectionPlan(**meta["plan"])
                if (plan.m, plan.r) != (1, r) or any(objs[k]["size"] != plan.part for k in parts):
                    raise ValueError("taken by a job of another shape")
                doc = parse_layout(meta["layout"])
                srcs = [np.frombuffer(dm, dtype=np.uint8, count=objs[k]["size"]) for k, (dm, _) in zip(parts, data)]
                targets = targets_in(doc, into)
                written = written or any(t is not None for t in targets)
                if r == 1:
                    tensors, value, finite = copy_verified_into(doc, srcs[0], data[0][1].algo, targets,
                                                                check_finite=check_finite)
                    sums = {0: value}
                else:
                    tensors, sums, finite = copy_parts_into(doc, srcs, data[0][1].algo, targets,
                                                            share=(topo.local_rank, r), check_finite=check_finite)
                if any(sums[l] != data[l][1].checksum for l in sums):
                    log.warning("in-memory snapshot step %s fails its checksum; not used", step)
                    why = "fails its checksum"
                else:
                    state = rebuild(doc, tensors=tensors)
            except (KeeperError, ValueError, TypeError, KeyError) as e:
                why = str(e)
        if step is not None and topo.local_rank == 0 and any(int(e["step"]) > step for e in listing):
            # Stale versions of later steps go before the verdict's collective: after it, the node's
            # other ranks may already be writing the next snapshot (as in restore()).
            _quietly(keeper.discard_newer, step)
        loaded = state is not None
        if topo.world > 1:
            mine = -1 if step is None else step
            verdict = torch.tensor([int(keeper is not None), int(loaded), int(finite), mine, -mine], dtype=torch.int64)
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
            have, loaded, finite, low, high = (int(v) for v in verdict)
            if not have or low != -high:
                return None, written, False
        if step is None:
            break
        if not loaded:
            _skip(skipped, f"memory step {step}", why or "failed on another rank")
            continue
        if not finite:
            _skip(skipped, f"memory step {step}", "restored state has NaN/Inf")
            if topo.local_rank == 0:
                _quietly(keeper.reject, step)
            continue
        return (step, state), written, True
    return None, written, True


def restore(*, socket_path: Optional[str] = None, ranks_per_node: Optional[int] = None,
            checkpoint_dir: Optional[str] = None, group: Any = None,
            check_finite: bool = True, into: Any = None,
            keeper: Optional[KeeperClient] = None) -> RestoreResult:
    """Load the newest usable state (memory or disk tier); see the module docstring.

    ``into``: the trainer's live state, of the structure the snapshots were taken of (e.g.
    ``{"model": model.state_dict(), "optimizer": opt.state_dict(), ...}``). An in-memory snapshot
    is copied straight into its tensors (those of the same place, dtype and shape; one node, one
    rank: verified beside the copy; several ranks: after they verified their shares; several
    nodes: from the objects of this node's keeper and those received from the others, unless a
    part had to be decoded from parity); the state returned holds those very tensors, so
    ``load_state_dict`` of it copies nothing.
    Should the in-memory state fail its checks after ``into``'s tensors were written, they hold
    partial data: the disk tier then loads, and without one this raises rather than let training
    go on from them.

    ``keeper``: a client of this node's keeper whose buffers are mapped already
    (:class:`~jitckpt.snapshot.premap.Premapper`); the caller keeps it (not closed here).
    """
    t0 = time.monotonic()
    topo = Topology.detect(ranks_per_node, group)
    skipped: list = []
    owned = keeper is None
    kept: Optional[dict] = {} if topo.world == 1 else None
    if owned:
        try:
            keeper = KeeperClient(socket_path)
        except (KeeperError, ValueError) as e:
            _skip(skipped, "memory tier", str(e))
    mapped0 = keeper.mappings_made if keeper is not None else 0
    disk = _newest_disk(checkpoint_dir, topo) if checkpoint_dir else None
    disk_step = disk[1].step if disk else None
    written = False
    agreed = False
    if into is not None and topo.num_nodes == 1:
        direct, written, agreed = _direct_step(keeper, into, disk_step, skipped, check_finite, topo, group)
        if direct is not None:
            ahead = not owned and keeper.mappings_made == mapped0
            if owned:
                keeper.close()
            return RestoreResult("memory", direct[0], direct[1], time.monotonic() - t0, skipped=skipped,
                                 mapped_ahead=ahead)
    # After the direct path the memory tier is done: the disk's turn. Several nodes loading into the
    # trainer's tensors hash every data part in the copy (_load_memory), so the catalogue need not
    # hash them before: only should that copy find a bad object is the catalogue made again, verified,
    # which leaves the bad object out (decoded from parity instead, or an older step).
    trusting = into is not None and topo.num_nodes > 1
    try:
        for verify in ([] if agreed else [False, True] if trusting else [True]):
            choice = _newest_memory_step(keeper, topo, group, skipped, kept, verify=verify)
            if choice is None or (disk_step is not None and choice.step < disk_step):
                break
            if not verify and not _verified_in_load(choice):
                continue  # a part decoded from parity: every object it reads is hashed first
            remote: list = []
            state, ok, bad_object = None, False, True
            try:
                state, wrote, finite = _load_memory(choice, keeper, topo, group, remote, kept, into)
                written = written or wrote
                if state is None:
                    _skip(skipped, f"memory step {choice.step}", "an object fails its checksum after the transfer")
                else:
                    bad_object = False
                    ok = not check_finite or (finite if finite is not None else _finite(state))
                    if not ok:
                        _skip(skipped, f"memory step {choice.step}", "restored state has NaN/Inf")
            except (KeeperError, ValueError, KeyError) as e:
                _skip(skipped, f"memory step {choice.step}", f"load failed: {e}")
            if keeper is not None and topo.local_rank == 0:
                # Stale partial versions of later steps go now, before the agreement collective:
                # after it, the node's other ranks may already be writing the next snapshot.
                keeper.discard_newer(choice.step)
            if _all_true(ok, group):
                return RestoreResult("memory", choice.step, state, time.monotonic() - t0,
                                     decoded=choice.decoded, remote=remote, skipped=skipped,
                                     mapped_ahead=not owned and keeper.mappings_made == mapped0)
            if not verify and not _all_true(not bad_object, group):
                continue  # once more, every object hashed before it is chosen: the bad one is left out
            if keeper is not None and topo.local_rank == 0:
                keeper.reject(choice.step)
            _skip(skipped, f"memory step {choice.step}", "rejected; falling back to disk")
            break
        if disk is not None:
            path, meta = disk
            state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
            ok = not check_finite or _finite(state)
            if keeper is not None and topo.local_rank == 0:
                keeper.discard_newer(meta.step)
            if _all_true(ok, group):
                return RestoreResult("disk", meta.step, state, time.monotonic() - t0, skipped=skipped,
                                     path=str(path))
            _skip(skipped, f"disk {path}", "restored state has NaN/Inf")
        if topo.world > 1:
            written = not _all_true(not written, group)  # every rank raises, or none
        if written:
            raise RuntimeError("restore: an in-memory snapshot failed its checks while being loaded into the "
                               "trainer's tensors (on this rank or another), which now hold partial data, and no "
                               "other checkpoint is left "
                               f"({'; '.join(f'{w}: {y}' for w, y in skipped)}); start the job anew")
        return RestoreResult("none", None, None, time.monotonic() - t0, skipped=skipped)
    finally:
        if owned and keeper is not None:
            keeper.close()  # restored tensors hold private memory, not the keeper's


def find_latest_in_memory(keepers: Mapping[int, str], *, num_nodes: int, ranks_per_node: int,
                          skipped: Optional[list] = None) -> Optional[tuple[int, Any]]:
    """Non-collective discovery for a process that can reach the keepers' sockets (a controller,
    a launcher, a test): (step, state) of the newest rebuildable snapshot, or None.

    ``keepers`` maps node index -> keeper socket; unreachable keepers count as lost nodes. Same
    selection rule as :func:`restore`, so its step can be compared with ``find_latest`` on disk.
    """
    topo = Topology(0, num_nodes * ranks_per_node, ranks_per_node)
    clients: dict[int, KeeperClient] = {}
    catalogues = []
    try:
        for node, path in sorted(keepers.items()):
            if not 0 <= node < num_nodes:
                raise ValueError(f"keeper for node {node}: nodes are 0..{num_nodes - 1}")
            try:
                clients[node] = KeeperClient(path)
            except KeeperError as e:
                _skip(skipped, f"node {node}", str(e))
                continue
            node_topo = Topology(node * ranks_per_node, topo.world, ranks_per_node)
            catalogues.append(local_catalogue(clients[node], node_topo, share=(0, 1)))
        choice = latest_memory_step(catalogues, topo, skipped)
        if choice is None:
            return None
        objects = {}
        for key, (holder, size) in choice.holders.items():
            m, _ = clients[holder // ranks_per_node].open(key, choice.step)
            objects[key] = torch.frombuffer(m, dtype=torch.uint8, count=size)
        meta = parse_meta(objects.pop(META_KEY).numpy())
        flat = choice.plan.assemble(objects, choice.covers)
        if flat is objects.get("x0.0"):
            flat = flat.clone()  # one part is the state: never hand out views of keeper memory
        return choice.step, rebuild(meta["layout"], flat.numpy())
    finally:
        for c in clients.values():
            c.close()


def reject_snapshot(step: int, *, socket_path: Optional[str] = None) -> None:
    """Never offer in-memory step ``step`` again (e.g. training diverged right after restoring it).

    Call it on every node (any rank; it is idempotent): with parity, the copies left on the other
    nodes could otherwise rebuild the step again.
    """
    k = KeeperClient(socket_path)
    try:
        k.reject(step)
    finally:
        k.close()
