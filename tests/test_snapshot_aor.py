"""AOR (Asynchronous Optimizer Recomputing) for ZeRO-1: replica exactness, refusals, node loss.

Rank-side code runs in real processes (this file re-executed as ``python test_snapshot_aor.py``,
gloo on loopback); every process is killed by PID when its test ends.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_snapshot_nodes import SimCluster, _free_port  # the simulated-node harness

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_zero1_aor.py"
RANK_TIMEOUT = 90.0
PHASE_TIMEOUT = 400.0  # per job phase: bounds a hang; 8 ranks starting on 2 loaded cores took > 150 s


# Rank side ------------------------------------------------------------------------------------

def _init() -> tuple[int, int]:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 4), torch.nn.Linear(4, 4))


REPLICA_CONFIGS = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw_amsgrad": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    "sgd_nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    # NAdam's foreach and for-loop paths round differently (checked below): the pin must hold.
    "nadam": (torch.optim.NAdam, {"lr": 0.01}),
    "nadam_foreach": (torch.optim.NAdam, {"lr": 0.01, "foreach": True}),
    "rmsprop_centered": (torch.optim.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}),
}


def _minibatch(model: torch.nn.Module, zero, step: int, rank: int, world: int) -> None:
    """Step ``step``'s gradients, averaged over the ranks (the last layer gets none at steps 2 and
    3), and at step 4 the learning rate halved, as a scheduler would."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
    zero.zero_grad(set_to_none=True)
    out = model[:5](x) if step in (2, 3) else model(x)
    torch.nn.functional.mse_loss(out, y).backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    if step == 4:
        for group in zero.param_groups:
            group["lr"] *= 0.5


