"""Real node loss (issue 17): three "nodes" on this machine, each a launcher with its worker, the
job's store on a real 3-member etcd cluster (``--rdzv-backend etcd-v2``). At a random step a whole
node's process tree (launcher, worker, standbys) is SIGKILLed at once, as a machine going down: node
0, whose launcher would have served a c10d store, or another. The survivors' ranks save JIT
checkpoints (data-parallel replicas), a replacement launcher started with the lost node's
``--node-rank`` (or, where the launchers had none, with the same command) joins the next
generation, and the final parameters are bitwise a failure-free run's.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from etcd_cluster import etcd_cluster  # noqa: F401  (fixture)
from jobs import ROOT, TRAIN, kill_tree

NODES, STEPS, TIMEOUT_S = 3, 30, 240


class Node:
    """One node's `jitckpt run` (launcher + its worker), in a session of its own; with ``daemon``,
    the node's `jitckpt daemon run` too (its own socket), which then runs the snapshot keeper."""

    def __init__(self, tmp: Path, tag: str, node: Optional[int], endpoint: str, name: str = "",
                 step_sleep: float = 0.05, flags: tuple = (), script_args: tuple = (), daemon: bool = False,
                 backend: str = "etcd-v2") -> None:
        self.dir = tmp / f"{tag}-node{node}{name}"
        self.dir.mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JITCKPT_DAEMON_SOCKET": str(self.dir / "daemon" / "d.sock")}
        self.daemon = None
        if daemon:
            self.daemon = subprocess.Popen([sys.executable, "-m", "jitckpt", "daemon", "run"], env=env,
                                           stdout=open(self.dir / "daemon.log", "wb"), stderr=subprocess.STDOUT,
                                           start_new_session=True)
            log = self.dir / "daemon.log"
            deadline = time.monotonic() + 30
            while "serving" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.02)  # polling for the line a started server writes
            assert "serving" in log.read_text(), log.read_text()
        slot = [] if node is None else ["--node-rank", str(node)]  # None: the c10d rendezvous gives it
        cmd = [sys.executable, "-m", "jitckpt", "run", "--nnodes", str(NODES), *slot,
               "--nproc-per-node", "1", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", tag,
               "--checkpoint-dir", str(tmp / f"{tag}-ckpt"), "--run-dir", str(self.dir / "run"),
               "--status-interval", "0", "--hang-timeout", "auto:floor=3,startup=60", "--save-timeout", "20",
               "--max-restarts", "2", *flags, str(TRAIN), "--steps", str(STEPS), "--step-sleep", str(step_sleep),
               "--out", str(tmp / f"{tag}-final.pt"), "--steps-log", str(tmp / f"{tag}-train.jsonl"),
               *script_args]
        self.log = self.dir / "launcher.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=self.dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def power_off(self) -> None:
        """SIGKILL the daemon, the launcher and every process under them, as a machine going down."""
        for p in (self.daemon, self.proc):
            if p is not None:
                kill_tree(p.pid)

    def events(self) -> list[dict]:
        path = self.dir / "run" / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_all(nodes: list[Node]) -> list[int]:
    deadline = time.monotonic() + TIMEOUT_S
    try:
        return [n.proc.wait(timeout=max(1.0, deadline - time.monotonic())) for n in nodes]
    except subprocess.TimeoutExpired:
        raise AssertionError("a node did not end:\n" + "\n".join(f"--- {n.dir.name}\n{n.log.read_text()[-4000:]}"
                                                                 for n in nodes)) from None


def assert_bitwise(final: Path, expected: dict) -> None:
    got = torch.load(final, weights_only=True)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), \
        "parameters differ from the failure-free run"


