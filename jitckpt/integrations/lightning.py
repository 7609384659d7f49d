"""PyTorch Lightning: JIT checkpoints as Lightning ``.ckpt`` files that resume exactly.

::

    trainer = L.Trainer(..., callbacks=[JitCheckpointCallback()])
    trainer.fit(model, loader, ckpt_path=jitckpt.get_checkpoint_path())

After a failure a survivor writes ``epoch=<e>-step=<k>.ckpt`` (Lightning's own checkpoint dict,
as ``ModelCheckpoint`` would have written it after step ``k-1``), without a collective, holding
the state at the start of the failed minibatch (:class:`jitckpt.Protected`'s rule): the module,
optimizer and scheduler, the loops' progress with the data loader's position (a
``StatefulDataLoader``'s ``state_dict``, saved by Lightning's fit loop), and every rank's RNG.
Lightning's own mid-epoch resume restores no RNG, so its dropout draws differ from an
uninterrupted run; this callback restores each rank's RNG right before the resumed minibatch's
forward, so the resumed run is bitwise the uninterrupted one. Keep the callback in the Trainer
that resumes (also outside jitckpt): it is what restores the RNG.
"""
from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any, Optional

from jitckpt.integrations.versions import require

VERSION = require("lightning", extra="lightning", at_least="2.0", below="3")

import torch  # noqa: E402  (after the version check: its error is the one to see)
from lightning.pytorch import Callback  # noqa: E402

from jitckpt.integrations.data_rng import data_rng, set_data_rng  # noqa: E402

log = logging.getLogger("jitckpt.lightning")
ENTRY = "epoch={epoch}-step={step}.ckpt"  # ModelCheckpoint's default file name


