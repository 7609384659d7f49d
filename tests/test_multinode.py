"""Two launchers as two "nodes" on this machine, coordinating through node 0's c10d TCPStore."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from jobs import ROOT, TRAIN, _read_jsonl, kill_tree, start_launcher, wait_for_records


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(tmp_path, script_args, tag, *, local_dirs=False):
    """Two launchers of one job; ``local_dirs``: each its own --checkpoint-dir (not shared)."""
    port = free_port()
    procs = []
    for node in (0, 1):
        d = tmp_path / f"{tag}-node{node}"
        d.mkdir(parents=True)
        cmd = [sys.executable, "-m", "jitckpt", "run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag,
               "--checkpoint-dir", str(tmp_path / f"{tag}-ckpt{node if local_dirs else ''}"), "--run-dir", str(d / "run"),
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


@pytest.mark.slow
def test_two_nodes_with_checkpoint_dirs_they_do_not_share_stop_at_the_start(tmp_path):
    """Found from outside: node-local --checkpoint-dir of one name made the restarted ranks load
    different steps (each node found its own checkpoints) and hang in DDP's first broadcast until
    the restarts ran out. Both launchers now stop before any worker starts, naming the fix."""
    rcs, outs = launch_nodes(tmp_path, [], "local", local_dirs=True)
    assert rcs == [1, 1], outs
    for node, out in enumerate(outs):
        assert f"is not shared between the job's nodes: node {node} does not see what node(s) [{1 - node}]" in out, out
        assert "mounts at the same path" in out
    events = _read_jsonl(tmp_path / "local-node0" / "run" / "events.jsonl")
    assert not [e for e in events if e["event"] == "worker_start"]


@pytest.mark.slow
def test_node_1_stops_soon_naming_the_store_when_node_0_is_lost(tmp_path):
    """c10d: node 0's launcher serves the job's store, so losing node 0 whole ends the job. Node 1's
    rank saves a JIT checkpoint and its launcher stops within the store's 15 s grace, naming the store
    (found from outside: it retried every store request for 15 s in turn, 76 s in all, then tried to
    restart and died on "Broken pipe")."""
    import time

    port = free_port()
    procs = []
    try:
        for node in (0, 1):
            procs.append(start_launcher(tmp_path / f"node{node}", [
                "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lost0",
                "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / f"node{node}" / "run"),
                "--status-interval", "0", str(TRAIN), "--steps", "200", "--step-sleep", "0.1",
                "--steps-log", str(tmp_path / "train.jsonl")]))
        wait_for_records(tmp_path / "train.jsonl", 6, procs)
        kill_tree(procs[0].pid)
        t0 = time.monotonic()
        assert procs[1].wait(timeout=60) == 1
        took = time.monotonic() - t0
        out = (tmp_path / "node1" / "out.txt").read_text()
        assert took < 30, (took, out[-3000:])
        assert "job stopped: the job's store (c10d at 127.0.0.1" in out, out[-3000:]
        ev1 = _read_jsonl(tmp_path / "node1" / "run" / "events.jsonl")
        assert any(e["event"] == "checkpoint_saved" and e["rank"] == 1 and e["kind"] == "jit" for e in ev1)
    finally:
        for p in procs:
            kill_tree(p.pid)
