"""The node daemon (issue 17): `jitckpt daemon run` as a real process, its gRPC API through
``jitckpt.daemon.Client`` and raw channels, its security, a fuzz of every handler, and `jitckpt run`
reporting to it."""
from __future__ import annotations

import json
import os
import random
import secrets
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_process import Daemon
from jobs import ROOT, TRAIN, kill_tree

pytest.importorskip("grpc_tools", reason="the daemon needs grpcio-tools: pip install grpcio-tools")
from jitckpt.daemon import Client, DaemonRefused  # noqa: E402
from jitckpt.daemon.schema import MAX_MESSAGE_BYTES, SERVICE, pb  # noqa: E402

METHODS = ("RegisterJob", "ReportFailure", "ReportCheckpoint", "EndJob", "Health", "Status", "Drain",
           "EnsureKeeper", "StopKeeper", "RequestMigration")


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.close()


def register(c: Client, run_id: str = "job1", **kw) -> None:
    args = dict(run_id=run_id, node_rank=0, launcher_pid=os.getpid(), world_size=2, generation=0,
                processes=[(0, os.getpid(), "worker")])
    c.register_job(**{**args, **kw})


def test_status_shows_jobs_processes_checkpoints_and_failures_and_the_socket_is_private(daemon, tmp_path):
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(daemon.socket.parent.stat().st_mode) == 0o700
    with daemon.client() as c:
        register(c, processes=[(0, os.getpid(), "worker"), (1, 2**22 + 12345, "worker"), (-1, os.getpid(), "keeper")])
        c.report_checkpoint(run_id="job1", rank=0, step=7, kind="jit", path="/ckpt/s7", nbytes=10)
        c.report_failure(run_id="job1", generation=0, kind="signal", rank=1, detail="killed by SIGKILL")
        health = c.health()
        assert health.serving and health.jobs == 1
        assert [(p.rank, p.pid) for p in health.dead] == [(1, 2**22 + 12345)]  # no such process
    out = subprocess.run([sys.executable, "-m", "jitckpt", "daemon", "status", "--json"], env=daemon.env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    st_ = json.loads(out.stdout)
    job = st_["jobs"][0]
    assert (job["run_id"], job["status"], job["last_checkpoint_step"]) == ("job1", "running", "7")
    assert st_["failures"][0]["detail"] == "killed by SIGKILL" and st_["failures"][0]["rank"] == 1
    text = subprocess.run([sys.executable, "-m", "jitckpt", "daemon", "status"], env=daemon.env,
                          capture_output=True, text=True, timeout=30).stdout
    assert "job1" in text and "killed by SIGKILL" in text and "step 7" in text, text
    # A second daemon on the same socket is refused; the first keeps serving.
    second = subprocess.run([sys.executable, "-m", "jitckpt", "daemon", "run"], env=daemon.env,
                            capture_output=True, text=True, timeout=30)
    assert second.returncode == 2 and "already serves" in second.stderr, second.stderr
    with daemon.client() as c:
        assert c.health().serving


def test_bad_and_oversized_requests_are_refused_naming_the_problem_and_change_nothing(daemon):
    with daemon.client() as c:
        register(c)
        before = c.status()
        bad = [
            (lambda: register(c, run_id="no spaces"), "run_id"),
            (lambda: register(c, run_id="job2", world_size=0), "world_size 0"),
            (lambda: register(c, run_id="job2", processes=[(5, 1, "worker")]), "processes[0].rank 5"),
            (lambda: register(c, run_id="job2", processes=[(0, 1, "shell")]), "processes[0].kind"),
            (lambda: c.report_failure(run_id="nope", generation=0, kind="x"), "no such job"),
            (lambda: c.report_checkpoint(run_id="job1", rank=0, step=-1, kind="jit"), "step -1"),
            (lambda: c.report_checkpoint(run_id="job1", rank=0, step=1, kind="snapshot"), "kind 'snapshot'"),
            (lambda: c.end_job(run_id="job1", status="great"), "status 'great'"),
        ]
        for call, needle in bad:
            with pytest.raises(DaemonRefused) as err:
                call()
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in str(err.value), err.value
        with pytest.raises(DaemonRefused) as err:
            c.report_failure(run_id="job1", generation=0, kind="x", detail="x" * (MAX_MESSAGE_BYTES + 10))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(DaemonRefused) as err:
            c.request_migration(run_id="job1", rank=0, target="node7")
        assert err.value.code == grpc.StatusCode.UNIMPLEMENTED and "CRIU" in str(err.value)
        assert c.status().jobs == before.jobs and list(c.status().failures) == list(before.failures)
        c.drain()
        with pytest.raises(DaemonRefused) as err:
            register(c, run_id="job2")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "drained" in str(err.value)
        register(c, generation=1)  # a job already here goes on
        c.drain(False)
        register(c, run_id="job2")


def test_tcp_needs_a_token_and_checks_it(tmp_path):
    no_token = subprocess.run([sys.executable, "-m", "jitckpt", "daemon", "run", "--listen", "127.0.0.1:0"],
                              env={**os.environ, "PYTHONPATH": str(ROOT), "JITCKPT_DAEMON_SOCKET": str(tmp_path / "x.sock"),
                                   "JITCKPT_DAEMON_TOKEN": ""},
                              capture_output=True, text=True, timeout=30)
    assert no_token.returncode == 2 and "give a token" in no_token.stderr, no_token.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token + "\n")
    d = Daemon(tmp_path, "--listen", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "token"))
    try:
        for wrong in ("", "x" * 32, token[:-1] + ("0" if token[-1] != "0" else "1")):
            with Client(address=f"127.0.0.1:{port}", token=wrong) as c:
                with pytest.raises(DaemonRefused) as err:
                    c.status()
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(address=f"127.0.0.1:{port}", token=token) as c:
            assert c.health().serving
    finally:
        d.close()


