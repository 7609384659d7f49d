"""Device proxies owned by the node's daemon (issue 17): with ``JITCKPT_PROXY_BROKER`` (set by
`jitckpt run` when a daemon runs), libjit.so asks `jitckpt daemon run` to start each jitckpt-proxy,
so the proxy is the daemon's child, listed in its status under the job's rank, and reaped by it.
A proxy killed at a random moment is replaced through the daemon too, and the run ends bitwise.
The broker refuses what is not its protocol and stays up. Verified on simcuda only."""
from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import time

import psutil
import pytest

from daemon_process import Daemon
from simcuda_progs.simcuda_harness import Program, build_program
from test_transparent_recovery import PROXY, assert_same_result, finish, reference, start  # noqa: F401

pytest.importorskip("grpc_tools", reason="the daemon needs grpcio-tools: pip install grpcio-tools")
pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def prog() -> Program:
    return build_program("streams_pinned_sendrecv", kernels=True, nccl=True)


def children(d: Daemon, *, zombies: bool) -> list[psutil.Process]:
    """The daemon's child proxies, running (or zombies: exited, not reaped)."""
    out = []
    for c in psutil.Process(d.proc.pid).children():
        try:
            if c.name().startswith("jitckpt-proxy") and (c.status() == psutil.STATUS_ZOMBIE) == zombies:
                out.append(c)
        except psutil.NoSuchProcess:
            pass  # exited (and reaped) while listed
    return out


def daemon_proxies(d: Daemon) -> list[psutil.Process]:
    return children(d, zombies=False)


def wait_for(cond, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)  # polling another process's state
    return cond()


def test_the_daemon_starts_owns_and_replaces_a_programs_proxy_and_the_run_ends_bitwise(
        prog: Program, reference: dict, tmp_path) -> None:
    d = Daemon(tmp_path)
    broker = str(d.socket.parent / "proxy.sock")
    try:
        with d.client() as c:
            c.register_job(run_id="brokered", node_rank=0, launcher_pid=d.proc.pid, world_size=1, generation=0,
                           processes=[])
        env = {"JITCKPT_PROXY_BROKER": broker, "TORCHELASTIC_RUN_ID": "brokered", "RANK": "0"}
        rng = random.Random()
        proc = start(prog, **env)
        try:
            assert wait_for(lambda: len(daemon_proxies(d)) == 1 or proc.poll() is not None), d.log.read_text()
            first = daemon_proxies(d)
            assert len(first) == 1 and proc.poll() is None, "the run ended before its proxy was seen"
            assert not [c for c in psutil.Process(proc.pid).children() if c.name().startswith("jitckpt-proxy")]
            with d.client() as c:
                job = {j.run_id: j for j in c.status().jobs}["brokered"]
            assert [(p.rank, p.pid, p.kind) for p in job.processes] == [(0, first[0].pid, "proxy")], job
            time.sleep(rng.uniform(0.0, 0.3))  # a random moment of the run, not a synchronization
            assert proc.poll() is None, "the run ended before the kill"
            first[0].kill()
        finally:
            rc, kv, out = finish(proc)
        assert rc == 0, out
        assert_same_result(kv, reference, out)
        m = re.search(r"recovered: jitckpt-proxy pid (\d+) took over", out)
        assert m and int(m.group(1)) != first[0].pid, out
        # Both proxies were the daemon's, and both are reaped once the program is gone.
        assert wait_for(lambda: not daemon_proxies(d)), [p.pid for p in daemon_proxies(d)]
        assert wait_for(lambda: not children(d, zombies=True)), children(d, zombies=True)
        with d.client() as c:
            job = {j.run_id: j for j in c.status().jobs}["brokered"]
        assert not [p for p in job.processes if p.kind == "proxy"], job
    finally:
        d.close()


def test_the_broker_refuses_what_is_not_its_protocol_and_starts_nothing(tmp_path) -> None:
    d = Daemon(tmp_path)
    broker = str(d.socket.parent / "proxy.sock")
    rnd = random.Random(7)
    requests = [rnd.randbytes(rnd.choice([0, 1, 30, 5000])) for _ in range(30)] + [
        b"jitckpt-proxy-spawn/1\0relative/binary\0\0",
        b"jitckpt-proxy-spawn/1\0/etc/passwd\0A=1\0",
        b"jitckpt-proxy-spawn/1\0/bin/true\0NOEQUALS\0",
        b"jitckpt-proxy-spawn/1\0/bin/true\0A=\xff\0",
        b"x" * ((1 << 20) + 10)]
    try:
        for req in requests:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.settimeout(10)
                s.connect(broker)
                try:
                    s.send(req)
                except OSError:  # over the socket's message size: refused by the kernel, fine too
                    continue
                reply, fds, _, _ = socket.recv_fds(s, 4096, 1)
            assert reply.startswith(b"error ") and not fds, (req[:60], reply)
        assert d.proc.poll() is None and not daemon_proxies(d)
        assert (d.socket.parent / "proxy.sock").stat().st_mode & 0o777 == 0o600
    finally:
        d.close()


def test_jitckpt_run_has_the_nodes_daemon_start_its_workers_proxies(prog: Program, tmp_path) -> None:
    """`jitckpt run --transparent` on a node with a daemon: the worker's proxy, and the one that
    replaces it after a crash injected into it, are started by the daemon (its log says so, with the
    job and the rank); the worker keeps its PID and the run ends ok."""
    from simcuda_progs.simcuda_harness import REPO

    d = Daemon(tmp_path)
    try:
        env = {k: v for k, v in prog.env().items() if not k.startswith("JITCKPT_")}
        env.update(PYTHONPATH=str(REPO), SIMCUDA_FAIL_MODE="crash", SIMCUDA_FAIL_AT="40",
                   SIMCUDA_FAIL_ONCE=str(tmp_path / "fault-fired"), JITCKPT_DAEMON_SOCKET=str(d.socket))
        run = tmp_path / "run"
        cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "1", "--transparent", "--no-python",
               "--rdzv-id", "viadaemon", "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(run),
               "--max-restarts", "0", "--status-interval", "0", str(prog.exe), "ring", "env", "env",
               str(tmp_path / "uid"), "200"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "ok=1" in out, out
        assert (tmp_path / "fault-fired").exists(), "the fault was not injected"
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
        assert [e["event"] for e in events].count("worker_start") == 1, "the worker was restarted"
        assert [e["recovered"] for e in events if e["event"] == "transparent_recovery"] == [True], events
        log = d.log.read_text()
        started = re.findall(r"proxy broker: started jitckpt-proxy pid (\d+) for job viadaemon rank 0", log)
        assert len(started) == 2 and started[0] != started[1], log
        assert wait_for(lambda: all(f"pid {pid} ended" in d.log.read_text() for pid in started)), d.log.read_text()
    finally:
        d.close()
