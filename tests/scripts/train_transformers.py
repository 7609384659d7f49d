"""A Hugging Face Trainer job as a user writes it: a tiny random-init GPT-2 with dropout, AdamW and a
linear schedule, DDP over gloo (2 epochs of a shuffled dataset), with jitckpt's callback.

The flags are tests/fault_harness.py's: every rank logs ``begin``/``step`` records to
``--steps-log``; rank 0 saves its final parameters and optimizer state to ``--out``.
``--without-jitckpt`` runs the same job with no jitckpt at all (the failure-free reference under
torchrun); ``--resume DIR`` resumes from a checkpoint with Trainer's own resume, outside jitckpt.
"""
from __future__ import annotations

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

from harness_flags import StepRecords, end, parser, save_final

p = parser()
p.add_argument("--save-only-model", action="store_true")
p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps (batches per optimizer step)")
args = p.parse_args()
records = StepRecords(args)


class StepLog(TrainerCallback):
    """What the fault harness watches: when each rank begins and completes each step."""

    def on_step_begin(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
        records.began(state.global_step)

    def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
        records.done(state.global_step - 1)


set_seed(0)
config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=16,
                    resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
model = GPT2LMHeadModel(config)
if args.die.endswith(":forward"):
    model.register_forward_hook(lambda *_: records.die(trainer.state.global_step, "forward"))
g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, config.vocab_size, (64, 16), generator=g)
dataset = [{"input_ids": t, "labels": t} for t in tokens]
targs = TrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="hf-out-"), per_device_train_batch_size=4, max_steps=args.steps,
    learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, save_strategy="no", logging_steps=4,
    report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, ddp_backend="gloo",
    save_only_model=args.save_only_model, disable_tqdm=True, gradient_accumulation_steps=args.accum)
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
save_final(model, trainer.optimizer, args.out)
end(args.without_jitckpt)
