"""DDP's construction broadcast deferred in a resumed job (jitckpt.runtime.ddp_init_sync), on two
real gloo ranks whose models start different (seeded by rank)."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from forked_ranks import run_ranks
from jitckpt.runtime.ddp_init_sync import DeferredInitSync

PROC_TIMEOUT = 60.0


def _sums(model: torch.nn.Module) -> list:
    return [float(p.detach().double().sum()) for p in model.parameters()]


def _worker(rank: int, port: int, root: str, mode: str) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        sync = DeferredInitSync(lambda: mode != "fresh")
        DDP.__init__ = sync.wrap_init(DDP.__init__)
        DDP._pre_forward = sync.wrap_pre_forward(DDP._pre_forward)
        torch.manual_seed(rank)  # the replicas differ until something makes them equal
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        ddp = DDP(net, init_sync=True) if mode == "explicit" else DDP(net)
        out = {"constructed": _sums(net), "owed": sync.owed}
        if mode == "loaded":  # what protect().restore() does: the same bytes on every rank
            torch.manual_seed(7)
            loaded = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
            net.load_state_dict(loaded.state_dict())
            sync.loaded()
        out["owed_at_forward"] = sync.owed
        ddp(torch.randn(3, 4)).sum().backward()
        out["after_forward"] = _sums(net)
        Path(root, f"{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def _run(tmp_path: Path, mode: str) -> list:
    assert run_ranks(_worker, str(tmp_path), mode, timeout=PROC_TIMEOUT) == [0, 0]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


def test_resuming_defers_the_broadcast_until_the_first_forward(tmp_path):
    r0, r1 = _run(tmp_path, "owed")
    assert r0["owed"] == r1["owed"] == r0["owed_at_forward"] == 1
    assert r0["constructed"] != r1["constructed"]  # no broadcast in the constructor
    # The first forward broadcast rank 0's parameters before using them: equal after the step's
    # all-reduced gradients, as DDP's own constructor would have made them.
    assert r0["after_forward"] == r1["after_forward"]


def test_a_loaded_checkpoint_settles_the_deferred_broadcast(tmp_path):
    r0, r1 = _run(tmp_path, "loaded")
    assert r0["constructed"] != r1["constructed"]
    assert r0["owed_at_forward"] == r1["owed_at_forward"] == 0  # the forward broadcasts nothing
    assert r0["after_forward"] == r1["after_forward"]  # both loaded the same state


@pytest.mark.parametrize("mode", ["fresh", "explicit"])
def test_fresh_jobs_and_explicit_init_sync_broadcast_in_the_constructor(tmp_path, mode):
    r0, r1 = _run(tmp_path, mode)
    assert r0["owed"] == r1["owed"] == 0
    assert r0["constructed"] == r1["constructed"]
