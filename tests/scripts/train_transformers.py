"""A Hugging Face Trainer job as a user writes it: a tiny random-init GPT-2 with dropout, AdamW and a
linear schedule, DDP over gloo (2 epochs of a shuffled dataset), with jitckpt's callback.

The flags are tests/fault_harness.py's: every rank logs ``begin``/``step`` records to
``--steps-log``; rank 0 saves its final parameters and optimizer state to ``--out``.
``--without-jitckpt`` runs the same job with no jitckpt at all (the failure-free reference under
torchrun); ``--resume DIR`` resumes from a checkpoint with Trainer's own resume, outside jitckpt.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--out", default="")
p.add_argument("--steps-log", default="")
p.add_argument("--without-jitckpt", action="store_true")
p.add_argument("--resume", default="")
p.add_argument("--save-only-model", action="store_true")
p.add_argument("--die", default="", help="RANK:STEP:forward|end: that rank SIGKILLs itself (first run only) after "
               "its forward of minibatch STEP, or once optimizer step STEP is done")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds slept at each step's start (numbers unchanged)")
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class StepLog(TrainerCallback):
    """What the fault harness watches: when each rank begins and completes each step."""

    def __init__(self) -> None:
        self.f = open(args.steps_log, "a") if args.steps_log else None

    def _log(self, **rec) -> None:  # type: ignore[no-untyped-def]
        if self.f:
            self.f.write(json.dumps({"gen": gen, "rank": rank, "pid": os.getpid(), "t": time.time(), **rec}) + "\n")
            self.f.flush()

    def on_step_begin(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
        self._log(begin=state.global_step)
        time.sleep(args.step_sleep)  # a slow step, for a signal to land mid-training

    def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
        self._log(step=state.global_step - 1)
        die(state.global_step - 1, "end")


def die(step: int, where: str) -> None:
    if args.die and gen == 0 and args.die == f"{rank}:{step}:{where}":
        os.kill(os.getpid(), signal.SIGKILL)


set_seed(0)
config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=16,
                    resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
model = GPT2LMHeadModel(config)
if args.die.endswith(":forward"):
    model.register_forward_hook(lambda *_: die(trainer.state.global_step, "forward"))
g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, config.vocab_size, (64, 16), generator=g)
dataset = [{"input_ids": t, "labels": t} for t in tokens]
targs = TrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="hf-out-"), per_device_train_batch_size=4, max_steps=args.steps,
    learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, save_strategy="no", logging_steps=4,
    report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, ddp_backend="gloo",
    save_only_model=args.save_only_model, disable_tqdm=True)
callbacks: list = [StepLog()]
resume = args.resume or None
if not args.without_jitckpt:
    import jitckpt
    from jitckpt.integrations.transformers import JitCheckpointCallback

    callbacks.append(JitCheckpointCallback())
trainer = Trainer(model=model, args=targs, train_dataset=dataset, callbacks=callbacks)
if not args.without_jitckpt and not resume:
    resume = jitckpt.get_checkpoint_path()
trainer.train(resume_from_checkpoint=resume)
if rank == 0 and args.out:
    final = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in trainer.optimizer.state_dict()["state"].items():
        final.update({f"optim.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    torch.save(final, args.out)
# As a user's script ends (the framework leaves the process group up).
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
if args.without_jitckpt:
    # A reference run must not fail after its work is done: torch's gloo teardown at interpreter
    # exit now and then aborts ("terminate called without an active exception"). Under jitckpt
    # run the exit barrier (atexit) must run, and such a death after it is no failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