def steps_done(log: Path) -> int:
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if '"step"' in line)


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict:
    """The failure-free run's final parameters: one launcher with the 3 ranks (the same math as 3
    nodes of one rank each; cheaper than starting 3 launchers)."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = subprocess.run([sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", str(NODES), "--checkpoint-dir",
                           str(tmp / "ckpt"), "--status-interval", "0", "--warm-standby", "0", str(TRAIN), "--steps", str(STEPS),
                           "--out", str(tmp / "ref-final.pt")], cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(tmp / "ref-final.pt", weights_only=True)


# Node 0: with a c10d store its launcher would take the job down with it. Both in the slow suite
# (~25 s each): the fast one has a node lost with its keeper (test_snapshot_launcher.py) and a
# replacement launcher joining after a node loss (below).
@pytest.mark.parametrize("lost", [pytest.param(0, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_a_whole_node_lost_is_replaced_and_the_job_ends_bitwise(tmp_path: Path, etcd_cluster, expected: dict,
                                                                lost: int) -> None:
    # Each node with its daemon (which runs nothing here but is part of what the node loses).
    nodes = [Node(tmp_path, "loss", n, etcd_cluster.endpoint(n), daemon=True) for n in range(NODES)]
    try:
        at = random.randint(4, STEPS - 12)
        deadline = time.monotonic() + TIMEOUT_S
        while steps_done(tmp_path / "loss-train.jsonl") < NODES * at and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the training's progress: the moment is meant to be random
        assert all(n.proc.poll() is None for n in nodes), "the job ended before the node loss"
        nodes[lost].power_off()
        nodes.append(Node(tmp_path, "loss", lost, etcd_cluster.endpoint(lost), name="-replacement", daemon=True))
        survivors = [n for i, n in enumerate(nodes) if i != lost]
        rcs = wait_all(survivors)
        assert rcs == [0] * NODES, "\n".join(f"--- {n.dir.name}\n{n.log.read_text()[-4000:]}" for n in nodes)
        replacement = nodes[-1].events()
        assert any(e["event"] == "worker_start" for e in replacement)
        assert any(e["event"] == "checkpoint_saved" for n in survivors[:-1] for e in n.events()), "no JIT save"
        assert_bitwise(tmp_path / "loss-final.pt", expected)
        from jitckpt.daemon import Client

        with Client(socket_path=str(survivors[0].dir / "daemon" / "d.sock")) as c:  # a survivor's daemon
            st = c.status()
        job = {j.run_id: j for j in st.jobs}["loss"]
        assert job.status == "ok" and job.generation == 1 and st.failures, st
    finally:
        for n in nodes:
            n.power_off()


def test_a_replacement_launcher_joins_after_the_generation_that_lost_its_node(tmp_path: Path, etcd_cluster) -> None:
    """NodeCoordinator on etcd, two nodes in this process (no server thread: etcd serves): node 1's
    launcher is gone; a new launcher with its --node-rank waits until the survivors found the
    failure, says the lost node's workers are gone (the survivors stop waiting for them at once),
    and joins generation 1 with node 0. A launcher of a job that is still gathering joins the
    generation being gathered."""
    import threading

    from jitckpt.cli import build_parser
    from jitckpt.launcher.config import LaunchConfig
    from jitckpt.launcher.node_coordinator import NodeCoordinator

    def cfg(node: int) -> LaunchConfig:
        return LaunchConfig.from_args(build_parser().parse_args(
            ["run", "--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "etcd-v2", "--rdzv-endpoint",
             etcd_cluster.endpoint(node), "--rdzv-id", "coord", "--rdzv-conf", "timeout=30",
             "--checkpoint-dir", str(tmp_path / "ckpt"), str(TRAIN)]))

    coords = [NodeCoordinator(cfg(0)), NodeCoordinator(cfg(1))]
    try:
        assert [c.first_launch() for c in coords] == [0, 0]  # a new job (node 0 not yet begun: nothing there)
        ts = [threading.Thread(target=c.begin_generation, args=(0,)) for c in coords]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        assert not any(t.is_alive() for t in ts)
        coords[1].close()  # node 1 is lost
        coords[1] = NodeCoordinator(cfg(1))
        got: list[int] = []
        joiner = threading.Thread(target=lambda: got.append(coords[1].first_launch()))
        joiner.start()
        joiner.join(0.5)
        assert joiner.is_alive(), "the replacement did not wait for the survivors to find the failure"
        coords[0].announce_failure(0, {"kind": "hang", "rank": 1, "detail": "node 1 gone"})
        joiner.join(30)
        assert got == [1]
        assert coords[0].node_done(0, ok=False), "the survivors still wait for the lost node's workers"
        begun: list[tuple] = []
        t0 = threading.Thread(target=lambda: begun.append(coords[0].begin_generation(1)))
        t0.start()
        late = NodeCoordinator(cfg(1))  # a second launcher for node 1 while generation 1 gathers
        try:
            assert late.first_launch() == 1
        finally:
            late.close()
        joined = coords[1].begin_generation(1)
        t0.join(30)
        assert [g.master for g in begun] == [joined.master] and joined.master[0] == "127.0.0.1", (begun, joined)
        assert (joined.gen, joined.nodes, joined.group_rank, begun[0].group_rank) == (1, (0, 1), 1, 0)
    finally:
        for c in coords:
            c.close()


def _no_rank_cfg(etcd_cluster, tmp_path: Path, *flags: str, timeout: int = 30):  # type: ignore[no-untyped-def]
    """A 2-node etcd job's config, without --node-rank unless ``flags`` give one."""
    from jitckpt.cli import build_parser
    from jitckpt.launcher.config import LaunchConfig

    return LaunchConfig.from_args(build_parser().parse_args(
        ["run", "--nnodes", "2", *flags, "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_cluster.endpoints(),
         "--rdzv-id", "noslot", "--rdzv-conf", f"timeout={timeout}", "--checkpoint-dir", str(tmp_path / "ckpt"),
         str(TRAIN)]))


