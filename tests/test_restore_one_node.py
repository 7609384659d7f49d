"""Issue 19: two ranks of one node restore an in-memory snapshot straight into their live tensors.

Each rank copies the whole state from the node's keeper into its own model and optimizer, and
hashes and checks for NaN/Inf only its share (one data object each); one all-reduce combines the
verdicts. So damage that only the other rank can see must still turn both ranks away from a step.
Two real gloo ranks (forked processes), a real keeper process.
"""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from forked_ranks import run_ranks
from jitckpt.snapshot.client import SnapshotTaker
from jitckpt.snapshot.keeper_client import KeeperClient

PROC_TIMEOUT = 90.0


def _trainer(seed: int) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.BatchNorm1d(13), torch.nn.Dropout(0.1),
                                torch.nn.Linear(13, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 7)).sum().backward()
    opt.step()
    return model, opt


def _live(model, opt) -> dict:
    return {"step": 0, "model": model.state_dict(), "optimizer": opt.state_dict()}


def _frozen(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return type(state)((k, _frozen(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(_frozen(v) for v in state)
    return state


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _worker(rank: int, port: int, sock: str, out: str, damage: str) -> None:
    from jitckpt.snapshot.restore import restore

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    model, opt = _trainer(0)  # data-parallel replicas: the same state on both ranks
    states = {1: _frozen({**_live(model, opt), "step": 1})}
    model(torch.randn(5, 7)).sum().backward()
    opt.step()
    states[2] = _frozen({**_live(model, opt), "step": 2})
    if damage == "nan":  # the layout's last tensor: in the second data object, which rank 1 checks
        states[2]["optimizer"]["state"][3]["exp_avg_sq"][-1] = math.nan
    snap = SnapshotTaker(state_fn=lambda: states[step], socket_path=sock, scheme="none", ranks_per_node=2)
    for step in (1, 2):
        assert snap.begin(step) and snap.wait() == step
    snap.close()
    dist.barrier()  # both objects of both steps are in the keeper
    if damage == "partial" and rank == 0:
        # Step 3 as a kill in the middle of a snapshot leaves it: rank 0 committed its object and
        # the metadata, rank 1 died before committing its own.
        c = KeeperClient(sock)
        items = []
        for key in ("x0.0", "meta"):
            m, info = c.open(key, 2)
            w = c.begin(key, 3, info.size)
            w[:info.size] = m[:info.size]
            items.append({"key": key, "step": 3, "checksum": info.checksum, "algo": info.algo})
        c.commit(items)
        c.close()
    if damage == "flip" and rank == 0:
        c = KeeperClient(sock)
        m, info = c.open("x0.1", 2)  # hashed by rank 1 only
        m[info.size // 2] ^= 0x04
        c.close()
    dist.barrier()
    other, other_opt = _trainer(rank + 5)
    live = _live(other, other_opt)
    params = {k: v.data_ptr() for k, v in live["model"].items()}
    client = None
    if damage == "premapped":  # as each rank's warm standby hands it over
        client = KeeperClient(sock)
        client.premap()
    if damage == "nokeeper" and rank == 1:
        sock += ".gone"  # this rank cannot reach the keeper
    try:
        res = restore(socket_path=sock, ranks_per_node=2, into=live, keeper=client)
    except RuntimeError as e:
        Path(out, f"{rank}.json").write_text(json.dumps({"error": str(e)}))
        return
    if client is not None:
        client.close()
    result = {"mapped_ahead": res.mapped_ahead, **_outcome(res, states, params, other, other_opt)}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _outcome(res, states: dict, params: dict, model, opt) -> dict:
    """What a test checks of a restore into ``model``'s and ``opt``'s live tensors (``params``: the
    model's data pointers before it): the step, whether it is bitwise the state snapshotted at that
    step, restored in place, and what load_state_dict then holds."""
    result = {"source": res.source, "step": res.step, "skipped": res.skipped}
    if res.state is not None:
        result["same"] = _same(states[res.step], res.state)
        result["in_place"] = all(res.state["model"][k].data_ptr() == p for k, p in params.items()
                                 if res.state["model"][k].numel())
        model.load_state_dict(res.state["model"])
        opt.load_state_dict(res.state["optimizer"])
        result["loaded"] = _same(states[res.step]["model"], model.state_dict())
    return result


def _run(tmp_path: Path, sock: str, damage: str) -> list[dict]:
    assert run_ranks(_worker, sock, str(tmp_path), damage, timeout=PROC_TIMEOUT) == [0, 0]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mapped", ["premapped", "none"])
def test_two_ranks_restore_the_newest_step_into_their_own_tensors(keeper, tmp_path, mapped) -> None:
    sock, _ = keeper
    for r in _run(tmp_path, sock, mapped):
        assert (r["source"], r["step"], r["mapped_ahead"]) == ("memory", 2, mapped == "premapped"), r["skipped"]
        assert r["same"] and r["in_place"] and r["loaded"]


@pytest.mark.timeout(180)
def test_a_flipped_byte_only_the_other_rank_hashes_turns_both_to_the_older_step(keeper, tmp_path) -> None:
    """Rank 1 alone hashes the damaged object; rank 0 copied it into its tensors all the same and
    must not keep it: the verdict is combined, and both load step 1 instead, bitwise."""
    sock, _ = keeper
    r0, r1 = _run(tmp_path, sock, "flip")
    for r in (r0, r1):
        assert (r["source"], r["step"]) == ("memory", 1), r["skipped"]
        assert r["same"] and r["in_place"] and r["loaded"]
    assert ["memory step 2", "fails its checksum"] in r1["skipped"]
    assert ["memory step 2", "failed on another rank"] in r0["skipped"]


@pytest.mark.timeout(180)
def test_a_nan_only_the_other_rank_checks_rejects_the_step_on_both(keeper, tmp_path) -> None:
    sock, _ = keeper
    for r in _run(tmp_path, sock, "nan"):
        assert (r["source"], r["step"]) == ("memory", 1), r["skipped"]
        assert ["memory step 2", "restored state has NaN/Inf"] in r["skipped"]
        assert r["same"] and r["loaded"]
    c = KeeperClient(sock)
    try:
        assert {e["step"] for e in c.listing()} == {1}  # never offered again
    finally:
        c.close()


@pytest.mark.timeout(180)
def test_a_rank_without_the_keeper_stops_every_rank_rather_than_train_on_partial_state(keeper, tmp_path) -> None:
    """The direct path needs every rank on the keeper. Rank 0 has copied a snapshot into its
    tensors by the time the verdict says rank 1 cannot reach the keeper; then rank 0 alone cannot
    rebuild the state and no disk tier exists: both ranks raise (no rank starts afresh while the
    other stops, and neither waits in a collective the other skipped)."""
    sock, _ = keeper
    r0, r1 = _run(tmp_path, sock, "nokeeper")
    for r in (r0, r1):
        assert "partial data" in r.get("error", ""), r
    assert "cannot connect to the snapshot keeper" in r1["error"]


@pytest.mark.timeout(180)
def test_a_step_one_rank_never_committed_is_passed_over_by_both(keeper, tmp_path) -> None:
    """A kill in the middle of a snapshot: step 3 has rank 0's object and the metadata but not rank
    1's. Both ranks pass over it and load step 2, bitwise."""
    sock, _ = keeper
    for r in _run(tmp_path, sock, "partial"):
        assert (r["source"], r["step"]) == ("memory", 2), r["skipped"]
        assert any(what == "memory step 3" and "data objects" in why for what, why in r["skipped"]), r["skipped"]
        assert r["same"] and r["in_place"] and r["loaded"]