def _train_and_compare(name: str, rank: int, world: int) -> dict:
    """ZeRO-1 steps with two parameter groups, an lr change and a parameter without gradient at
    some steps; then the replica against the peer's real partition state, tensor by tensor."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from jitckpt.snapshot.aor import OptimizerReplica, successor_peer

    cls, kw = REPLICA_CONFIGS[name]
    model = _model()
    params = list(model.parameters())
    zero = ZeroRedundancyOptimizer([{"params": params[:4]}, {"params": params[4:], "lr": kw["lr"] / 3}],
                                   optimizer_class=cls, **kw)
    peer = successor_peer(rank, world, 1)
    replica = OptimizerReplica(zero=zero, peer=peer)
    last = model[5]
    for step in range(7):
        _minibatch(model, zero, step, rank, world)
        replica.capture()
        zero.step()
    assert last.weight.grad is not None
    real: list = [None] * world
    dist.all_gather_object(real, zero.optim.state_dict())
    mine, theirs = replica.state_dict(), real[peer]
    mismatches = []
    if mine["param_groups"] != theirs["param_groups"]:
        # The replica pins foreach where the peer has None; everything else must agree.
        for a, b in zip(mine["param_groups"], theirs["param_groups"]):
            diff = {k for k in set(a) | set(b) if a.get(k) != b.get(k)} - {"foreach"}
            if diff:
                mismatches.append(f"param_groups differ in {sorted(diff)}")
    if sorted(mine["state"]) != sorted(theirs["state"]):
        mismatches.append(f"state indices {sorted(mine['state'])} vs {sorted(theirs['state'])}")
    tensors = 0
    for i in theirs["state"]:
        for k, v in theirs["state"][i].items():
            w = mine["state"].get(i, {}).get(k)
            tensors += 1
            if not (isinstance(w, torch.Tensor) and w.dtype == v.dtype and torch.equal(w, v)):
                mismatches.append(f"state[{i}][{k}]")
    ok_params = replica.matches_live_parameters()
    replica.close()
    return {"mismatches": mismatches, "tensors": tensors, "params_ok": ok_params,
            "peer_params": sum(len(g["params"]) for g in theirs["param_groups"])}


def scenario_replica(rank: int, world: int) -> dict:
    return {name: _train_and_compare(name, rank, world) for name in REPLICA_CONFIGS}


def scenario_log(rank: int, world: int) -> dict:
    """GradientLog (copy interval 2: a ring of 4 slots) over 6 steps with an lr change and a layer
    without gradient at some steps; then a replay of the peer partition from its state and
    parameters at step 2 through the logged steps 2-5, against the peer's real state; the ring's
    slots, as a restore's survey lists them, across a resumed run's ring (start 4); a torn and a
    damaged slot."""
    import numpy as np
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from jitckpt.snapshot.aor import successor_peer
    from jitckpt.snapshot.aor_log import SLOT_HEAD, GradientLog, read_ring_entry, replay_partition, ring_key
    from jitckpt.snapshot.aor_store import _local_partitions
    from jitckpt.snapshot.client import Topology

    model = _model()
    params = list(model.parameters())
    zero = ZeroRedundancyOptimizer([{"params": params[:4]}, {"params": params[4:], "lr": 0.003}],
                                   optimizer_class=torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    peer = successor_peer(rank, world, 1)
    log = GradientLog(zero=zero, peer=peer, every=2)
    copy: dict = {}

    def train(steps) -> None:
        for step in steps:
            _minibatch(model, zero, step, rank, world)
            if step == 2 and "state" not in copy:  # what PartitionCopier sends, and the base
                real: list = [None] * world
                dist.all_gather_object(real, zero.optim.state_dict())
                copy["state"] = real[peer]
                copy["base"] = [p.detach().clone() for p in log.live]
            log.capture(step)
            zero.step()
        log.wait()

    train(range(6))
    keeper = log.keeper
    m, info = keeper.open(ring_key(peer), 0)
    ring = np.frombuffer(m, dtype=np.uint8, count=info.size)
    entries = [read_ring_entry(ring, owner=peer, world=world, slot=t % 4, step=t) for t in range(2, 6)]
    real: list = [None] * world
    dist.all_gather_object(real, zero.optim.state_dict())
    replayed = replay_partition(zero=zero, owner=peer, state=copy["state"], base=copy["base"], entries=entries,
                                live=[p.detach() for p in log.live])
    mismatches = [] if replayed is not None else ["parameters"]
    for i, per in (replayed or {"state": {}})["state"].items():
        for k, v in per.items():
            if not torch.equal(v, real[peer]["state"][i][k]):
                mismatches.append(f"state[{i}][{k}]")
    none_logged = [[g is None for g in e["grads"]] for e in entries]
    topo = Topology.detect(1)

    def listed() -> list:
        return sorted((e["key"], e["step"]) for e in _local_partitions(keeper, topo))

    only_first = listed()
    resumed = GradientLog(zero=zero, peer=peer, every=2, start_step=4)  # as if restored at step 4
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
    resumed.capture(4)
    resumed.capture(5)
    resumed.wait()
    both = listed()
    m4, info4 = keeper.open(ring_key(peer), 4)
    ring4 = np.frombuffer(m4, dtype=np.uint8, count=info4.size)
    head = json.loads(ring4[8:8 + int.from_bytes(ring4[:8].tobytes(), "little")].tobytes())
    slot5 = head["first"] + (5 % 4) * head["slot_size"]
    ring4[slot5 + SLOT_HEAD + 3] ^= 1  # damaged data: its checksum fails
    slot4 = head["first"] + (4 % 4) * head["slot_size"]
    ring4[slot4:slot4 + 8] = 0        # torn: the header's length is written last
    damaged = listed()
    resumed.close()
    log.close()
    return {"mismatches": mismatches, "none_logged": none_logged, "only_first": only_first, "both": both,
            "damaged": damaged, "peer": peer}


def _refusal(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def scenario_refusals(rank: int, world: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from jitckpt.snapshot.aor import OptimizerReplica

    class MyAdam(torch.optim.Adam):
        pass

    def zero(cls=torch.optim.Adam, params=None, **kw):
        return ZeroRedundancyOptimizer(params or _model().parameters(), optimizer_class=cls, lr=0.01, **kw)

    other = 1 - rank
    out = {
        "plain_optimizer": _refusal(lambda: OptimizerReplica(
            zero=torch.optim.Adam(_model().parameters()), peer=other)),
        "lbfgs": _refusal(lambda: OptimizerReplica(zero=zero(torch.optim.LBFGS), peer=other)),
        "subclass": _refusal(lambda: OptimizerReplica(zero=zero(MyAdam), peer=other)),
        "overlap_with_ddp": _refusal(lambda: OptimizerReplica(zero=zero(overlap_with_ddp=True), peer=other)),
        "self_peer": _refusal(lambda: OptimizerReplica(zero=zero(), peer=rank)),
        "peer_out_of_range": _refusal(lambda: OptimizerReplica(zero=zero(), peer=world)),
        "negative_start": _refusal(lambda: OptimizerReplica(zero=zero(), peer=other, start_step=-1)),
        # One parameter tensor for two ranks: rank 1 owns nothing.
        "empty_peer": _refusal(lambda: OptimizerReplica(
            zero=zero(params=[torch.nn.Parameter(torch.ones(3))]), peer=1)) if rank == 0 else "n/a",
    }
    z = zero()
    replica = OptimizerReplica(zero=z, peer=other)
    z.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    out["groups_changed"] = _refusal(replica.capture)
    replica.close()
    return out


def _worker() -> None:
    rank, world = _init()
    result = {"replica": scenario_replica(rank, world), "refusals": scenario_refusals(rank, world),
              "log": scenario_log(rank, world)}
    print(json.dumps({"rank": rank, "result": result}), flush=True)
    import torch.distributed as dist
    dist.destroy_process_group()


# Test side ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both rank-side scenarios, run once on 2 rank processes (killed by PID on timeout): each
    process start pays seconds of torch import and first-optimizer setup on this machine."""
    import contextlib

    from conftest import keeper_process

    world = 2
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "JITCKPT_SNAPSHOT_RANKS_PER_NODE": "1"}
    socks = [str(tmp_path_factory.mktemp("keepers") / f"k{r}.sock") for r in range(world)]
    with contextlib.ExitStack() as keepers:  # one keeper per rank (the log mode's ring lives there)
        for sock in socks:
            keepers.enter_context(keeper_process(sock))
        procs = [subprocess.Popen([sys.executable, __file__],
                                  env={**env, "RANK": str(r), "JITCKPT_SNAPSHOT_SOCKET": socks[r]},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
                 for r in range(world)]
        try:
            outs = [p.communicate(timeout=RANK_TIMEOUT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(10)
    results = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed ({p.returncode}):\n{err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1])["result"])
    return results


@pytest.mark.timeout(150)
def test_replica_is_bitwise_equal_to_peer_partition(rank_results: list) -> None:
    for rank, per_config in enumerate(r["replica"] for r in rank_results):
        for name, r in per_config.items():
            assert r["mismatches"] == [], (rank, name, r)
            assert r["tensors"] >= r["peer_params"] > 0, (rank, name, r)  # state really compared
            assert r["params_ok"], (rank, name)  # shadow parameters followed the peer's update too


@pytest.mark.timeout(150)
def test_gradient_log_replays_the_peer_partition_bitwise_and_its_ring_keeps_one_timeline(
        rank_results: list) -> None:
    for rank, r in enumerate(x["log"] for x in rank_results):
        assert r["mismatches"] == [], (rank, r)
        # steps 2 and 3 had no gradient for the last layer (rank 0's peer owns it): logged as None
        assert any(any(e) for e in r["none_logged"][:2]) or rank == 1, r
        g = f"aor.g{r['peer']}"

        def slots(listed: list) -> list:  # (key, step led to) of the ring's slots
            return sorted(tuple(e) for e in listed if e[0].startswith(g + "."))
        ring0 = [(f"{g}.0.{t % 4}", t + 1) for t in range(2, 6)]
        assert slots(r["only_first"]) == sorted(ring0), r
        # the resumed run's ring (start 4) holds steps 4-5; ring 0's slots of 4-5 are another timeline
        ring4 = [(f"{g}.4.{t % 4}", t + 1) for t in (4, 5)]
        assert slots(r["both"]) == sorted(ring0[:2] + ring4), r
        assert slots(r["damaged"]) == sorted(ring0[:2]), r  # the torn and the damaged slot are left out


def test_foreach_and_for_loop_round_differently_for_nadam() -> None:
    # Why the replica pins the implementation path: the two paths are not bit-compatible.
    ref = [torch.randn(64, 33, generator=torch.Generator().manual_seed(1))]
    results = []
    for foreach in (False, True):
        p = ref[0].clone().requires_grad_()
        opt = torch.optim.NAdam([p], lr=0.01, foreach=foreach)
        g = torch.Generator().manual_seed(2)
        for _ in range(10):
            p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        results.append(p.detach())
    assert not torch.equal(*results)


@pytest.mark.timeout(150)
def test_unsupported_configurations_are_refused(rank_results: list) -> None:
    want = {
        "plain_optimizer": "TypeError: AOR protects a torch.distributed.optim.ZeroRedundancyOptimizer",
        "lbfgs": "ValueError: AOR cannot recompute optimizer torch.optim.lbfgs.LBFGS",
        "subclass": "ValueError: AOR cannot recompute optimizer",
        "overlap_with_ddp": "ValueError: AOR does not support ZeroRedundancyOptimizer(overlap_with_ddp=True)",
        "self_peer": "ValueError: peer must be another rank",
        "peer_out_of_range": "ValueError: peer must be another rank",
        "negative_start": "ValueError: need start_step >= 0",
        "groups_changed": "ValueError: the optimizer's parameter groups changed",
    }
    results = [r["refusals"] for r in rank_results]
    for rank, res in enumerate(results):
        for case, prefix in want.items():
            assert res[case].startswith(prefix), (rank, case, res[case])
    assert results[0]["empty_peer"].startswith("ValueError: peer 1 owns no parameters"), results[0]


# Storage format -------------------------------------------------------------------------------

def test_partition_object_round_trips_bitwise_and_refuses_damage_or_another_job(tmp_path: Path) -> None:
    """write_partition puts a partition state into keeper memory as JSON layout + tensor bytes,
    hashed while copied; _decode gives back the same state bit for bit (no pickle), and refuses an
    object with a damaged header or one written for another owner, step or optimizer."""
    from types import SimpleNamespace

    import numpy as np
    from conftest import keeper_process
    from jitckpt.snapshot.aor_store import _decode, partition_key, write_partition
    from jitckpt.snapshot.checksum import checksum_of
    from jitckpt.snapshot.keeper_client import KeeperClient

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(33, 7)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.5, "amsgrad": True}])
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    zero = SimpleNamespace(optim=opt)  # the header names the optimizer class only
    state = opt.state_dict()
    sock = str(tmp_path / "k.sock")
    with keeper_process(sock):
        keeper = KeeperClient(sock)
        try:
            m, size, h = write_partition(keeper, owner=3, world=4, step=7, zero=zero, state=state)
            keeper.commit([{"key": partition_key(3), "step": 7, "checksum": h.value(), "algo": h.algorithm}])
            m, info = keeper.open(partition_key(3), 7)
            assert checksum_of(memoryview(m)[:size], info.algo) == info.checksum == h.value()
            data = np.frombuffer(m, dtype=np.uint8, count=size).copy()
        finally:
            keeper.close()
    got = _decode(data, owner=3, world=4, step=7, zero=zero)
    assert got["param_groups"] == state["param_groups"]
    assert got["state"].keys() == state["state"].keys()
    for i, per in state["state"].items():
        assert got["state"][i].keys() == per.keys()
        for k, v in per.items():
            assert got["state"][i][k].dtype == v.dtype and torch.equal(got["state"][i][k], v), (i, k)
    fresh = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.5, "amsgrad": True}])
    fresh.load_state_dict(got)  # what load_zero_partition does
    for wrong in ({"owner": 2, "world": 4, "step": 7}, {"owner": 3, "world": 2, "step": 7},
                  {"owner": 3, "world": 4, "step": 6}):
        with pytest.raises(ValueError, match="is for .* this job needs"):
            _decode(data, zero=zero, **wrong)
    with pytest.raises(ValueError, match="is for .*'optimizer': 'AdamW'"):
        _decode(data, owner=3, world=4, step=7, zero=SimpleNamespace(optim=torch.optim.SGD(params, lr=1)))
    damaged = data.copy()
    damaged[:8] = 255  # the header length
    with pytest.raises(ValueError, match="is damaged .* or written by another jitckpt version"):
        _decode(damaged, owner=3, world=4, step=7, zero=zero)
    damaged = data.copy()
    damaged[9] ^= 0x20  # inside the JSON header
    with pytest.raises(ValueError, match="damaged|is for"):
        _decode(damaged, owner=3, world=4, step=7, zero=zero)


