"""Issue 13 item 11: the c10d stores jitckpt runs listen on the rendezvous address, not on every
interface (torch's default for the store rank 0 starts in ``init_process_group``)."""
from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from jobs import ROOT, TRAIN, kill_tree


def _listening(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


def _wait_lines(path: Path, n: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, f"job ended early (rc {proc.returncode})"
        time.sleep(0.1)
    raise AssertionError(f"{path} did not reach {n} lines in time")


def test_generation_store_and_gloo_listen_on_loopback_only(tmp_path):
    steps = tmp_path / "steps.jsonl"
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"),
           "--status-interval", "0", str(TRAIN), "--steps", "400", "--step-sleep", "0.05",
           "--steps-log", str(steps)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait_lines(steps, 6, proc, time.monotonic() + 120)  # both ranks past init_process_group
        events = [json.loads(l) for l in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
        pids = {e["rank"]: e["pid"] for e in events if e["event"] == "worker_start"}
        assert sorted(pids) == [0, 1]
        sockets = {rank: _listening(pid) for rank, pid in pids.items()}
        assert sockets[0], "rank 0 serves the process group's store: it must listen somewhere"
        for rank, socks in sockets.items():
            for ip, port in socks:
                assert ipaddress.ip_address(ip).is_loopback, (
                    f"rank {rank} listens on {ip}:{port}, beyond this machine: {sockets}")
    finally:
        kill_tree(proc.pid)


SCENARIO = r'''
import json, socket, sys
import psutil
from jitckpt.cli import build_parser
from jitckpt.launcher.config import LaunchConfig
from jitckpt.launcher.node_coordinator import NodeCoordinator

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
cfg = LaunchConfig.from_args(build_parser().parse_args(
    ["run", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}",
     "--rdzv-id", "t", sys.argv[1]]))
coord = NodeCoordinator(cfg)
print(json.dumps([c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port]))
coord.close()
'''


def test_multinode_rendezvous_store_binds_the_endpoint_address(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(script)], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["127.0.0.1"]
