"""In-memory snapshots through `jitckpt run`: a whole node lost with no replica left to JIT-save from.

Three launchers on this machine act as three nodes (one rank each), `--snapshot-every 1`. In
launch 0 every rank dies at step KILL_AT at once (SIGKILL before the forward pass: no healthy
replica is left to take a JIT checkpoint) and node 2 also loses its snapshot keeper (SIGKILL by
PID), as a replaced node would. The launchers restart; node 2's launcher starts an empty keeper;
the job resumes from the newest snapshot (step KILL_AT - 1), rebuilding node 2's part from the
other nodes' parity (AEC) or replica (ARC), and finishes bitwise identical to a failure-free run
that took the same snapshots.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import torch

from jobs import ROOT, TRAIN, _read_jsonl, kill_tree, start_launcher, wait_for_records

NODES, STEPS, KILL_AT = 3, 8, 5
TIMEOUT = 60.0  # per job; normally ~15 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(tmp_path, tag: str, protection: str, script_args: list, *, nodes: int = NODES,
              nproc: int = 1, snapshot_args: tuple = ()) -> tuple[list, list]:
    """Run one job on ``nodes`` launchers; return (return codes, per-node event lists)."""
    port = free_port()
    procs = []
    try:
        for node in range(nodes):
            d = tmp_path / f"{tag}-node{node}"
            d.mkdir(parents=True)
            cmd = [sys.executable, "-m", "jitckpt", "run", "--nnodes", str(nodes), "--node-rank", str(node),
                   "--nproc-per-node", str(nproc), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag,
                   "--checkpoint-dir", str(tmp_path / f"{tag}-ckpt"), "--run-dir", str(d / "run"),
                   "--status-interval", "0", "--warm-standby", "0", "--max-restarts", "1",
                   "--hang-timeout", "auto:floor=5,startup=60", "--snapshot-every", "1",
                   "--snapshot-protection", protection, *snapshot_args, str(TRAIN), "--steps", str(STEPS),
                   "--out", str(tmp_path / f"{tag}-final.pt"),
                   "--steps-log", str(tmp_path / f"{tag}-train.jsonl"), *script_args]
            procs.append(subprocess.Popen(cmd, cwd=d, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        try:
            outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_tree(p.pid)
            outs = [p.communicate()[0] for p in procs]
            raise AssertionError(f"job {tag} timed out after {TIMEOUT}s:\n"
                                 + "\n".join(o[-3000:] for o in outs)) from None
    finally:
        for p in procs:
            kill_tree(p.pid)
    events = [_read_jsonl(tmp_path / f"{tag}-node{n}" / "run" / "events.jsonl") for n in range(nodes)]
    # Every keeper any launcher started is gone once its launcher is.
    for ev in events:
        for e in ev:
            if e["event"] == "snapshot_keeper_start" and psutil.pid_exists(e["pid"]):
                p = psutil.Process(e["pid"])
                if p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    raise AssertionError(f"snapshot keeper pid {e['pid']} outlived its launcher")
    rcs = [p.returncode for p in procs]
    assert rcs == [0] * nodes, "\n".join(o[-3000:] for o in outs)
    return rcs, events


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("snapref")
    _, events = run_nodes(tmp, "ref", "aec", [])
    assert not any(e["event"] == "failure_detected" for ev in events for e in ev)
    return torch.load(tmp / "ref-final.pt", weights_only=True)


@pytest.mark.parametrize("protection,kill_at,lost,extra", [
    pytest.param("aec", KILL_AT, 2, [], marks=pytest.mark.slow),
    pytest.param("arc", KILL_AT, 2, [], marks=pytest.mark.slow),
    # Resume from the step-1 snapshot: minibatch 1 is the first to run on DDP's rebuilt bucket
    # layout, so that snapshot must carry the rebuilt layout (3 ranks: the sum order depends on it).
    # Every rank's RNG state differs (a script seeding by rank) and node 0 is lost: AEC's XOR
    # decode of its part mixed two ranks' RNG bytes from node 2's part, and the difference landed
    # in node 0's part at the same offset; the snapshot now holds rank 0's RNG on every rank.
    pytest.param("aec", 2, 0, ["--rank-rng"], marks=pytest.mark.slow)])  # make test's 15-minute budget
def test_node_loss_resumes_from_in_memory_snapshot(reference, tmp_path, protection, kill_at, lost, extra):
    inject = [a for r in range(NODES) for a in ("--inject", f"0:{r}:{kill_at}:{'node' if r == lost else 'kill'}")]
    _, events = run_nodes(tmp_path, "fail", protection, inject + extra)
    ev0, evl = events[0], events[lost]
    # No surviving replica: nobody took a JIT checkpoint.
    assert not [e for ev in events for e in ev if e["event"] == "checkpoint_saved" and e["kind"] == "jit"]
    # The lost node's keeper was killed with the node: its launcher started a fresh one for launch 1.
    keepers = [e for e in evl if e["event"] == "snapshot_keeper_start"]
    assert [k["replaced"] for k in keepers] == [False, True], keepers
    assert keepers[1]["previous_exit"] == -9 and keepers[0]["pid"] != keepers[1]["pid"]
    assert [len([e for e in ev if e["event"] == "snapshot_keeper_start"])
            for n, ev in enumerate(events) if n != lost] == [1, 1]
    # Every rank resumed from the in-memory snapshot of the last committed step; the lost node's
    # data part came from parity (aec) or from its predecessor's copy (arc).
    restores = [e for ev in events for e in ev if e["event"] == "restore"]
    assert len(restores) == NODES, restores
    assert {(e["source"], e["step"]) for e in restores} == {("memory", kill_at - 1)}
    expect_decoded = [f"x{lost}.0"] if protection == "aec" else []
    assert all(e["decoded"] == expect_decoded for e in restores), restores
    assert [e["restart_count"] for e in ev0 if e["event"] == "restart"] == [1]
    log = _read_jsonl(tmp_path / "fail-train.jsonl")
    resumed = sorted({r["step"] for r in log if r.get("gen") == 1 and "step" in r})
    assert resumed == list(range(kill_at - 1, STEPS)), resumed
    final = torch.load(tmp_path / "fail-final.pt", weights_only=True)
    assert final.keys() == reference.keys()
    for k in reference:
        assert torch.equal(final[k], reference[k]), f"parameter {k} differs from the failure-free run"


@pytest.mark.slow
def test_single_rank_loss_with_snapshots_on(reference, tmp_path):
    """A rank dies, the others live: they JIT-save as without snapshots and the job resumes at the
    failed step, bitwise the same. (From memory if the survivors' snapshot of that step was
    committed before they exited, which is a race; otherwise from the JIT checkpoints.)"""
    _, events = run_nodes(tmp_path, "fail", "aec", ["--inject", f"0:2:{KILL_AT}:kill"])
    jit = [e for ev in events for e in ev if e["event"] == "checkpoint_saved" and e["kind"] == "jit"]
    assert {e["rank"] for e in jit} == {0, 1} and {e["step"] for e in jit} == {KILL_AT}, jit
    restores = [e for ev in events for e in ev if e["event"] == "restore"]
    assert len(restores) == NODES and {e["step"] for e in restores} == {KILL_AT}, restores
    assert len({e["source"] for e in restores}) == 1, restores
    final = torch.load(tmp_path / "fail-final.pt", weights_only=True)
    assert all(torch.equal(final[k], reference[k]) for k in reference)


ONE_NODE = dict(nodes=1, nproc=2, snapshot_args=("--snapshot-flush-every", "2"))
ONE_NODE_ARGS = ["--step-sleep", "0.2"]  # a snapshot's disk flush finishes long before a kill


@pytest.fixture(scope="module")
def one_node_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("snapref1")
    run_nodes(tmp, "ref", "none", ONE_NODE_ARGS, **ONE_NODE)
    return torch.load(tmp / "ref-final.pt", weights_only=True)


@pytest.mark.slow  # make test's 15-minute budget: a node's keeper restore stays fast in test_snapshot_nodes
def test_one_node_two_ranks_killed_at_once_resume_from_their_keeper(one_node_reference, tmp_path):
    """One node, two ranks, both SIGKILLed at the same step (no survivor to JIT-save from): the
    keeper outlives them, and both ranks read the newest snapshot's objects from it, each verified
    by one of them (on one node no object goes through the process group), bitwise."""
    inject = ["--inject", f"0:0:{KILL_AT}:kill", "--inject", f"0:1:{KILL_AT}:kill"]
    _, (ev,) = run_nodes(tmp_path, "fail", "none", ONE_NODE_ARGS + inject, **ONE_NODE)
    restores = [e for e in ev if e["event"] == "restore"]
    assert {(e["source"], e["step"]) for e in restores} == {("memory", KILL_AT - 1)} and len(restores) == 2, restores
    assert not [e for e in ev if e["event"] == "checkpoint_saved" and e["kind"] == "jit"]
    assert [k["replaced"] for k in ev if k["event"] == "snapshot_keeper_start"] == [False]
    a = torch.load(tmp_path / "fail-final.pt", weights_only=True)
    assert all(torch.equal(a[k], one_node_reference[k]) for k in one_node_reference)


@pytest.mark.slow
def test_one_node_loses_its_keeper_resumes_from_flushed_snapshot(one_node_reference, tmp_path):
    """One node, two ranks, no protection: both ranks and the keeper die at once; the memory tier
    is empty after the restart, so the newest snapshot flushed to disk is the resume point."""
    inject = ["--inject", f"0:0:{KILL_AT}:node", "--inject", f"0:1:{KILL_AT}:kill"]
    _, (ev,) = run_nodes(tmp_path, "fail", "none", ONE_NODE_ARGS + inject, **ONE_NODE)
    ckpt = tmp_path / "fail-ckpt" / "fail"  # --rdzv-id fail: the job's own checkpoint directory
    gen0 = sorted(ckpt.glob("snapshot-g0000-*"), key=lambda p: int(p.name.rsplit("-s", 1)[1]))
    assert gen0, list(ckpt.iterdir())
    restores = [e for e in ev if e["event"] == "restore"]
    assert [e["source"] for e in restores] == ["disk", "disk"], restores
    assert {(e["path"], e["step"]) for e in restores} == {(str(gen0[-1]), int(gen0[-1].name.rsplit("-s", 1)[1]))}
    assert not [e for e in ev if e["event"] == "checkpoint_saved" and e["kind"] == "jit"]
    assert [k["replaced"] for k in ev if k["event"] == "snapshot_keeper_start"] == [False, True]
    a = torch.load(tmp_path / "fail-final.pt", weights_only=True)
    assert all(torch.equal(a[k], one_node_reference[k]) for k in one_node_reference)


@pytest.mark.slow
def test_keeper_death_is_a_failure_recovered_by_jit(one_node_reference, tmp_path):
    """Only the keeper dies: the ranks' snapshot fails, which is a failure of the job: they
    JIT-save, the launcher starts a fresh keeper, and the job resumes from the JIT checkpoint."""
    inject = ["--inject", f"0:0:{KILL_AT}:keeper"]
    _, (ev,) = run_nodes(tmp_path, "fail", "none", ONE_NODE_ARGS + inject, **ONE_NODE)
    failures = [e for e in ev if e["event"] == "failure_detected"]
    assert failures and failures[0]["kind"] == "snapshot", failures
    # Rank 0 fails in step KILL_AT; rank 1 too, unless its copy was committed before the keeper
    # died: then it finishes that step and saves at the next one.
    jit = {e["rank"]: e["step"] for e in ev if e["event"] == "checkpoint_saved" and e["kind"] == "jit"}
    assert jit[0] == KILL_AT and jit[1] in (KILL_AT, KILL_AT + 1), jit
    assert [k["replaced"] for k in ev if k["event"] == "snapshot_keeper_start"] == [False, True]
    restores = [e for e in ev if e["event"] == "restore"]
    assert {(e["source"], e["step"]) for e in restores} == {("disk", max(jit.values()))}, restores
    a = torch.load(tmp_path / "fail-final.pt", weights_only=True)
    assert all(torch.equal(a[k], one_node_reference[k]) for k in one_node_reference)


# Flags and the keeper's lifecycle (fast) ---------------------------------------------------------

def _cfg(tmp_path, *argv):
    from jitckpt.cli import build_parser
    from jitckpt.launcher.config import LaunchConfig

    script = tmp_path / "t.py"
    script.write_text("")
    return LaunchConfig.from_args(build_parser().parse_args(["run", *argv, str(script)]))


def test_snapshot_flags_defaults_and_errors(tmp_path):
    two = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"]
    assert _cfg(tmp_path, "--snapshot-every", "2").snapshot_protection == "none"   # one node
    cfg = _cfg(tmp_path, *two, "--snapshot-every", "2", "--snapshot-flush-every", "5")
    assert (cfg.snapshot_every, cfg.snapshot_protection, cfg.snapshot_flush_every) == (2, "aec", 5)
    with pytest.raises(ValueError, match="needs --nnodes >= 2.*--snapshot-protection none"):
        _cfg(tmp_path, "--snapshot-every", "1", "--snapshot-protection", "aec")
    with pytest.raises(ValueError, match="--snapshot-flush-every needs --snapshot-every"):
        _cfg(tmp_path, "--snapshot-flush-every", "3")
    with pytest.raises(ValueError, match="must be >= 0"):
        _cfg(tmp_path, "--snapshot-every", "-1")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        _cfg(tmp_path, *two, "--snapshot-every", "1", "--snapshot-protection", "raid5")


def test_keeper_supervisor_replaces_a_dead_keeper_and_stops_it(tmp_path):
    from jitckpt.launcher.keeper_supervisor import KeeperSupervisor
    from jitckpt.protocol.keeper_messages import Pong
    from jitckpt.snapshot.keeper_client import KeeperClient

    deep = tmp_path / ("d" * 60) / ("e" * 60)   # too long for a Unix socket path: falls back
    deep.mkdir(parents=True)
    sup = KeeperSupervisor(run_dir=str(deep), node=3, python=sys.executable,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, start_timeout=30)
    try:
        assert len(sup.socket_path.encode()) <= 100
        assert sup.ensure_running() is True
        first = sup.pid
        k = KeeperClient(sup.socket_path)
        assert k.ping() == Pong(pid=first, node=3)
        k.close()
        assert sup.ensure_running() is False and sup.pid == first   # alive: kept
        os.kill(first, 9)
        sup.proc.wait(timeout=10)
        assert sup.ensure_running() is True and sup.pid != first    # dead: a fresh one
        assert sup.previous_exit == -9
        k = KeeperClient(sup.socket_path)
        assert k.listing() == []
        k.close()
        second = sup.proc
    finally:
        sup.stop()
    assert second.returncode is not None and not os.path.exists(sup.socket_path)


def test_keeper_socket_lives_in_the_run_dir_named_per_node(tmp_path):
    from jitckpt.launcher.keeper_supervisor import KeeperSupervisor

    short = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    try:
        socks = {KeeperSupervisor(run_dir=str(short), node=n, python=sys.executable, env={}).socket_path
                 for n in (0, 1)}
        assert socks == {str(short / "snapshot-keeper-node0.sock"), str(short / "snapshot-keeper-node1.sock")}
    finally:
        shutil.rmtree(short)


ZERO = ["--optim", "zero-adam"]


@pytest.fixture(scope="module")
def zero_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zref")
    run_nodes(tmp, "zref", "aec", ZERO)
    return torch.load(tmp / "zref-final.pt", weights_only=True)


# All slow (the suite's 15 minutes): the fast suite's node loss through AOR is the log mode's test
# below, whose restore reads partitions the copier exchanged, replays one and fetches it across nodes.
@pytest.mark.slow
@pytest.mark.parametrize("lost,mode", [("node", "recompute"), ("node", "copy"), ("rank", "recompute")])
def test_zero_failure_restores_partitions_through_aor(zero_reference, tmp_path, lost, mode):
    """ZeRO-1 through protect(), snapshot every step. ``node``: node 2 (its rank and keeper) is
    lost with every other rank; its optimizer partition comes back from node 1's AOR replica
    (``mode``: --snapshot-zero, the replica recomputed every step or received at each snapshot).
    ``rank``: rank 1 alone dies before its forward of step KILL_AT; the survivors take no JIT
    checkpoint (a ZeRO job has none) and exit at once. If their snapshot of KILL_AT was committed
    first (a race), it is whole without rank 1 (its parameter part decoded from parity, its
    partition from rank 0's replica) and the job loses no step; else it resumes from KILL_AT - 1.
    Either way the run finishes bitwise equal to a failure-free ZeRO run."""
    if lost == "node":
        inject = [a for r in range(NODES)
                  for a in ("--inject", f"0:{r}:{KILL_AT}:{'node' if r == 2 else 'kill'}")]
        # Rank 2's own partition (aor.z2) was only on node 1 (rank 1's replica) and its replica
        # of rank 0's (aor.z0) died with node 2: both came from other nodes.
        fetched = {0: [], 1: [], 2: ["aor.z0", "aor.z2"]}
    else:
        inject = ["--inject", f"0:1:{KILL_AT}:kill"]
        fetched = {0: [], 1: [], 2: []}
    _, events = run_nodes(tmp_path, "zfail", "aec", ZERO + inject, snapshot_args=("--snapshot-zero", mode))
    assert not [e for ev in events for e in ev if e["event"] == "checkpoint_saved"]  # no JIT for ZeRO
    restores = sorted((e["rank"], e["source"], e["step"], e["fetched"])
                      for ev in events for e in ev if e["event"] == "restore")
    step = restores[0][2]
    if lost == "rank" and step == KILL_AT:  # the survivors' step-KILL_AT snapshot won the race
        fetched[1] = ["aor.z1", "aor.z2"]
    else:
        assert step == KILL_AT - 1, restores
    assert restores == [(r, "memory", step, fetched[r]) for r in range(NODES)], restores
    final = torch.load(tmp_path / "zfail-final.pt", weights_only=True)
    assert final.keys() == zero_reference.keys()
    for k in zero_reference:
        assert torch.equal(final[k], zero_reference[k]), f"parameter {k} differs from the failure-free run; restores {restores}"


@pytest.mark.slow  # make test's 15-minute budget: ZeRO's AOR stays fast in test_snapshot_aor
def test_zero_log_mode_replays_a_lost_node_partition_and_resumes_at_the_failed_step(zero_reference, tmp_path):
    """--snapshot-zero log (copy every 2 steps, gradients logged every step): node 2 (rank and
    keeper) is lost before its forward of step KILL_AT; the survivors, blocked in that step's
    all-reduce, save their own partitions and fill in the parameter snapshot of KILL_AT from their
    own replica, then exit. The restart replays rank 2's partition on node 1 from the copy of
    KILL_AT - 1 and its logged gradients, resumes at KILL_AT on every rank (no step lost) and ends
    bitwise equal to a failure-free run."""
    inject = ["--inject", f"0:2:{KILL_AT}:node"]
    _, events = run_nodes(tmp_path, "zlog", "aec", ZERO + inject,
                          snapshot_args=("--snapshot-zero", "log", "--snapshot-zero-copy-every", "2"))
    restores = sorted((e["rank"], e["source"], e["step"]) for ev in events for e in ev if e["event"] == "restore")
    assert restores == [(r, "memory", KILL_AT) for r in range(NODES)], restores
    final = torch.load(tmp_path / "zlog-final.pt", weights_only=True)
    assert final.keys() == zero_reference.keys()
    for k in zero_reference:
        assert torch.equal(final[k], zero_reference[k]), f"parameter {k} differs from the failure-free run"


def _standbys_mapped(launcher_pid: int, count: int) -> bool:
    """Whether ``count`` standbys of the launcher say (in their process title) that they mapped the
    keeper's snapshot buffers."""
    titles = []
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return False  # the launcher ended: the caller's loop sees it
    for p in children:
        try:
            titles.append(" ".join(p.cmdline()))
        except psutil.Error:
            continue  # gone meanwhile
    return sum(t.startswith("jitckpt standby (snapshots mapped ahead)") for t in titles) >= count


# Slow (~25 s, to keep `make test` under its 15 minutes): test_restore_one_node.py and
# test_snapshot_units.py cover the mapping ahead and its restore without a launcher.
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_restart_on_one_node_restores_from_buffers_its_standbys_mapped_ahead(tmp_path, nproc):
    """Issue 19, from outside: a one-node job (1 or 2 ranks) with --snapshot-every 1 and a warm
    standby per rank (--warm-standby 1); every worker is SIGKILLed by PID at a random step once the
    standbys mapped the keeper's buffers while idle (jitckpt.snapshot.premap; their process title
    says so), so each restarted rank loads the newest snapshot into its tensors without mapping anything, and
    the job ends bitwise equal to an unfailed run."""
    import random
    import signal
    import time

    steps, extra = 80, random.Random().randint(3, 10)

    def job(tag: str) -> subprocess.Popen:
        d = tmp_path / tag
        d.mkdir()
        cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", str(nproc), "--checkpoint-dir",
               str(d / "ckpt"), "--run-dir", str(d / "run"), "--status-interval", "0", "--warm-standby", "1",
               "--max-restarts", "1",
               "--snapshot-every", "1", str(TRAIN), "--steps", str(steps), "--model", "bn", "--step-sleep", "0.1",
               "--out", str(d / "final.pt"), "--steps-log", str(d / "train.jsonl")]
        return subprocess.Popen(cmd, cwd=d, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    # The reference starts after the kill: two jobs importing torch at once on two cores left the
    # standbys unmapped past the end of an 80-step job (a clean clone, and 2 of 2 runs alone that
    # evening; then 2 of 2 passed: it is timing).
    ref, run = None, job("fail")
    try:
        deadline = time.monotonic() + TIMEOUT
        log = tmp_path / "fail" / "train.jsonl"
        events = tmp_path / "fail" / "run" / "events.jsonl"
        workers = kill_at = None
        while time.monotonic() < deadline and run.poll() is None:
            done = max([-1] + [r["step"] for r in (_read_jsonl(log) if log.exists() else []) if "step" in r])
            if kill_at is None and _standbys_mapped(run.pid, nproc):
                kill_at = done + extra  # a random step once every standby mapped the keeper's buffers
            if kill_at is not None and done >= kill_at:
                workers = [e["pid"] for e in _read_jsonl(events) if e["event"] == "worker_start"]
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.02)  # polling the job's logs, bounded by the deadline
        assert workers, f"the job ended before its standbys were up and {extra} more steps done"
        ref = job("ref")
        outs = {}
        for tag, p in (("ref", ref), ("fail", run)):
            outs[tag] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            assert p.returncode == 0, outs[tag][-4000:]
    finally:
        for p in (ref, run):
            if p is not None:
                kill_tree(p.pid)
    ev = _read_jsonl(events)
    restores = [e for e in ev if e["event"] == "restore"]
    assert [e["source"] for e in restores] == ["memory"] * nproc, (restores, [e["event"] for e in ev], outs["fail"][-3000:])
    worker_log = "\n".join(f.read_text() for f in (tmp_path / "fail" / "run").rglob("*.log")) + outs["fail"]
    assert worker_log.count("its buffers were mapped ahead by the warm standby") == nproc, worker_log[-4000:]
    final = torch.load(tmp_path / "fail" / "final.pt", weights_only=True)
    expected = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    assert final.keys() == expected.keys()
    for k in expected:
        assert torch.equal(final[k], expected[k]), f"{k} differs from the failure-free run (killed at {kill_at})"


