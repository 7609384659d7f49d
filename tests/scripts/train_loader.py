"""A hand-written DDP loop whose data position is a data loader's, not "data chosen by step": an MLP
with dropout, AdamW and StepLR, a ``StatefulDataLoader`` over a ``DistributedSampler(shuffle=True)`` (``--loader``: or a plain
``DataLoader``, fast-forwarded), two epochs, with ``jitckpt.protect(ddp, opt, sched, dataloader=loader)``.

The flags are tests/fault_harness.py's (tests/scripts/harness_flags.py). ``--without-jitckpt`` runs
the same loop with no jitckpt at all (the failure-free reference under torchrun).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from harness_flags import StepRecords, end, parser, save_final

p = parser()
p.add_argument("--loader", default="stateful", choices=["stateful", "plain", "shuffle"],
               help="stateful: a StatefulDataLoader over a DistributedSampler(shuffle=True); plain: a torch "
                    "DataLoader (no state_dict: fast-forwarded) over the same sampler; shuffle: a DataLoader("
                    "shuffle=True) over this rank's half of the data (its order drawn from the global RNG)")
p.add_argument("--rank-seed", action="store_true", help="seed torch's RNG by rank after building the model "
               "(every rank's dropout, and with --loader shuffle its order, differ)")
args = p.parse_args()
records = StepRecords(args)
dist.init_process_group("gloo")
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
model = DDP(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 8, generator=g)
data = list(zip(x, x.sum(dim=1, keepdim=True).sin()))
if args.loader == "shuffle":  # this rank's half, shuffled at each iter() from the global RNG (a RandomSampler)
    sampler = None
    loader = torch.utils.data.DataLoader(data[dist.get_rank()::dist.get_world_size()], batch_size=4, shuffle=True)
else:
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    kind = StatefulDataLoader if args.loader == "stateful" else torch.utils.data.DataLoader
    loader = kind(data, batch_size=4, sampler=sampler)
if args.rank_seed:
    torch.manual_seed(100 + dist.get_rank())
step = 0
if not args.without_jitckpt:
    import jitckpt

    state = jitckpt.protect(model, opt, sched, dataloader=loader)
    step = state.restore()  # model, optimizer, scheduler, RNG and the loader's position
for epoch in range(step // len(loader), -(-args.steps // len(loader))):
    if sampler is not None:
        sampler.set_epoch(epoch)
    for xb, yb in loader:
        if step >= args.steps:
            break
        records.began(step)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        records.die(step, "forward")
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        records.done(step)
        step += 1
save_final(net, opt, args.out)
end(args.without_jitckpt)
