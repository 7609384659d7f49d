"""``jitckpt.protect``: a correct save/restore for plain torch training objects in two lines."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Optional

import torch

STATE_FILE = "state.pt"


def _rng_state() -> dict:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))


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


class Protected:
    """Model, optimizer, optional scheduler and extra state, saved and restored consistently.

    ``step`` counts completed ``optimizer.step()`` calls; a resumed job continues with minibatch
    ``step`` (0-based), i.e. ``for step in range(state.restore(), total_steps)``. A checkpoint taken
    in the middle of minibatch *i* (failure before or during the gradient all-reduce) records the
    state at the *start* of minibatch *i*: parameters and optimizer state are untouched until
    ``optimizer.step()``, and model buffers (BatchNorm statistics) and RNG states are taken from a
    snapshot made when minibatch *i*'s first forward began. A failure after the all-reduce (during
    another rank's optimizer step) lets the healthy ranks finish step *i*; they save at the start of
    minibatch *i+1*. ``extra`` holds objects with ``state_dict``/``load_state_dict`` (GradScaler,
    a sampler) or plain tensors/numbers/strings, saved under their keys.

    ``snapshots`` is the in-memory tier (:class:`~jitckpt.snapshot_tier.SnapshotTier`) when the job
    runs with ``--snapshot-every``. A ``ZeroRedundancyOptimizer`` needs it: its partitions are
    snapshotted through AOR (each rank also recomputes its successor node's partition) and restored
    from the keepers; such a job takes no JIT or periodic checkpoints.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, *, extra: Optional[dict] = None,
                 snapshots: Any = None) -> None:
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
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra = dict(extra or {})
        self.step = 0
        self._mid_minibatch = False
        self._rng_snapshot: Optional[dict] = None
        self._buffer_snapshot: Optional[dict] = None
        self._has_buffers = any(True for _ in model.buffers())
        self._stepped = False          # optimizer.step() ran since this minibatch's forward
        self._in_step = False          # optimizer.step() began and has not returned
        self._undo: Any = None         # jitckpt.swift.UpdateUndo under --plugin undo
        self._sched_epoch: Any = None  # scheduler.last_epoch when this minibatch's forward began
        self._ddp_layout: Optional[dict] = None
        self._train_forwards = 0
        self._layout_settled = False     # _ddp_layout is the current minibatch's (snapshots on)
        self._snapshots: Any = snapshots     # SnapshotTier (jitckpt run --snapshot-every)
        self._replica: Any = None            # ZeRO: OptimizerReplica of the successor's partition
        self._aor: Any = None                # ZeRO: AorSnapshotter writing both partitions
        self._peer_state: Optional[dict] = None  # ZeRO: the successor's partition, restored
        self._resumed_step: Optional[int] = None
        self._handles = [
            model.register_forward_pre_hook(self._on_forward),
            model.register_forward_hook(self._after_forward),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._on_step_done),
        ]

    @property
    def uses_aor(self) -> bool:
        """True for a ZeroRedundancyOptimizer: partitions protected by AOR, no disk checkpoints."""
        return self._zero

    # Hooks -------------------------------------------------------------------------------------
    def _on_forward(self, module: Any, args: Any) -> None:
        if self._mid_minibatch:
            return  # gradient accumulation or a second forward: the snapshot is already taken
        from . import _runtime_or_none

        rt = _runtime_or_none()
        if rt is not None:
            rt.mark_step(self.step)  # a safe point: may save (failure) or checkpoint (periodic)
        self._stepped = False
        self._sched_epoch = getattr(self.scheduler, "last_epoch", None)
        self._rng_snapshot = _rng_state()
        if self._has_buffers:
            self._buffer_snapshot = {k: b.detach().clone() for k, b in self.model.named_buffers()}
        self._mid_minibatch = True
        if self._snapshots is not None and rt is not None:
            self._settle_ddp_layout()
            # The state at the start of this minibatch; copied while forward/backward run.
            rt.run_snapshot_op(self._snapshot_begin, blocking=True)

    def _settle_ddp_layout(self) -> None:
        """Make ``_ddp_layout`` the bucket layout this minibatch runs on, before it is snapshotted.

        DDP rebuilds its buckets once, at the start of its second training forward (after this
        pre-hook): a snapshot begun here would otherwise carry the layout of the previous
        minibatch, and a job resumed from the step-1 snapshot would sum in another order. So the
        rebuild DDP is about to do is done now (the same call DDP's own forward and its Join hook
        make; every rank reaches this hook at the same point, and DDP's own call is then a no-op).
        """
        reducer = getattr(self.model, "reducer", None)
        if reducer is None or not torch.is_grad_enabled():
            return
        from . import ddp_layout

        if reducer._rebuild_buckets() or self._ddp_layout is None:
            self._ddp_layout = ddp_layout.capture(self.model) or self._ddp_layout
            self._layout_settled = self._ddp_layout is not None

    def _snapshot_begin(self) -> None:
        self._snapshots.start(self._snapshot_state, resumed_step=self._resumed_step)
        if self._zero and self._replica is None:
            self._start_aor()
        if self._snapshots.begin(self.step) and self._aor is not None:
            self._aor.begin(self.step)  # the partitions of the same step, on the replica's worker

    def _start_aor(self) -> None:
        """ZeRO: the replica of the successor's partition (from the restored state if any)."""
        from .snapshot_aor import OptimizerReplica
        from .snapshot_aor_store import AorSnapshotter

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

    def _snapshot_state(self) -> dict:
        sd = self.state_dict()
        if self._ddp_layout is not None and self._layout_settled:  # the one this minibatch uses
            from .snapshot_tier import LAYOUT_KEY

            sd[LAYOUT_KEY] = json.dumps(self._ddp_layout)
        return sd

    def enable_undo(self) -> None:
        """``jitckpt run --plugin undo``: make a torn state recoverable by SWIFT update-undo.

        Raises :class:`jitckpt.swift.NotInvertibleError` (naming the fix) for an optimizer or
        configuration that has no exact inverse; the hooks it installs run after this object's."""
        if self._zero:
            raise TypeError("--plugin undo: a ZeroRedundancyOptimizer step is not undone (its partitions "
                            "are protected by AOR snapshots); drop --plugin undo")
        from .swift import NotInvertibleError, UpdateUndo

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

    def _before_step(self, *args: Any, **kwargs: Any) -> None:
        self._in_step = True
        # The snapshot reads parameters and optimizer state: done before they change.
        if self._snapshots is not None and self._snapshots.taker is not None:
            from . import _runtime_or_none

            rt = _runtime_or_none()
            if rt is not None:
                rt.run_snapshot_op(self._settle_snapshots, blocking=False)
            else:
                self._settle_snapshots()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        # DDP rebuilds its buckets at the start of the second training forward; record the layout
        # here, on the main thread: at save time the reducer may be locked by a blocked backward.
        if self._train_forwards < 2 and torch.is_grad_enabled() and hasattr(self.model, "reducer"):
            from . import ddp_layout

            self._train_forwards += 1
            self._ddp_layout = ddp_layout.capture(self.model) or self._ddp_layout

    def _on_step_done(self, *args: Any, **kwargs: Any) -> None:
        self._in_step = False
        self.step += 1
        self._mid_minibatch = False
        self._stepped = True

    def consistent_now(self) -> bool:
        """False between optimizer.step() and the scheduler's step of the same minibatch."""
        if not self._stepped or self.scheduler is None:
            return True
        return getattr(self.scheduler, "last_epoch", None) != self._sched_epoch

    # Save / load ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        model_sd = self.model.state_dict()
        rng = _rng_state()
        if self._mid_minibatch:
            rng = self._rng_snapshot or rng
            if self._buffer_snapshot:
                model_sd = {**model_sd, **{k: v for k, v in self._buffer_snapshot.items() if k in model_sd}}
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
        if self._zero:
            # The wrapper's hyperparameters are what its step syncs into the local optimizer: a
            # scheduler changes them there, and scheduler.load_state_dict() does not set them.
            out["zero_param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                        for g in self.optimizer.param_groups]
        return out

    def save(self, path: str) -> None:
        """Save into directory ``path`` (the save_fn given to ``jitckpt.init``)."""
        if self._zero:
            raise RuntimeError("a ZeroRedundancyOptimizer job has no disk checkpoints: its partitions "
                               "are protected in the snapshot keepers (AOR)")
        torch.save(self.state_dict(), Path(path) / STATE_FILE)
        if self._ddp_layout is not None:
            from . import ddp_layout

            ddp_layout.write(self._ddp_layout, path)

    def load(self, path: str) -> int:
        """Load a checkpoint directory written by :meth:`save`; return the step to continue from."""
        file = Path(path) / STATE_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found: this checkpoint was not written by jitckpt.protect(); load it with "
                "your own function")
        return self.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))

    def load_state_dict(self, sd: dict) -> int:
        """Load a state from :meth:`state_dict` (a checkpoint's or a snapshot's); return its step."""
        self.model.load_state_dict(sd["model"])
        if sd["optimizer"] is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        elif not self._zero:
            raise ValueError("this state has no optimizer state (it is from a ZeroRedundancyOptimizer "
                             "job) but the optimizer is a plain one")
        if self.scheduler is not None and sd["scheduler"] is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        for k, v in sd["extra"].items():
            if k in self.extra and hasattr(self.extra[k], "load_state_dict"):
                self.extra[k].load_state_dict(v)
            else:
                self.extra[k] = v
        _set_rng_state(sd["rng"])
        self.step = int(sd["step"])
        self._mid_minibatch = False
        self._resumed_step = self.step
        return self.step

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
        from . import _get_runtime, _runtime_or_none

        if self._snapshots is not None:
            return self._restore_tiered(_get_runtime())
        path = _get_runtime().latest_checkpoint()
        if path is None:
            return self.step
        t0 = time.monotonic()
        step = self.load(path)
        rt = _runtime_or_none()
        if rt is not None:
            rt.report_restored(path, step, time.monotonic() - t0)
        return step

    def _restore_tiered(self, rt: Any) -> int:
        point = self._snapshots.resolve()
        if point is None:
            return self.step
        t0 = time.monotonic()
        if self._zero and point.aor is None and point.step != 0:  # step 0: nothing to lose
            raise RuntimeError(f"resume: a ZeroRedundancyOptimizer job found a {point.source} state of "
                               f"step {point.step} without its optimizer partitions; it cannot resume "
                               "from it (ZeRO jobs resume from in-memory snapshots only)")
        step = self.load_state_dict(point.state)
        fetched: list = []
        if self._zero and point.aor is not None:
            loaded = self._snapshots.load_zero_partitions(self.optimizer, point)
            self._peer_state, fetched = loaded.peer_state, loaded.remote
            self._load_zero_hyperparameters(point.state)
        path = point.path or f"memory:step{point.step}"
        rt.report_restored(path, step, point.seconds + time.monotonic() - t0, source=point.source,
                           decoded=point.decoded, fetched=fetched)
        return step

    def close(self) -> None:
        """Remove the hooks; finish and stop in-memory snapshotting."""
        for h in self._handles:
            h.remove()
        if self._aor is not None:
            self._aor.close()
        if self._replica is not None:
            self._replica.close()
        if self._snapshots is not None:
            self._snapshots.close()