def _refusal(trainer: Any) -> Optional[str]:
    """Why this Trainer cannot be checkpointed by jitckpt yet (None: it can)."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) or type(strategy).__name__.startswith("DeepSpeed"):
        return (f"strategy {type(strategy).__name__}: its sharded state is saved by collectives, which survivors of a "
                "failure cannot run. Use strategy='ddp', or train without JitCheckpointCallback")
    if len(trainer.optimizers) != 1:
        return (f"{len(trainer.optimizers)} optimizers: jitckpt protects one optimizer (and its scheduler). "
                "Return one from configure_optimizers, or train without JitCheckpointCallback")
    if len(trainer.lr_scheduler_configs) > 1:
        return (f"{len(trainer.lr_scheduler_configs)} LR schedulers: jitckpt protects one. Chain them "
                "(torch.optim.lr_scheduler.SequentialLR), or train without JitCheckpointCallback")
    precision = str(trainer.precision)
    if precision.startswith("16"):
        return (f"precision={precision!r}: the GradScaler's state is not saved by JitCheckpointCallback yet. "
                "Use precision='bf16-mixed', or train without JitCheckpointCallback")
    return None


class JitCheckpointCallback(Callback):
    """Makes a Lightning ``Trainer.fit`` job recoverable by jitckpt (see the module docstring).
    Refuses, when training starts, what it cannot checkpoint yet (sharded strategies, several
    optimizers or schedulers, fp16 mixed precision)."""

    def __init__(self) -> None:
        self._protected: Any = None  # jitckpt.Protected over the DDP-wrapped module
        self._trainer: Any = None
        self._prefix = ""            # of the LightningModule's names in the wrapped module's state_dict
        self._rngs: Any = None       # jitckpt.integrations.rank_rngs.RankRngs
        self._rank = 0
        # Lightning's loops' state (fit progress, the data loader's position) as a checkpoint after
        # the previous optimizer step holds it, by the global step it resumes at.
        self._loops: dict[int, tuple[int, dict]] = {}  # step -> (epoch, loops state)
        self._loaded: Optional[tuple[int, int, dict]] = None  # the resumed checkpoint's (step, epoch, loops)
        # The RNG as the epoch's data loader iterator was made (a sampler draws its shuffle from
        # it), and the global step there: a resume makes the iterator again from it.
        self._iter_rng: Optional[tuple[int, dict]] = None
        self._first_epoch = True     # this process's first epoch: its iterator is made before on_train_start
        # A resume's RNGs of this rank, until restored: what the epoch's iterator is made from, and
        # the minibatch's.
        self._pending_iter: Optional[dict] = None
        self._pending_batch: Optional[dict] = None

    # Lightning events ----------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._rank = int(trainer.global_rank)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # Next come the restore of the training state and the first epoch's iter() (a resume makes
        # that iterator again in on_train_start).
        source = trainer.fit_loop._data_source.instance  # the user's loader: Lightning wraps its sampler
        self._iter_rng = (int(trainer.global_step), data_rng([source]))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import jitckpt
        from jitckpt.integrations.rank_rngs import RankRngs
        from jitckpt.integrations.runtime_checks import require_jit_checkpoints

        why = _refusal(trainer)
        if why is not None:
            raise ValueError(f"jitckpt JitCheckpointCallback (lightning {VERSION}): {why}")
        require_jit_checkpoints("Lightning", "a Lightning .ckpt")
        wrapped = trainer.strategy.model  # DDP(the module): its forward runs every training_step
        self._prefix = next(name + "." for name, m in wrapped.named_modules() if m is pl_module) \
            if wrapped is not pl_module else ""
        scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        self._protected = jitckpt.protect(wrapped, trainer.optimizers[0], scheduler)
        if self._protected.unsupported is not None:
            return  # protect() said why; the job trains as without jitckpt
        step = int(trainer.global_step)
        self._protected.resumed_by_framework(step)
        self._trainer = trainer
        self._rngs = RankRngs.of_job(rank=self._rank, world_size=int(trainer.world_size))
        self._protected.on_minibatch.append(lambda s, rng: self._rngs.started(s, self._resume_rngs(s, rng)))
        if self._loaded is not None and self._loaded[0] == step:
            self._loops[step] = self._loaded[1:]  # what this run resumed from is what it would save
            self._resume_data(trainer, epoch_end=bool(self._loops_epoch_end(step)))
        else:  # a fresh start (or a resume from a checkpoint of Lightning's own)
            self._capture(trainer)
        self._loaded = None
        jitckpt.init(self._save, step_fn=lambda: self._protected.step)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning.fabric.utilities.data import _set_sampler_epoch

        loaders = trainer.fit_loop._combined_loader.flattened
        # Lightning's restore from an epoch's end counts that epoch twice in the sampler's epoch
        # (seen: epoch 1 shuffled as epoch 2, and with more epochs every later one as the next): the
        # sampler gets the epoch that runs, as in a run without a restore.
        for dl in loaders:
            _set_sampler_epoch(dl, trainer.current_epoch)
        if self._pending_iter is not None:  # a resume at this epoch's start
            set_data_rng(loaders, self._pending_iter)
            self._pending_iter = None
            self._first_epoch = False
        if not self._first_epoch:  # a later epoch's iterator is made after this hook
            self._iter_rng = (int(trainer.global_step), data_rng(loaders))
        self._first_epoch = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._pending_batch is not None:
            # The resumed minibatch's forward comes next: its RNG is this rank's at the failure.
            from jitckpt.runtime.ddp_buffers import set_rng_state

            set_rng_state(self._pending_batch)
            self._pending_batch = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._protected is not None and self._protected.unsupported is None:
            self._capture(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # The step after an epoch's last one resumes from an epoch-end state, as ModelCheckpoint's
        # epoch checkpoints do: from the last batch's end, Lightning's restore skips an epoch.
        if self._protected is not None and self._protected.unsupported is None:
            self._capture(trainer, replace=True)

    def state_dict(self) -> dict:
        return {}  # a checkpoint of Lightning's own (ModelCheckpoint) holds no RNG of this callback's

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        mine = checkpoint.get("callbacks", {}).get(self.state_key) or {}
        if "rng" not in mine:
            return  # not a jitckpt checkpoint
        self._loaded = (int(checkpoint["global_step"]), int(checkpoint["epoch"]), copy.deepcopy(checkpoint["loops"]))
        rngs = mine["rng"].get(self._rank)
        self._pending_iter, self._pending_batch = (None, None) if rngs is None else (rngs["iter"], rngs["batch"])
        if rngs is None:
            log.warning("resuming from jitckpt's checkpoint of step %s: rank %d's RNG state is not in it (it "
                        "was lost with the rank); rank %d's random draws (shuffle, dropout) differ from an "
                        "uninterrupted run", mine.get("step"), self._rank, self._rank)

    # State ------------------------------------------------------------------------------------------
    def _resume_data(self, trainer: Any, *, epoch_end: bool) -> None:
        """A resume: the epoch's iterator as the interrupted run had it, moved past the batches
        already trained on (Lightning restores the fetcher's count, not the iterator).

        Lightning made the iterator before this hook, without the epoch's sampler epoch (set only
        later) and from this process's RNG and sampler generators, which a shuffle draws from:
        inside an epoch it is made again from the interrupted epoch's. (A loader's own state would
        not do: a StatefulDataLoader's restore makes its sampler's iterator three times, drawing
        each time.) At an epoch's end the iterator is only run out: Lightning ends that epoch and
        makes the next one's after on_train_epoch_start, which restores the RNG it draws from."""
        from lightning.fabric.utilities.data import _set_sampler_epoch

        fit = trainer.fit_loop
        loaders = fit._combined_loader.flattened
        if not epoch_end:
            for dl in loaders:
                _set_sampler_epoch(dl, fit.epoch_progress.current.processed)
            if self._pending_iter is not None:
                set_data_rng(loaders, self._pending_iter)
                self._pending_iter = None
            self._iter_rng = (int(trainer.global_step), data_rng(loaders))
            iter(fit._data_fetcher)  # resets the fetcher's count, which the epoch loop's start sets again
        n, t0 = int(fit.epoch_loop.batch_progress.current.ready), time.monotonic()
        for _ in range(n):
            next(fit._data_fetcher.iterator)
        if n and not epoch_end:
            log.warning("resuming inside epoch %d: read past the %d batches of it already trained on (%.2f s)",
                        trainer.current_epoch, n, time.monotonic() - t0)

    def _resume_rngs(self, step: int, rng: dict) -> dict:
        """What a resume at minibatch ``step`` restores on this rank, given its RNG at that
        minibatch's start: the RNG its epoch's iterator is made from, and ``rng``."""
        it = self._iter_rng
        # Not yet made at this step while the new epoch's iter() has not come (a failure at an
        # epoch's end): it is made from the RNG as it is now.
        if it is not None and (it[0] == step or self._loops_epoch_end(step) is False):
            iter_rng = it[1]
        else:
            iter_rng = data_rng(self._trainer.fit_loop._combined_loader.flattened)
        return {"iter": iter_rng, "batch": rng}

    def _loops_epoch_end(self, step: int) -> Optional[bool]:
        """Whether the loops' state for ``step`` is an epoch's end (None: there is none)."""
        if step not in self._loops:
            return None
        return bool(self._loops[step][1]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"])

    def _capture(self, trainer: Any, *, replace: bool = False) -> None:
        """The loops' state as of now, which a resume at ``trainer.global_step`` starts from. With
        gradient accumulation the first capture at a step (right after the optimizer step) is it."""
        step = int(trainer.global_step)
        if step in self._loops and not replace:
            return
        loops = copy.deepcopy(trainer._checkpoint_connector._get_loops_state_dict())
        self._loops = {s: v for s, v in self._loops.items() if s >= step - 1}
        self._loops[step] = (int(trainer.current_epoch), loops)

    def _save(self, path: str) -> str:
        """jitckpt's save function: a Lightning ``.ckpt`` of the minibatch's start inside ``path``."""
        sd = self._protected.state_dict()
        step = int(sd["step"])
        if step not in self._loops:
            raise RuntimeError(f"jitckpt JitCheckpointCallback: no record of Lightning's loops at step {step} "
                               f"(have {sorted(self._loops)})")
        epoch, loops = self._loops[step]
        trainer = self._trainer
        # Lightning's checkpoint of this moment (callbacks, hyperparameters, precision, the user's
        # on_save_checkpoint), with the minibatch's start put in: no collective runs in it under DDP.
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        n = len(self._prefix)
        ckpt["state_dict"] = {k[n:]: v for k, v in sd["model"].items() if k.startswith(self._prefix)}
        ckpt["optimizer_states"] = [sd["optimizer"]]
        ckpt["lr_schedulers"] = [sd["scheduler"]] if sd["scheduler"] is not None else []
        # Without the loader's state: the resume makes the epoch's iterator afresh and skips ahead.
        loops = copy.copy(loops)
        loops["fit_loop"] = {**loops["fit_loop"], "state_dict": {
            k: v for k, v in loops["fit_loop"]["state_dict"].items() if k != "combined_loader"}}
        ckpt["loops"], ckpt["epoch"], ckpt["global_step"] = loops, epoch, step
        rngs = self._rngs.at(step, self._resume_rngs(step, sd["rng"]))
        ckpt.setdefault("callbacks", {})[self.state_key] = {"step": step, "rng": rngs}
        name = ENTRY.format(epoch=epoch, step=step)
        torch.save(ckpt, Path(path) / name)
        return name


__all__ = ["JitCheckpointCallback", "VERSION"]
