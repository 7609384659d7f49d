"""Hugging Face accelerate: JIT checkpoints in ``accelerator.save_state``'s layout, resumed by
``accelerator.load_state``.

::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    jit = JitCheckpoint(accelerator)
    step = jit.resume(jitckpt.get_checkpoint_path())   # accelerator.load_state(path); 0 without one
    for epoch in range(step // len(loader), epochs):
        done = step - epoch * len(loader)               # this epoch's batches already trained on
        for batch in accelerator.skip_first_batches(loader, done) if done else loader:
            ...                                         # forward, accelerator.backward, step
            step += 1

After a failure a survivor writes ``step_<k>/`` (the name accelerate's examples resume from) as
``save_state`` does: ``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``,
``random_states_<rank>.pkl`` of every rank and ``custom_checkpoint_<i>.pkl`` of the registered
objects, without a collective, holding the state at the start of the failed minibatch
(:class:`jitckpt.Protected`'s rule). ``JitCheckpoint`` registers one object of its own for
checkpointing: its state is the step and every rank's RNG as the interrupted epoch's iterator was
made (the shuffled sampler's generator, which accelerate advances at every epoch and does not
save) and at the minibatch's forward. ``load_state`` restores the first, so the resumed epoch is
shuffled as the interrupted one was, and the second is restored right before the resumed
minibatch's forward (``skip_first_batches`` makes a new iterator, which draws). Keep
``JitCheckpoint`` in the script that resumes, also outside jitckpt: it is what restores these.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

from jitckpt.integrations.versions import require

VERSION = require("accelerate", extra="accelerate", at_least="1.0", below="2")

import torch  # noqa: E402  (after the version check: its error is the one to see)

from jitckpt.integrations.data_rng import data_rng, sampler_generators, set_data_rng  # noqa: E402
from jitckpt.runtime.ddp_buffers import numpy_state  # noqa: E402

log = logging.getLogger("jitckpt.accelerate")
ENTRY = "step_{step}"  # accelerate's examples resume from step_<k> (and epoch_<e>) directories


def _refusal(accelerator: Any) -> Optional[str]:
    """Why this Accelerator cannot be checkpointed by jitckpt yet (None: it can)."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind not in ("NO", "MULTI_CPU", "MULTI_GPU"):
        return (f"distributed_type {kind}: its state is saved by collectives (FSDP, DeepSpeed, Megatron) or "
                "is not tested with jitckpt. Use DDP (the default multi-process setup), or train without JitCheckpoint")
    if len(accelerator._models) != 1 or len(accelerator._optimizers) != 1:
        return (f"{len(accelerator._models)} prepared model(s) and {len(accelerator._optimizers)} optimizer(s): "
                "jitckpt protects one of each. Construct JitCheckpoint after accelerator.prepare(model, optimizer, ...) "
                "of one model and one optimizer, or train without JitCheckpoint")
    if len(accelerator._schedulers) > 1:
        return (f"{len(accelerator._schedulers)} LR schedulers: jitckpt protects one. Chain them "
                "(torch.optim.lr_scheduler.SequentialLR), or train without JitCheckpoint")
    if accelerator.scaler is not None:
        return (f"mixed_precision={accelerator.mixed_precision!r}: the GradScaler's state is not saved by "
                "JitCheckpoint yet. Use mixed_precision='bf16', or train without JitCheckpoint")
    if accelerator.gradient_accumulation_steps > 1:
        return (f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps}: not supported by "
                "JitCheckpoint yet. Use 1 (a larger batch), or train without JitCheckpoint")
    config = accelerator.dataloader_config
    for flag in ("use_stateful_dataloader", "use_seedable_sampler", "dispatch_batches"):
        if getattr(config, flag, None):
            return (f"DataLoaderConfiguration({flag}=True): not supported by JitCheckpoint yet. Leave it at its "
                    "default (JitCheckpoint restores the shuffle order itself), or train without JitCheckpoint")
    return None


def accelerate_rng(state: dict, step: int) -> dict:
    """jitckpt's RNG state (:func:`jitckpt.runtime.ddp_buffers.rng_state`) as ``save_state`` writes
    it into ``random_states_<rank>.pkl`` (``step``: its accelerator.step)."""
    out: dict[str, Any] = {"step": step, "random_state": state["python"], "torch_manual_seed": state["torch"]}
    if "numpy" in state:
        out["numpy_random_seed"] = numpy_state(state)
    if "cuda" in state:
        out["torch_cuda_manual_seed"] = state["cuda"]
    return out


class _ResumeState:
    """The object JitCheckpoint registers for checkpointing (``custom_checkpoint_<i>.pkl``)."""

    def __init__(self, owner: "JitCheckpoint") -> None:
        self._owner = owner

    def state_dict(self) -> dict:
        return {}  # a save_state of the user's own holds no jitckpt state: load_state_dict ignores it

    def load_state_dict(self, state: dict) -> None:
        if state:
            self._owner._loaded(state)