# Node loss ------------------------------------------------------------------------------------



class ZeroCluster(SimCluster):
    """SimCluster running the ZeRO-1 + AOR example instead of the replicated-optimizer one."""

    script = SCRIPT
    keeper_lifetime_s = 600  # must outlast both jobs on a loaded 2-core machine


def _zero_node_loss(tmp_path: Path, *, nodes: int, scheme: str, steps: int, pause: tuple,
                    lost: int = 1, rpn: int = 1, zero: str = "recompute",
                    extra: tuple = ()) -> tuple[dict, dict, dict]:
    """Kill node ``lost`` (rank and keeper) and every other rank where ``pause`` says, restart on a
    fresh node, finish; compare with a failure-free run alongside. ``zero``: how the example
    protects the peer partitions (recompute: OptimizerReplica, copy: PartitionCopier).
    (restored, done, ref_done) events."""
    ref_out, out = tmp_path / "ref.pt", tmp_path / "final.pt"
    ref = ZeroCluster(tmp_path, nodes=nodes, ranks_per_node=rpn, scheme=scheme)
    c = ZeroCluster(tmp_path, nodes=nodes, ranks_per_node=rpn, scheme=scheme)
    try:
        for n in range(nodes):
            ref.start_keeper(n)
            c.start_keeper(n)
        ref.start_job("--steps", str(steps), "--zero", zero, *extra, "--out", str(ref_out))
        c.start_job("--steps", str(steps), "--zero", zero, *extra, *map(str, pause))
        c.wait_all_events("paused", PHASE_TIMEOUT)
        c.kill_node(lost)       # its rank and its keeper: its optimizer partition is gone
        c.kill_ranks()          # and every other trainer: nothing live to copy from
        c.start_keeper(lost)    # replacement node, empty memory
        c.start_job("--steps", str(steps), "--zero", zero, *extra, "--restore", "--out", str(out))
        restored = c.wait_all_events("restored", PHASE_TIMEOUT)
        done = c.wait_all_events("done", PHASE_TIMEOUT)
        c.finish_job()
        ref_done = ref.wait_all_events("done", PHASE_TIMEOUT)
        ref.finish_job()
    finally:
        c.close()
        ref.close()
    ref_params, params = torch.load(ref_out, weights_only=True), torch.load(out, weights_only=True)
    assert list(ref_params) == list(params)
    for k in ref_params:
        assert torch.equal(ref_params[k], params[k]), f"{k} differs from the failure-free run"
    for rank in range(nodes * rpn):
        assert done[rank]["partition_sha256"] == ref_done[rank]["partition_sha256"], rank
        # recompute: the replica reproduced the peer's parameters too; copy and log keep no replica
        want_ok = True if zero == "recompute" else None
        assert done[rank]["replica_params_ok"] is want_ok and ref_done[rank]["replica_params_ok"] is want_ok, rank
    # Rank r's replica lives on the previous node: the lost ranks' partitions came from there; the
    # other ranks read their own partition from their own node's keeper (in log mode their peer's
    # partition of the failed step is only where its owner saved it).
    for rank, ev in restored.items():
        if rank // rpn == lost:
            assert ev["own_from"] // rpn == lost - 1 and f"aor.z{rank}" in ev["remote"], ev
        else:
            assert ev["own_from"] // rpn == rank // rpn, ev
            assert zero == "log" or ev["remote"] == [], ev
    return restored, done, ref_done


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nodes,rpn,scheme,zero", [
    # Fast coverage of both modes: the replica test above and test_snapshot_launcher's
    # [node-recompute] and [node-copy] (3 nodes: a ring, each rank sending to one rank and
    # receiving from another).
    pytest.param(2, 1, "arc", "recompute", marks=pytest.mark.slow),
    pytest.param(3, 1, "aec", "copy", marks=pytest.mark.slow),
    pytest.param(3, 1, "aec", "recompute", marks=pytest.mark.slow),
    pytest.param(2, 2, "aec", "recompute", marks=pytest.mark.slow),
    pytest.param(2, 2, "aec", "copy", marks=pytest.mark.slow)])
