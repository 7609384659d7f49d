"""AOR's log mode: a ZeRO-1 partition current at every step for the price of a copy every K.

:class:`PartitionCopier` sends each partition to the rank that protects it only every ``K``-th
step (``C``). In between, :class:`GradientLog` keeps what it takes to redo the peer partition's
optimizer steps ``C .. s-1``: the peer partition's parameters at ``C`` (its *base*, copied from
this rank's own replicated parameters: no traffic) and, every step, the peer partition's
all-reduced gradients and the hyperparameters in force (no traffic either: every rank holds every
gradient after the all-reduce). Both go into this node's keeper, so they outlive the trainers.

Keeper objects (written with :func:`jitckpt.snapshot.aor_store.write_object`, hashed while copied):

* ``aor.b{p}`` of step ``C``: ``{"params": [...]}``, the peer partition's parameters at the start
  of step ``C`` (the same step as the copy ``aor.z{p}`` of ``C``);
* ``aor.g{p}.{t % K}`` of step ``t + 1``: ``{"grads": [...], "hyper": [...]}``, the gradients of
  step ``t``. Keyed by the step they lead to, so discarding the steps newer than a restore's also
  drops the gradients of its own and later steps, which a resumed run logs again.

The keeper keeps two versions per key, so the ring holds the last ``2K`` steps, and the copy and
base of the last two copy steps: enough to replay from the previous copy when the kill landed in
the newest one's writes.

After a failure (:func:`jitckpt.snapshot.aor_store.restore_with_aor` with ``model``), a step
``s`` is restorable when every partition's object of ``s`` survives or can be replayed: a node
holds its copy and base of some ``C <= s`` and the gradients of ``C .. s-1``. The rank that replays
checks the result: the replayed parameters must equal the parameters snapshot of ``s`` bit for bit
(they are replicated), which verifies the base, the log and the replayed optimizer together.
Survivors make their own partition of the failed step available by writing it just in time
(:func:`save_own_partition`), so only the lost node's partitions are replayed.

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
import time
from typing import Any, Optional

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from jitckpt.snapshot.aor import _hyperparameters
from jitckpt.snapshot.keeper_client import KeeperClient

BASE_PREFIX = "aor.b"
GRAD_PREFIX = "aor.g"
LOG_FORMAT = 1


def base_key(owner: int) -> str:
    """Keeper object key of partition ``owner``'s parameters at a copy step."""
    return f"{BASE_PREFIX}{owner}"


def grad_key(owner: int, slot: int) -> str:
    """Keeper object key of ring slot ``slot`` of partition ``owner``'s gradient log."""
    return f"{GRAD_PREFIX}{owner}.{slot}"


def log_header(*, kind: str, owner: int, world: int, step: int) -> dict:
    """The header every log object carries (and a reader expects): what, whose, which step."""
    return {"format": LOG_FORMAT, "kind": kind, "owner": owner, "world": world, "step": step}


class GradientLog:
    """Logs peer ``peer``'s ZeRO-1 partition for replay: its parameters at every ``every``-th step
    (:meth:`begin`, called when :class:`PartitionCopier` begins that step) and its gradients and
    hyperparameters at every step (:meth:`capture`, after the all-reduce, before ``zero.step()``).
    """

    def __init__(self, *, zero: ZeroRedundancyOptimizer, peer: int, every: int,
                 socket_path: Optional[str] = None, wait_timeout: float = 120.0) -> None:
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError(f"GradientLog logs a ZeroRedundancyOptimizer's partition, got {type(zero).__name__}")
        if every < 1 or wait_timeout <= 0:
            raise ValueError(f"need every >= 1 (the copy interval) and wait_timeout > 0, got {every}, "
                             f"{wait_timeout}")
        if not 0 <= peer < zero.world_size or peer == zero.rank:
            raise ValueError(f"peer must be another rank of the ZeRO group (0..{zero.world_size - 1}, "
                             f"not this rank {zero.rank}), got {peer}")
        partition = zero._partition_parameters()[peer]  # the same on every rank; no public accessor
        self.zero, self.peer, self.every, self.wait_timeout = zero, peer, every, wait_timeout
        self.world = zero.world_size
        self.live = [p for g in partition for p in g["params"]]
        if not self.live:
            raise ValueError(f"peer {peer} owns no parameters (more ranks than parameter tensors)")
        self.keeper = KeeperClient(socket_path)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jitckpt-aor-log")
        self._job: Optional[concurrent.futures.Future] = None
        self.writes, self.write_seconds, self.cpu_seconds, self.blocked_seconds = 0, 0.0, 0.0, 0.0

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
            if g is not None and (g.is_sparse or g.shape != p.shape or g.device.type != "cpu"):
                raise ValueError("the AOR log needs dense CPU gradients shaped like their parameters")
        versions = [None if g is None else g._version for g in grads]
        hyper = [_hyperparameters(g) for g in self.zero.param_groups]
        self._job = self._pool.submit(self._write_grads, step, grads, versions, hyper)

    def wait(self) -> None:
        """Block until the queued write is committed (raises its error)."""
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

    def _write(self, key: str, step: int, header: dict, state: Any, check: Any = None) -> None:
        from jitckpt.snapshot.aor_store import write_object  # aor_store imports this module

        t0, c0 = time.perf_counter(), time.thread_time()
        m, size, h = write_object(self.keeper, key=key, step=step, header=header, state=state)
        if check is not None:
            check()
        self.keeper.commit([{"key": key, "step": step, "checksum": h.value(), "algo": h.algorithm}])
        self.writes += 1
        self.write_seconds += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0

    def _write_base(self, step: int) -> None:
        self._write(base_key(self.peer), step, log_header(kind="base", owner=self.peer, world=self.world, step=step),
                    {"params": [p.detach() for p in self.live]})

    def _write_grads(self, step: int, grads: list, versions: list, hyper: list) -> None:
        def unchanged() -> None:
            if any(g is not None and g._version != v for g, v in zip(grads, versions)):
                raise RuntimeError(f"a gradient of peer {self.peer}'s partition changed while step {step} was "
                                   "logged (zero_grad(set_to_none=False), or a gradient view rewritten by the "
                                   "next backward): the entry is not committed; use zero_grad(set_to_none=True)")

        self._write(grad_key(self.peer, step % self.every), step + 1,
                    log_header(kind="grads", owner=self.peer, world=self.world, step=step),
                    {"grads": [None if g is None else g.detach() for g in grads], "hyper": hyper}, unchanged)


def save_own_partition(zero: ZeroRedundancyOptimizer, *, step: int, socket_path: Optional[str] = None) -> None:
    """Write this rank's own partition, as it is at the start of ``step`` (call it between optimizer
    steps), into its node's keeper as ``aor.z{rank}`` of ``step``: a survivor's just-in-time save
    after a failure, so that a restore to ``step`` replays only the lost ranks' partitions."""
    from jitckpt.snapshot.aor_store import write_partition

    keeper = KeeperClient(socket_path)
    try:
        if any(e["key"] == f"aor.z{zero.rank}" and e["step"] == step for e in keeper.listing()):
            return  # a copy step: the copier wrote it already
        _, _, h = write_partition(keeper, owner=zero.rank, world=zero.world_size, step=step, zero=zero,
                                  state=zero.optim.state_dict())
        keeper.commit([{"key": f"aor.z{zero.rank}", "step": step, "checksum": h.value(), "algo": h.algorithm}])
    finally:
        keeper.close()


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
