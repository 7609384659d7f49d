"""AOR's log mode: a ZeRO-1 partition current at every step for the price of a copy every K.

:class:`PartitionCopier` sends each partition to the rank that protects it only every ``K``-th
step (``C``). In between, :class:`GradientLog` keeps what it takes to redo the peer partition's
optimizer steps ``C .. s-1``: the peer partition's parameters at ``C`` (its *base*, copied from
this rank's own replicated parameters: no traffic) and, every step, the peer partition's
all-reduced gradients and the hyperparameters in force (no traffic either: every rank holds every
gradient after the all-reduce). Both go into this node's keeper, so they outlive the trainers.

Keeper objects:

* ``aor.b{p}`` of step ``C``: ``{"params": [...]}``, the peer partition's parameters at the start
  of step ``C`` (the same step as the copy ``aor.z{p}`` of ``C``), written with
  :func:`jitckpt.snapshot.keeper_object.write_object` (hashed while copied) and committed;
* ``aor.g{p}`` of step ``G`` (the step the run started at): a ring of ``2K`` slots, begun and
  committed once, then written in place (no keeper round trip per step, which cost more than the
  copy). Its header (JSON) gives the slot geometry and the gradients' layout. Slot ``t % 2K``
  holds step ``t``'s gradients, hashed while copied, behind a small JSON header (the step, the
  checksum, which parameters had a gradient, the hyperparameters) whose length is written last
  and zeroed before the data: a slot torn by a kill reads as empty. A reader takes from ring ``G``
  only the steps ``G <= t`` before the next ring's start (older slots of a later timeline are
  stale), so a resumed run's ring and the one before it together cover a replay across the resume.

The ring holds the last ``2K`` steps and the keeper the copy and base of the last two copy steps:
enough to replay from the previous copy when the kill landed in the newest one's writes.

After a failure (:func:`jitckpt.snapshot.aor_store.restore_with_aor` with ``model``), a step
``s`` is restorable when every partition's object of ``s`` survives or can be replayed: a node
holds its copy and base of some ``C <= s`` and the gradients of ``C .. s-1``. The rank that replays
checks the result: the replayed parameters must equal the parameters snapshot of ``s`` bit for bit
(they are replicated), which verifies the base, the log and the replayed optimizer together.
Survivors make their own partition of the failed step available by writing it just in time
(:func:`jitckpt.snapshot.aor_store.save_own_partition`), so only the lost node's partitions are replayed.

Race rule: the gradients are logged by reference on a worker thread (the trainer's thread only
waits for the previous entry); their version counters are checked after the copy, so a gradient
changed in place under the copy (``zero_grad(set_to_none=False)`` or a gradient bucket view
rewritten by the next backward before the copy ended) is never committed: the log raises at the
next :meth:`GradientLog.capture`. The base is copied at :meth:`GradientLog.begin` of a copy step,
while forward and backward only read the parameters, and :meth:`GradientLog.capture` (before
``zero.step()``) waits for it.
"""
from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any, Optional

import numpy as np
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from jitckpt.snapshot.aor import _hyperparameters
from jitckpt.snapshot.checksum import DEFAULT_ALGORITHM, Checksum, checksum_of
from jitckpt.snapshot.keeper_client import KeeperClient, KeeperError
from jitckpt.snapshot.keeper_object import write_object
from jitckpt.snapshot.layout import ALIGN, FlatState, rebuild

BASE_PREFIX = "aor.b"
GRAD_PREFIX = "aor.g"
LOG_FORMAT = 1


def base_key(owner: int) -> str:
    """Keeper object key of partition ``owner``'s parameters at a copy step."""
    return f"{BASE_PREFIX}{owner}"


def ring_key(owner: int) -> str:
    """Keeper object key of partition ``owner``'s gradient ring."""
    return f"{GRAD_PREFIX}{owner}"


