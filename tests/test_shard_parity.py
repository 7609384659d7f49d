"""XOR parity of DTensor shard snapshots across nodes (``--snapshot-protection aec``, 3+ nodes).

The arithmetic first (every lost node's object decodes, uneven sizes), then real ranks and real
keepers: 4 simulated nodes x 1 rank write uneven shards with parity; a node is lost with its
keeper, and the new job's ranks find the step complete, the lost rank's shard decoded from the
others' parity and shards, bitwise. Two lost nodes of one group cannot be decoded: no step is
offered (the job would resume from disk), never a wrong shard."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from jitckpt.snapshot.protection import xor_into
from jitckpt.snapshot.shard_parity import ParityLayout, decode_sources

from test_snapshot_nodes import SimCluster

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("nodes", [3, 4, 5])
def test_every_lost_nodes_object_decodes_from_the_others_parity(nodes):
    rnd = random.Random(nodes)
    objs = [torch.randint(0, 256, (rnd.randint(1, 5000),), dtype=torch.uint8) for _ in range(nodes)]
    lay = ParityLayout.for_sizes([o.numel() for o in objs], nodes)
    assert lay.size >= max(o.numel() for o in objs) and lay.seg_len * (nodes - 1) == lay.size
    parity = []
    for i in range(nodes):
        p = torch.zeros(lay.seg_len, dtype=torch.uint8)
        for k in range(nodes):
            if k != i:
                xor_into(p, lay.segment(objs[k], lay.seg(k, i)))
        parity.append(p)
    covered = sorted((k, lay.seg(k, i)) for i in range(nodes) for k in range(nodes) if k != i)
    assert covered == sorted((k, s) for k in range(nodes) for s in range(nodes - 1))  # each segment once
    for lost in range(nodes):
        out = torch.empty(lay.size, dtype=torch.uint8)
        for s, (holder, others) in enumerate(decode_sources(lost, ranks_per_node=1, nodes=nodes)):
            assert lost not in others and holder not in others and len(others) == nodes - 2
            dst = out[s * lay.seg_len:(s + 1) * lay.seg_len]
            dst.copy_(parity[holder])
            for j in others:
                xor_into(dst, lay.segment(objs[j], lay.seg(j, holder)))
        assert torch.equal(out[:objs[lost].numel()], objs[lost])


def test_parity_needs_three_nodes():
    with pytest.raises(ValueError, match="3 or more nodes"):
        ParityLayout(2, 64)


class ParityCluster(SimCluster):
    script = ROOT / "tests" / "scripts" / "shard_parity_worker.py"


@pytest.mark.parametrize("lost", [pytest.param([2], marks=pytest.mark.slow), pytest.param([1, 2], marks=pytest.mark.slow)], ids=["one-node", "two-nodes"])
def test_a_lost_nodes_shard_comes_back_from_parity_bitwise(tmp_path, lost):
    c = ParityCluster(tmp_path, nodes=4, ranks_per_node=1, scheme="aec")
    try:
        for n in range(4):
            c.start_keeper(n)
        c.start_job("--steps", "3")
        paused = c.wait_all_events("paused")
        assert all(ev["snapshot"] == 3 for ev in paused.values())
        c.finish_job()
        for n in lost:
            c.keepers.pop(n).kill()
            c.start_keeper(n)  # the replacement node: an empty keeper
        c.start_job("--restore")
        restored = c.wait_all_events("restored")
        c.wait_all_events("done")
        c.finish_job()
    finally:
        c.close()
    if len(lost) == 2:
        assert all(ev["step"] is None for ev in restored.values()), restored
        return
    assert all(ev["step"] == 3 and ev["equal"] for ev in restored.values()), list(restored.values())
    assert restored[2]["how"] == "dt.r2 decoded from parity", restored
    assert all(restored[r]["how"] is None for r in (0, 1, 3)), restored
