"""The floor of in-process recovery on this machine: what a failure costs if the survivors keep their
processes (the route issue 19 names, as NVIDIA's in-process restart and torchft take), measured
without any of jitckpt's machinery, so that bench_recovery can put it beside jitckpt's time.

Two processes, both with torch imported before the clock starts (a warm standby and a survivor):

* the survivor (rank 0) holds the bench model and its Adam state, as at the start of the failed
  minibatch; the standby (rank 1) holds nothing;
* on "go" both form a new gloo group (a new store, rank 0 serves it), the standby builds the model and
  its optimizer, both wrap it in DDP (whose constructor broadcasts the parameters from rank 0), and the
  survivor broadcasts the optimizer state (one flat tensor), which the standby loads;
* each reports the seconds from "go" to ready at the failed minibatch. The floor is the slower rank.

Not included: detecting the failure, getting the survivor's main thread out of the failed
collective, tearing down its old group. So this is a lower bound of that route, not an implementation.

Usage (from bench_recovery.py): python bench/inprocess_floor.py [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIMS = [1024, 2048, 2048, 1024]  # bench_recovery's MODEL: 8.4 M parameters, Adam: 100 MB of state


def _model():  # type: ignore[no-untyped-def]
    import torch.nn as nn

    layers: list = []
    for a, b in zip(DIMS[:-2], DIMS[1:-1]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(DIMS[-2], DIMS[-1]))


def rank_main(rank: int, port: int) -> None:
    import datetime

    import torch
    import torch._dynamo  # noqa: F401 - DDP's constructor imports it; a warm standby has (jitckpt's do)
    import torch.distributed as dist
    import torch.nn.parallel  # noqa: F401

    torch.set_num_threads(1)
    model = opt = None
    if rank == 0:  # the survivor: model and optimizer state exist before the failure
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(32, DIMS[0])).square().mean().backward()
        opt.step()
    print("ready", flush=True)
    t0 = float(sys.stdin.readline())
    t_go = time.time()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    phases = {"group_s": time.time() - t_go}
    if rank == 1:  # the standby: builds what the user's script builds
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    phases["build_s"] = time.time() - t_go
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts the parameters from rank 0
    phases["ddp_s"] = time.time() - t_go
    params = list(ddp.module.parameters())
    n = sum(p.numel() for p in params)
    if rank == 0:
        flat = torch.cat([torch.cat([opt.state[p]["exp_avg"].reshape(-1), opt.state[p]["exp_avg_sq"].reshape(-1)])
                          for p in params])
    else:
        flat = torch.empty(2 * n)
    dist.broadcast(flat, 0)
    if rank == 1:
        off = 0
        for p in params:
            k = p.numel()
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": flat[off:off + k].view_as(p).clone(),
                            "exp_avg_sq": flat[off + k:off + 2 * k].view_as(p).clone()}
            off += 2 * k
    t_ready = time.time()
    print(json.dumps({"rank": rank, "ready_s": t_ready - t0, "from_go_s": t_ready - t_go, **phases}), flush=True)
    # No teardown: in torch 2.13, freeing DDP's reducer (which holds the GIL) joins gloo's worker
    # thread, which may be waiting for the GIL to free the broadcast's tensor: a deadlock at exit
    # seen in about one run in three here, each costing this benchmark a 120 s timeout.
    os._exit(0)


def measure(reps: int = 3, rank_timeout: float = 120) -> dict:
    """The floor, median of ``reps`` runs (each: fresh processes, warm before the clock starts;
    a run whose ranks take longer than ``rank_timeout`` is tried again, ``2 * reps`` runs at most)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    floors: list = []
    runs: list = []
    attempts = 0
    while len(floors) < reps:
        attempts += 1
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port)], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(2)]
        try:
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            t0 = time.time()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(f"{t0}\n")
                p.stdin.flush()
            outs = [json.loads(p.communicate(timeout=rank_timeout)[0].strip().splitlines()[-1]) for p in procs]
        except subprocess.TimeoutExpired:
            # Once in a long bench run a rank hung in its rendezvous (a port taken meanwhile?): try
            # afresh, a bounded number of times.
            if attempts >= 2 * reps:
                raise
            print("in-process floor: a run hung; running it again", file=sys.stderr, flush=True)
            continue
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        floors.append(max(o["ready_s"] for o in outs))
        runs.append(outs)
    return {"floor_s": statistics.median(floors), "samples_s": floors, "runs": runs, "attempts": attempts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.rank is not None:
        rank_main(a.rank, a.port)
        return
    print(json.dumps(measure(a.reps), indent=1))


if __name__ == "__main__":
    main()
