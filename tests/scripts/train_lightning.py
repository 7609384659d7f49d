"""A PyTorch Lightning job as a user writes it: an MLP with dropout, AdamW and a per-step StepLR, a
shuffled ``StatefulDataLoader`` over two epochs, DDP over gloo on CPU, with jitckpt's callback.

The flags are tests/fault_harness.py's: every rank logs ``begin``/``step`` records to
``--steps-log``; rank 0 saves its final parameters and optimizer state to ``--out``.
``--without-jitckpt`` runs the same job with no jitckpt at all (the failure-free reference under
torchrun); ``--resume CKPT`` resumes with Lightning's own ``ckpt_path``, outside jitckpt.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torchdata.stateful_dataloader import StatefulDataLoader

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--out", default="")
p.add_argument("--steps-log", default="")
p.add_argument("--without-jitckpt", action="store_true")
p.add_argument("--resume", default="")
p.add_argument("--keep-callback", action="store_true", help="with --without-jitckpt: keep JitCheckpointCallback "
               "(it restores every rank's RNG when resuming from jitckpt's checkpoint)")
p.add_argument("--die", default="", help="RANK:STEP:forward|end: that rank SIGKILLs itself (first run only) after "
               "its forward of minibatch STEP, or once optimizer step STEP is done")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds slept at each step's start (numbers unchanged)")
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die(step: int, where: str) -> None:
    if args.die and gen == 0 and args.die == f"{rank}:{step}:{where}":
        os.kill(os.getpid(), signal.SIGKILL)


class StepLog(L.Callback):
    """What the fault harness watches: when each rank begins and completes each step."""

    def __init__(self) -> None:
        self.f = open(args.steps_log, "a") if args.steps_log else None

    def _log(self, **rec) -> None:  # type: ignore[no-untyped-def]
        if self.f:
            self.f.write(json.dumps({"gen": gen, "rank": rank, "pid": os.getpid(), "t": time.time(), **rec}) + "\n")
            self.f.flush()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._log(begin=trainer.global_step)
        time.sleep(args.step_sleep)  # a slow step, for a signal to land mid-training

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._log(step=trainer.global_step - 1)
        die(trainer.global_step - 1, "end")


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        die(self.trainer.global_step, "forward")
        return loss

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
                    enable_model_summary=False, num_sanity_val_steps=0)
ckpt = args.resume or None
if not args.without_jitckpt and not ckpt:
    ckpt = jitckpt.get_checkpoint_path()
trainer.fit(model, loader, ckpt_path=ckpt)
if rank == 0 and args.out:
    final = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in trainer.optimizers[0].state_dict()["state"].items():
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
