"""AOR (ZeRO-1 optimizer replica) cost on the training step, measured in one run (CPU, gloo).

Two rank processes train an MLP with ZeroRedundancyOptimizer(Adam). Blocks of 5 steps alternate
with and without ``replica.capture()`` (AOR x5, none x5, ...), so load drifts on this shared
machine hit both alike; the first step of each block is not counted (the previous block's last
recompute may still run in it); the median step times are compared. A step is zero_grad + forward + backward + one
flat gradient all-reduce + [capture] + zero.step(). Also reported: the trainer-thread gradient
copy per capture, the time capture() waited for the worker, and the worker's recompute time per
update (overlap hides it from the step, it does not make it free: on 2 shared cores it competes
with the trainers). The replica's state is not checked here (alternating skips updates);
tests/test_snapshot_aor.py checks exactness. Keeper writes are not included (bench_snapshot.py).

Usage: python bench/bench_aor.py [--hidden 1024 --layers 4 --steps 65] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from jitckpt.snapshot.aor import OptimizerReplica, successor_peer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mods: list = []
    for _ in range(args.layers):
        mods += [nn.Linear(args.hidden, args.hidden), nn.Tanh()]
    model = nn.Sequential(*mods)
    params = list(model.parameters())
    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=1e-4)
    replica = OptimizerReplica(zero=zero, peer=successor_peer(rank, world, 1))
    times: dict = {"aor": [], "none": []}
    block = 5
    for step in range(args.steps):
        with_aor = (step // block) % 2 == 0
        x = torch.randn(32, args.hidden)
        t0 = time.perf_counter()
        zero.zero_grad()
        model(x).square().mean().backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        if with_aor:
            replica.capture()
        zero.step()
        if step % block and step >= block:  # the first block warms up allocators and the worker
            times["aor" if with_aor else "none"].append(time.perf_counter() - t0)
    replica.close()
    st = replica.stats
    n = max(st.updates, 1)
    print(json.dumps({
        "rank": rank, "params": sum(p.numel() for p in params),
        "peer_params": sum(p.numel() for ps in replica.live for p in ps),
        "step_median_s": {k: statistics.median(v) for k, v in times.items()},
        "copy_ms_per_capture": 1e3 * st.copy_seconds / n,
        "blocked_ms_per_capture": 1e3 * st.blocked_seconds / n,
        "update_ms_per_update": 1e3 * st.update_seconds / n,
        "update_cpu_ms_per_update": 1e3 * st.update_cpu_seconds / n,
    }), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=65)
    p.add_argument("--out", default="")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        rank_main(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    argv = [sys.executable, __file__, "--rank", "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--steps", str(args.steps)]
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [json.loads(pr.communicate(timeout=600)[0].strip().splitlines()[-1]) for pr in procs]
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait(10)
    for o in outs:
        med = o["step_median_s"]
        o["step_overhead_pct"] = 100.0 * (med["aor"] / med["none"] - 1.0)
        # The ceiling: AOR's own CPU work (the gradient copy and the recomputed optimizer step) as a
        # share of a step. With every core busy training, as here, nothing can hide it; REFT's ~0.6 %
        # needs host cores idle while devices compute, which this machine does not have.
        o["cpu_work_pct_of_step"] = 100.0 * (o["copy_ms_per_capture"] + o["update_cpu_ms_per_update"]) / (1e3 * med["none"])
    result = {"config": vars(args) | {"rank": None}, "ranks": outs,
              "load_average": os.getloadavg()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
