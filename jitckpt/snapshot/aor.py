"""Asynchronous Optimizer Recomputing (AOR, REFT section 4.2) for ZeRO-1 data parallelism.

With ``torch.distributed.optim.ZeroRedundancyOptimizer`` every rank's optimizer holds the state of
its own partition of the parameters only, so that state has no copy anywhere: a lost node loses
it although the parameters survive on every replica. The gradients, however, are all-reduced, so
every rank holds bit-identical gradients for *every* partition. :class:`OptimizerReplica` uses
them to keep, in host memory, a replica of one peer's partition state: after each step it applies
the same ``torch.optim`` rule (same class, same hyperparameters, same implementation path) to a
shadow copy of the peer partition's parameters. No bytes cross nodes while training; a lost
node's partition comes back from the replica (see :mod:`jitckpt.snapshot.aor_store`).

Race rule (why gradients are copied): the recompute runs on a worker thread while training goes
on, and the next backward overwrites (or ``zero_grad`` frees) the gradients. :meth:`capture`
therefore copies the peer partition's gradients (1/N of the model) into a staging buffer on the
trainer's thread, then queues the update; the worker owns the staging buffer until the update is
done, and the next ``capture`` waits for that (it normally had a whole forward/backward to finish).
The replica never touches the live parameters, so it cannot race ``optimizer.step()``.
"""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import _default_to_fused_or_foreach

T = TypeVar("T")

# Optimizers whose step is a pure function of (parameters, gradients, state, hyperparameters), so
# recomputing it elsewhere gives the same bits. Exact classes only: a subclass may override step().
SUPPORTED_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
)