def _in_threads(*fns) -> list:  # type: ignore[no-untyped-def]
    """Each fn's result or exception, called at once in threads, every thread bounded."""
    import threading

    out: list = [TimeoutError("neither returned nor raised within 25 s")] * len(fns)

    def call(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - the caller asserts on it
            out[i] = e

    ts = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(fns))]
    [t.start() for t in ts]
    [t.join(25) for t in ts]
    return out


@pytest.mark.slow  # make test's 15-minute budget: the node-range and replacement tests on etcd stay fast
def test_without_node_ranks_a_replacement_takes_the_lost_slot_on_etcd(tmp_path: Path, etcd_cluster) -> None:
    """NodeCoordinator on etcd, no --node-rank: two launchers take slots 0 and 1; slot 0's (the
    controller's) is lost. Two new launchers started at once find every slot taken, watch the
    heartbeats, and one takes the lost slot (etcd's compare-and-swap from the lost launcher's claim);
    the other finds slot 1's launcher alive and stops, naming why. The replacement joins generation 1
    with the survivor. (Was: both read ``slot/0``, a key etcd never had (the claim is a once-key
    beside the store's keys), and waited the store's whole timeout, printing nothing.) A launcher
    for a slot whose launcher is alive stops once the rendezvous timeout passed with no failure."""
    from jitckpt.launcher.node_coordinator import NodeCoordinator

    def cfg(*flags: str, timeout: int = 30):  # type: ignore[no-untyped-def]
        return _no_rank_cfg(etcd_cluster, tmp_path, *flags, timeout=timeout)

    coords = [NodeCoordinator(cfg()), NodeCoordinator(cfg())]
    try:
        assert [c.cfg.node_rank for c in coords] == [0, 1]
        assert [c.first_launch() for c in coords] == [0, 0]
        assert [g.nodes for g in _in_threads(*(lambda c=c: c.begin_generation(0) for c in coords))] == [(0, 1)] * 2
        coords[0].close()  # slot 0's launcher is lost
        survivor = coords[1]
        t0 = time.monotonic()
        new = _in_threads(lambda: NodeCoordinator(cfg()), lambda: NodeCoordinator(cfg()))
        coords += [c for c in new if isinstance(c, NodeCoordinator)]
        assert sorted(type(c).__name__ for c in new) == ["NodeCoordinator", "RuntimeError"], new
        replacement, extra = coords[2], next(e for e in new if not isinstance(e, NodeCoordinator))
        assert replacement.cfg.node_rank == 0
        assert isinstance(extra, RuntimeError) and "every node slot of --nnodes 2 is held by a running launcher" in \
            str(extra), repr(extra)
        assert time.monotonic() - t0 < 15, "the launchers took more than three heartbeat periods and a bit"
        got = _in_threads(replacement.first_launch, lambda: survivor.announce_failure(
            0, {"kind": "hang", "rank": 0, "detail": "node 0 gone"}))
        assert got[0] == 1, got
        assert survivor.node_done(0, ok=False), "the survivor still waits for the lost node's workers"
        gens = _in_threads(lambda: replacement.begin_generation(1, restarts=1),
                          lambda: survivor.begin_generation(1, restarts=1))
        assert [(g.gen, g.nodes, g.group_rank) for g in gens] == [(1, (0, 1), 0), (1, (0, 1), 1)], gens
        assert gens[0].master == gens[1].master and gens[0].master[0] == "127.0.0.1"
        # Slot 1's launcher is alive and reported no failure: one with its --node-rank stops, naming why.
        late = NodeCoordinator(cfg("--node-rank", "1", timeout=1))
        coords.append(late)
        with pytest.raises(RuntimeError, match=r"came to replace node 1 of the running generation 1, but no node "
                                               r"reported a failure within the rendezvous timeout \(1s"):
            late.first_launch()
    finally:
        for c in coords:
            c.close()