def _events(run_dir: Path) -> list:
    return _read_jsonl(run_dir / "events.jsonl")


def _zero_job(tmp_path: Path, tag: str, ckpt: str, launcher_args: tuple = (), script_args: tuple = ()) -> list:
    """The two launchers of a 40-step ZeRO job (keepers run by the launchers, snapshots every 2
    steps); its final parameters go to ``<tag>.pt``."""
    port = free_port()
    return [start_launcher(tmp_path / f"{tag}{node}", [
        "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "zp",
        "--checkpoint-dir", str(tmp_path / ckpt), "--run-dir", str(tmp_path / f"{tag}{node}" / "run"),
        "--status-interval", "0", "--max-restarts", "1", "--snapshot-every", "2", "--snapshot-protection", "aec",
        *launcher_args, str(TRAIN), "--steps", "40", "--step-sleep", "0.05", "--out", str(tmp_path / f"{tag}.pt"),
        "--steps-log", str(tmp_path / f"{tag}.jsonl"), *ZERO, *script_args]) for node in range(2)]


def _ended(procs: list, codes: list) -> None:
    try:
        got = [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert got == codes, got


def _assert_as_reference(tmp_path: Path, tag: str, why: str) -> None:
    final, expected = (torch.load(tmp_path / f"{t}.pt", weights_only=True) for t in (tag, "ref"))
    assert final.keys() == expected.keys()
    for k in expected:
        assert torch.equal(final[k], expected[k]), f"{k} differs from the failure-free run ({why})"


@pytest.mark.slow
def test_a_preempted_zero_job_resumes_from_the_shards_its_ranks_saved(tmp_path):
    """SIGTERM to every launcher of a ZeRO job whose keepers the launchers run, so its snapshots
    stop with them (found from outside: the next run started at step 0). Every rank saves its own
    shard (the parameters and its optimizer partition), and the same commands run again resume
    from those at the preempted step. Node 1 is then lost: its partition comes back from node 0's
    replica, which began from node 1's shard. The job ends bitwise equal to a failure-free run."""
    import signal

    _ended(_zero_job(tmp_path, "ref", "ref-ck"), [0, 0])
    procs = _zero_job(tmp_path, "a", "ck")
    try:
        wait_for_records(tmp_path / "a.jsonl", 8, procs)
        for p in procs:
            p.send_signal(signal.SIGTERM)
    finally:
        _ended(procs, [143, 143])
    saved = [e for node in range(2) for e in _events(tmp_path / f"a{node}" / "run") if e["event"] == "checkpoint_saved"]
    assert sorted(e["rank"] for e in saved) == [0, 1] and len({e["step"] for e in saved}) == 1, saved
    preempted = saved[0]["step"]
    assert preempted < 26, saved  # the node loss below comes after the resume and a snapshot
    kill_at = 30
    procs = _zero_job(tmp_path, "b", "ck", script_args=("--inject", f"0:0:{kill_at}:kill", "--inject", f"0:1:{kill_at}:node"))
    _ended(procs, [0, 0])
    restores = [sorted((e["rank"], e["source"], e["step"], e.get("fetched")) for node in range(2)
                       for e in _events(tmp_path / f"b{node}" / "run") if e["event"] == "restore" and e["gen"] == gen)
                for gen in (0, 1)]
    assert restores[0] == [(0, "disk", preempted, []), (1, "disk", preempted, [])], restores
    # The newest snapshot (every 2 steps) before the kill; node 1's own partition and its replica
    # of node 0's come from node 0's keeper.
    assert restores[1] == [(0, "memory", kill_at - 2, []), (1, "memory", kill_at - 2, ["aor.z0", "aor.z1"])], restores
    _assert_as_reference(tmp_path, "b", f"preempted at {preempted}")


@pytest.mark.slow
def test_a_zero_job_lost_whole_resumes_from_its_periodic_shards(tmp_path):
    """--periodic-every 4: every rank saves its own shard every 4 steps. Both launchers are
    SIGKILLed with their workers and keepers at a random moment (the whole job lost at once: no JIT
    checkpoint, no snapshot survives); the same commands run again resume from the newest complete
    set of shards and end bitwise equal to a failure-free run."""
    import random

    _ended(_zero_job(tmp_path, "ref", "ref-ck"), [0, 0])
    procs = _zero_job(tmp_path, "a", "ck", ("--periodic-every", "4"))
    try:
        wait_for_records(tmp_path / "a.jsonl", random.randint(16, 40), procs)  # a record per rank and step
    finally:
        for p in procs:
            kill_tree(p.pid)
    lost_at = max(r.get("step", -1) for r in _read_jsonl(tmp_path / "a.jsonl"))
    _ended(_zero_job(tmp_path, "b", "ck", ("--periodic-every", "4")), [0, 0])
    restores = sorted((e["rank"], e["source"], e["step"]) for node in range(2)
                      for e in _events(tmp_path / f"b{node}" / "run") if e["event"] == "restore")
    assert [(r, src) for r, src, _ in restores] == [(0, "disk"), (1, "disk")], restores
    step = restores[0][2]
    assert step % 4 == 0 and lost_at - 4 <= step <= lost_at + 1 and restores[1][2] == step, (restores, lost_at)
    _assert_as_reference(tmp_path, "b", f"lost at step {lost_at}, resumed from {step}")