def test_fuzz_random_bytes_and_random_fields_never_break_the_daemon(daemon):
    """Random bytes to every handler (a raw channel), then random field values through the real
    messages: each gets an answer (OK or an error status), the daemon lives on, and what it keeps
    stays valid."""
    rnd = random.Random(1234)
    channel = grpc.insecure_channel(f"unix:{daemon.socket}")
    try:
        for method in METHODS:
            call = channel.unary_unary(f"/{SERVICE}/{method}")
            for _ in range(60):
                payload = rnd.randbytes(rnd.choice([0, 1, 5, 40, 300, 5000]))
                try:
                    call(payload, timeout=5)
                except grpc.RpcError as e:
                    assert e.code() != grpc.StatusCode.UNAVAILABLE, f"{method}: the daemon stopped answering"
    finally:
        channel.close()
    assert daemon.proc.poll() is None, daemon.log.read_text()
    with daemon.client() as c:
        c.drain(False)  # random Drain bytes may have set it
        for job in c.status().jobs:
            assert 1 <= len(job.run_id) <= 128 and job.world_size >= 1 and job.launcher_pid >= 1, job
            assert all(-1 <= p.rank < job.world_size and p.pid >= 1 for p in job.processes), job


ints = st.integers(min_value=-2**31, max_value=2**31 - 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run_id=st.text(max_size=140), node_rank=ints, pid=ints, world=ints, gen=ints, prank=ints,
       kind=st.sampled_from(["worker", "proxy", "keeper", "", "x"]))
def test_fuzz_register_job_fields(daemon, run_id, node_rank, pid, world, gen, prank, kind):
    with daemon.client() as c:
        before = {j.run_id: j for j in c.status().jobs}
        try:
            c.register_job(run_id=run_id, node_rank=node_rank, launcher_pid=pid, world_size=world, generation=gen,
                           processes=[(prank, pid, kind)])
        except DaemonRefused as e:
            assert e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), e
            assert {j.run_id: j for j in c.status().jobs} == before  # nothing changed
            return
        job = {j.run_id: j for j in c.status().jobs}[run_id]
        assert (job.node_rank, job.launcher_pid, job.world_size, job.generation) == (node_rank, pid, world, gen)


