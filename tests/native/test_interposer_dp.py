"""Data-parallel CUDA/NCCL training (tests/native/dp_cuda) on simcuda under LD_PRELOAD=libjit.so.

Each rank is a process running dp_train.py; the step goes through ctypes.PyDLL (GIL held while
blocked). One rank fails at a collective (simcuda failure injection); the other ranks' libjit.so
watchdog must detect it within the hang timeout, their callback copies the device state to the host
on a fresh stream and saves; a restarted job resumes from that JIT checkpoint and ends with final
parameters bitwise identical to a failure-free run. Verified on simcuda.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dp_build import DP_LIBS, DRIVER, LIBJIT, REPO, SIMCUDA, need_build

pytestmark = pytest.mark.native

WORLD = 3
STEPS = 12
FAIL_RANK = 1
FAIL_AT = 6  # SIMCUDA_FAIL_AT is 1-based: the 6th all-reduce, i.e. step 5 (one all-reduce per step)
FAIL_STEP = FAIL_AT - 1
HANG_TIMEOUT_S = 1.0
RUN_TIMEOUT_S = 90



class RankGroup:
    """The rank processes of one job attempt; every process is killed by PID in close()."""

    def __init__(self, work: Path, name: str, *, fail_env: dict[str, str] | None = None) -> None:
        self.dir = work / name
        self.dir.mkdir()
        self.procs: list[subprocess.Popen[str]] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "SIMCUDA_"))}
        env.update(LD_PRELOAD=str(LIBJIT), LD_LIBRARY_PATH=str(SIMCUDA), PYTHONPATH=str(REPO),
                   SIMCUDA_KERNEL_LIB=str(DP_LIBS / "libdp_train_kernels.so"), **(fail_env or {}))
        self.env = env

    def start(self, ckpt_dir: Path) -> None:
        for rank in range(WORLD):
            cmd = [sys.executable, str(DRIVER), "--lib-dir", str(DP_LIBS), "--rank", str(rank), "--world",
                   str(WORLD), "--id-file", str(self.dir / "nccl.id"), "--steps", str(STEPS), "--ckpt-dir",
                   str(ckpt_dir), "--out", str(self.dir / "final{rank}.bin"), "--hang-timeout",
                   str(HANG_TIMEOUT_S), "--status-out", str(self.dir / f"status{rank}.json")]
            log = open(self.dir / f"rank{rank}.log", "w")
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                               text=True, cwd=REPO))
            log.close()

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes (None for a rank still running at the deadline)."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}\n" + (self.dir / f"rank{r}.log").read_text() for r in range(WORLD))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def groups(tmp_path: Path):
    made: list[RankGroup] = []

    def make(name: str, **kw) -> RankGroup:
        g = RankGroup(tmp_path, name, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def run_clean(groups, tmp_path: Path, name: str, ckpt_dir: Path) -> list[bytes]:
    g = groups(name)
    g.start(ckpt_dir)
    codes = g.wait(RUN_TIMEOUT_S)
    assert codes == [0] * WORLD, g.logs()
    finals = [(g.dir / f"final{r}.bin").read_bytes() for r in range(WORLD)]
    assert all(f == finals[0] for f in finals), "replicas diverged"
    return finals


# What the injected rank does and how it ends: hang -> stuck in its own all-reduce, detects the hang,
# saves (75); crash -> SIGKILL; error -> ncclAllReduce returns ncclSystemError, libjit.so reports
# nccl_error before the error surfaces, the rank saves (75); sticky -> a sticky device error, seen as
# cuda_error on the sentinel event, the rank cannot copy its state (76). The others always see a hang.
INJECTED = {"hang": (75, "hang"), "crash": (-9, None), "error": (75, "nccl_error"), "sticky": (76, None)}


@pytest.mark.parametrize("mode", list(INJECTED))
def test_rank_failure_jit_saved_and_resumed_bitwise(groups, tmp_path: Path, mode: str) -> None:
    need_build()
    reference = run_clean(groups, tmp_path, "reference", tmp_path / "no-ckpt")
    status = json.loads((tmp_path / "reference" / "status0.json").read_text())
    assert status["collectives_completed"] + len(status["in_flight"]) == STEPS
    assert len(status["nccl_streams"]) == 1 and status["last_error"] is None
    assert len(status["dependent_streams"]) == 1  # the compute stream waits on the all-reduce

    ckpt = tmp_path / "ckpt"
    failing = groups("failing", fail_env={"SIMCUDA_FAIL_RANK": str(FAIL_RANK), "SIMCUDA_FAIL_AT": str(FAIL_AT),
                                          "SIMCUDA_FAIL_MODE": mode})
    t0 = time.monotonic()
    failing.start(ckpt)
    codes = failing.wait(RUN_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    healthy = [r for r in range(WORLD) if r != FAIL_RANK]
    assert all(codes[r] == 75 for r in healthy), (codes, failing.logs())
    for r in healthy:
        meta = json.loads((ckpt / f"rank{r}.json").read_text())
        assert meta["callback_thread_is_main"] is False
        assert meta["status"]["gil_preemptions"] >= 1, "main thread held the GIL in dp_step"
        assert meta["status"]["redirect_active"] is True
        assert meta["step"] == FAIL_STEP, meta
        assert meta["kind"] in ("hang", "nccl_async_error", "cuda_error"), meta
        print(f"rank {r}: {meta['kind']}: {meta['detail']} (save {meta['save_s'] * 1e3:.1f} ms)")
        if meta["kind"] == "hang":  # detected one poll period (timeout/20) after the timeout at most
            age = float(meta["detail"].split(" for ")[1].split(" s ")[0])
            assert HANG_TIMEOUT_S <= age < HANG_TIMEOUT_S * 1.05 + 0.1, meta["detail"]
    expected_code, expected_kind = INJECTED[mode]
    assert codes[FAIL_RANK] == expected_code, (codes, failing.logs())
    if expected_kind is not None:
        meta = json.loads((ckpt / f"rank{FAIL_RANK}.json").read_text())
        assert meta["kind"] == expected_kind and meta["step"] == FAIL_STEP, meta
    if mode == "sticky":
        assert "cannot save after cuda_error" in failing.logs(), failing.logs()
    # Detected within the timeout (plus start-up and poll slack), not at the run timeout.
    assert elapsed < RUN_TIMEOUT_S / 2, elapsed
    failing.close()

    resumed = groups("resumed")
    resumed.start(ckpt)
    codes = resumed.wait(RUN_TIMEOUT_S)
    assert codes == [0] * WORLD, resumed.logs()
    assert f"resumed at step {FAIL_STEP}" in resumed.logs()
    finals = [(resumed.dir / f"final{r}.bin").read_bytes() for r in range(WORLD)]
    assert finals == reference  # bitwise identical to the failure-free run
