"""The dp_cuda CUDA/NCCL program under `jitckpt run` with LD_PRELOAD=libjit.so, on simcuda.

libjit.so detects the hung all-reduce (its watchdog, not the Python runtime's), the jitckpt runtime's
callback saves the JIT checkpoint while the main thread is parked in cudaStreamSynchronize, the
launcher restarts the job, it resumes from the JIT checkpoint and ends bitwise identical to a
failure-free run. Verified on simcuda.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dp_build import DP_LIBS, DRIVER, LIBJIT, REPO, SIMCUDA, ProcessTree, need_build, need_cpu_torch

pytestmark = pytest.mark.native

WORLD, STEPS, FAIL_RANK, FAIL_AT = 3, 12, 1, 6  # SIMCUDA_FAIL_AT is 1-based: step 5
TIMEOUT_S = 150



def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "SIMCUDA_", "LD_PRELOAD"))}
    # libjit.so reaches the workers through `jitckpt run --preload`, not the launcher's own env.
    env.update(LD_LIBRARY_PATH=str(SIMCUDA), PYTHONPATH=str(REPO),
               SIMCUDA_KERNEL_LIB=str(DP_LIBS / "libdp_train_kernels.so"))
    return env


class Job(ProcessTree):
    def __init__(self, cmd: list[str], log: Path, **env: str) -> None:
        super().__init__(cmd, log, {**base_env(), **env})


@pytest.fixture
def jobs():
    made: list[Job] = []

    def start(cmd: list[str], log: Path, **env: str) -> Job:
        made.append(Job(cmd, log, **env))
        return made[-1]

    yield start
    for j in made:
        j.close()


def reference_final(jobs, work: Path, steps: int = STEPS) -> bytes:
    """Failure-free run with the plain harness (no launcher), same data and hyper-parameters."""
    procs = [jobs([sys.executable, str(DRIVER), "--lib-dir", str(DP_LIBS), "--rank", str(r), "--world", str(WORLD),
                   "--id-file", str(work / "ref.id"), "--steps", str(steps), "--ckpt-dir", str(work / "ref-ckpt"),
                   "--out", str(work / "ref{rank}.bin")], work / f"ref{r}.log") for r in range(WORLD)]
    assert [p.wait(TIMEOUT_S) for p in procs] == [0] * WORLD, (work / "ref0.log").read_text()
    finals = {(work / f"ref{r}.bin").read_bytes() for r in range(WORLD)}
    assert len(finals) == 1
    return finals.pop()


# ~10-45 s each on the shared 2-core machine (standby workers import torch); the crash case is also
# covered without the launcher by test_interposer_dp.py, so here it runs with the slow tests.
# transparent: the same job with every CUDA/NCCL call of the workers in a jitckpt-proxy (proxy
# mode): the survivors' watchdogs query their events on channels of their own while the main
# threads are blocked in the hung synchronize, and the save's copies go through the proxy too.
# The replay journal is off (JITCKPT_REPLAY_LIMIT_MB=0), so transparent recovery refuses and
# user-level recovery takes over (issue 16 case 5); test_transparent_peers.py has it on.
@pytest.mark.parametrize("mode, transparent", [("hang", False), pytest.param("crash", False, marks=pytest.mark.slow),
                                               pytest.param("hang", True, marks=pytest.mark.slow),
                                               pytest.param("crash", True, marks=pytest.mark.slow),
                                               # (test_native_no_save_path.py covers a refusal's fall-back fast)
                                               pytest.param("error", True, marks=pytest.mark.slow)])
def test_launcher_resumes_from_libjit_detected_jit_checkpoint(jobs, tmp_path: Path, mode: str,
                                                             transparent: bool) -> None:
    need_build()
    need_cpu_torch()
    reference = reference_final(jobs, tmp_path)
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", str(WORLD), "--hang-timeout", "1",
           "--checkpoint-dir", str(ckpt), "--run-dir", str(run), "--max-restarts", "2", "--status-interval", "0",
           *(["--transparent"] if transparent else ["--preload", str(LIBJIT)]), str(DRIVER), "--jitckpt", "--lib-dir", str(DP_LIBS), "--steps", str(STEPS),
           "--out", str(tmp_path / "final{rank}.bin"), "--fail-gen0", f"{mode}:{FAIL_RANK}:{FAIL_AT}"]
    job = jobs(cmd, tmp_path / "launcher.log", **({"JITCKPT_REPLAY_LIMIT_MB": "0"} if transparent else {}))
    rc = job.wait(TIMEOUT_S)
    log = (tmp_path / "launcher.log").read_text()
    assert rc == 0, log
    # libjit.so's watchdog saw the all-reduce of step 5 not completing on the device (with an NCCL
    # error a survivor can save at once, and the launcher restarts before any hang timeout).
    if mode != "error":
        assert "ncclAllReduce (seq 6, step 5" in log and "not complete on the device" in log
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    # The finished job deleted its JIT checkpoints: which ranks saved is in the event log.
    saved = sorted(Path(e["path"]).name for e in events
                   if e["event"] == "checkpoint_saved" and e["kind"] == "jit" and e["gen"] == 0)
    survivors = [r for r in range(WORLD) if mode == "hang" or r != FAIL_RANK]
    if mode == "error":  # the failed rank exits at once: the launcher restarts on the first survivor's save
        assert saved and set(saved) <= {f"jit-g0000-r{r:05d}-s5" for r in survivors}, saved
    else:
        assert saved == [f"jit-g0000-r{r:05d}-s5" for r in survivors], saved
    assert not list(ckpt.glob("jit-*")), "a finished job leaves no JIT checkpoints behind"
    assert all(f"rank {r}: resumed at step 5" in log for r in range(WORLD)), log
    for r in range(WORLD):
        assert (tmp_path / f"final{r}.bin").read_bytes() == reference, f"rank {r} differs from the failure-free run"
    detected = [e for e in events if e["event"] == "failure_detected"]
    # A hang is first known through libjit.so; a crash (SIGKILL) is seen by the launcher first, while
    # the survivors' libjit.so still detects their hung all-reduce (log check above) and saves. In
    # proxy mode simcuda's crash kills the process that runs the collective, the worker's proxy:
    # the worker's next call fails and the worker exits with that exception.
    expected = "hang" if mode == "hang" else ("exception" if transparent else "signal")
    assert detected and detected[0]["kind"] == expected, detected
    if mode == "crash" and transparent:
        assert "was killed by signal 9" in log, log
    if transparent and mode != "crash":
        # Issue 16 case 5: a failure transparent recovery cannot take (the journal is off); the
        # event log says so for each rank that found it, and the user-level recovery above ended
        # bitwise.
        refused = [e for e in events if e["event"] == "transparent_recovery"]
        assert refused and all(e["recovered"] is False and "journal is off" in e["reason"] for e in refused), refused
        if mode == "error":
            assert any(e["rank"] == FAIL_RANK and "NCCL failed" in e["cause"] for e in refused), refused
