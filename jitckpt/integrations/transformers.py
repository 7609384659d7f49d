"""Hugging Face ``Trainer``: JIT checkpoints in Trainer's own layout, resumed by Trainer itself.

::

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[JitCheckpointCallback()])
    trainer.train(resume_from_checkpoint=jitckpt.get_checkpoint_path())

After a failure each survivor writes ``checkpoint-<step>/`` as ``Trainer._save_checkpoint`` does
(``model.safetensors`` and ``config.json``, ``optimizer.pt``, ``scheduler.pt``,
``trainer_state.json``, ``rng_state_<rank>.pth`` of every rank, ``training_args.bin``), without a
collective, holding the state at the start of the failed minibatch (:class:`jitckpt.Protected`'s
rule). ``get_checkpoint_path()`` returns that directory; Trainer's resume loads it and skips the
data already trained on. A lost rank's RNG comes from the node's rank-state board
(:mod:`jitckpt.runtime.rank_state`); where it is not there the save says so and Trainer resumes
that rank with a fresh RNG, never another rank's.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Optional

from jitckpt.integrations.versions import require

VERSION = require("transformers", extra="transformers", at_least="5.0", below="6")

import torch  # noqa: E402  (after the version check: its error is the one to see)
from transformers import TrainerCallback  # noqa: E402

from jitckpt.runtime.ddp_buffers import numpy_state  # noqa: E402

log = logging.getLogger("jitckpt.transformers")


def _refusal(args: Any, model: Any) -> Optional[str]:
    """Why this Trainer cannot be checkpointed by jitckpt yet (None: it can)."""
    if getattr(args, "save_only_model", False):
        return ("TrainingArguments(save_only_model=True): a checkpoint without optimizer, scheduler and RNG "
                "states cannot resume a run exactly. Remove save_only_model: jitckpt writes its checkpoints "
                "only after a failure, so they cost no disk while training runs")
    if getattr(args, "deepspeed", None):
        return ("a DeepSpeed Trainer: its ZeRO partitions are saved by DeepSpeed's collective save_checkpoint, "
                "which survivors of a failure cannot run. Train with DDP, or without JitCheckpointCallback")
    if getattr(args, "fsdp", None):
        return ("an FSDP Trainer: its sharded layout is not supported by JitCheckpointCallback yet (jitckpt.protect() "
                "handles FSDP2 in your own loop). Train with DDP, or without JitCheckpointCallback")
    if getattr(getattr(model, "config", None), "distributed_config", None) is not None:
        return ("a model sharded at load time (tp_plan / distributed_config): its save gathers the shards with "
                "collectives. Load it unsharded and train with DDP, or without JitCheckpointCallback")
    if getattr(args, "fp16", False):
        return ("TrainingArguments(fp16=True): the GradScaler's state is not saved by JitCheckpointCallback yet. "
                "Use bf16=True, or train without JitCheckpointCallback")
    return None


def trainer_rng(state: dict) -> dict:
    """jitckpt's RNG state (:func:`jitckpt.runtime.ddp_buffers.rng_state`) as Trainer saves it."""
    out: dict[str, Any] = {"python": state["python"], "cpu": state["torch"]}
    if "numpy" in state:
        out["numpy"] = numpy_state(state)
    if "cuda" in state:
        out["cuda"] = state["cuda"]
    return out


