"""A DDP training script that uses the paper's API: ``jitckpt.init(save_fn, step_fn=...)`` and
``jitckpt.get_checkpoint_path()``, with its own save function and no ``jitckpt.mark_step`` (unless
--mark-step). Used by tests/test_init_api.py.

Failure injection: --inject GEN:RANK:STEP:MODE fires in launch GEN on RANK at minibatch STEP, MODE
one of ``kill`` (SIGKILL self before the forward pass), ``exit0`` (``sys.exit(0)``: leave the job
early with a success code) or ``fork-kill`` (fork a helper that keeps every inherited descriptor
open for 120 s, as a data loader or compile worker would, write its PID and the time to
``<steps-log>.death``, then SIGKILL self).
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import jitckpt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--inject", action="append", default=[], metavar="GEN:RANK:STEP:MODE")
    p.add_argument("--mark-step", action="store_true", help="call jitckpt.mark_step each iteration")
    p.add_argument("--out", default="")
    p.add_argument("--steps-log", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mine = {}
    for spec in args.inject:
        g, r, s, mode = spec.split(":")
        if int(g) == gen and int(r) == rank:
            mine[int(s)] = mode
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    state = {"done": 0}  # completed optimizer steps

    def save_fn(path):
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "step": state["done"], "rng": torch.get_rng_state()}, os.path.join(path, "state.pt"))

    jitckpt.init(save_fn, step_fn=lambda: state["done"])
    path = jitckpt.get_checkpoint_path()
    if path is not None:
        sd = torch.load(os.path.join(path, "state.pt"), weights_only=True)
        net.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        torch.set_rng_state(sd["rng"])
        state["done"] = sd["step"]
    logf = open(args.steps_log, "a") if args.steps_log else None
    for step in range(state["done"], args.steps):
        if args.mark_step:
            jitckpt.mark_step(step)
        mode = mine.get(step)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit0":
            sys.exit(0)
        if mode == "fork-kill":
            helper = os.fork()
            if helper == 0:
                time.sleep(120)
                os._exit(0)
            with open(args.steps_log + ".death", "w") as f:
                json.dump({"helper": helper, "t": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        state["done"] += 1
        sched.step()
        if logf:
            logf.write(json.dumps({"gen": gen, "rank": rank, "step": step, "loss": loss.item()}) + "\n")
            logf.flush()
    if rank == 0 and args.out:
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, args.out + ".tmp")
        os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
