"""Issue 19: ranks on several nodes restore an in-memory snapshot straight into their live tensors.

Each node's keeper holds its ranks' parts of the flat state; a rank verifies its node's parts,
receives the others' over the process group and copies every part into its own model and
optimizer, hashing and checking all of it for NaN/Inf behind the copy: no assembled private
copy, and the parts that crossed the network are verified end to end. Two simulated nodes of one
rank each (two real keeper processes, two forked gloo ranks).
"""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import keeper_process
from forked_ranks import run_ranks
from jitckpt.snapshot.client import META_KEY, SnapshotTaker, Topology
from jitckpt.snapshot.keeper_client import KeeperClient
from test_restore_one_node import _frozen, _live, _outcome, _same, _trainer

PROC_TIMEOUT = 90.0


def _worker(rank: int, port: int, socks: list, out: str, damage: str) -> None:
    from jitckpt.snapshot.restore import restore

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    sock = socks[rank]  # node `rank`'s keeper
    model, opt = _trainer(0)  # data-parallel replicas: the same state on both ranks
    states = {1: _frozen({**_live(model, opt), "step": 1})}
    model(torch.randn(5, 7)).sum().backward()
    opt.step()
    states[2] = _frozen({**_live(model, opt), "step": 2})
    if damage == "nan":  # the layout's last tensor: in node 1's part, which rank 0 receives
        states[2]["optimizer"]["state"][3]["exp_avg_sq"][-1] = math.nan
    snap = SnapshotTaker(state_fn=lambda: states[step], socket_path=sock, scheme="none", ranks_per_node=1)
    for step in (1, 2):
        assert snap.begin(step) and snap.wait() == step
    snap.close()
    dist.barrier()  # both nodes' objects of both steps are in their keepers
    if damage == "flip" and rank == 1:  # in node 1's keeper, after its writer hashed it
        c = KeeperClient(sock)
        m, info = c.open("x1.0", 2)
        m[info.size // 2] ^= 0x04
        c.close()
    dist.barrier()
    other, other_opt = _trainer(rank + 5)
    live = _live(other, other_opt)
    params = {k: v.data_ptr() for k, v in live["model"].items()}
    try:
        res = restore(socket_path=sock, ranks_per_node=1, into=live)
    except RuntimeError as e:
        c = KeeperClient(sock)
        steps = sorted({e["step"] for e in c.listing()})
        c.close()
        Path(out, f"{rank}.json").write_text(json.dumps({"error": str(e), "steps_left": steps}))
        return
    result = {"remote": res.remote, **_outcome(res, states, params, other, other_opt)}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run(tmp_path: Path, damage: str) -> list[dict]:
    socks = [str(tmp_path / f"k{n}.sock") for n in range(2)]
    with keeper_process(socks[0]), keeper_process(socks[1]):
        assert run_ranks(_worker, socks, str(tmp_path), damage, timeout=PROC_TIMEOUT) == [0, 0]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(180)
def test_two_nodes_restore_the_newest_step_into_their_own_tensors(tmp_path) -> None:
    r0, r1 = _run(tmp_path, "none")
    for r, received in ((r0, ["x1.0"]), (r1, [META_KEY, "x0.0"])):  # the metadata: from rank 0
        assert (r["source"], r["step"], r["skipped"]) == ("memory", 2, []), r
        assert r["remote"] == received
        assert r["same"] and r["in_place"] and r["loaded"]


@pytest.mark.timeout(180)
def test_a_nan_in_the_other_nodes_part_rejects_the_step_on_both(tmp_path) -> None:
    """Rank 0 finds the NaN only in the part it received from node 1. Both ranks have written into
    their tensors and no disk checkpoint exists: both raise (neither trains on it), and both
    keepers never offer step 2 again."""
    for r in _run(tmp_path, "nan"):
        assert "partial data" in r.get("error", ""), r
        assert "memory step 2: restored state has NaN/Inf" in r["error"]
        assert r["steps_left"] == [1]


@pytest.mark.timeout(180)
def test_a_flipped_byte_in_a_keeper_is_found_in_the_copy_and_the_step_chosen_again_verified(tmp_path) -> None:
    """Loading into the live tensors hashes every part in the copy, so the catalogue does not hash
    them first. A byte flipped in node 1's keeper after its writer hashed it is found there, on both
    ranks; the catalogue is then made again, hashed, which leaves node 1's part of step 2 out (no
    protection covers it): both load step 1, bitwise, into their own tensors."""
    for r in _run(tmp_path, "flip"):
        assert (r["source"], r["step"]) == ("memory", 1), r
        assert r["same"] and r["in_place"] and r["loaded"]
        assert r["skipped"] == [["memory step 2", "an object fails its checksum after the transfer"],
                                ["memory step 2", "more objects lost than the protection scheme covers"]], r


def test_a_part_that_fails_its_checksum_after_the_transfer_is_not_used(tmp_path) -> None:
    """The bytes of every part are hashed behind the copy into the live tensors and compared with
    the checksum their writer recorded: a mismatch (here a wrong record stands in for bytes damaged
    on the way) gives no state, and says that the tensors were written."""
    from jitckpt.snapshot.restore import _load_memory, latest_memory_step, local_catalogue

    model, opt = _trainer(0)
    state = _frozen(_live(model, opt))
    with keeper_process(str(tmp_path / "k.sock")):
        snap = SnapshotTaker(state_fn=lambda: state, socket_path=str(tmp_path / "k.sock"), scheme="none",
                             ranks_per_node=1)
        assert snap.begin(1) and snap.wait() == 1
        snap.close()
        keeper = KeeperClient(str(tmp_path / "k.sock"))
        topo = Topology(0, 1, 1)
        try:
            choice = latest_memory_step([local_catalogue(keeper, topo)], topo)
            assert choice is not None and set(choice.checksums) == {"x0.0"} and META_KEY in choice.holders
            live = _live(*_trainer(3))
            loaded, wrote, finite = _load_memory(choice, keeper, topo, None, [], into=live)
            assert wrote and finite and _same(state, loaded)
            assert loaded["model"]["0.weight"].data_ptr() == live["model"]["0.weight"].data_ptr()
            value, algo = choice.checksums["x0.0"]
            choice.checksums["x0.0"] = (value ^ 1, algo)
            assert _load_memory(choice, keeper, topo, None, [], into=_live(*_trainer(4)))[:2] == (None, True)
        finally:
            keeper.close()


def _gather_worker(rank: int, port: int, out: str) -> None:
    from jitckpt.snapshot import restore as r

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    topo = Topology(rank=rank, world=2, ranks_per_node=1)
    calls = []
    real = dist.all_gather
    r.dist.all_gather = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    long = "x" * (r.GATHER_INLINE_BYTES + 17)
    got = {"short": r.gather_json({"rank": rank, "é": [1.5, None]}, topo, None)}
    got["short_calls"] = len(calls)
    got["mixed"] = r.gather_json(long if rank == 1 else [], topo, None)  # only rank 1's is long
    got["mixed_calls"] = len(calls) - got["short_calls"]
    got["empty"] = r.gather_json("", topo, None)
    Path(out, f"{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_gather_json_takes_one_round_unless_some_rank_sends_a_long_document(tmp_path) -> None:
    from jitckpt.snapshot.restore import GATHER_INLINE_BYTES

    assert run_ranks(_gather_worker, str(tmp_path), timeout=PROC_TIMEOUT) == [0, 0]
    long = "x" * (GATHER_INLINE_BYTES + 17)
    for r in range(2):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["short"] == [{"rank": 0, "é": [1.5, None]}, {"rank": 1, "é": [1.5, None]}]
        assert got["short_calls"] == 1
        assert got["mixed"] == [[], long] and got["mixed_calls"] == 2
        assert got["empty"] == ["", ""]


def _parity_worker(rank: int, port: int, socks: list, diverge: bool) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=30))
    # "z" ends the flat state: node 2's second segment, which node 1's parity covers and which only
    # a decode of node 0's shard reads (the place a differing RNG state sat, issue 19's fix).
    state = {"w": torch.arange(3000, dtype=torch.float32),
             "z": torch.full((64,), float(rank if diverge else 7))}
    snap = SnapshotTaker(state_fn=lambda: state, socket_path=socks[rank], scheme="aec", ranks_per_node=1)
    assert snap.begin(1) and snap.wait() == 1
    snap.close()
    dist.barrier()  # every node's objects are committed
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("diverge", [False, True])
def test_a_range_decoded_from_parity_is_checked_against_its_writers_replica(tmp_path, diverge: bool) -> None:
    """Three nodes, AEC, node 0 lost. Each parity writer hashes every range it XORs, as read from
    its own replica; a decoded range must match. Replicas that differ (here rank 2's last tensor)
    would otherwise decode into finite garbage that nothing catches."""
    from jitckpt.snapshot.restore import find_latest_in_memory

    socks = [str(tmp_path / f"k{n}.sock") for n in range(3)]
    with keeper_process(socks[0]), keeper_process(socks[1]), keeper_process(socks[2]):
        assert run_ranks(_parity_worker, socks, diverge, world=3, timeout=PROC_TIMEOUT) == [0, 0, 0]
        c = KeeperClient(socks[1])
        parity = [e for e in c.listing() if e["key"] == "p1.0"]
        c.close()
        assert len(parity) == 1 and len(parity[0]["covers"]) == 2  # one checksum per node it covers
        survivors = {1: socks[1], 2: socks[2]}
        if not diverge:
            step, state = find_latest_in_memory(survivors, num_nodes=3, ranks_per_node=1)
            assert step == 1 and torch.equal(state["w"], torch.arange(3000, dtype=torch.float32))
            assert torch.equal(state["z"], torch.full((64,), 7.0))
        else:
            with pytest.raises(ValueError, match=r"x0.0 decoded from parity p1.0 differs .* node 1 hashed"):
                find_latest_in_memory(survivors, num_nodes=3, ranks_per_node=1)