class JitCheckpointCallback(TrainerCallback):
    """Makes a ``Trainer`` job recoverable by jitckpt (see the module docstring). Refuses, when the
    Trainer is built, what it cannot checkpoint yet (DeepSpeed, FSDP, ``save_only_model``, fp16)."""

    def __init__(self) -> None:
        self._protected: Any = None  # jitckpt.Protected over the model, optimizer and scheduler
        self._model: Any = None
        self._args: Any = None
        self._state: Any = None       # Trainer's live TrainerState
        self._rngs: Any = None        # jitckpt.integrations.rank_rngs.RankRngs
        self._rank, self._world = 0, 1
        self._steps_per_epoch: Optional[int] = None
        self._epoch_rng: Optional[tuple[int, dict]] = None  # (global step, RNG) where the epoch began

    # Trainer events ----------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        why = _refusal(args, model)
        if why is not None:
            raise ValueError(f"jitckpt JitCheckpointCallback (transformers {VERSION}): {why}")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        import jitckpt
        from jitckpt.integrations.rank_rngs import RankRngs
        from jitckpt.integrations.runtime_checks import require_jit_checkpoints

        why = _refusal(args, model)
        if why is not None:
            raise ValueError(f"jitckpt JitCheckpointCallback (transformers {VERSION}): {why}")
        require_jit_checkpoints("Trainer", "in Trainer's layout")
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self._protected = jitckpt.protect(model, inner, lr_scheduler)
        if self._protected.unsupported is not None:
            return  # protect() said why; the job trains as without jitckpt
        self._protected.resumed_by_framework(state.global_step)
        self._model, self._args, self._state = model, args, state
        self._rank, self._world = int(args.process_index), int(args.world_size)
        self._rngs = RankRngs.of_job(rank=self._rank, world_size=self._world)
        self._protected.on_minibatch.append(lambda step, rng: self._rngs.started(step, self._resume_rng(step, rng)))
        self._steps_per_epoch = self._update_steps_per_epoch(args, train_dataloader)
        jitckpt.init(self._save, step_fn=lambda: self._protected.step)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Trainer's resume at an epoch's first step loads the RNG before the epoch's iter() draws
        # from it: that step's checkpoint holds the RNG as it was here, not at the first forward.
        from jitckpt.runtime.ddp_buffers import rng_state

        self._epoch_rng = (int(state.global_step), rng_state())

    # State ----------------------------------------------------------------------------------------
    @staticmethod
    def _update_steps_per_epoch(args: Any, loader: Any) -> Optional[int]:
        try:
            n = len(loader)
        except TypeError:
            return None  # an iterable dataset: Trainer counts max_steps as one epoch
        return max(math.ceil(n / args.gradient_accumulation_steps), 1)

    def _resume_rng(self, step: int, rng: dict) -> dict:
        """The RNG Trainer's resume at minibatch ``step`` must load, given this rank's at its start:
        at an epoch's first step, the RNG as the epoch began (Trainer loads it before the epoch's
        iter() draws from it); elsewhere the minibatch's own (loaded after the skipped batches)."""
        n = self._steps_per_epoch
        if n and step % n == 0 and self._epoch_rng is not None and self._epoch_rng[0] == step:
            return self._epoch_rng[1]
        return rng

    def _save(self, path: str) -> str:
        """jitckpt's save function: ``checkpoint-<step>/`` in Trainer's layout inside ``path``."""
        sd = self._protected.state_dict()
        step = int(sd["step"])
        rng = self._resume_rng(step, sd["rng"])
        out = Path(path) / f"checkpoint-{step}"
        out.mkdir()
        # The model's own save (config, tied weights dropped, safetensors) with the saved state. It
        # writes only on global rank 0 (should_save_on_this_rank), and the survivor may be any rank:
        # this save is the only writer (no collective runs in it for an unsharded model, which
        # _refusal ensures), so this rank is told it is the one.
        self._model.should_save_on_this_rank = lambda is_main_process: True
        try:
            self._model.save_pretrained(out, state_dict=dict(sd["model"]), is_main_process=True)
        finally:
            del self._model.should_save_on_this_rank
        if not (out / "config.json").is_file():
            raise RuntimeError(f"{type(self._model).__name__}.save_pretrained wrote no config.json into {out}")
        torch.save(sd["optimizer"], out / "optimizer.pt")
        if sd["scheduler"] is not None:
            torch.save(sd["scheduler"], out / "scheduler.pt")
        if self._world <= 1:
            torch.save(trainer_rng(rng), out / "rng_state.pth")
        else:
            for r, state in self._rngs.at(step, rng).items():
                torch.save(trainer_rng(state), out / f"rng_state_{r}.pth")
        self._trainer_state(step).save_to_json(str(out / "trainer_state.json"))
        torch.save(self._args, out / "training_args.bin")
        return out.name

    def _trainer_state(self, step: int) -> Any:
        """Trainer's state as it was at the start of minibatch ``step``."""
        state = copy.copy(self._state)
        n = self._steps_per_epoch
        history = [e for e in state.log_history if e.get("step", 0) <= step]
        return dataclasses.replace(state, global_step=step, log_history=copy.deepcopy(history),
                                   epoch=step / n if n else state.epoch)


__all__ = ["JitCheckpointCallback", "VERSION"]