@pytest.mark.slow  # ~20 s: a dead run's heartbeats are watched twice (slots, then the run)
def test_without_node_ranks_a_new_run_after_a_dead_one_keeps_its_slot_claims(tmp_path: Path, etcd_cluster) -> None:
    """A dead run's keys (every launcher gone, as when etcd lost its majority): launchers without
    --node-rank take its slots from the gone launchers, slot 0's clears the old keys for a new run,
    and each writes its claim again. (Was: the clearing took the claims too, so a launcher started
    later took slot 0 as free, its launcher alive.)"""
    from jitckpt.launcher import job_store
    from jitckpt.launcher.node_coordinator import NodeCoordinator

    old = [NodeCoordinator(_no_rank_cfg(etcd_cluster, tmp_path)) for _ in range(2)]
    coords = list(old)
    try:
        assert [c.first_launch() for c in old] == [0, 0]
        assert [g.nodes for g in _in_threads(*(lambda c=c: c.begin_generation(0) for c in old))] == [(0, 1)] * 2
        for c in old:
            c.close()  # the run is dead: no heartbeat moves
        new = _in_threads(*(lambda: NodeCoordinator(_no_rank_cfg(etcd_cluster, tmp_path)) for _ in range(2)))
        coords += [c for c in new if isinstance(c, NodeCoordinator)]
        assert sorted(c.cfg.node_rank for c in new) == [0, 1], new
        assert _in_threads(*(c.first_launch for c in new)) == [0, 0]
        assert not new[0].store.check(["latest"]), "the dead run's keys were not cleared"
        claims = [job_store.read_once(new[0].store, f"slot/{c.cfg.node_rank}") for c in new]
        assert claims == [c._slot_claim for c in new] and None not in claims, claims
    finally:
        for c in coords:
            c.close()