def test_node_loss_restores_zero_partition_from_peer_replica_bitwise(tmp_path: Path, nodes: int, rpn: int,
                                                                     scheme: str, zero: str) -> None:
    restored, _, _ = _zero_node_loss(tmp_path, nodes=nodes, rpn=rpn, scheme=scheme, steps=7,
                                     pause=("--pause-at", 4), zero=zero)
    for ev in restored.values():
        assert (ev["source"], ev["step"]) == ("memory", 4), ev


@pytest.mark.slow  # the fast suite has the launcher's (test_snapshot_launcher) and the replay scenario above
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nodes,scheme", [(2, "arc"), (3, "aec")])
def test_node_loss_replays_the_lost_partition_from_the_gradient_log_bitwise(tmp_path: Path, nodes: int,
                                                                           scheme: str) -> None:
    # Log mode: partitions copied at steps 0, 4, 8; each rank logs its peer's gradients every step.
    # At step 10 every rank saves its own partition (as survivors do), then node 1 is lost with
    # its keeper: partition 1 of step 10 is replayed on node 0 from the copy and base of 8 and the
    # gradients of 8 and 9, checked against the parameters of 10, and the job resumes at 10.
    restored, _, _ = _zero_node_loss(tmp_path, nodes=nodes, scheme=scheme, steps=13, pause=("--pause-at", 10),
                                     zero="log", extra=("--copy-every", "4"))
    for ev in restored.values():
        assert (ev["source"], ev["step"], ev["replayed"]) == ("memory", 10, [1]), ev


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero", ["recompute", "copy"])
def test_node_loss_mid_snapshot_restores_a_whole_step_bitwise(tmp_path: Path, zero: str) -> None:
    # Killed while step 4's parameter and AOR writes (or the partition exchange) may still run:
    # step 4 if every partition and the parameters of 4 survived, else 3 (kept until every rank
    # committed 4), never a mix.
    restored, _, _ = _zero_node_loss(tmp_path, nodes=2, scheme="arc", steps=7, pause=("--pause-mid", 4),
                                     zero=zero)
    steps = {ev["step"] for ev in restored.values()}
    assert len(steps) == 1 and steps <= {3, 4}, restored
    assert all(ev["source"] == "memory" for ev in restored.values()), restored


if __name__ == "__main__":
    _worker()
