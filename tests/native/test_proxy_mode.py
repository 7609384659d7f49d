"""Proxy mode (issue 15) on simcuda: every CUDA/NCCL call of the application runs in jitckpt-proxy.

The data-parallel program of the interposer tests (dp_cuda, driven from Python through ctypes) runs
unchanged with LD_PRELOAD=libjit.so JITCKPT_MODE=proxy on 2 and 3 ranks and ends bitwise where it
ends run directly on simcuda and under observe mode. The application process holds no device
memory: the device arena (at a fixed address) is mapped in the proxy and not in the application.
Killing the application takes its proxy with it; killing the proxy fails the application's next
call with an error naming the proxy and the signal. Verified on simcuda only (no GPU here).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest

from dp_build import DP_LIBS, DRIVER, LIBJIT, REPO, SIMCUDA, need_build

pytestmark = pytest.mark.native
TIMEOUT_S = 120
ARENA_BASE = 0x3000_0000_0000  # SIMCUDA_ARENA_BASE: the device arena at a known address
MODES = ("direct", "observe", "proxy")


def dp_env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "SIMCUDA_")) and k != "LD_PRELOAD"}
    env.update(LD_LIBRARY_PATH=str(SIMCUDA), PYTHONPATH=str(REPO), SIMCUDA_ARENA_BASE=hex(ARENA_BASE),
               SIMCUDA_KERNEL_LIB=str(DP_LIBS / "libdp_train_kernels.so"))
    if mode != "direct":
        env["LD_PRELOAD"] = str(LIBJIT)
    if mode == "proxy":
        env["JITCKPT_MODE"] = "proxy"
    return env


def start_rank(tmp: Path, mode: str, rank: int, world: int, steps: int, *extra: str,
               env: Optional[dict] = None) -> subprocess.Popen:
    cmd = [sys.executable, str(DRIVER), "--lib-dir", str(DP_LIBS), "--rank", str(rank), "--world", str(world),
           "--id-file", str(tmp / "id"), "--steps", str(steps), "--ckpt-dir", str(tmp / "ckpt"),
           "--out", str(tmp / "out{rank}.bin"), *extra]
    return subprocess.Popen(cmd, env={**dp_env(mode), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def kill_all(procs: list[psutil.Process | subprocess.Popen]) -> None:
    for p in procs:
        try:
            p.kill()
            p.wait(timeout=10)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


def run_dp(tmp: Path, mode: str, world: int, steps: int = 12, maps: bool = False) -> list[bytes]:
    tmp.mkdir(parents=True)
    procs = [start_rank(tmp, mode, r, world, steps, *(["--maps-out", str(tmp / "maps")] if maps and r == 0 else []))
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        kill_all(procs)
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, (mode, r, out, err)
    return [(tmp / f"out{r}.bin").read_bytes() for r in range(world)]


def maps_cover(maps: str, address: int) -> bool:
    for line in maps.splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return True
    return False


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    need_build()


@pytest.mark.parametrize("world", [2, 3])
def test_dp_program_is_bitwise_the_same_in_proxy_mode(tmp_path: Path, world: int) -> None:
    results = {mode: run_dp(tmp_path / mode, mode, world, maps=mode == "proxy") for mode in MODES}
    assert results["proxy"] == results["direct"] == results["observe"]
    assert len(set(results["proxy"])) == 1  # data parallel: every rank ends with the same state
    assert any(b != 0 for b in results["proxy"][0])
    # Rank 0's device memory is the proxy's: the arena is mapped in its one child, not in it.
    maps = tmp_path / "proxy" / "maps"
    children = sorted(maps.glob("[0-9]*.maps"))
    assert len(children) == 1, children
    assert maps_cover(children[0].read_text(), ARENA_BASE)
    assert not maps_cover((maps / "app.maps").read_text(), ARENA_BASE)


def wait_for_proxy(app: subprocess.Popen) -> psutil.Process:
    """The proxy libjit.so started for `app` (its child running jitckpt-proxy)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert app.poll() is None, app.communicate()
        for child in psutil.Process(app.pid).children():
            try:
                if child.name() == "jitckpt-proxy":
                    return child
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)  # polling for the process to appear, with a deadline
    raise AssertionError("no jitckpt-proxy child within 30 s")


def test_killing_the_application_leaves_no_proxy(tmp_path: Path) -> None:
    app = start_rank(tmp_path, "proxy", 0, 1, 10**7)
    try:
        proxy = wait_for_proxy(app)
        app.send_signal(signal.SIGKILL)
        app.wait(timeout=10)
        gone, alive = psutil.wait_procs([proxy], timeout=10)
        assert not alive, f"jitckpt-proxy {proxy.pid} outlived its application"
    finally:
        kill_all([app])


def test_killing_the_proxy_fails_the_application_clearly_without_the_replay_journal(tmp_path: Path) -> None:
    """With the journal on, a new proxy takes over (test_transparent_recovery.py); without it the
    device state is gone with the proxy, and the application is told once."""
    app = start_rank(tmp_path, "proxy", 0, 1, 10**7, env={"JITCKPT_REPLAY_LIMIT_MB": "0"})
    try:
        proxy = wait_for_proxy(app)
        # Past the proxy's start: the NCCL unique id (made in the proxy) is written. A kill during
        # the start is another message ("cannot start the jitckpt device proxy": seen on a busy VM).
        deadline = time.monotonic() + 30
        while not (tmp_path / "id").exists() and time.monotonic() < deadline and app.poll() is None:
            time.sleep(0.02)  # polling for the file, with a deadline
        assert (tmp_path / "id").exists(), app.communicate()
        proxy.send_signal(signal.SIGKILL)
        out, err = app.communicate(timeout=30)
        assert app.returncode != 0
        assert f"jitckpt-proxy (pid {proxy.pid}) was killed by signal 9" in err, err
        assert "transparent recovery failed: the replay journal is off (JITCKPT_REPLAY_LIMIT_MB=0)" in err, err
        assert err.count("every CUDA/NCCL call of this process fails from now on") == 1, err
        assert err.count("was killed by signal 9") == 1, err  # said once, not by every failing call
    finally:
        kill_all([app])


def test_a_proxy_blocked_in_a_call_still_ends_with_its_application(tmp_path: Path) -> None:
    """Rank 0 of a 2-rank job alone: its proxy blocks in ncclCommInitRank, waiting for a peer that
    never comes. Killing the application must still end the proxy (it does not wait for the call)."""
    from simcuda_progs.simcuda_harness import build_program

    prog = build_program("streams_pinned_sendrecv", kernels=True, nccl=True)
    env = prog.env(LD_PRELOAD=str(LIBJIT), JITCKPT_MODE="proxy")
    app = subprocess.Popen([str(prog.exe), "ring", "0", "2", "-", "5"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        proxy = wait_for_proxy(app)
        assert app.stdout is not None and app.stdout.readline().startswith("uid="), "rank 0 did not start"
        app.send_signal(signal.SIGKILL)
        app.wait(timeout=10)
        gone, alive = psutil.wait_procs([proxy], timeout=10)
        assert not alive, f"jitckpt-proxy {proxy.pid} outlived its application while blocked in a call"
    finally:
        kill_all([app])