def test_with_a_node_range_the_job_goes_on_with_fewer_nodes_and_grows_when_one_joins(tmp_path: Path, etcd_cluster) -> None:
    """NodeCoordinator on etcd with --nnodes 2:3, three nodes in this process. Node 0, the
    controller, is lost: a survivor takes the controller's lease, and after the last call generation
    1 has nodes 1 and 2 (node 1's address is the workers' store, its ranks are 0..). A launcher for
    slot 0 started later asks the job to grow (a scale_up failure of generation 1) and generation 2
    has all three."""
    import threading

    from jitckpt.cli import build_parser
    from jitckpt.launcher.config import LaunchConfig
    from jitckpt.launcher.node_coordinator import SCALE_UP, NodeCoordinator

    def cfg(node: int) -> LaunchConfig:
        return LaunchConfig.from_args(build_parser().parse_args(
            ["run", "--nnodes", "2:3", "--node-rank", str(node), "--rdzv-backend", "etcd-v2", "--rdzv-endpoint",
             etcd_cluster.endpoints(first=node), "--rdzv-id", "elastic", "--rdzv-conf",
             "timeout=30,last_call_timeout=1", "--local-addr", f"127.0.0.{node + 1}",
             "--checkpoint-dir", str(tmp_path / "ckpt"), str(TRAIN)]))

    def begin(cs: list, gen: int, restarts: int = 0) -> list:
        out: dict = {}
        ts = [threading.Thread(target=lambda c=c: out.__setitem__(c, c.begin_generation(gen, restarts=restarts)))
              for c in cs]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        assert not any(t.is_alive() for t in ts), "begin_generation did not return"
        return [out[c] for c in cs]

    coords = [NodeCoordinator(cfg(n)) for n in range(3)]
    try:
        assert [c.first_launch() for c in coords] == [0, 0, 0]
        assert [c.leads for c in coords] == [True, False, False]  # the first to take the lease
        gens = begin(coords, 0)
        assert [(g.nodes, g.group_rank, g.master[0]) for g in gens] == [((0, 1, 2), r, "127.0.0.1") for r in range(3)]
        coords[0].close()  # node 0 is lost (its launcher gone: the lease is free)
        survivors = coords[1:]
        survivors[0].announce_failure(0, {"kind": "signal", "rank": 0, "detail": "node 0 gone"})
        t0 = time.monotonic()
        gens = begin(survivors, 1, restarts=1)
        assert [(g.gen, g.nodes, g.group_rank) for g in gens] == [(1, (1, 2), 0), (1, (1, 2), 1)], gens
        assert gens[0].master == gens[1].master and gens[0].master[0] == "127.0.0.2"  # node 1 has rank 0
        assert time.monotonic() - t0 >= 1.0, "closed before the last call"
        assert sum(c.leads for c in survivors) == 1, "no survivor took the controller's lease"
        newcomer = NodeCoordinator(cfg(0))
        coords.append(newcomer)
        assert newcomer.first_launch() == 2
        assert newcomer.restarts_before(2) == survivors[0].restarts_before(1) == 1  # the loss; the growth is none
        failed = json.loads(survivors[0].store.get("g1/failed"))
        assert failed["kind"] == SCALE_UP and "node 0 joins" in failed["detail"], failed
        gens = begin([newcomer, *survivors], 2, restarts=1)
        assert [(g.nodes, g.group_rank) for g in gens] == [((0, 1, 2), r) for r in range(3)], gens
        assert gens[0].master[0] == "127.0.0.1"
    finally:
        for c in coords:
            c.close()


def start_job(tmp_path: Path, etcd_cluster, tag: str, step_sleep: float = 0.05) -> list[Node]:
    """Three nodes, each given every etcd member (a different one first)."""
    return [Node(tmp_path, tag, n, etcd_cluster.endpoints(first=n), step_sleep=step_sleep) for n in range(NODES)]


