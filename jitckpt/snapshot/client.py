"""Asynchronous in-memory snapshots from a training process (REFT-save on CPU).

Usage in a training loop (state at the *start* of minibatch ``step``)::

    snap = SnapshotTaker(state_fn=lambda: {"step": step, "model": ..., "optimizer": ...},
                         ranks_per_node=2, scheme="aec")
    for step in range(start, total):
        snap.begin(step)            # hands the copy to a background thread, returns at once
        loss = model(x); loss.backward()
        with snap.idle():           # a window where this process waits (the gradient all-reduce)
            allreduce(grads)
        snap.wait()                 # deadline: parameters change in optimizer.step()
        optimizer.step()

Hierarchical asynchronous snapshotting (REFT section 4.1) mapped to CPU: the copy runs in chunks
on a background thread; chunks go first into announced idle windows (layer 1), then, unless
``idle_only``, alongside compute (layer 2); whatever is left when :meth:`wait` is reached is
copied while the trainer blocks (the fallback). Each rank copies only its share of the state
plus its protection object (see :mod:`jitckpt.snapshot.protection`), hashes it, and commits it to the
node's keeper. A snapshot is overwritten only after every rank committed the one after it
(checked with an asynchronous all-reduce on a side gloo group), so some complete step always
survives. Every ``flush_every``-th snapshot, global rank 0 also writes it to disk through
:mod:`jitckpt.checkpoint_store` (kind ``snapshot``) from a separate thread.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from jitckpt.checkpoint_store import write_checkpoint
from jitckpt.snapshot.checksum import DEFAULT_ALGORITHM, Checksum
from jitckpt.snapshot.keeper_client import KeeperClient
from jitckpt.snapshot.layout import FlatState, rebuild
from jitckpt.snapshot.protection import ObjectSpec, ProtectionPlan, xor_into

log = logging.getLogger("jitckpt.snapshot")

ENV_RANKS_PER_NODE = "JITCKPT_SNAPSHOT_RANKS_PER_NODE"
META_KEY = "meta"
META_ALIGN = 4096  # the metadata object's size is a multiple of this (meta_blob)
STATE_FILE = "state.pt"  # same name as jitckpt.protect, so Protected.load reads a flushed snapshot


@dataclass(frozen=True)
class Topology:
    """This rank's place: ``world`` ranks on nodes of ``ranks_per_node`` consecutive ranks."""

    rank: int
    world: int
    ranks_per_node: int

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world // self.ranks_per_node

    @staticmethod
    def detect(ranks_per_node: Optional[int] = None, group: Any = None) -> "Topology":
        """From torch.distributed (or a single rank) and ranks_per_node or $JITCKPT_SNAPSHOT_RANKS_PER_NODE."""
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        else:
            rank, world = 0, 1
        rpn = ranks_per_node or int(os.environ.get(ENV_RANKS_PER_NODE)
                                    or os.environ.get("LOCAL_WORLD_SIZE") or world)
        if rpn < 1 or world % rpn:
            raise ValueError(f"ranks_per_node={rpn} must divide the world size {world} (nodes are "
                             f"groups of consecutive ranks); set {ENV_RANKS_PER_NODE}")
        return Topology(rank, world, rpn)


def meta_blob(step: int, plan: ProtectionPlan, flat: FlatState) -> bytes:
    """The node's metadata object: step, protection plan and state layout, as JSON."""
    # check_circular off: a layout is a tree FlatState built (a deep model's: 2.1 -> 1.35 ms, measured)
    raw = json.dumps({"step": step, "plan": plan.describe(), "layout": flat.layout},
                     allow_nan=False, check_circular=False, separators=(",", ":")).encode()
    # Padded with spaces (JSON allows trailing whitespace) to whole pages: the object's size, so the
    # keeper's buffer and a standby's mapping of it, stays the same while the layout's numbers (a
    # step, a learning rate) change length; a new size is a new buffer, which no standby has mapped.
    return raw + b" " * (-len(raw) % META_ALIGN)