def successor_peer(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank whose partition ``rank`` protects: same local rank on the next node (as ARC does)."""
    if ranks_per_node < 1 or world % ranks_per_node or world // ranks_per_node < 2:
        raise ValueError(f"AOR needs >= 2 nodes of ranks_per_node={ranks_per_node} consecutive ranks; "
                         f"world size {world} does not give that")
    return (rank + ranks_per_node) % world


@dataclass
class ReplicaStats:
    """Where the replica's time goes (seconds); the first two are on the trainer's thread."""

    updates: int = 0
    copy_seconds: float = 0.0      # gradient copies in capture()
    blocked_seconds: float = 0.0   # waiting for the worker (capture, state_dict, ...)
    update_seconds: float = 0.0    # recomputed optimizer steps, on the worker
    update_cpu_seconds: float = 0.0  # the CPU time of those (what they take from training on busy cores)


def _hyperparameters(group: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}


class OptimizerReplica:
    """A float-exact replica of peer ``peer``'s ZeRO-1 optimizer partition, recomputed on a worker.

    Call :meth:`capture` once per training step after the gradients are all-reduced and before
    ``zero.step()``. ``start_step`` is the number of optimizer steps already taken (the restored
    step after a restart); :meth:`load_state_dict` then installs the peer's restored state.
    Refuses configurations whose recompute could differ from the peer's real step.
    """

    def __init__(self, *, zero: ZeroRedundancyOptimizer, peer: int, start_step: int = 0,
                 wait_timeout: float = 120.0) -> None:
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError(f"AOR protects a torch.distributed.optim.ZeroRedundancyOptimizer, got "
                            f"{type(zero).__name__} (a plain optimizer's state is replicated: use "
                            "SnapshotTaker's arc/aec protection)")
        if getattr(zero, "_overlap_with_ddp", False):
            raise ValueError("AOR does not support ZeroRedundancyOptimizer(overlap_with_ddp=True): its "
                             "step runs inside DDP's communication hook; use overlap_with_ddp=False")
        cls = type(zero.optim)
        if cls not in SUPPORTED_OPTIMIZERS:
            raise ValueError(f"AOR cannot recompute optimizer {cls.__module__}.{cls.__qualname__}: only "
                             f"{', '.join(c.__name__ for c in SUPPORTED_OPTIMIZERS)} (exact classes) are "
                             "known to be pure functions of parameters, gradients and state")
        if not 0 <= peer < zero.world_size or peer == zero.rank:
            raise ValueError(f"peer must be another rank of the ZeRO group (0..{zero.world_size - 1}, "
                             f"not this rank {zero.rank}), got {peer}")
        if start_step < 0 or wait_timeout <= 0:
            raise ValueError(f"need start_step >= 0 and wait_timeout > 0, got {start_step}, {wait_timeout}")
        # ZeRO's partition is computed identically on every rank; there is no public accessor.
        partition = zero._partition_parameters()[peer]
        if len(partition) != len(zero.param_groups):
            raise ValueError(f"peer {peer}'s partition has {len(partition)} parameter groups, the "
                             f"optimizer {len(zero.param_groups)}: cannot map them")
        self.zero, self.peer, self.wait_timeout, self.step = zero, peer, wait_timeout, start_step
        self.live: list[list[torch.Tensor]] = [list(g["params"]) for g in partition]
        flat_live = [p for ps in self.live for p in ps]
        if not flat_live:
            raise ValueError(f"peer {peer} owns no parameters (more ranks than parameter tensors)")
        for p in flat_live:
            if p.device.type != "cpu" or p.is_sparse:
                raise ValueError(f"AOR recomputes on the host; parameter on {p.device} "
                                 f"{'(sparse) ' if p.is_sparse else ''}would not be bit-identical "
                                 "(only dense CPU parameters are supported)")
        # Pin the implementation the peer's optimizer resolves for these parameters (foreach vs
        # for-loop round differently); the shadow tensors' type must not change the choice.
        self._pinned: list[dict] = []
        for g in partition:
            pin = {}
            if g.get("foreach") is None and not g.get("fused"):
                _, foreach = _default_to_fused_or_foreach(list(g["params"]), bool(g.get("differentiable")),
                                                          use_fused=False)
                pin["foreach"] = foreach
            self._pinned.append(pin)
        self.shadow = [[p.detach().clone() for p in ps] for ps in self.live]
        self.staging = [[torch.empty_like(p) for p in ps] for ps in self.live]
        self._opt = cls([{**_hyperparameters(g), **pin, "params": sh}
                         for g, pin, sh in zip(partition, self._pinned, self.shadow)])
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jitckpt-aor")
        self._pending: Optional[concurrent.futures.Future] = None  # the last update
        self._last: Optional[concurrent.futures.Future] = None     # the last job of any kind
        self.stats = ReplicaStats()

    # Trainer-facing API ------------------------------------------------------------------------
    def capture(self) -> None:
        """Copy the peer partition's (all-reduced) gradients and queue its optimizer update."""
        self._settle()
        if len(self.zero.param_groups) != len(self.live):
            raise ValueError("the optimizer's parameter groups changed since the AOR replica was built "
                             "(add_param_group); build a new OptimizerReplica")
        t0 = time.perf_counter()
        has_grad = []
        for ps, stage in zip(self.live, self.staging):
            for p, buf in zip(ps, stage):
                g = p.grad
                if g is not None and (g.is_sparse or g.shape != p.shape):
                    raise ValueError("AOR needs dense gradients shaped like their parameters")
                if g is not None:
                    buf.copy_(g)
                has_grad.append(g is not None)
        hyper = [_hyperparameters(g) for g in self.zero.param_groups]
        self.stats.copy_seconds += time.perf_counter() - t0
        self._pending = self._last = self._pool.submit(self._update, hyper, has_grad)
        self.step += 1

    def after_updates(self, fn: Callable[[dict], T]) -> "concurrent.futures.Future[T]":
        """Run ``fn(replica_state_dict)`` on the worker once every update queued so far is applied
        (the state is the peer's at the start of step :attr:`step`; ``fn`` must copy what it keeps).
        The next :meth:`capture` waits for it, so it may also read this rank's own optimizer state."""
        self._last = self._pool.submit(lambda: fn(self._opt.state_dict()))
        return self._last

    def state_dict(self) -> dict:
        """The replica's state (the peer's local ``zero.optim.state_dict()``), after pending updates."""
        self._settle()
        return self._opt.state_dict()

    def load_state_dict(self, state: dict, *, params: Optional[list[torch.Tensor]] = None) -> None:
        """Install the peer's state after a restore (call once the model parameters are restored:
        the shadow parameters are re-copied from the live ones, or from ``params``, the peer
        partition's parameters in order, when the state is of an older step than the live ones)."""
        self._settle()
        shadows = [s for ss in self.shadow for s in ss]
        src = [p for ps in self.live for p in ps] if params is None else list(params)
        if len(src) != len(shadows) or any(a.shape != b.shape for a, b in zip(shadows, src)):
            raise ValueError(f"{len(src)} parameters given for peer {self.peer}'s partition of "
                             f"{len(shadows)} (or their shapes differ)")
        with torch.no_grad():
            for sh, p in zip(shadows, src):
                sh.copy_(p)
        self._opt.load_state_dict(state)

    def replay(self, grads: list[Optional[torch.Tensor]], hyper: list[dict]) -> None:
        """Apply one logged step now, on this thread: the peer partition's gradients in order (None
        where a parameter had none) and the hyperparameters of each group at that step."""
        self._settle()
        stage = [b for bs in self.staging for b in bs]
        if len(grads) != len(stage) or len(hyper) != len(self.staging):
            raise ValueError(f"a logged step of {len(grads)} gradients and {len(hyper)} groups does not "
                             f"fit peer {self.peer}'s partition of {len(stage)} and {len(self.staging)}")
        for buf, g in zip(stage, grads):
            if g is not None:
                buf.copy_(g)
        self._update(hyper, [g is not None for g in grads])
        self.step += 1

    def matches_live_parameters(self) -> bool:
        """Whether the shadow parameters equal the live ones bit for bit (call after ``zero.step()``:
        the recompute reproduced the peer's parameter update too)."""
        self._settle()
        return all(torch.equal(sh, p) for ss, ps in zip(self.shadow, self.live) for sh, p in zip(ss, ps))

    def close(self) -> None:
        """Finish pending work and stop the worker."""
        try:
            self._settle()
        finally:
            self._pool.shutdown(wait=True)

    # Internals --------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Wait for every queued job; raise an update's error (other jobs' owners report theirs)."""
        pending, last, self._pending, self._last = self._pending, self._last, None, None
        if last is not None:
            t0 = time.perf_counter()
            done, _ = concurrent.futures.wait([last], timeout=self.wait_timeout)
            self.stats.blocked_seconds += time.perf_counter() - t0
            if not done:
                raise TimeoutError(f"AOR replica worker still busy after {self.wait_timeout} s")
        if pending is not None:
            pending.result()

    def _update(self, hyper: list[dict], has_grad: list[bool]) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        flags = iter(has_grad)
        for group, h, pin, shadows, stage in zip(self._opt.param_groups, hyper, self._pinned,
                                                 self.shadow, self.staging):
            group.update(h)  # what ZeRO's _sync_param_groups does before the peer's local step
            group.update(pin)
            for sh, buf in zip(shadows, stage):
                sh.grad = buf if next(flags) else None
        self._opt.step()
        self.stats.updates += 1
        self.stats.update_seconds += time.perf_counter() - t0
        self.stats.update_cpu_seconds += time.thread_time() - c0
