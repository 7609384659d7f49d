"""An accelerate job as a user writes it: an MLP with dropout, AdamW and a per-step StepLR, a
shuffled plain ``DataLoader`` over two epochs, prepared by an ``Accelerator`` (DDP over gloo on CPU),
the loop resuming as accelerate's examples do (``load_state``, then ``skip_first_batches``).

The flags are tests/fault_harness.py's (tests/scripts/harness_flags.py). ``--without-jitckpt`` runs
the same job with no jitckpt at all (the failure-free reference under torchrun); ``--resume DIR``
resumes from DIR with ``accelerator.load_state`` outside jitckpt (``--keep-jitckpt``: with
``JitCheckpoint`` constructed, which restores every rank's RNG from jitckpt's checkpoint).
"""
from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from harness_flags import StepRecords, end, parser, save_final

p = parser()
p.add_argument("--keep-jitckpt", action="store_true", help="with --without-jitckpt: construct JitCheckpoint")
p.add_argument("--samples", type=int, default=64, help="the dataset's size (64: 8 steps per epoch on 2 ranks)")
args = p.parse_args()
records = StepRecords(args)
accelerator = Accelerator(cpu=True)
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
g = torch.Generator().manual_seed(1)
x = torch.randn(args.samples, 8, generator=g)
data = list(zip(x, x.sum(dim=1, keepdim=True).sin()))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
step = 0
if not args.without_jitckpt or args.keep_jitckpt:
    import jitckpt
    from jitckpt.integrations.accelerate import JitCheckpoint

    jit = JitCheckpoint(accelerator)
    step = jit.resume(args.resume or jitckpt.get_checkpoint_path())
elif args.resume:
    accelerator.load_state(args.resume)
    step = int(args.resume.rstrip("/").rsplit("step_", 1)[1])
n = len(loader)
for epoch in range(step // n, -(-args.steps // n)):
    done = step - epoch * n  # this epoch's batches already trained on
    for xb, yb in accelerator.skip_first_batches(loader, done) if done else loader:
        if step >= args.steps:
            break
        records.began(step)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        records.die(step, "forward")
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        records.done(step)
        step += 1
save_final(accelerator.unwrap_model(model), opt.optimizer, args.out)
end(args.without_jitckpt)
