"""A PyTorch Lightning job as a user writes it: an MLP with dropout, AdamW and a per-step StepLR, a
shuffled ``StatefulDataLoader`` over two epochs, DDP over gloo on CPU, with jitckpt's callback.

The flags are tests/fault_harness.py's: every rank logs ``begin``/``step`` records to
``--steps-log``; rank 0 saves its final parameters and optimizer state to ``--out``.
``--without-jitckpt`` runs the same job with no jitckpt at all (the failure-free reference under
torchrun); ``--resume CKPT`` resumes with Lightning's own ``ckpt_path``, outside jitckpt.
"""
from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torchdata.stateful_dataloader import StatefulDataLoader

from harness_flags import StepRecords, end, parser, save_final

p = parser()
p.add_argument("--keep-callback", action="store_true", help="with --without-jitckpt: keep JitCheckpointCallback "
               "(it restores every rank's RNG when resuming from jitckpt's checkpoint)")
p.add_argument("--accum", type=int, default=1, help="accumulate_grad_batches (batches per optimizer step)")
p.add_argument("--validate", action="store_true", help="a validation loop twice per epoch, inside fit")
args = p.parse_args()
records = StepRecords(args)


class StepLog(L.Callback):
    """What the fault harness watches: when each rank begins and completes each step."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):  # type: ignore[no-untyped-def]
        records.began(trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        records.done(trainer.global_step - 1)


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        records.die(self.trainer.global_step, "forward")
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


L.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 8, generator=g)
data = list(zip(x, x.sum(dim=1, keepdim=True).sin()))
loader = StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=0)
callbacks: list = [StepLog()]
if not args.without_jitckpt or args.keep_callback:
    import jitckpt
    from jitckpt.integrations.lightning import JitCheckpointCallback

    callbacks.append(JitCheckpointCallback())
model = MLP()
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    strategy=DDPStrategy(process_group_backend="gloo"), max_steps=args.steps,
                    callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, accumulate_grad_batches=args.accum,
                    **({"val_check_interval": 0.5} if args.validate else {"limit_val_batches": 0}))
ckpt = args.resume or None
if not args.without_jitckpt and not ckpt:
    ckpt = jitckpt.get_checkpoint_path()
val = StatefulDataLoader(data[:16], batch_size=4) if args.validate else None
trainer.fit(model, loader, val, ckpt_path=ckpt)
save_final(model, trainer.optimizers[0], args.out)
end(args.without_jitckpt)
