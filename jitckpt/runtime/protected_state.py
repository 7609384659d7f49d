"""``jitckpt.protect``: a correct save/restore for plain torch training objects in two lines."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from jitckpt.checkpoint_store import CheckpointError, read_meta
from jitckpt.runtime.current import get_runtime, runtime_or_none
from jitckpt.runtime.step_closure import begin_after_closure
from jitckpt.runtime.ddp_buffers import rng_state, set_rng_state
from jitckpt.runtime.sharded_layout import dtensor_layout
from jitckpt.runtime.sharded_state import ShardedState, UnmappableLayout, newest_set, own_copy

log = logging.getLogger("jitckpt.protect")

STATE_FILE = "state.pt"
SHARDED_STATE_FILE = "sharded-state.pt"  # a DTensor job's non-tensor state; its tensors are DCP shards
STATE_KEYS = ("step", "model", "optimizer", "scheduler", "rng", "extra")


class UnloadableCheckpoint(CheckpointError):
    """A checkpoint whose files verify but whose content is not a loadable protect() state."""


def _load_error(e: BaseException) -> str:
    """Why torch.load refused a file, in one line (its weights_only text is mostly boilerplate)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        detail = [ln for ln in lines[1:] if "GLOBAL" in ln or "Unsupported" in ln or "error:" in ln]
        return ("refused by torch.load(weights_only=True), not unpickled: "
                + (" ".join(detail) or lines[-1]))
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def read_state(path: str) -> dict:
    """The state saved by :meth:`Protected.save` in checkpoint directory ``path``, unapplied.

    Raises FileNotFoundError if it holds no ``state.pt`` (not written by protect()), OSError if it
    cannot be read, and :class:`UnloadableCheckpoint` if the file is not a complete protect()
    state: garbage with a valid checksum, a pickle that weights_only refuses, missing keys.
    """
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} not found: this checkpoint was not written by jitckpt.protect(); load it with "
            "your own function")
    try:
        sd = torch.load(file, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure is the file's content
        raise UnloadableCheckpoint(_load_error(e)) from e
    if not isinstance(sd, dict):
        raise UnloadableCheckpoint(f"{STATE_FILE} holds a {type(sd).__name__}, not a jitckpt.protect() state")
    missing = [k for k in STATE_KEYS if k not in sd]
    if missing:
        raise UnloadableCheckpoint(f"{STATE_FILE} has no {', '.join(missing)} (not a complete "
                                   "jitckpt.protect() state)")
    return sd


def is_zero(optimizer: Any) -> bool:
    # By name: importing torch.distributed.optim for an isinstance check costs every job its
    # import (and torch.jit deprecation warnings); subclasses are caught through the MRO.
    return any(c.__name__ == "ZeroRedundancyOptimizer" and c.__module__.startswith("torch.distributed")
               for c in type(optimizer).__mro__)


ZERO_NEEDS_SNAPSHOTS = (
    "protect(optimizer=ZeroRedundancyOptimizer) needs jitckpt run --snapshot-every N on >= 2 nodes. "
    "With ZeRO each rank holds the only copy of its optimizer partition and ZeRO's state_dict() is a "
    "collective, so the survivors of a failure cannot JIT-save a lost rank's partition; with "
    "in-memory snapshots each node also keeps a replica of the next node's partitions (AOR, "
    "docs/aor.md) and a lost node's come back from there. Alternatives: a plain torch.optim "
    "optimizer with DDP, or jitckpt.init(save_fn) with your own per-rank save plus --periodic-every")

DTENSOR_NOT_YET = (
    "jitckpt.protect(): this model's state is DTensor-sharded or -replicated over a DeviceMesh "
    "({layout}) in a way jitckpt cannot save: {why}. The job trains as under torchrun, and a failure "
    "restarts it from step 0. To lose fewer steps, save your own torch.distributed.checkpoint every N "
    "steps and resume from it")


def incomplete_sets(root: Path) -> str:
    """Why the checkpoints under ``root`` make no complete set ("" if there are none)."""
    from jitckpt.checkpoint_store import list_candidates, read_meta

    steps: dict = {}
    for c in list_candidates(root):
        try:
            meta = read_meta(c.path)
        except CheckpointError:
            continue
        steps.setdefault(c.step, (meta.num_shards, set()))[1].add(meta.shard_id)
    if not steps:
        return ""
    step = max(steps)
    n, have = steps[step]
    lost = sorted(set(range(n)) - have)
    return (f"the newest, of step {step}, holds {len(have)} of its {n} shards; no copy of shard(s) {lost} "
            "survived (each was on a lost rank only: this layout has no replica of it)")


class Protected:
    """Model, optimizer, optional scheduler and extra state, saved and restored consistently.

    ``step`` counts completed ``optimizer.step()`` calls; a resumed job continues with minibatch
    ``step`` (0-based), i.e. ``for step in range(state.restore(), total_steps)``. A checkpoint taken
    in the middle of minibatch *i* (failure before or during the gradient all-reduce) records the
    state at the *start* of minibatch *i*: parameters and optimizer state are untouched until
    ``optimizer.step()``, and RNG states are taken from a snapshot made when minibatch *i*'s first
    forward began. A failure after the all-reduce (during another rank's optimizer step) lets the
    healthy ranks finish step *i*; they save at the start of minibatch *i+1*.

    Model buffers (BatchNorm statistics) are saved as DDP treats them: with its default
    ``broadcast_buffers`` every rank's forward *i* starts from rank 0's buffers after its forward
    *i-1*; each rank receives those right after every forward
    (:class:`~jitckpt.runtime.ddp_buffers.BufferTracker`), so any survivor saves them, also when rank 0 is lost. With ``broadcast_buffers=False`` or without DDP
    buffers are per-rank state, and the resumed job has the loaded replica's (bitwise for rank
    0's copy only). ``extra`` holds objects with ``state_dict``/``load_state_dict`` (GradScaler,
    a sampler) or plain tensors/numbers/strings, saved under their keys.

    ``snapshots`` is the in-memory tier (:class:`~jitckpt.snapshot.tier.SnapshotTier`) when the job
    runs with ``--snapshot-every``. A ``ZeroRedundancyOptimizer`` needs it: its partitions are
    snapshotted through AOR (each rank also recomputes its successor node's partition) and restored
    from the keepers; its disk checkpoints are per-rank shards (the parameters and the rank's
    partition), taken at a preemption and with ``--periodic-every``, never after a failure.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, *, extra: Optional[dict] = None,
                 snapshots: Any = None, dataloader: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"protect(model=...): expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"protect(optimizer=...): expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._zero = is_zero(optimizer)
        if self._zero and (snapshots is None or snapshots.peer() is None):
            raise TypeError(ZERO_NEEDS_SNAPSHOTS)
        if self._zero and optimizer.world_size != torch.distributed.get_world_size():
            raise TypeError(f"protect(optimizer=ZeroRedundancyOptimizer): its process group has "
                            f"{optimizer.world_size} ranks, the job {torch.distributed.get_world_size()}; "
                            "AOR protects a ZeRO group spanning the whole job only (no hybrid parallelism)")
        if scheduler is not None and not hasattr(scheduler, "state_dict"):
            raise TypeError("protect(scheduler=...): the scheduler needs state_dict()/load_state_dict()")
        stateful = hasattr(dataloader, "state_dict") and hasattr(dataloader, "load_state_dict")
        if dataloader is not None and not stateful and not isinstance(dataloader, torch.utils.data.DataLoader):
            raise TypeError(f"protect(dataloader=...): a {type(dataloader).__name__} is no torch DataLoader and has "
                            "no state_dict()/load_state_dict(), so its position cannot be saved; use torchdata's "
                            "StatefulDataLoader (a drop-in DataLoader), or choose each step's data by step")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.dataloader = dataloader
        # A plain DataLoader: its epoch's start is recorded, and a resume reads past the batches done.
        self._fast_forward: Any = None
        # What a resume at each step loads, taken once the previous optimizer step is done (its
        # batches are all drawn, the next minibatch's not yet): the loader's state (None: the next
        # iter() starts an epoch afresh) and the RNG the loop goes on from, which the loader's
        # iter() draws from at an epoch's start. The minibatch's own RNG is restored at its forward.
        self._loader_states: dict[int, tuple[Any, dict]] = {0: (None, rng_state())} if dataloader is not None else {}
        self._forward_rng: Optional[dict] = None  # a resume's, until the first forward
        layout = dtensor_layout(model)
        # DTensor state: saved as DCP shards, one copy of each shard a complete checkpoint.
        self.sharded: Optional[ShardedState] = None
        # Not saved, snapshotted or restored: a failure restarts the job from step 0 (see protect()).
        self.unsupported: Optional[str] = None
        # The in-memory tier of a DTensor job: each rank's own shard in its node's keeper.
        self._shard_snaps: Any = None  # jitckpt.snapshot.shard_snapshots.ShardSnapshots
        self._snapshot_owed = False  # the shard snapshot of self.step is due once the scheduler steps
        self._agreement_owed: Optional[int] = None  # its step, agreed on at the next minibatch's start
        if layout is not None:
            try:
                self.sharded = ShardedState(model, optimizer, world_size=torch.distributed.get_world_size())
            except UnmappableLayout as e:
                self.unsupported = DTENSOR_NOT_YET.format(layout=layout, why=str(e).removeprefix("jitckpt.protect(): "))
            if self.sharded is not None and snapshots is not None:
                from jitckpt.snapshot.shard_snapshots import ShardSnapshots

                pos = self.sharded.position
                self._shard_snaps = ShardSnapshots(
                    socket_path=snapshots.socket_path, every=snapshots.every,
                    ranks_per_node=snapshots.ranks_per_node, shard_id=pos.shard_id,
                    num_shards=pos.num_shards, replica_id=pos.replica_id, mesh=pos.mesh,
                    protection=snapshots.protection)
            snapshots = None  # the replicated tier (SnapshotTaker) holds whole replicas only
        if dataloader is not None and (self.sharded is not None or self._zero or snapshots is not None):
            raise TypeError("protect(dataloader=...): not yet with DTensor-sharded models, a ZeroRedundancyOptimizer "
                            "or jitckpt run --snapshot-every; drop dataloader= and choose each step's data by step")
        if dataloader is not None and not stateful:
            from jitckpt.runtime.loader_fast_forward import FastForward

            self._fast_forward = FastForward(dataloader, lambda: self.step)
        # With dataloader=, each rank's own resume state (its loader's position, the RNG its loop goes
        # on from), posted to the node's rank-state board once each step is done: the rank that
        # saves writes every rank's, and each resumes with its own (a script seeding by rank).
        self._rank_states: Any = None
        if dataloader is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            from jitckpt.integrations.rank_rngs import RankRngs

            states = RankRngs.of_job(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size())
            self._rank_states = states if states.board is not None else None
        self.extra = dict(extra or {})
        self.step = 0
        if self._rank_states is not None:
            self._rank_states.started(0, self._own_resume(None))
        self._mid_minibatch = False
        self._rng_snapshot: Optional[dict] = None
        # Called as f(step, rng) when a minibatch starts (its first forward): per-rank state boards.
        self.on_minibatch: list[Callable[[int, dict], None]] = []
        self._buffer_snapshot: Optional[dict] = None
        # Buffers copied at each minibatch's start, for a save of it (none for an unsaved layout).
        self._has_buffers = self.unsupported is None and any(True for _ in model.buffers())
        self._stepped = False          # optimizer.step() ran since this minibatch's forward
        self._in_step = False          # optimizer.step() began and has not returned
        self._undo: Any = None         # jitckpt.swift.UpdateUndo under --plugin undo
        self._sched_epoch: Any = None  # scheduler.last_epoch when this minibatch's forward began
        self._ddp_layout: Optional[dict] = None  # the layout this minibatch runs on (snapshots on)
        self._layout_settled = False
        self._snapshots: Any = snapshots     # SnapshotTier (jitckpt run --snapshot-every)
        self._replica: Any = None            # ZeRO: OptimizerReplica of the successor's partition
        self._aor: Any = None                # ZeRO: AorSnapshotter writing both partitions
        self._grad_log: Any = None           # ZeRO, --snapshot-zero log: GradientLog of the successor
        self._peer_state: Optional[dict] = None  # ZeRO: the successor's partition, restored
        self._resumed_step: Optional[int] = None
        self._reserve_asked = False    # for the runtime's JIT save reserve, after the first step
        self.forward_hook = model.register_forward_pre_hook(self._on_forward)
        self._handles = [
            self.forward_hook,
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._on_step_done),
        ]
        if self._shard_snaps is not None and scheduler is not None:
            # The state at the start of the next minibatch is complete once the scheduler stepped.
            from jitckpt.runtime.scheduler_hook import after_step

            try:
                self._handles.append(SimpleNamespace(remove=after_step(scheduler, self._after_scheduler_step)))
            except TypeError:
                pass  # no weak reference to it: the snapshot is taken at the next forward instead
        from jitckpt.runtime import compile_guard

        compile_guard.watch(self)  # under torch.compile the hook still runs at every step

    @property
    def uses_aor(self) -> bool:
        """True for a ZeroRedundancyOptimizer: partitions protected by AOR, no disk checkpoints."""
        return self._zero

    # Hooks -------------------------------------------------------------------------------------
    def _on_forward(self, module: Any, args: Any) -> None:
        if self._mid_minibatch:
            return  # gradient accumulation or a second forward: the snapshot is already taken
        if self._snapshot_owed:  # a scheduler not stepped every minibatch
            self._take_shard_snapshot()
        if self._agreement_owed is not None:
            self._agree_on_shard_snapshot()
        rt = runtime_or_none()
        if rt is not None:
            rt.mark_step(self.step)  # a safe point: may save (failure) or checkpoint (periodic)
        self._stepped = False
        self._sched_epoch = getattr(self.scheduler, "last_epoch", None)
        if self._forward_rng is not None:  # a resume with dataloader=: the minibatch's RNG, now
            set_rng_state(self._forward_rng)
            self._forward_rng = None
        self._rng_snapshot = rng_state()
        for listener in self.on_minibatch:
            listener(self.step, self._rng_snapshot)
        if self._has_buffers:
            self._buffer_snapshot = self._shared_next() or {
                k: b.detach().clone() for k, b in self.model.named_buffers()}
        self._mid_minibatch = True
        if self._snapshots is not None and rt is not None:
            self._settle_ddp_layout()
            # The state at the start of this minibatch; copied while forward/backward run.
            rt.run_snapshot_op(self._snapshot_begin, blocking=True)

    def _begin_minibatch(self) -> None:
        """Minibatch ``self.step`` starts here, before the loop copies its batch to the device: the
        runtime's minibatch mark for libjit.so (proxy mode's replay journal), which the forward
        pre-hook would give only after those copies (see WorkerRuntime.begin_minibatch)."""
        rt = runtime_or_none()
        if rt is not None:
            rt.begin_minibatch(self.step)

    def _shared_next(self) -> Optional[dict]:
        """Rank 0's buffers after the last training forward, named as in ``model.state_dict()``
        (shared by the runtime's :class:`~jitckpt.runtime.ddp_buffers.BufferTracker`; None: not shared)."""
        rt = runtime_or_none()
        shared = rt.ddp_buffers.next_of(self.model) if rt is not None else None
        return None if shared is None else {f"module.{k}": v for k, v in shared.items()}

    def _settle_ddp_layout(self) -> None:
        """Make ``_ddp_layout`` the bucket layout this minibatch runs on, before it is snapshotted.

        The runtime's :class:`~jitckpt.runtime.ddp_layout.LayoutTracker` has it: DDP's one-time rebuild
        is done right after the first backward. Should it still be pending (a backward the
        runtime did not see), it is done now, as DDP's own forward would (every rank reaches this
        hook at the same point, and DDP's own call is then a no-op).
        """
        reducer = getattr(self.model, "reducer", None)
        rt = runtime_or_none()
        if reducer is None or rt is None or not torch.is_grad_enabled():
            return
        layouts = rt.ddp_layouts
        if reducer._rebuild_buckets():
            layouts.rebuilt(self.model)
        elif layouts.layout_of(self.model) is None:
            layouts.forward_began(self.model)
        self._ddp_layout = layouts.layout_of(self.model)
        self._layout_settled = self._ddp_layout is not None

    def _snapshot_begin(self) -> None:
        self._snapshots.start(self._snapshot_state, resumed_step=self._resumed_step)
        if self._zero and self._aor is None:
            self._start_aor()
        copy = self._aor is not None and self._copy_due()
        # Log mode: a copy step's parameters are pinned in the keepers, so a failure no partition of
        # a newer step survives (one inside an optimizer step) falls back to the last copy.
        if self._snapshots.begin(self.step, pin=copy and self._grad_log is not None) and copy:
            self._aor.begin(self.step)  # the partitions of the same step, on the replica's worker
            if self._grad_log is not None:
                self._grad_log.begin(self.step)  # the successor partition's parameters: the replay's base

    def _copy_due(self) -> bool:
        """Log mode copies the partitions every ``zero_copy_every`` steps, and at the first snapshot
        after a resume (the new nodes then hold a copy and base too; the resumed step's own objects
        exist already); the other modes at every snapshot."""
        if self._grad_log is None:
            return True
        first = self._resumed_step is not None and self.step == self._resumed_step + 1
        return self.step % self._snapshots.zero_copy_every == 0 or first

    def _start_aor(self) -> None:
        """ZeRO: the replica of the successor's partition (from the restored state if any), or
        with ``--snapshot-zero copy`` the exchange of partitions at each snapshot."""
        from jitckpt.snapshot.aor import OptimizerReplica
        from jitckpt.snapshot.aor_store import AorSnapshotter, PartitionCopier

        if self._snapshots.zero in ("copy", "log"):
            self._peer_state = None  # no replica to load it into: the peer sends its own
            self._aor = PartitionCopier(zero=self.optimizer, ranks_per_node=self._snapshots.ranks_per_node,
                                        socket_path=self._snapshots.socket_path)
            if self._snapshots.zero == "log":
                from jitckpt.snapshot.aor_log import GradientLog

                self._grad_log = GradientLog(zero=self.optimizer, peer=self._snapshots.peer(),
                                             every=self._snapshots.zero_copy_every, start_step=self.step,
                                             socket_path=self._snapshots.socket_path)
            return
        self._replica = OptimizerReplica(zero=self.optimizer, peer=self._snapshots.peer(),
                                         start_step=self.step)
        if self._peer_state is not None:
            self._replica.load_state_dict(self._peer_state)  # after the parameters were loaded
            self._peer_state = None
        self._aor = AorSnapshotter(replica=self._replica, socket_path=self._snapshots.socket_path)

    def _settle_snapshots(self) -> None:
        """Before optimizer.step(): the snapshot of this minibatch is written (partitions first:
        the taker's every-rank-committed check then covers them) and, with ZeRO, the replica has
        the gradients of this step."""
        if self._aor is not None:
            self._aor.wait()
        self._snapshots.wait()
        if self._replica is not None:
            self._replica.capture()
        if self._grad_log is not None:
            self._grad_log.capture(self.step)

    def _snapshot_state(self, *, uniform: bool = True) -> dict:
        sd = self.state_dict()
        # Everything but parameters and optimizer state (RNG, buffers, scheduler, extra) may differ
        # between ranks; ARC/AEC need one replica's bytes on every rank (jitckpt.snapshot.uniform).
        params = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        keys = [k for k in sd if k not in ("model", "optimizer")]
        buffers = {k: v for k, v in sd["model"].items() if k not in params}
        parts = [buffers, *(sd[k] for k in keys)]
        # uniform=False: a survivor's own view, after a failure (the collective would wait for the lost rank)
        shared_buffers, *rest = self._snapshots.uniform(parts) if uniform else parts
        sd["model"].update(shared_buffers)  # a fresh dict: the model's own is not touched
        sd.update(zip(keys, rest))
        if self._ddp_layout is not None and self._layout_settled:  # the one this minibatch uses
            from jitckpt.snapshot.tier import LAYOUT_KEY

            sd[LAYOUT_KEY] = json.dumps(self._ddp_layout)
        return sd

    def enable_undo(self) -> None:
        """``jitckpt run --plugin undo``: make a torn state recoverable by SWIFT update-undo.

        Raises :class:`jitckpt.swift.NotInvertibleError` (naming the fix) for an optimizer or
        configuration that has no exact inverse; the hooks it installs run after this object's."""
        if self._zero:
            raise TypeError("--plugin undo: a ZeroRedundancyOptimizer step is not undone (its partitions "
                            "are protected by AOR snapshots); drop --plugin undo")
        from jitckpt.swift import NotInvertibleError, UpdateUndo

        try:
            self._undo = UpdateUndo(self.optimizer, self.scheduler)
        except NotInvertibleError as e:
            raise NotInvertibleError(f"jitckpt run --plugin undo: {e} (or drop --plugin undo)") from None

    def torn(self) -> bool:
        """True inside ``optimizer.step()`` and between it and the scheduler's step."""
        return self._in_step or not self.consistent_now()

    def roll_back(self) -> int:
        """Undo the torn step (``enable_undo`` first): the state is again the one at the start of
        this minibatch, as if the failure had come before ``optimizer.step()``. Returns the number
        of parameters undone; raises :class:`jitckpt.swift.UndoError` if the step's gradients are
        gone (``zero_grad()`` ran after the step), leaving the state untouched."""
        if self._undo is None:
            raise RuntimeError("roll_back() needs enable_undo() (jitckpt run --plugin undo)")
        undone = self._undo.undo_last_step()
        if not self._in_step:  # the step had completed and been counted
            self.step -= 1
        self._in_step = self._stepped = False
        self._mid_minibatch = True  # RNG and buffers are saved from the minibatch's start again
        return undone

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
        return begin_after_closure(args, kwargs, self._enter_step)

    def _enter_step(self) -> None:
        self._in_step = True
        # The snapshot reads parameters and optimizer state: done before they change.
        if self._snapshots is not None and self._snapshots.taker is not None:
            rt = runtime_or_none()
            if rt is not None:
                rt.run_snapshot_op(self._settle_snapshots, blocking=False)
            else:
                self._settle_snapshots()

    def _on_step_done(self, *args: Any, **kwargs: Any) -> None:
        self._in_step = False
        self.step += 1
        if self.dataloader is not None:
            self._loader_states = {self.step: (self._loader_position(), rng_state())}
            if self._rank_states is not None:
                self._rank_states.started(self.step, self._own_resume(None))
        self._mid_minibatch = False
        self._stepped = True
        if self._shard_snaps is not None and self._shard_snaps.due(self.step):
            self._snapshot_owed = True
            rt = runtime_or_none()
            if rt is not None:
                rt.minibatch_open = True  # until the snapshot's agreement
            if self.scheduler is None:
                self._take_shard_snapshot()
        self._begin_minibatch()  # the next one's input copies come next, before its forward
        if not self._reserve_asked:  # the optimizer state exists now: the state's size is known
            self._reserve_asked = True
            rt = runtime_or_none()
            if rt is not None and rt.save_fn == self.save and self.sharded is None:
                rt.save_reserve.prepare(self._state_bytes() + (1 << 20))  # + the pickle and RNG

    def _after_scheduler_step(self) -> None:
        if self._snapshot_owed:
            self._take_shard_snapshot()

    def _take_shard_snapshot(self) -> None:
        """A DTensor job's in-memory snapshot: this rank's shard at the start of minibatch
        ``self.step``, written into its node's keeper once the previous minibatch's scheduler step
        is done. The minibatch it starts begins only when every rank has (the agreement, begun
        now, waited for at its first forward: see :mod:`jitckpt.snapshot.shard_snapshots`). Its
        failure is the job's (keeper gone)."""
        self._snapshot_owed = False
        assert self._shard_snaps is not None and self.sharded is not None
        step = self.step

        def take() -> None:
            state = self.sharded.local_state()
            state.update(step=step, rng=rng_state(), extra=self._extra_state(),
                         scheduler=self.scheduler.state_dict() if self.scheduler is not None else None)
            self._shard_snaps.take(step, state)
            self._shard_snaps.agree_begin(step)

        rt = runtime_or_none()
        if rt is not None:
            # With copies or parity across nodes the write waits on the peers: a region (hang detection).
            rt.run_snapshot_op(take, blocking=self._shard_snaps.waits_on_peers)
        else:
            take()
        self._agreement_owed = step

    def _agree_on_shard_snapshot(self) -> None:
        """At the first forward of minibatch ``step``, before it begins: wait until every rank has
        committed its shard snapshot of ``step`` (a collective). Until then the step board shows the
        previous minibatch: a rank lost before its commit leaves the others here, at a safe point."""
        step, self._agreement_owed = self._agreement_owed, None
        assert self._shard_snaps is not None and step is not None
        rt = runtime_or_none()
        if rt is None:
            self._shard_snaps.agree_wait()
            return
        rt.run_snapshot_op(self._shard_snaps.agree_wait, blocking=True)  # waits on the others
        rt.close_minibatch(step)

    def _extra_state(self) -> dict:
        return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in self.extra.items()}

    def _state_bytes(self) -> int:
        seen: set = set()
        total = 0

        def add(obj: Any) -> None:
            nonlocal total
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            elif isinstance(obj, dict):
                for v in obj.values():
                    add(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    add(v)

        add(self.model.state_dict())
        add(self.optimizer.state)
        return total

    def untouched_mid_minibatch(self) -> bool:
        """True from a minibatch's first forward until its ``optimizer.step()`` begins.

        Parameters and optimizer state do not change there, and the buffers and RNG states of the
        minibatch's start are recorded, so :meth:`state_dict` reads the start of this minibatch
        even while the training thread goes on with its forward and backward: another thread may
        save then without waiting for it to block."""
        return self._mid_minibatch and not self._in_step and not self._stepped and not self._zero

    def save_partition_now(self) -> str:
        """``--snapshot-zero log``, on a survivor after a failure: write this rank's own partition,
        as it is at the start of this minibatch, into its node's keeper, so a restore to this step
        replays only the lost ranks' partitions. Not inside the optimizer step (the partition may
        be half updated); the object is committed only if the training thread did not enter the
        step while it was copied. Returns what it did, for the log."""
        if self._grad_log is None:
            return "no partition saved (not --snapshot-zero log)"

        def settled() -> bool:
            return not self._in_step and self.consistent_now() and not (self._mid_minibatch and self._stepped)

        step = self.step
        if not settled():
            return f"no partition saved: the failure came inside the optimizer step of step {step}"
        try:
            self._grad_log.wait()  # the log's last entry, before this process exits
        except Exception as e:  # noqa: BLE001 - the partition is still worth saving
            log.warning("the gradient log's last write failed: %s", e)
        from jitckpt.snapshot.aor_store import save_own_partition
        from jitckpt.snapshot.keeper_client import KeeperError

        still = lambda: settled() and self.step == step  # noqa: E731
        try:
            done = save_own_partition(self.optimizer, step=step, socket_path=self._snapshots.socket_path,
                                      still_valid=still)
        except KeeperError as e:
            return f"no partition saved: {e}"
        if done.startswith("no partition"):
            return done
        # The parameters of this step: a lost rank may have died before its part of the snapshot
        # was written. Every survivor holds them all (replicated), untouched since the snapshot began.
        taker = self._snapshots.taker
        try:
            if taker.running is not None:  # this minibatch's snapshot began: only the lost ranks' parts
                filled = taker.fill_in(step, still_valid=still) if self._mid_minibatch else []
            else:  # it blocked in the snapshot's collective: the whole state, this rank's view
                filled = taker.fill_whole(step, self._snapshot_state(uniform=False), still_valid=still)
        except Exception as e:  # noqa: BLE001 - the partition alone may still do
            return f"{done}; its parameter snapshot not filled in: {type(e).__name__}: {e}"
        return done + (f"; parameter snapshot parts {filled} filled in" if filled else "")

    def consistent_now(self) -> bool:
        """False between optimizer.step() and the scheduler's step of the same minibatch."""
        if not self._stepped or self.scheduler is None:
            return True
        return getattr(self.scheduler, "last_epoch", None) != self._sched_epoch

    def _own_resume(self, forward_rng: Optional[dict]) -> dict:
        """What a resume at ``self.step`` loads on this rank (``dataloader=``): the loader's state
        and the RNG the loop goes on from, taken when the previous step was done, and the
        minibatch's forward RNG when it is known (inside the minibatch; before it, at a safe point
        at its forward or a collective after the previous step, see :meth:`_load_rest`)."""
        position, loop_rng = self._loader_states[self.step]
        return {"position": position, "rng": loop_rng, "forward_rng": forward_rng}

    def _loader_position(self) -> Any:
        """The loader's state as of now; None once its epoch is drawn out, so that a resume's next
        iter() starts the next epoch instead of finishing the drawn-out one (and skipping an epoch)."""
        if self._fast_forward is not None:
            return self._fast_forward.position(self.step)
        state = self.dataloader.state_dict()
        try:
            drawn_out = isinstance(state, dict) and state.get("_num_yielded", -1) >= len(self.dataloader)
        except TypeError:  # an iterable dataset: no length
            drawn_out = False
        return None if drawn_out else state

    # Save / load ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        model_sd = self.model.state_dict()
        rng = rng_state()
        buffers = self._buffer_snapshot if self._mid_minibatch else self._shared_next()
        if self._mid_minibatch:
            rng = self._rng_snapshot or rng
        if buffers:  # between minibatches: the next one's (rank 0's), not this rank's own
            model_sd = {**model_sd, **{k: v for k, v in buffers.items() if k in model_sd}}
        extra = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in self.extra.items()}
        out = {
            "step": self.step,
            "model": model_sd,
            # ZeRO: the partitions go through AOR (its state_dict() would be a collective).
            "optimizer": None if self._zero else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": rng,
            "extra": extra,
        }
        if self.dataloader is not None:
            own = self._own_resume(rng if self._mid_minibatch else None)
            out["dataloader"] = dict(own)
            if self._rank_states is not None:
                out["dataloader"]["ranks"] = self._rank_states.at(
                    self.step, own, unknown="rank {rank} resumes with this rank's RNG and loader position, so its "
                    "random draws and data differ from an uninterrupted run where they differ from this rank's")
        if self._zero:
            # The wrapper's hyperparameters are what its step syncs into the local optimizer: a
            # scheduler changes them there, and scheduler.load_state_dict() does not set them.
            out["zero_param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                        for g in self.optimizer.param_groups]
        return out

    def save(self, path: str) -> None:
        """Save into directory ``path`` (the save_fn given to ``jitckpt.init``). ZeRO: this rank's
        shard, its own partition as ``optimizer`` (the local optimizer's state: no collective)."""
        # The checkpoint store checksums every file (CRC32C, verified before a load): torch's own
        # CRC-32 of each zip record would be a second pass over the bytes (~40 % of the write).
        from torch.utils.serialization import config as serialization_config

        if self.sharded is not None:
            return self._save_sharded(path)
        target = Path(path) / STATE_FILE
        rt = runtime_or_none()
        reserve = rt.take_save_reserve() if rt is not None else None
        sd = self.state_dict()
        if self._zero:
            sd["optimizer"] = self.optimizer.optim.state_dict()
        with serialization_config.patch({"save.compute_crc32": False}):
            if reserve is None:
                torch.save(sd, target)
                return
            os.rename(reserve, target)  # its pages are in the page cache: overwritten in place
            with open(target, "r+b") as f:
                torch.save(sd, f)
                f.truncate()

    def _save_sharded(self, path: str) -> None:
        """A DTensor job's save: this rank's chunks as DCP shards (no collective: a survivor writes
        them while a peer is gone), the rest beside them. Reads only the tensors captured at
        ``protect()`` (see :class:`ShardedState`), so it may run while the training thread is in
        this minibatch's forward or backward."""
        assert self.sharded is not None
        mid = self._mid_minibatch
        tensors, other = self.sharded.tensor_state(self._buffer_snapshot if mid else None)
        rng = (self._rng_snapshot if mid else None) or rng_state()
        self.sharded.write(path, tensors)
        torch.save({
            "step": self.step,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": rng,
            "extra": self._extra_state(),
            "param_groups": self.sharded.param_groups(),
            "optim_other": other,
            "layout": self.sharded.position.mesh,
        }, Path(path) / SHARDED_STATE_FILE)

    def _restore_sharded(self) -> int:
        """``restore()`` of a DTensor job: one copy of every shard of the newest complete step,
        loaded through DCP (resharded to this job's mesh). Collective."""
        assert self.sharded is not None
        rt = get_runtime()
        t0 = time.monotonic()
        root = Path(rt.checkpoint_dir)
        copies = newest_set(root)
        if self._shard_snaps is not None:
            disk_step = read_meta(next(iter(copies.values()))).step if copies else None
            step = self._restore_shard_snapshot(rt, disk_step, t0)
            if step is not None:
                return step
        if copies is None:
            why = incomplete_sets(root)
            if why:
                rt.report_fresh_start(self.step, why)
            return self.step
        own = own_copy(copies, self.sharded.position, self.sharded.world_size)
        sd = torch.load(own / SHARDED_STATE_FILE, map_location="cpu", weights_only=True)
        self.sharded.load(root, {s: p.name for s, p in copies.items()}, sd["optim_other"], sd["param_groups"])
        self._load_rest(sd)
        rt.report_restored(str(own), self.step, time.monotonic() - t0)
        return self.step

    def _restore_shard_snapshot(self, rt: Any, disk_step: Optional[int], t0: float) -> Optional[int]:
        """Collective: resume from the keepers' shard snapshots when their newest complete step is
        at least the disk's (``disk_step``); the step, or None to resume from disk (or afresh)."""
        snaps = self._shard_snaps
        assert snaps is not None and self.sharded is not None
        choice = snaps.survey()
        if choice is None or (disk_step is not None and choice.step < disk_step):
            snaps.settle(-1 if disk_step is None else disk_step)
            return None
        try:
            saved, fetched = snaps.load(choice)
            self.sharded.load_local(saved, source=f"the in-memory snapshot of step {choice.step}")
        except (ValueError, UnmappableLayout):
            snaps.reject(choice.step)  # never offered again: the restarted job resumes from the rest
            raise
        self._load_rest(saved)
        snaps.settle(self.step)
        rt.report_restored(f"memory:step{self.step}", self.step, time.monotonic() - t0, source="memory",
                           fetched=[fetched] if fetched else [])
        return self.step

    def load(self, path: str) -> int:
        """Load a checkpoint directory written by :meth:`save`; return the step to continue from."""
        return self.load_state_dict(read_state(path))

    def load_state_dict(self, sd: dict) -> int:
        """Load a state from :meth:`state_dict` (a checkpoint's or a snapshot's); return its step."""
        self.model.load_state_dict(sd["model"])
        if sd["optimizer"] is not None and self._zero:  # this rank's shard (preemption or periodic)
            from jitckpt.snapshot.aor_store import load_zero_partition

            load_zero_partition(self.optimizer, sd["optimizer"])
            self._load_zero_hyperparameters(sd)
        elif sd["optimizer"] is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        elif not self._zero:
            raise ValueError("this state has no optimizer state (it is from a ZeroRedundancyOptimizer "
                             "job) but the optimizer is a plain one")
        return self._load_rest(sd)

    def _load_rest(self, sd: dict) -> int:
        """Scheduler, extra, RNG and step of a loaded state (after model and optimizer); its step."""
        if self.scheduler is not None and sd["scheduler"] is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        for k, v in sd["extra"].items():
            if k in self.extra and hasattr(self.extra[k], "load_state_dict"):
                self.extra[k].load_state_dict(v)
            else:
                self.extra[k] = v
        set_rng_state(sd["rng"])
        self.step = int(sd["step"])
        if self.dataloader is not None and sd.get("dataloader") is not None:
            resume = self._resume_of_this_rank(sd["dataloader"], int(sd["step"]))
            position, loop_rng = resume["position"], resume["rng"]
            fast_forward = position is not None and self._fast_forward is not None
            if fast_forward:
                self._fast_forward.resume_at(position["skip"])
            elif position is not None:
                self.dataloader.load_state_dict(position)
            # The loop's iter() and fetch come next, then the forward. A fast-forward makes the
            # epoch's iterator again from the RNG it was made from (reading past its first batches
            # draws otherwise than training on them did).
            set_rng_state(position["iter_rng"] if fast_forward else loop_rng)
            self._forward_rng = resume["forward_rng"]
            if position is not None and self._forward_rng is None:
                # Inside an epoch the resumed iter() draws where the interrupted loop drew nothing
                # (it went on with its iterator): the minibatch's RNG is the loop's at the step's
                # end (a loader whose fetch draws, random augmentation, is not covered).
                self._forward_rng = loop_rng
            self._loader_states = {self.step: (position, loop_rng)}
        self._mid_minibatch = False
        self._resumed_step = self.step
        return self.step

    @staticmethod
    def _resume_of_this_rank(saved: dict, step: int) -> dict:
        """This rank's own resume state in a checkpoint's ``dataloader`` entry: from its ``ranks``
        (every rank's, where the saver knew them), else the saver's, said in the log."""
        ranks = saved.get("ranks")
        if ranks is None:
            return saved  # written without a rank-state board (outside jitckpt run, one rank)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank in ranks:
            return ranks[rank]
        log.warning("resuming at step %d: this rank's (%d) RNG and loader position were not known to the rank that "
                    "saved (lost with this rank); it resumes with that rank's, so its random draws and data differ "
                    "from an uninterrupted run where they differ from that rank's", step, rank)
        return saved

    def resumed_by_framework(self, step: int) -> None:
        """A framework's own resume (a Trainer's, Lightning's) loaded the state of minibatch ``step``
        into the protected objects: count on from there, as :meth:`restore` does."""
        self.step = self._resumed_step = int(step)

    def pin_forward_rng(self, rng: dict) -> None:
        """The next minibatch's first forward starts from RNG state ``rng`` (a resume whose loop
        draws differently from the interrupted run's before that forward: a skipped data loader)."""
        self._forward_rng = rng

    def _load_zero_hyperparameters(self, sd: dict) -> None:
        """ZeRO, after its partitions are loaded: the wrapper's hyperparameters as they were. The
        partition loader copies the local optimizer's, which a scheduler step after the last
        ``zero.step()`` has made stale."""
        groups = sd.get("zero_param_groups")
        if groups is None or len(groups) != len(self.optimizer.param_groups):
            raise ValueError("this ZeroRedundancyOptimizer state has no hyperparameters for its "
                             f"{len(self.optimizer.param_groups)} parameter group(s) (written by an "
                             "older jitckpt?); resume it from scratch")
        for g, saved in zip(self.optimizer.param_groups, groups):
            g.update(saved)

    def restore(self) -> int:
        """Load the newest complete checkpoint if there is one; return the step to continue from.

        With in-memory snapshots on (``jitckpt run --snapshot-every``) this is collective (every
        rank calls it) and also considers the snapshots held by the nodes' keepers.
        """
        if self.unsupported is not None:
            step = self.step  # nothing was saved (see protect())
        elif self.sharded is not None:
            step = self._restore_sharded()
        elif self._snapshots is not None:
            step = self._restore_tiered(get_runtime())
        else:
            step = self._restore_disk()
        self._begin_minibatch()  # the first minibatch's input copies come next
        return step

    def _restore_disk(self) -> int:
        """``restore()`` from the newest complete disk checkpoint, if any."""
        rt = get_runtime()
        t0 = time.monotonic()
        found = self._read_loadable(rt)
        if found is None:
            return self.step
        path, sd = found
        step = self.load_state_dict(sd)
        rt.ddp_init_sync.loaded()  # every replica loads these bytes: DDP's broadcast is not owed
        rt.report_restored(path, step, time.monotonic() - t0)
        return step

    def _read_loadable(self, rt: Any) -> Optional[tuple[str, dict]]:
        """The newest complete checkpoint whose state loads, read but not yet applied.

        One that verifies but does not load is quarantined (``bad-<name>``, kept) with the reason
        logged, and the next choice is tried: another replica's copy of the same step, else the
        next older complete step. Every data-parallel replica reads the same copy of the same
        bytes, so all ranks fall back alike. With several shards another shard's ranks may have
        loaded the newer step already: then this rank stops instead (the job restarts, and every
        rank chooses from what is left).
        """
        path = rt.latest_checkpoint()
        first = rt.selected_step
        while path is not None:
            try:
                return path, read_state(path)
            except OSError:
                if Path(path).is_dir():
                    raise  # unreadable now (an I/O error): not evidence that the content is bad
                path = rt.reject_checkpoint(path, "gone")  # another rank quarantined it just now
                continue
            except UnloadableCheckpoint as e:
                reason = str(e)
            log.warning("checkpoint %s cannot be loaded: %s; falling back to the next "
                        "older complete checkpoint", path, reason)
            bad = path
            path = rt.reject_checkpoint(path, reason)
            if rt.num_shards > 1 and rt.selected_step != first:
                raise CheckpointError(
                    f"shard {rt.shard_id}'s checkpoint of step {first} ({bad}) cannot be loaded: "
                    f"{reason}. It is quarantined; the ranks of the other shards may have loaded step "
                    f"{first} already, so this rank stops and the restarted job resumes from the "
                    "newest step every shard can load")
        if first is not None:
            rt.report_fresh_start(self.step, f"every checkpoint in {rt.checkpoint_dir} failed to load; "
                                  "the bad ones are kept as bad-*")
        return None

    def _restore_tiered(self, rt: Any) -> int:
        # One rank: the snapshot is loaded straight into the live tensors (load_state_dict then copies nothing).
        point = self._snapshots.resolve(into=None if self._zero else self.state_dict())
        if point is None:
            if self._snapshots.rejected:
                rt.report_fresh_start(self.step, "; ".join(self._snapshots.rejected))
            return self.step
        t0 = time.monotonic()
        if self._zero and point.aor is None and point.state["optimizer"] is None and point.step != 0:
            raise RuntimeError(f"resume: a ZeroRedundancyOptimizer job found a {point.source} state of "
                               f"step {point.step} without its optimizer partitions; it cannot resume "
                               "from it (ZeRO jobs resume from in-memory snapshots, or from the shards "
                               "every rank saves at a preemption and with --periodic-every)")
        step = self.load_state_dict(point.state)
        fetched: list = []
        if self._zero and point.aor is None and point.path is not None:
            self._peer_state = self._peer_shard(point)  # for the replica of the successor's partition
        if self._zero and point.aor is not None:
            loaded, replayed = self._snapshots.load_zero_partitions(self.optimizer, point)
            self._peer_state, fetched = loaded.peer_state, loaded.remote
            if replayed:
                log.warning("resume: ZeRO partitions %s of step %d replayed from the gradient logs",
                            replayed, point.step)
            self._load_zero_hyperparameters(point.state)
        path = point.path or f"memory:step{point.step}"
        rt.report_restored(path, step, point.seconds + time.monotonic() - t0, source=point.source,
                           decoded=point.decoded, fetched=fetched)
        return step

    def _peer_shard(self, point: Any) -> Optional[dict]:
        """ZeRO resumed from disk: the successor's partition, from its shard of the same step (the
        replica of recompute mode starts from it; copy mode needs none)."""
        if self._snapshots.zero == "copy":
            return None
        import torch.distributed as dist

        from jitckpt.checkpoint_store import find_latest

        peer = self._snapshots.peer()
        found = find_latest(Path(point.path).parent, shard_id=peer, num_shards=dist.get_world_size())
        if found is None or found[1].step != point.step:
            raise RuntimeError(f"resume: rank {peer}'s shard of step {point.step} is gone from "
                               f"{Path(point.path).parent} since this rank chose that step; start the job again")
        return read_state(str(found[0]))["optimizer"]

    def close(self) -> None:
        """Remove the hooks; finish and stop in-memory snapshotting."""
        for h in self._handles:
            h.remove()
        if self._aor is not None:
            self._aor.close()
        if self._grad_log is not None:
            self._grad_log.close()
        if self._replica is not None:
            self._replica.close()
        if self._snapshots is not None:
            self._snapshots.close()
        if self._shard_snaps is not None:
            self._shard_snaps.close()