def wait_for_step(tmp_path: Path, tag: str, at: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while steps_done(tmp_path / f"{tag}-train.jsonl") < NODES * at and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the training's progress: the moment is meant to be random


@pytest.mark.slow
def test_losing_one_etcd_member_changes_nothing(tmp_path: Path, etcd_cluster, expected: dict) -> None:
    nodes = start_job(tmp_path, etcd_cluster, "member")
    try:
        wait_for_step(tmp_path, "member", random.randint(3, STEPS - 10))
        etcd_cluster.kill(0)  # the member node 0's launcher talks to first
        assert wait_all(nodes) == [0] * NODES, [n.log.read_text()[-3000:] for n in nodes]
        kinds = {e["event"] for n in nodes for e in n.events()}
        assert "failure_detected" not in kinds and "restart" not in kinds, kinds
        assert_bitwise(tmp_path / "member-final.pt", expected)
    finally:
        for n in nodes:
            n.power_off()


@pytest.mark.slow
def test_losing_etcds_majority_stops_the_job_with_every_rank_saved_and_it_resumes(
        tmp_path: Path, etcd_cluster, expected: dict) -> None:
    """Two of three members die: no recovery could be coordinated any more. Every launcher finds
    the store refusing writes, has its ranks save a JIT checkpoint and stops with exit code 1,
    naming the store. With etcd back, the same command starts the job again (the dead run's keys
    are told apart by their stale heartbeats) and it resumes from those checkpoints, bitwise."""
    # Slow steps: a write to etcd without a quorum fails after ~7 s, the job must still be training.
    nodes = start_job(tmp_path, etcd_cluster, "quorum", step_sleep=0.6)
    try:
        wait_for_step(tmp_path, "quorum", random.randint(2, 4))
        etcd_cluster.kill(0)
        etcd_cluster.kill(1)
        assert wait_all(nodes) == [1] * NODES, [n.log.read_text()[-3000:] for n in nodes]
        for n in nodes:
            log = n.log.read_text()
            assert "does not take writes" in log and "run the job again once the store is back" in log, log[-3000:]
            saved = [e for e in n.events() if e["event"] == "checkpoint_saved" and e["kind"] == "jit"]
            assert saved, f"{n.dir.name}: its rank saved no JIT checkpoint"
            end = [e for e in n.events() if e["event"] == "job_end"]
            assert end and end[-1]["status"] == "failed" and "etcd" in end[-1]["reason"], end
    finally:
        for n in nodes:
            n.power_off()
    etcd_cluster.restart(0)
    etcd_cluster.restart(1)
    again = [Node(tmp_path, "quorum", n, etcd_cluster.endpoints(first=n), name="-again") for n in range(NODES)]
    try:
        assert wait_all(again) == [0] * NODES, [n.log.read_text()[-3000:] for n in again]
        resumed = [e for e in again[0].events() if e["event"] == "restore"]
        assert resumed and resumed[0]["step"] > 0, again[0].events()
        assert_bitwise(tmp_path / "quorum-final.pt", expected)
    finally:
        for n in again:
            n.power_off()


@pytest.mark.slow
def test_a_lost_zero_node_comes_back_from_parity_and_replicas_in_memory(tmp_path: Path, etcd_cluster) -> None:
    """ZeRO-1 (no JIT checkpoint can cover a lost optimizer partition), snapshots every step with
    AEC: node 2's whole process tree, its snapshot keeper included, is SIGKILLed. The replacement
    node starts an empty keeper; every rank resumes from the in-memory snapshot, node 2's data
    part decoded from parity and its optimizer partitions from other nodes' AOR replicas; bitwise."""
    zero, snap = ("--optim", "zero-adam"), ("--snapshot-every", "1", "--snapshot-protection", "aec")
    ref = [Node(tmp_path, "zref", n, etcd_cluster.endpoints(first=n), flags=snap, script_args=zero) for n in range(NODES)]
    try:
        assert wait_all(ref) == [0] * NODES, [n.log.read_text()[-3000:] for n in ref]
    finally:
        for n in ref:
            n.power_off()
    expected = torch.load(tmp_path / "zref-final.pt", weights_only=True)
    nodes = [Node(tmp_path, "zloss", n, etcd_cluster.endpoints(first=n), flags=snap, script_args=zero)
             for n in range(NODES)]
    try:
        wait_for_step(tmp_path, "zloss", random.randint(4, STEPS - 12))
        assert all(n.proc.poll() is None for n in nodes), "the job ended before the node loss"
        nodes[2].power_off()
        nodes.append(Node(tmp_path, "zloss", 2, etcd_cluster.endpoints(first=2), name="-replacement", flags=snap,
                          script_args=zero))
        survivors = [nodes[0], nodes[1], nodes[3]]
        assert wait_all(survivors) == [0] * NODES, "\n".join(n.log.read_text()[-3000:] for n in nodes)
        restores = [e for n in survivors for e in n.events() if e["event"] == "restore"]
        assert len(restores) == NODES and {e["source"] for e in restores} == {"memory"}, restores
        assert [e["decoded"] for e in restores if e["rank"] == 2] == [["x2.0"]], restores
        assert_bitwise(tmp_path / "zloss-final.pt", expected)
    finally:
        for n in nodes:
            n.power_off()


@pytest.mark.slow  # ~30 s; the coordinator test of the same range is in the fast suite
def test_with_a_node_range_a_lost_node_0_leaves_two_nodes_training_and_a_new_one_grows_the_job(
        tmp_path: Path, etcd_cluster) -> None:
    """--nnodes 2:3: node 0 (the first controller, the workers' store) is SIGKILLed whole at a random
    step and no replacement comes. After the last call the two survivors go on as a 2-node job
    (world 2; their ranks saved JIT checkpoints, so no step is lost). A launcher for slot 0 started
    later grows the job back to 3 nodes (a scale-up, which does not use up --max-restarts 1)."""
    elastic = ("--nnodes", "2:3", "--rdzv-conf", "last_call_timeout=2", "--max-restarts", "1")
    slow = ("--step-sleep", "0.4")
    nodes = [Node(tmp_path, "elastic", n, etcd_cluster.endpoints(first=n), flags=elastic, script_args=slow)
             for n in range(NODES)]
    try:
        wait_for_step(tmp_path, "elastic", random.randint(3, 6))
        assert all(n.proc.poll() is None for n in nodes), "the job ended before the node loss"
        nodes[0].power_off()
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and not any(e["event"] == "resumed" for e in nodes[1].events()):
            time.sleep(0.05)  # polling the survivors' event log for their resumption
        two = [e for e in nodes[1].events() if e["event"] == "generation_nodes"]
        assert two and two[-1]["nodes"] == [1, 2] and two[-1]["world_size"] == 2, two
        assert nodes[1].proc.poll() is None, nodes[1].log.read_text()[-3000:]
        nodes.append(Node(tmp_path, "elastic", 0, etcd_cluster.endpoints(first=0), name="-new", flags=elastic,
                          script_args=slow))
        assert wait_all(nodes[1:]) == [0] * NODES, "\n".join(f"--- {n.dir.name}\n{n.log.read_text()[-3000:]}"
                                                             for n in nodes)
        worlds = [e["world_size"] for e in nodes[1].events() if e["event"] == "generation_nodes"]
        assert worlds == [3, 2, 3], worlds
        summaries = [e for e in nodes[1].events() if e["event"] == "recovery_summary"]
        assert summaries and summaries[0]["steps_redone"] <= 1, summaries  # from the survivors' JIT checkpoints
        assert any(e["failure_kind"] == "scale_up" for e in summaries), summaries
        assert torch.load(tmp_path / "elastic-final.pt", weights_only=True)
    finally:
        for n in nodes:
            n.power_off()


@pytest.mark.slow  # ~35 s; test_torchrun_parity checks the slots themselves in the fast suite
def test_without_node_ranks_a_replacement_takes_the_lost_nodes_slot_on_c10d(tmp_path: Path, expected: dict) -> None:
    """torchrun's way, no --node-rank: three c10d launchers take slots 0-2 in the rendezvous; a fourth
    finds every slot's launcher alive and stops, naming why. A node other than node 0 (whose
    launcher serves the store) is SIGKILLed whole at a random step; a new launcher, also without
    --node-rank, finds every slot taken, takes the one whose heartbeat stopped, and joins the next
    generation in its place. The job ends bitwise."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    # Slow steps: the launcher too many takes three heartbeat periods (6 s) to give up.
    nodes = [Node(tmp_path, "slots", None, endpoint, name=f"-{i}", backend="c10d", step_sleep=0.8)
             for i in range(NODES)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(any(e["event"] == "job_start" for e in n.events()) for n in nodes):
            assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes)
            time.sleep(0.05)  # polling the launchers' event logs for their slots
        slots = {n: next(e["node_rank"] for e in n.events() if e["event"] == "job_start") for n in nodes}
        assert sorted(slots.values()) == [0, 1, 2], slots
        extra = Node(tmp_path, "slots", None, endpoint, name="-extra", backend="c10d")
        assert extra.proc.wait(timeout=60) == 2
        assert "every node slot of --nnodes 3 is held by a running launcher" in extra.log.read_text()
        at = steps_done(tmp_path / "slots-train.jsonl") // NODES + random.randint(1, 3)
        assert at < STEPS - 3, f"step {at}: the job is too far on to lose a node"
        wait_for_step(tmp_path, "slots", at)
        lost = random.choice([n for n in nodes if slots[n] != 0])
        lost.power_off()
        new = Node(tmp_path, "slots", None, endpoint, name="-new", backend="c10d", step_sleep=0.8)
        survivors = [n for n in nodes if n is not lost] + [new]
        assert wait_all(survivors) == [0] * NODES, "\n".join(f"--- {n.dir.name}\n{n.log.read_text()[-3000:]}"
                                                             for n in survivors)
        assert next(e["node_rank"] for e in new.events() if e["event"] == "job_start") == slots[lost]
        assert f"node {slots[lost]}'s launcher is gone; this launcher takes its slot" in new.log.read_text()
        assert_bitwise(tmp_path / "slots-final.pt", expected)
    finally:
        for n in nodes + [v for k, v in locals().items() if k in ("extra", "new")]:
            n.power_off()


@pytest.mark.slow  # ~35 s; the coordinator test of the same case is in the fast suite
@pytest.mark.parametrize("lost_slot", [0, 2])
def test_without_node_ranks_a_replacement_takes_the_lost_nodes_slot_on_etcd(tmp_path: Path, etcd_cluster,
                                                                           expected: dict, lost_slot: int) -> None:
    """The etcd sibling of the c10d test above (issue 43: a replacement there waited forever, on a
    key etcd never had): three launchers without --node-rank take slots 0-2 in any order; the one
    in ``lost_slot`` (0: the controller and the workers' store) is SIGKILLed whole at a random step;
    a new launcher with the same command takes its slot once its heartbeat stopped and joins the
    next generation. The survivors' JIT checkpoints leave at most the failed minibatch to redo, and
    the job ends bitwise."""
    nodes = [Node(tmp_path, "etcdslots", None, etcd_cluster.endpoints(first=i), name=f"-{i}") for i in range(NODES)]
    new: Optional[Node] = None
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(any(e["event"] == "job_start" for e in n.events()) for n in nodes):
            assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes)
            time.sleep(0.05)  # polling the launchers' event logs for their slots
        slots = {n: next(e["node_rank"] for e in n.events() if e["event"] == "job_start") for n in nodes}
        assert sorted(slots.values()) == [0, 1, 2], slots
        wait_for_step(tmp_path, "etcdslots", random.randint(3, STEPS - 12))
        assert all(n.proc.poll() is None for n in nodes), "the job ended before the node loss"
        lost = next(n for n in nodes if slots[n] == lost_slot)
        lost.power_off()
        new = Node(tmp_path, "etcdslots", None, etcd_cluster.endpoints(first=lost_slot), name="-new")
        survivors = [n for n in nodes if n is not lost] + [new]
        assert wait_all(survivors) == [0] * NODES, "\n".join(f"--- {n.dir.name}\n{n.log.read_text()[-3000:]}"
                                                             for n in survivors)
        assert next(e["node_rank"] for e in new.events() if e["event"] == "job_start") == lost_slot
        assert f"node {lost_slot}'s launcher is gone; this launcher takes its slot" in new.log.read_text()
        for n in survivors[:-1]:
            assert any(e["event"] == "checkpoint_saved" and e["kind"] == "jit" for e in n.events()), n.dir.name
            summaries = [e for e in n.events() if e["event"] == "recovery_summary"]
            assert len(summaries) == 1 and summaries[0]["steps_redone"] is not None, summaries
            assert summaries[0]["steps_redone"] <= 1, summaries  # the failed minibatch, at most
        assert_bitwise(tmp_path / "etcdslots-final.pt", expected)
    finally:
        for n in nodes + ([new] if new is not None else []):
            n.power_off()
