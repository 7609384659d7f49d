"""Data parallelism by hand with ``async_op=True`` all-reduces waited for later, through
``Work.wait()`` or ``Work.get_future().wait()`` (no DDP, no jitckpt.blocking_region): used by
tests/test_ddp_collectives.py to check that such waits are covered.

--inject GEN:RANK:STEP:MODE, MODE ``kill`` or ``stop`` (SIGKILL/SIGSTOP self before the step's
all-reduces): the other ranks are then blocked in (stop) or fail in (kill) their later wait.
"""
import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

import jitckpt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--wait", choices=["work", "future"], default="work")
    p.add_argument("--inject", action="append", default=[], metavar="GEN:RANK:STEP:MODE")
    p.add_argument("--out", default="")
    p.add_argument("--steps-log", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mine = {int(s): mode for g, r, s, mode in (i.split(":") for i in args.inject)
            if int(g) == gen and int(r) == rank}
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    state = jitckpt.protect(net, opt)
    logf = open(args.steps_log, "a") if args.steps_log else None
    for step in range(state.restore(), args.steps):
        mode = mine.get(step)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(net(x), y).backward()
        works = [dist.all_reduce(q.grad.div_(world), async_op=True) for q in net.parameters()]
        for w in works:  # waited for only now, after every all-reduce was issued
            w.wait() if args.wait == "work" else w.get_future().wait()
        opt.step()
        if logf:
            logf.write(json.dumps({"gen": gen, "rank": rank, "step": step}) + "\n")
            logf.flush()
    if rank == 0 and args.out:
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, args.out + ".tmp")
        os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
