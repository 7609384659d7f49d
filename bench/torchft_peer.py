"""The recovery bench's workload under torchft (``pip install torchft``): one rank per replica group,
torchft's DDP across the groups, its lighthouse deciding each step's quorum (run by bench_inprocess.py).

Replica group 1 SIGKILLs itself when it begins step ``--fail-step`` (first launch only); its torchrun
starts it again, and the new process takes the live state from the other group (torchft's peer
recovery) and rejoins. Every step a group commits is logged with its time (``--steps-log``): the
bench reads when the surviving group committed the failed step and when the replacement committed
its first one. torchft's survivor does not redo the minibatch with the lost group's data: its step is
taken with the quorum it has, so the result is not the failure-free run's (no bitwise claim).

Usage (per replica group): REPLICA_GROUP_ID=G TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT torchrun
--nproc-per-node 1 --max-restarts 1 bench/torchft_peer.py --steps 40 --fail-step 25 --steps-log L
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.nn as nn

DIMS = [1024, 2048, 2048, 1024]  # bench_recovery's MODEL


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fail-step", type=int, default=25)
    p.add_argument("--steps-log", required=True)
    a = p.parse_args()
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])
    launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    layers: list = []
    for i, o in zip(DIMS[:-2], DIMS[1:-1]):
        layers += [nn.Linear(i, o), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(DIMS[-2], DIMS[-1]))
    inner = torch.optim.Adam(net.parameters(), lr=1e-3)

    def state_dict() -> dict:
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        net.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"group{group}",
                      timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30))
    model = DistributedDataParallel(manager, net)
    opt = Optimizer(manager, inner)
    log = open(a.steps_log, "a")
    loss_fn = nn.MSELoss()
    while manager.current_step() < a.steps:
        step = manager.current_step()
        if group == 1 and launch == 0 and step == a.fail_step:
            log.write(json.dumps({"group": group, "dying": step, "t": time.time()}) + "\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * step + group)
        x, y = torch.randn(32, DIMS[0], generator=g), torch.randn(32, DIMS[-1], generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()  # torchft starts the step's quorum here
        loss_fn(model(x), y).backward()
        opt.step()  # committed only if every participant's step went through (torchft's should_commit)
        log.write(json.dumps({"group": group, "launch": launch, "step": step,
                              "participants": manager.num_participants(), "t": time.time(),
                              "dt": time.perf_counter() - t0}) + "\n")
        log.flush()


if __name__ == "__main__":
    main()
