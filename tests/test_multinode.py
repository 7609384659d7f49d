"""Two launchers as two "nodes" on this machine, coordinating through node 0's c10d TCPStore."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from jobs import ROOT, TRAIN, _read_jsonl, kill_tree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(tmp_path, script_args, tag):
    port = free_port()
    procs = []
    for node in (0, 1):
        d = tmp_path / f"{tag}-node{node}"
        d.mkdir(parents=True)
        cmd = [sys.executable, "-m", "jitckpt", "run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag,
               "--checkpoint-dir", str(tmp_path / f"{tag}-ckpt"), "--run-dir", str(d / "run"),
               "--status-interval", "0", "--hang-timeout", "auto:floor=3,startup=60", str(TRAIN),
               "--steps", "10", "--out", str(tmp_path / f"{tag}-final.pt"),
               "--steps-log", str(tmp_path / f"{tag}-train.jsonl"), *script_args]
        procs.append(subprocess.Popen(cmd, cwd=d, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            outs.append(out)
    finally:
        for p in procs:
            kill_tree(p.pid)
    return [p.returncode for p in procs], outs


# Slow: the fast suite's several-node failures are the two-node stage tests (c10d), the snapshot node
# losses and tests/test_node_loss.py (etcd, a whole node lost).
@pytest.mark.slow
def test_two_nodes_recover_from_a_killed_rank(tmp_path):
    rcs, outs = launch_nodes(tmp_path, [], "ref")
    assert rcs == [0, 0], outs
    rcs, outs = launch_nodes(tmp_path, ["--inject", "0:1:4:kill"], "fail")
    assert rcs == [0, 0], "\n".join(o[-3000:] for o in outs)
    ev0 = _read_jsonl(tmp_path / "fail-node0" / "run" / "events.jsonl")
    ev1 = _read_jsonl(tmp_path / "fail-node1" / "run" / "events.jsonl")
    # Node 1 saw its worker die; node 0 learned of it through the store and its rank saved.
    assert any(e["event"] == "failure_detected" for e in ev1)
    assert any(e["event"] == "checkpoint_saved" and e["rank"] == 0 for e in ev0)
    assert [e["restart_count"] for e in ev0 if e["event"] == "restart"] == [1]
    a = torch.load(tmp_path / "fail-final.pt", weights_only=True)
    b = torch.load(tmp_path / "ref-final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in b)
