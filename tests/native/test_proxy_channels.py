"""A channel per client thread in proxy mode (issue 15): opened on a thread's first call, closed
when the thread exits, so threads that come and go leave no rings and no idle proxy threads behind.

thread_channels.cu stops between phases; the test counts the proxy's threads (/proc/PID/task) with N
threads alive, after they exited, and after 3 N more came and went. Verified on simcuda only.
"""
from __future__ import annotations

import subprocess
import time
from typing import Callable

import psutil
import pytest

from simcuda_progs.simcuda_harness import BUILD, Program, build_program

pytestmark = pytest.mark.native
N = 4
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def prog() -> Program:
    return build_program("thread_channels", kernels=False, nccl=False)


def test_channels_close_when_their_threads_exit(prog: Program) -> None:
    env = prog.env(LD_PRELOAD=str(BUILD / "lib" / "libjit.so"), JITCKPT_MODE="proxy", SIMCUDA_DEVICES="2")
    proc = subprocess.Popen([str(prog.exe), str(N)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        def step(settled: Callable[[int], bool] = lambda n: True) -> int:
            """The proxy's thread count at the next phase, once `settled` holds (a closed channel's
            proxy thread ends a moment after the client thread that closed it: bounded poll)."""
            line = proc.stdout.readline()  # the program waits for our newline after each phase
            assert line.startswith("phase="), line + proc.stderr.read()
            (proxy,) = [c for c in psutil.Process(proc.pid).children() if c.name() == "jitckpt-proxy"]
            deadline = time.monotonic() + 10
            while not settled(proxy.num_threads()) and time.monotonic() < deadline:
                time.sleep(0.01)
            threads = proxy.num_threads()
            proc.stdin.write("\n")
            proc.stdin.flush()
            return threads

        start = step()
        alive = step()
        gone = step(lambda n: n <= alive - N)
        churn = step(lambda n: n <= gone)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0 and "ok=1" in out, out + err
    assert "main_device=0" in out  # the threads' cudaSetDevice(1) stayed theirs
    # N more proxy threads while N client threads are alive; none left once they exited, however
    # many came and went.
    counts = {"start": start, "alive": alive, "gone": gone, "churn": churn}
    assert alive >= start + N, counts
    assert gone <= alive - N, counts
    assert churn == gone, counts
