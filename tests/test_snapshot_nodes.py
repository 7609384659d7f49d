"""Whole-node loss with no surviving replica: resume from the in-memory snapshot tier.

Each simulated node is a keeper process plus its rank processes (gloo on loopback). A node is
killed with SIGKILL (its ranks and its keeper, so its memory is gone), the other ranks are killed
too (no live replica is left to JIT-checkpoint from), a replacement node starts with an empty
keeper, and the new job restores from the surviving keepers: AEC decodes the lost shard from XOR
parity, ARC fetches the copy the predecessor node kept. The run must finish bitwise identical to
a failure-free run that took the same snapshots.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_snapshot.py"
DEADLINE = 150.0  # seconds per job phase: bounds a hang; normally 15-40 s


_USED_PORTS: set[int] = set()


def _free_port() -> int:
    """A free port not handed out before in this session (two jobs run side by side: a reused
    port would make one job's ranks join the other's store)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _USED_PORTS:
            _USED_PORTS.add(port)
            return port


class SimCluster:
    """Keepers and rank processes of simulated nodes; every process is killed by PID in close()."""

    script = SCRIPT  # the training script each rank runs
    # A safety net only (close() kills keepers by PID): outlive the test's own 400 s timeout, or a
    # slow, loaded machine loses a keeper mid-test.
    keeper_lifetime_s = 450

    def __init__(self, workdir: Path, *, nodes: int, ranks_per_node: int, scheme: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="snap", dir="/tmp"))  # short Unix socket paths
        self.workdir, self.m, self.r, self.scheme = workdir, nodes, ranks_per_node, scheme
        self.keepers: dict[int, subprocess.Popen] = {}
        self.ranks: dict[int, subprocess.Popen] = {}
        self.all: list[subprocess.Popen] = []
        self.events: list[dict] = []
        self._buf: dict[int, bytes] = {}
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def sock(self, node: int) -> str:
        return str(self.dir / f"k{node}.sock")

    def start_keeper(self, node: int) -> None:
        p = subprocess.Popen([sys.executable, "-m", "jitckpt.snapshot.keeper", "--socket", self.sock(node),
                              "--node", str(node), "--max-lifetime", str(self.keeper_lifetime_s)],
                             stdout=subprocess.PIPE,
                             text=True, env=self.env, cwd=ROOT)
        self.all.append(p)
        line = p.stdout.readline()  # "ready" once it listens; EOF if it died
        assert line.startswith("ready"), f"keeper {node} did not start: {line!r}"
        self.keepers[node] = p

    def start_job(self, *extra: str) -> None:
        port, world = _free_port(), self.m * self.r
        self.ranks, self._buf = {}, {}
        for rank in range(world):
            env = {**self.env, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "JITCKPT_SNAPSHOT_SOCKET": self.sock(rank // self.r)}
            p = subprocess.Popen([sys.executable, str(self.script), "--scheme", self.scheme,
                                  "--ranks-per-node", str(self.r), "--timeout", "40", *extra],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, cwd=self.workdir)
            self.all.append(p)
            self.ranks[rank] = p

    def wait_all_events(self, name: str, timeout: float = DEADLINE) -> dict[int, dict]:
        """Read every rank's stdout until each printed event ``name``; fail on exit or timeout."""
        sel = selectors.DefaultSelector()
        got: dict[int, dict] = {}
        for rank, p in self.ranks.items():  # lines left over from the previous call first
            ev = self._take_event(rank, name)
            if ev is not None:
                got[rank] = ev
            else:
                sel.register(p.stdout.fileno(), selectors.EVENT_READ, rank)
        end = time.monotonic() + timeout
        try:
            while len(got) < len(self.ranks):
                left = end - time.monotonic()
                if left <= 0:
                    self.kill_ranks()
                    errs = "\n".join(f"--- rank {r}:\n{p.stderr.read()[-2000:]}" for r, p in self.ranks.items())
                    raise AssertionError(f"timed out waiting for {name!r}; have {sorted(got)}\n{errs}")
                for key, _ in sel.select(left):
                    rank = key.data
                    data = os.read(key.fd, 65536)  # raw reads: no buffered line hidden from select
                    if not data:
                        sel.unregister(key.fd)
                        p = self.ranks[rank]
                        p.wait(timeout=10)
                        raise AssertionError(f"rank {rank} exited ({p.returncode}) before {name!r}:\n"
                                             f"{p.stderr.read()[-3000:]}")
                    self._buf[rank] = self._buf.get(rank, b"") + data
                    ev = self._take_event(rank, name)
                    if ev is not None:
                        got[rank] = ev
                        sel.unregister(key.fd)
        finally:
            sel.close()
        return got

    def _take_event(self, rank: int, name: str):
        """Consume complete lines of ``rank`` up to and including the first event ``name``."""
        buf = self._buf.get(rank, b"")
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            ev = json.loads(line)
            self.events.append(ev)
            if ev["event"] == name:
                self._buf[rank] = buf
                return ev
        self._buf[rank] = buf
        return None

    def finish_job(self) -> None:
        for rank, p in self.ranks.items():
            p.stdin.close()
            rc = p.wait(timeout=DEADLINE)
            assert rc == 0, f"rank {rank} failed ({rc}):\n{p.stderr.read()[-3000:]}"

    def kill_node(self, node: int) -> None:
        victims = [self.ranks[r] for r in range(node * self.r, (node + 1) * self.r)] + [self.keepers.pop(node)]
        for p in victims:
            os.kill(p.pid, signal.SIGKILL)
        for p in victims:
            p.wait(timeout=10)

    def kill_ranks(self) -> None:
        for p in self.ranks.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def close(self) -> None:
        for p in self.all:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for f in (p.stdin, p.stdout, p.stderr):
                if f:
                    f.close()
        for f in self.dir.iterdir():
            f.unlink()
        self.dir.rmdir()


def _run_node_loss(tmp_path: Path, *, nodes: int, rpn: int, scheme: str, steps: int, pause_at: int,
                   lost: int, mid_snapshot: bool = False) -> tuple[dict, dict]:
    ref_out, out = tmp_path / "ref.pt", tmp_path / "final.pt"
    ref = SimCluster(tmp_path, nodes=nodes, ranks_per_node=rpn, scheme=scheme)
    c = SimCluster(tmp_path, nodes=nodes, ranks_per_node=rpn, scheme=scheme)
    try:
        # The failure-free run (same snapshots) runs alongside the first launch of the failing one.
        for n in range(nodes):
            ref.start_keeper(n)
            c.start_keeper(n)
        ref.start_job("--steps", str(steps), "--out", str(ref_out))
        c.start_job("--steps", str(steps), "--pause-mid" if mid_snapshot else "--pause-at", str(pause_at))
        paused = c.wait_all_events("paused")
        assert mid_snapshot or all(ev["snapshot"] == pause_at for ev in paused.values())
        c.kill_node(lost)       # its ranks and its keeper: the node's memory is gone
        c.kill_ranks()          # and no live replica is left anywhere
        c.start_keeper(lost)    # replacement node, empty memory
        c.start_job("--steps", str(steps), "--restore", "--out", str(out))
        restored = c.wait_all_events("restored")
        c.wait_all_events("done")
        c.finish_job()
        ref.wait_all_events("done")
        ref.finish_job()
    finally:
        c.close()
        ref.close()
    ref_params = torch.load(ref_out, weights_only=True)
    params = torch.load(out, weights_only=True)
    assert list(ref_params) == list(params)
    for k in ref_params:
        assert torch.equal(ref_params[k], params[k]), f"{k} differs from the failure-free run"
    return restored, paused


# Slow: through `jitckpt run`, test_snapshot_launcher's node-loss test decodes a lost node's part
# from parity in the fast suite.
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_aec_node_loss_decodes_from_parity_bitwise(tmp_path: Path) -> None:
    restored, _ = _run_node_loss(tmp_path, nodes=3, rpn=1, scheme="aec", steps=10, pause_at=5, lost=1)
    for rank, ev in restored.items():
        assert (ev["source"], ev["step"]) == ("memory", 5), ev
        assert ev["decoded"] == ["x1.0"], ev  # the lost node's shard came from XOR parity


@pytest.mark.timeout(400)
@pytest.mark.parametrize("rpn", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_arc_node_loss_mid_snapshot_uses_peer_copy_bitwise(tmp_path: Path, rpn: int) -> None:
    # The node dies while step 4's snapshot may still be copying: step 4 if every surviving object
    # of it was committed, else step 3 (kept until everyone committed 4) - never a torn mix.
    restored, _ = _run_node_loss(tmp_path, nodes=2, rpn=rpn, scheme="arc", steps=8, pause_at=4, lost=1,
                                 mid_snapshot=True)
    steps = {ev["step"] for ev in restored.values()}
    assert len(steps) == 1 and steps <= {3, 4}, restored
    for rank, ev in restored.items():
        assert (ev["source"], ev["decoded"]) == ("memory", []), ev
    # The replacement node's ranks fetched everything, including their own shard, from node 0.
    parts = {f"x{k}.{l}" for k in range(2) for l in range(rpn)}
    for rank in range(rpn, 2 * rpn):
        assert parts <= set(restored[rank]["remote"]), restored[rank]