def test_jitckpt_run_reports_its_job_to_the_nodes_daemon_and_a_draining_node_refuses_it(daemon, tmp_path):
    env = {**daemon.env, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2", "--rdzv-id", "dj", "--checkpoint-dir",
           str(tmp_path / "ckpt"), "--status-interval", "0", "--max-restarts", "1", str(TRAIN), "--steps", "8",
           "--inject", "0:1:4:kill"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    with daemon.client() as c:
        st_ = c.status()
    job = {j.run_id: j for j in st_.jobs}["dj"]
    assert job.status == "ok" and job.generation == 1, job
    assert sorted(p.rank for p in job.processes if p.kind == "worker") == [0, 1]
    assert job.last_checkpoint_step >= 4, job
    # Found by the dead rank's exit, or first by its peer's collective error (the rank not known yet).
    assert any(f.run_id == "dj" and f.rank in (1, -1) and f.kind for f in st_.failures), st_.failures
    with daemon.client() as c:
        c.drain()
    refused = subprocess.run(["dj2" if a == "dj" else a for a in cmd], env=env, capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
    assert refused.returncode == 1 and "drained" in refused.stderr, refused.stderr


@pytest.mark.slow  # ~19 s, for make test's 15 minutes; the daemon's job registration stays fast (above)
def test_a_jobs_snapshots_outlive_its_killed_launcher_in_the_daemons_keeper(daemon, tmp_path):
    """With a daemon, the job's snapshot keeper is the daemon's child. The launcher, its workers and
    standbys are SIGKILLed together at a random step (the launcher's own crash, or an operator's
    kill -9); the keeper lives on, and the same command run again resumes from its in-memory
    snapshot, bitwise. Once the job ends well, the keeper is stopped."""
    def cmd(tag: str) -> list:
        return [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2", "--rdzv-id", tag,
                "--checkpoint-dir", str(tmp_path / "ckpt"), "--status-interval", "0", "--snapshot-every", "1",
                "--snapshot-protection", "none", str(TRAIN), "--steps", "30", "--step-sleep", "0.05",
                "--out", str(tmp_path / f"{tag}.pt"), "--steps-log", str(tmp_path / f"{tag}.jsonl")]

    ref = subprocess.run(cmd("ref"), env=daemon.env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    first = subprocess.Popen(cmd("dk"), env=daemon.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             cwd=tmp_path, start_new_session=True)
    try:
        at = random.randint(5, 20)
        deadline = time.monotonic() + 120
        log = tmp_path / "dk.jsonl"
        while time.monotonic() < deadline and first.poll() is None and (
                not log.exists() or sum('"step"' in line for line in log.read_text().splitlines()) < 2 * at):
            time.sleep(0.01)  # polling the training's progress: the moment is meant to be random
        assert first.poll() is None, "the job ended before the kill"
        kill_tree(first.pid)
    finally:
        kill_tree(first.pid)
    with daemon.client() as c:
        job = {j.run_id: j for j in c.status().jobs}["dk"]
    keepers = [p.pid for p in job.processes if p.kind == "keeper"]
    assert len(keepers) == 1 and psutil.pid_exists(keepers[0]), job
    again = subprocess.run(cmd("dk"), env=daemon.env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    events = [json.loads(line) for line in (tmp_path / "ckpt" / "runs" / "dk" / "events.jsonl").read_text().splitlines()
              if line.strip()]
    starts = [i for i, e in enumerate(events) if e["event"] == "job_start"]
    events = events[starts[-1]:]  # the second run's (both runs of the job share its run directory)
    restores = [e for e in events if e["event"] == "restore"]
    assert restores and all(e["source"] == "memory" and e["step"] >= at - 1 for e in restores), restores
    a = torch.load(tmp_path / "dk.pt", weights_only=True)
    b = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in b), "the resumed run differs from the failure-free one"
    deadline = time.monotonic() + 10
    while psutil.pid_exists(keepers[0]) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the daemon's stop of its child, with a deadline
    assert not psutil.pid_exists(keepers[0]), "the keeper outlived the job that ended well"
