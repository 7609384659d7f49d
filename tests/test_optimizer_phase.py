"""The optimizer phase the runtime sees spans the training thread's whole ``optimizer.step()``,
nested steps included, and no other thread's.

``ZeroRedundancyOptimizer.step()`` runs its local optimizer's step, whose hooks fire inside its own,
then waits for the all-gather of the updated parameters. A save in that wait would record them half
updated (found from outside: a preempted ZeRO job's ranks saved shards with different parameters),
so the phase must end with the outer step only, and not with the step AOR's replica takes on its
worker meanwhile. Two forked gloo ranks, the real hooks, a sink that records what the runtime would
be told.
"""
from __future__ import annotations

import datetime
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from forked_ranks import run_ranks


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def region_enter(self, kind: str) -> int:
        self.calls.append(f"region:{kind}")
        return len(self.calls)

    def region_exit(self, token: int, exc: BaseException | None) -> None:
        pass

    def optimizer_pre_step(self) -> None:
        self.calls.append("pre")

    def optimizer_post_step(self) -> None:
        self.calls.append("post")


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from jitckpt.runtime.collective_hooks import CollectiveHooks

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
    sink = _Recorder()
    hooks = CollectiveHooks(sink)
    hooks.install()
    try:
        model(torch.randn(4, 8)).sum().backward()
        for p in model.parameters():  # the gradients all-reduced, as DDP would
            dist.all_reduce(p.grad)
        sink.calls.clear()
        zero.step()
        calls = list(sink.calls)
        sink.calls.clear()
        shadow = torch.nn.Parameter(torch.ones(3))
        shadow.grad = torch.ones(3)
        worker = threading.Thread(target=torch.optim.Adam([shadow]).step)  # as AOR's replica does
        worker.start()
        worker.join()
    finally:
        hooks.remove()
    Path(out, f"{rank}.json").write_text(json.dumps({"zero": calls, "worker": sink.calls}))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_zero_step_is_one_optimizer_phase_around_its_parameter_all_gather_and_no_worker_step_is(tmp_path) -> None:
    assert run_ranks(_rank, str(tmp_path), timeout=60) == [0, 0]
    for r in range(2):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["worker"] == [], got
        calls = got["zero"]
        regions = [c for c in calls if c.startswith("region:")]
        assert regions, calls  # the parameters' broadcasts were waited for
        assert calls == ["pre", *regions, "post"], calls