class JitCheckpoint:
    """Makes an ``Accelerator`` loop recoverable by jitckpt (see the module docstring). Construct it
    after ``accelerator.prepare``; it refuses what it cannot checkpoint yet (FSDP, DeepSpeed,
    several models or optimizers, fp16, gradient accumulation, stateful or seedable loaders)."""

    def __init__(self, accelerator: Any) -> None:
        import jitckpt
        from jitckpt.integrations.rank_rngs import RankRngs
        from jitckpt.integrations.runtime_checks import require_jit_checkpoints

        why = _refusal(accelerator)
        if why is not None:
            raise ValueError(f"jitckpt JitCheckpoint (accelerate {VERSION}): {why}")
        require_jit_checkpoints("accelerate", "an accelerator.save_state directory")
        self._accelerator = accelerator
        self._rank, self._world = int(accelerator.process_index), int(accelerator.num_processes)
        optimizer = accelerator._optimizers[0]
        scheduler = accelerator._schedulers[0] if accelerator._schedulers else None
        self._protected = jitckpt.protect(accelerator._models[0], getattr(optimizer, "optimizer", optimizer),
                                          getattr(scheduler, "scheduler", scheduler))
        # The shuffled loaders (a sampler generator each): the training data, whose iterator's order
        # a resume must make again. Their epoch has len() minibatches (no gradient accumulation).
        self._loaders = [dl for dl in accelerator._dataloaders if sampler_generators(dl)]
        self._epoch = len(self._loaders[0]) if self._loaders else None
        # The RNG as the current epoch's iterator was made, and the step that epoch began at.
        self._iter_rng: Optional[tuple[int, dict]] = None
        self._state = _ResumeState(self)
        accelerator.register_for_checkpointing(self._state)
        if self._protected.unsupported is not None:
            return  # protect() said why; the job trains as without jitckpt
        for dl in self._loaders:
            self._watch_epochs(dl)
        self._rngs = RankRngs.of_job(rank=self._rank, world_size=self._world)
        self._protected.on_minibatch.append(lambda s, rng: self._rngs.started(s, self._resume_rngs(s, rng)))
        jitckpt.init(self._save, step_fn=lambda: self._protected.step)

    def resume(self, path: Optional[str]) -> int:
        """``accelerator.load_state(path)`` (a checkpoint jitckpt wrote, or one of ``save_state``'s)
        and the number of optimizer steps done, which the loop goes on from; 0 if ``path`` is None."""
        if path is None:
            return self._protected.step
        self._accelerator.load_state(path)
        return self._protected.step

    # Events ----------------------------------------------------------------------------------------
    def _watch_epochs(self, loader: Any) -> None:
        """Record the data RNG whenever ``loader`` begins an epoch: accelerate's DataLoaderShard calls
        its ``begin()`` after syncing the sampler's generator from rank 0 and before making the
        iterator, which draws the epoch's order from it."""
        began = loader.begin

        def begin() -> None:
            self._iter_rng = (self._protected.step, data_rng(self._loaders))
            began()

        loader.begin = begin

    def _loaded(self, state: dict) -> None:
        """``load_state`` of a checkpoint jitckpt wrote (after the model, optimizer, scheduler and
        this rank's RNG file): the iterator's RNG now, the minibatch's at its forward."""
        step = int(state["step"])
        self._protected.resumed_by_framework(step)
        mine = state["rng"].get(self._rank)
        if mine is None:
            log.warning("resuming from jitckpt's checkpoint of step %d: rank %d's RNG state is not in it (it was "
                        "lost with the rank); rank %d's random draws (shuffle, dropout) differ from an "
                        "uninterrupted run", step, self._rank, self._rank)
            return
        set_data_rng(self._loaders, mine["iter"])
        self._iter_rng = (self._epoch_start(step), mine["iter"])
        if mine["batch"] is not None:
            self._protected.pin_forward_rng(mine["batch"])

    # State -------------------------------------------------------------------------------------------
    def _epoch_start(self, step: int) -> int:
        return step - step % self._epoch if self._epoch else 0

    def _resume_rngs(self, step: int, rng: dict) -> dict:
        """What a resume at minibatch ``step`` restores on this rank, given its RNG at that
        minibatch's start: the RNG its epoch's iterator is made from, and ``rng``. A failure at an
        epoch's end, before the next epoch's iterator is made, makes it from the RNG as it is now,
        and the resumed loop's own draws (that iterator's) lead to the minibatch's RNG: none is pinned."""
        it = self._iter_rng
        if it is not None and it[0] == self._epoch_start(step):
            return {"iter": it[1], "batch": rng}
        return {"iter": data_rng(self._loaders), "batch": None}

    def _save(self, path: str) -> str:
        """jitckpt's save function: ``step_<k>/`` in ``save_state``'s layout inside ``path``."""
        from accelerate.utils import clean_state_dict_for_safetensors
        from safetensors.torch import save_file

        sd = self._protected.state_dict()
        step = int(sd["step"])
        out = Path(path) / ENTRY.format(step=step)
        out.mkdir()
        model = clean_state_dict_for_safetensors(OrderedDict((k, v.detach()) for k, v in sd["model"].items()))
        save_file({k: v.contiguous() for k, v in model.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        torch.save(sd["optimizer"], out / "optimizer.bin")
        if sd["scheduler"] is not None:
            torch.save(sd["scheduler"], out / "scheduler.bin")
        rngs = self._rngs.at(step, self._resume_rngs(step, sd["rng"]))
        for r, state in rngs.items():
            torch.save(accelerate_rng(state["iter"]["global"], step), out / f"random_states_{r}.pkl")
        for i, obj in enumerate(self._accelerator._custom_objects):
            # Another registered object is saved as it is now (it is the user's: jitckpt cannot know
            # its state at the minibatch's start).
            mine = {"step": step, "rng": rngs} if obj is self._state else obj.state_dict()
            torch.save(mine, out / f"custom_checkpoint_{i}.pkl")
        return out.name


__all__ = ["JitCheckpoint", "VERSION"]