INBAND = "inband"  # the ring's keeper "algorithm": its slots carry their own checksums
SLOT_HEAD = 4096   # bytes before each slot's gradients: the slot's JSON header


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _json_at(buf: memoryview, at: int, limit: int) -> Optional[dict]:
    """The JSON object written at ``at`` behind its 8-byte length, or None (empty, torn, damaged)."""
    n = int.from_bytes(buf[at:at + 8], "little")
    if not 0 < n <= limit - 8:
        return None
    try:
        doc = json.loads(bytes(buf[at + 8:at + 8 + n]))
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _put_json(buf: np.ndarray, at: int, doc: dict, limit: int) -> None:
    """Write ``doc`` at ``at`` (its bytes first, its length last: a torn write reads as empty)."""
    data = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    if 8 + len(data) > limit:
        raise ValueError(f"AOR log header of {len(data)} bytes does not fit its {limit - 8}")
    buf[at + 8:at + 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    buf[at:at + 8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)


def ring_entries(data: Any, *, owner: int, world: int) -> tuple[int, list[dict]]:
    """The ring in ``data`` (a mapping of keeper object ``aor.g{owner}``): its start step and its
    slots that hold a whole entry whose bytes match their checksum, as
    ``{"slot", "step"}`` (the gradients of ``step``). ValueError when the ring header is not this
    job's (another world size, owner or format)."""
    buf = memoryview(data).cast("B")
    head = _json_at(buf, 0, min(len(buf), 1 << 20))
    want = log_header(kind="ring", owner=owner, world=world, step=None)
    if head is None or {k: head.get(k) for k in want if k != "step"} != {k: v for k, v in want.items() if k != "step"}:
        raise ValueError(f"AOR gradient ring {ring_key(owner)} is damaged or not this job's ({want})")
    out = []
    for slot in range(int(head["slots"])):
        at = int(head["first"]) + slot * int(head["slot_size"])
        doc = _json_at(buf, at, SLOT_HEAD)
        if doc is None:
            continue
        data_at = at + SLOT_HEAD
        if checksum_of(buf[data_at:data_at + int(head["bytes"])], doc["algo"]) == doc["checksum"]:
            out.append({"slot": slot, "step": int(doc["step"])})
    return int(head["step"]), out


def read_ring_entry(data: Any, *, owner: int, world: int, slot: int, step: int) -> dict:
    """Slot ``slot``'s entry (``{"grads": [tensor or None], "hyper": [...]}``, the tensors viewing
    ``data``); ValueError unless it holds step ``step``."""
    buf = memoryview(data).cast("B")
    head = _json_at(buf, 0, min(len(buf), 1 << 20))
    if head is None or head.get("owner") != owner or head.get("world") != world:
        raise ValueError(f"AOR gradient ring {ring_key(owner)} is damaged or not this job's")
    at = int(head["first"]) + slot * int(head["slot_size"])
    doc = _json_at(buf, at, SLOT_HEAD)
    if doc is None or doc.get("step") != step:
        raise ValueError(f"AOR gradient ring {ring_key(owner)} slot {slot} does not hold step {step}")
    grads = rebuild(head["layout"], buf[at + SLOT_HEAD:at + SLOT_HEAD + int(head["bytes"])])
    return {"grads": [g if has else None for g, has in zip(grads, doc["has_grad"])],
            "hyper": rebuild(doc["hyper"], b"")}


def log_header(*, kind: str, owner: int, world: int, step: int) -> dict:
    """The header every log object carries (and a reader expects): what, whose, which step."""
    return {"format": LOG_FORMAT, "kind": kind, "owner": owner, "world": world, "step": step}


class GradientLog:
    """Logs peer ``peer``'s ZeRO-1 partition for replay: its parameters at every ``every``-th step
    (:meth:`begin`, called when :class:`PartitionCopier` begins that step) and its gradients and
    hyperparameters at every step (:meth:`capture`, after the all-reduce, before ``zero.step()``)
    into a ring of ``2 * every`` slots. ``start_step``: the step this run starts at (0, or the
    restored one).
    """

    def __init__(self, *, zero: ZeroRedundancyOptimizer, peer: int, every: int, start_step: int = 0,
                 socket_path: Optional[str] = None, wait_timeout: float = 120.0) -> None:
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError(f"GradientLog logs a ZeroRedundancyOptimizer's partition, got {type(zero).__name__}")
        if every < 1 or wait_timeout <= 0 or start_step < 0:
            raise ValueError(f"need every >= 1 (the copy interval), start_step >= 0 and wait_timeout > 0, "
                             f"got {every}, {start_step}, {wait_timeout}")
        if not 0 <= peer < zero.world_size or peer == zero.rank:
            raise ValueError(f"peer must be another rank of the ZeRO group (0..{zero.world_size - 1}, "
                             f"not this rank {zero.rank}), got {peer}")
        partition = zero._partition_parameters()[peer]  # the same on every rank; no public accessor
        self.zero, self.peer, self.every, self.wait_timeout = zero, peer, every, wait_timeout
        self.world = zero.world_size
        self.live = [p for g in partition for p in g["params"]]
        if not self.live:
            raise ValueError(f"peer {peer} owns no parameters (more ranks than parameter tensors)")
        for p in self.live:
            if p.device.type != "cpu" or p.is_sparse:
                raise ValueError(f"the AOR log replays on the host: parameter on {p.device} "
                                 f"{'(sparse) ' if p.is_sparse else ''}is not supported")
        self._zeros = [torch.zeros_like(p) for p in self.live]  # logged where a parameter has no gradient
        flat = FlatState([z for z in self._zeros])
        self.slots, self._bytes = 2 * every, flat.total
        self._slot_size = SLOT_HEAD + _align(flat.total)
        head = log_header(kind="ring", owner=peer, world=self.world, step=start_step) | {
            "slots": self.slots, "slot_size": self._slot_size, "bytes": flat.total, "layout": flat.layout}
        self._first = _align(8 + len(json.dumps(head)) + 64)
        head["first"] = self._first
        self.keeper = KeeperClient(socket_path)
        self._ring = self._make_ring(start_step, head)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jitckpt-aor-log")
        self._job: Optional[concurrent.futures.Future] = None
        self.writes, self.write_seconds, self.cpu_seconds, self.blocked_seconds = 0, 0.0, 0.0, 0.0

    def _make_ring(self, start: int, head: dict) -> np.ndarray:
        """Begin and commit the ring object once, its header written and every slot empty."""
        key, size = ring_key(self.peer), self._first + self.slots * self._slot_size
        try:
            m = self.keeper.begin(key, start, size)
            fresh = True
        except KeeperError:  # a run that started at the same step made it: reuse it
            m, info = self.keeper.open(key, start)
            if info.size != size:
                raise ValueError(f"the keeper holds a gradient ring {key} of step {start} of another "
                                 f"geometry ({info.size} bytes, not {size}): restart its keeper") from None
            fresh = False
        ring = np.frombuffer(m, dtype=np.uint8, count=size)
        for slot in range(self.slots):
            ring[self._first + slot * self._slot_size:][:8] = 0
        _put_json(ring, 0, head, self._first)
        if fresh:
            self.keeper.commit([{"key": key, "step": start, "checksum": 0, "algo": INBAND}])
        return ring

    def begin(self, step: int) -> None:
        """Queue the write of the peer partition's parameters as the base of copy step ``step``."""
        self._settle()
        self._job = self._pool.submit(self._write_base, step)

    def capture(self, step: int) -> None:
        """Queue the log entry of ``step``: the peer partition's gradients (by reference) and the
        hyperparameters ``zero.step()`` is about to use. Waits for the previous write."""
        self._settle()
        grads = [p.grad for p in self.live]
        for p, g in zip(self.live, grads):
            if g is not None and (g.is_sparse or g.shape != p.shape or g.dtype != p.dtype
                                  or g.device.type != "cpu"):
                raise ValueError("the AOR log needs dense CPU gradients shaped like their parameters")
        versions = [None if g is None else g._version for g in grads]
        hyper = FlatState([_hyperparameters(g) for g in self.zero.param_groups])
        if hyper.total:
            raise ValueError("the AOR log keeps hyperparameters as JSON: tensor hyperparameters (a tensor "
                             "lr, capturable=True) are not supported")
        self._job = self._pool.submit(self._write_grads, step, grads, versions, hyper.layout)

    def wait(self) -> None:
        """Block until the queued write is done (raises its error)."""
        self._settle()

    def close(self) -> None:
        """Finish the queued write, stop the worker and drop the keeper connection."""
        try:
            self._settle()
        finally:
            self._pool.shutdown(wait=True)
            self.keeper.close()

    def _settle(self) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            job.result(timeout=self.wait_timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"AOR gradient log write not done after {self.wait_timeout} s") from None
        finally:
            self.blocked_seconds += time.perf_counter() - t0

    def _timed(self, fn: Any, *args: Any) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        fn(*args)
        self.writes += 1
        self.write_seconds += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0

    def _write_base(self, step: int) -> None:
        def write() -> None:
            key = base_key(self.peer)
            _, _, h = write_object(self.keeper, key=key, step=step, state={"params": [p.detach() for p in self.live]},
                                   header=log_header(kind="base", owner=self.peer, world=self.world, step=step))
            self.keeper.commit([{"key": key, "step": step, "checksum": h.value(), "algo": h.algorithm}])
        self._timed(write)

    def _write_grads(self, step: int, grads: list, versions: list, hyper: dict) -> None:
        def write() -> None:
            at = self._first + (step % self.slots) * self._slot_size
            self._ring[at:at + 8] = 0  # the slot is empty until its header is whole again
            h = Checksum(DEFAULT_ALGORITHM)
            flat = FlatState([z if g is None else g.detach() for g, z in zip(grads, self._zeros)])
            h.copy_flat(self._ring[at + SLOT_HEAD:at + SLOT_HEAD + self._bytes], flat, 0, bypass_cache=True)
            if any(g is not None and g._version != v for g, v in zip(grads, versions)):
                raise RuntimeError(f"a gradient of peer {self.peer}'s partition changed while step {step} was "
                                   "logged (zero_grad(set_to_none=False), or a gradient view rewritten by the "
                                   "next backward): the entry is left empty; use zero_grad(set_to_none=True)")
            _put_json(self._ring, at, {"step": step, "checksum": h.value(), "algo": h.algorithm,
                                       "has_grad": [g is not None for g in grads], "hyper": hyper}, SLOT_HEAD)
        self._timed(write)


def replay_partition(*, zero: ZeroRedundancyOptimizer, owner: int, state: dict, base: list,
                     entries: list, live: list) -> Optional[dict]:
    """Partition ``owner``'s optimizer state ``len(entries)`` steps after ``state`` (its copy of
    step ``C``), by applying each logged entry (``{"grads", "hyper"}``, steps ``C`` on) to its
    parameters ``base`` of ``C`` with the partition's own optimizer rule; None unless the replayed
    parameters equal ``live``, the partition's parameters at the target step, bit for bit."""
    from jitckpt.snapshot.aor import OptimizerReplica

    rep = OptimizerReplica(zero=zero, peer=owner)
    try:
        rep.load_state_dict(state, params=base)
        for e in entries:
            rep.replay(list(e["grads"]), list(e["hyper"]))
        shadows = [s for ss in rep.shadow for s in ss]
        if len(shadows) != len(live) or not all(torch.equal(s, p) for s, p in zip(shadows, live)):
            return None
        return rep.state_dict()
    finally:
        rep.close()