def parse_meta(data: Any) -> dict:
    """The metadata object written by :func:`meta_blob` (bytes-like), checked for its fields."""
    try:
        meta = json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"snapshot metadata is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or not {"step", "plan", "layout"} <= set(meta):
        raise ValueError("snapshot metadata lacks step/plan/layout (written by another version?)")
    return meta


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while the trainer builds and walks the state.

    Both allocate a container per node of the state (thousands for a deep model), and every 700
    allocations start a collection: in a process holding torch's ~300k objects these escalate to
    collections of the whole heap, ~130 ms each, every few snapshots. Held off, the allocations
    cost one young-generation collection afterwards, and the containers die by reference counting
    when the snapshot is done (measured, a 1680-tensor state: begin() cost the trainer 14.6 ms per
    step with the collector running, 2-5 ms held off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class SnapshotStats:
    """Counters for reports and benchmarks."""

    taken: int = 0
    skipped: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0        # wall time of the background copies
    copy_cpu_seconds: float = 0.0    # CPU time the copy thread used (overlap is not free)
    blocked_seconds: float = 0.0      # trainer waiting in wait() for the copy to finish
    chunks: dict = field(default_factory=lambda: {"idle": 0, "compute": 0, "deadline": 0})
    flushed: list = field(default_factory=list)


@dataclass
class _Job:
    step: int
    flat: FlatState
    plan: ProtectionPlan
    specs: list           # [ObjectSpec] this rank writes
    with_meta: bool       # local rank 0 also writes the node's meta object
    full_copy: Optional[torch.Tensor]
    pin: bool = False     # the keepers keep it until the next pinned snapshot
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None


class SnapshotTaker:
    """Takes asynchronous, sharded, protected snapshots into the node keeper's memory."""

    def __init__(self, *, state_fn: Callable[[], Any], socket_path: Optional[str] = None,
                 scheme: str = "aec", every: int = 1, ranks_per_node: Optional[int] = None,
                 group: Any = None, chunk_bytes: int = 1 << 20, idle_only: bool = False,
                 flush_dir: Optional[str] = None, flush_every: int = 0, gen: int = 0,
                 wait_timeout: float = 120.0, thread_nice: int = 0) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1 (snapshot every N steps), got {every}")
        if chunk_bytes < 4096 or chunk_bytes % 8:
            raise ValueError(f"chunk_bytes must be a multiple of 8 and >= 4096, got {chunk_bytes}")
        if not 0 <= thread_nice <= 19:
            raise ValueError(f"thread_nice must be in 0..19 (a Linux nice value), got {thread_nice}")
        if flush_every < 0 or (flush_every and not flush_dir):
            raise ValueError("flush_every > 0 needs flush_dir (the checkpoint root for disk flushes)")
        self.topo = Topology.detect(ranks_per_node, group)
        if scheme != "none" and self.topo.num_nodes < 2:
            raise ValueError(f"scheme {scheme!r} needs >= 2 nodes; this job has "
                             f"{self.topo.world} ranks at {self.topo.ranks_per_node} per node")
        self.state_fn, self.scheme, self.every = state_fn, scheme, every
        self.chunk, self.idle_only, self.wait_timeout = chunk_bytes, idle_only, wait_timeout
        self.flush_dir, self.flush_every, self.gen = flush_dir, flush_every, gen
        self.thread_nice = thread_nice
        self.keeper = KeeperClient(socket_path)
        self.stats = SnapshotStats()
        self._group = group
        self._side = (dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized()
                      and self.topo.world > 1 else None)
        self._commit_work: Any = None
        self._commit_val: Optional[torch.Tensor] = None
        self._last_committed: Optional[int] = None
        self._skip_step: Optional[int] = None
        self._job: Optional[_Job] = None
        self._idle = threading.Event()
        self._deadline = threading.Event()
        self._wake = threading.Condition()
        self._queue: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._tmp = torch.empty(chunk_bytes, dtype=torch.uint8)
        self._flush_thread: Optional[threading.Thread] = None
        self._thread = threading.Thread(target=self._run, name="jitckpt-snapshot", daemon=True)
        self._thread.start()

    # Trainer-facing API ------------------------------------------------------------------------
    @property
    def side_group(self) -> Any:
        """The taker's own gloo group (None with one rank): collectives in ``state_fn`` use it."""
        return self._side

    @property
    def running(self) -> Optional[int]:
        """The step of the snapshot begun and not yet waited for, or None."""
        return None if self._job is None else self._job.step

    def skip(self, step: int) -> None:
        """Do not snapshot ``step`` (the job just restored it: the keeper already holds it)."""
        self._skip_step = step

    def begin(self, step: int, *, pin: bool = False) -> bool:
        """Start snapshotting the current state as the state at ``step``; False if not due. ``pin``:
        the keepers keep this snapshot until the next pinned one (not only until two newer ones)."""
        if self._job is not None:
            raise RuntimeError("SnapshotTaker.begin: the previous snapshot was not waited for; call "
                               "wait() before optimizer.step()")
        if step % self.every or step == self._skip_step:
            return False
        if not self._previous_globally_committed():
            self.stats.skipped += 1
            return False
        with _gc_paused():
            flat = FlatState(self.state_fn())
        plan = ProtectionPlan(scheme=self.scheme, num_nodes=self.topo.num_nodes,
                              ranks_per_node=self.topo.ranks_per_node, total_bytes=flat.total)
        # Keeper requests and the metadata are the background thread's work: begin() only pins
        # the state's tensors (the trainer's critical path).
        specs = plan.rank_objects(self.topo.node, self.topo.local_rank)
        full = None
        if (self.flush_every and self.topo.rank == 0 and (self.stats.taken + 1) % self.flush_every == 0
                and not (self._flush_thread and self._flush_thread.is_alive())):
            full = torch.empty(flat.total, dtype=torch.uint8)
        self._job = _Job(step, flat, plan, specs, self.topo.local_rank == 0, full, pin)
        self._deadline.clear()
        self._queue.put(self._job)
        return True

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Mark a window where the trainer only waits (e.g. a gradient all-reduce): copy now."""
        with self._wake:
            self._idle.set()
            self._wake.notify_all()
        try:
            yield
        finally:
            self._idle.clear()

    def wait(self) -> Optional[int]:
        """Block until the running snapshot is committed (call before optimizer.step()).

        Returns the committed step, or None if no snapshot was running. Raises if the copy failed.
        """
        job = self._job
        if job is None:
            return None
        t0 = time.monotonic()
        with self._wake:
            self._deadline.set()
            self._wake.notify_all()
        if not job.done.wait(self.wait_timeout):
            raise TimeoutError(f"snapshot of step {job.step} not finished after {self.wait_timeout} s")
        self.stats.blocked_seconds += time.monotonic() - t0
        self._job = None
        if job.error is not None:
            raise RuntimeError(f"snapshot of step {job.step} failed: {job.error}") from job.error
        self.stats.taken += 1
        if job.full_copy is not None:
            self._start_flush(job)
        if self._side is not None:
            # Everyone's commit of this step is known at the next begin (see module docstring).
            self._commit_val = torch.tensor([job.step], dtype=torch.int64)
            self._commit_work = dist.all_reduce(self._commit_val, op=dist.ReduceOp.MIN,
                                                group=self._side, async_op=True)
        self._last_committed = job.step
        return job.step

    def fill_in(self, step: int, *, still_valid: Callable[[], bool], timeout: float = 10.0) -> list[str]:
        """After a failure, on a survivor: write into this node's keeper every data part of snapshot
        ``step`` that it lacks, from this rank's own copy of the state, so that a restore of
        ``step`` needs no part from the lost ranks (data-parallel replicas hold the whole state: the
        JIT principle, for the snapshot tier). Only while the snapshot of ``step`` is begun and not
        waited for, and while the state is as it was then: ``still_valid()`` (no optimizer step
        since) is checked after the copy, before the commit. The local rank ``l`` writes the parts
        ``x*.{l}``. Returns the keys written ([] when the snapshot of ``step`` is not the running
        one, did not commit here, or the state changed)."""
        job = self._job
        if job is None or job.step != step:
            return []
        with self._wake:  # no window to wait for: copy now
            self._deadline.set()
            self._wake.notify_all()
        if not job.done.wait(timeout) or job.error is not None:
            return []
        have = {e["key"] for e in self.keeper.listing() if e["step"] == step}
        specs = [job.plan.data_spec(k, self.topo.local_rank) for k in range(job.plan.m)]
        specs = [spec for spec in specs if spec.key not in have]
        if not specs:
            return []
        maps = self.keeper.begin_many([(spec.key, spec.size) for spec in specs], step)
        items = [self._write(job, spec, m) for spec, m in zip(specs, maps)]
        if not still_valid():
            return []
        self.keeper.commit(items)
        return [spec.key for spec in specs]

    def fill_whole(self, step: int, state: Any, *, still_valid: Callable[[], bool]) -> list[str]:
        """After a failure, on a survivor whose snapshot of ``step`` never began (it blocked in the
        snapshot's own collective, waiting for the lost rank): write ``state``, this rank's own view
        of the state at ``step``, as every data part and the metadata of snapshot ``step`` into this
        node's keeper (local rank 0 only: one writer per keeper). Its non-parameter leaves are this
        rank's, not rank 0's as in a snapshot. Nothing when the keeper has any object of ``step``
        already; committed only if ``still_valid()`` after the copy. Returns the keys written."""
        if self.topo.local_rank != 0 or self._job is not None:
            return []
        if any(e["step"] == step for e in self.keeper.listing() if e["key"] == META_KEY or e["key"][0] in "xp"):
            return []
        flat = FlatState(state)
        plan = ProtectionPlan(scheme=self.scheme, num_nodes=self.topo.num_nodes,
                              ranks_per_node=self.topo.ranks_per_node, total_bytes=flat.total)
        specs = [plan.data_spec(k, l) for k in range(plan.m) for l in range(plan.r)]
        blob = meta_blob(step, plan, flat)
        with self._wake:
            self._deadline.set()
            self._wake.notify_all()
        maps = self.keeper.begin_many([(spec.key, spec.size) for spec in specs] + [(META_KEY, len(blob))], step)
        job = _Job(step, flat, plan, specs, True, None)  # not pinned: a fallback of its own
        items = [self._write(job, spec, m) for spec, m in zip(specs, maps)]
        maps[-1][:len(blob)] = blob
        h = Checksum()
        h.update(blob)
        items.append({"key": META_KEY, "step": step, "checksum": h.value(), "algo": h.algorithm})
        if not still_valid():
            return []
        self.keeper.commit(items)
        return [it["key"] for it in items]

    def close(self) -> None:
        """Finish the running snapshot and any disk flush, stop the thread, drop the mappings."""
        if self._job is not None:
            self.wait()
        self._queue.put(None)
        self._thread.join(timeout=self.wait_timeout)
        if self._flush_thread is not None:
            self._flush_thread.join(timeout=self.wait_timeout)
        if self._commit_work is not None:
            self._commit_work.wait()
            self._commit_work = None
        self.keeper.close()

    # Internals --------------------------------------------------------------------------------
    def _previous_globally_committed(self) -> bool:
        if self._commit_work is None:
            return True
        self._commit_work.wait()
        self._commit_work = None
        ok = int(self._commit_val.item()) == self._last_committed
        if not ok:
            log.warning("snapshot %s was not committed by every rank; not overwriting it",
                        self._last_committed)
        return ok

    def _gate(self) -> str:
        """Wait for a window this chunk may use; return which one it is."""
        if self._deadline.is_set():
            return "deadline"
        if self._idle.is_set():
            return "idle"
        if not self.idle_only:
            return "compute"
        with self._wake:
            self._wake.wait_for(lambda: self._idle.is_set() or self._deadline.is_set())
        return "deadline" if self._deadline.is_set() else "idle"

    def _run(self) -> None:
        if self.thread_nice:
            # Lower only this thread: the copy yields the CPU to the trainer's compute (REFT's
            # "idle first" on a CPU host); at the deadline the trainer sleeps, so it still runs.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.thread_nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                blob = meta_blob(job.step, job.plan, job.flat) if job.with_meta else None
                # Every buffer of this snapshot in one keeper round trip.
                maps = self.keeper.begin_many([(spec.key, spec.size) for spec in job.specs]
                                              + ([(META_KEY, len(blob))] if blob is not None else []), job.step)
                items = [self._write(job, spec, m) for spec, m in zip(job.specs, maps)]
                if blob is not None:
                    m = maps[-1]
                    m[:len(blob)] = blob
                    h = Checksum()
                    h.update(blob)
                    items.append({"key": META_KEY, "step": job.step, "checksum": h.value(),
                                  "algo": h.algorithm})
                if job.pin:
                    items = [{**it, "pin": True} for it in items]
                if job.full_copy is not None:
                    for off in range(0, job.flat.total, self.chunk):
                        self._gate()
                        job.flat.read_into(off, job.full_copy[off:off + self.chunk])
                self.keeper.commit(items)
            except BaseException as e:  # reported to the trainer by wait()
                job.error = e
            self.stats.copy_seconds += time.monotonic() - t0
            self.stats.copy_cpu_seconds += time.thread_time() - c0
            job.done.set()

    def _write(self, job: _Job, spec: ObjectSpec, m: Any) -> dict:
        dst_all = torch.frombuffer(m, dtype=torch.uint8, count=spec.size)
        h = Checksum(DEFAULT_ALGORITHM)
        (off0, _), rest = spec.sources[0], spec.sources[1:]
        # Parity: each range is hashed too, as read here, so a range decoded from this parity on
        # another node can be checked against this node's replica (they must be equal bytes).
        covers = [Checksum(DEFAULT_ALGORITHM) for _ in spec.sources] if rest else []
        for c in range(0, spec.size, self.chunk):
            n = min(self.chunk, spec.size - c)
            self.stats.chunks[self._gate()] += 1
            dst = dst_all[c:c + n]
            if rest:  # parity: the XOR of several ranges, hashed once complete
                job.flat.read_into(off0 + c, dst)
                covers[0].update(dst.numpy())
                for (off, _), hc in zip(rest, covers[1:]):
                    tmp = self._tmp[:n]
                    job.flat.read_into(off + c, tmp)
                    hc.update(tmp.numpy())
                    xor_into(dst, tmp)
                h.update(dst.numpy())
            else:
                # Streaming stores: the trainer never reads the keeper's copy, so it should not
                # evict the trainer's data from the shared cache.
                h.copy_flat(dst.numpy(), job.flat, off0 + c, bypass_cache=True)
            self.stats.bytes_copied += n
        item = {"key": spec.key, "step": job.step, "checksum": h.value(), "algo": h.algorithm}
        if covers:
            item["covers"] = [hc.value() for hc in covers]
        return item

    def _start_flush(self, job: _Job) -> None:
        skeleton, full, step, topo = job.flat.skeleton, job.full_copy, job.step, self.topo

        def flush() -> None:
            try:
                state = rebuild(skeleton, full.numpy())
                path, _ = write_checkpoint(
                    self.flush_dir, lambda d: torch.save(state, Path(d) / STATE_FILE), kind="snapshot",
                    step=step, rank=topo.rank, world_size=topo.world, gen=self.gen)
                self.stats.flushed.append(step)
                log.info("snapshot of step %d flushed to %s", step, path)
            except Exception:
                log.exception("disk flush of snapshot %d failed (the in-memory copy is unaffected)", step)

        self._flush_thread = threading.Thread(target=flush, name="jitckpt-snapshot-flush", daemon=True)
        self._flush_thread.start()
