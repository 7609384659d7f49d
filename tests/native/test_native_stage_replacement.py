"""SWIFT logging in the device proxy, for a native program (issue 16, `--plugin logging`): a pipeline
of 2 or 3 stages (nvcc-compiled CUDA + NCCL send/recv, simcuda) under `jitckpt run --no-python
--transparent --plugin logging`. One stage's application process is killed with SIGKILL at a random
iteration. The launcher starts a replacement alone; each survivor's hung send or receive becomes a
transparent recovery in which it waits for the replacement, rebuilds the communicator with it and
replays only its current minibatch; the replacement loads the global checkpoint, replays its
receives from the survivors' send logs through the iteration before theirs, and runs on live. The
survivors are never restarted and every stage's final weights are bitwise a failure-free run's.
Verified on simcuda only.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simcuda_progs.simcuda_harness import REPO, Program, build_program

pytestmark = pytest.mark.native
ITERS, EVERY, TIMEOUT_S = 40, 5, 120
LIBJIT = Path(os.environ.get("JITCKPT_BUILD_DIR", REPO / "build" / "native")) / "lib" / "libjit.so"


@pytest.fixture(scope="module")
def prog() -> Program:
    if not LIBJIT.exists():
        pytest.skip(f"{LIBJIT} is missing: build with `make native`")
    return build_program("pipeline_training", kernels=True, nccl=True,
                         headers=(REPO / "interposer" / "include" / "jitckpt" / "jit_abi.h",))


class Job:
    """`jitckpt run` of pipeline_training on 2 ranks; every process it started is killed at close."""

    def __init__(self, prog: Program, tmp: Path, name: str, world: int, *flags: str) -> None:
        self.dir, self.run = tmp / name, tmp / f"{name}-run"
        self.dir.mkdir()
        env = {k: v for k, v in prog.env().items() if not k.startswith("JITCKPT_")}
        env["PYTHONPATH"] = str(REPO)
        cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", str(world), "--no-python", *flags,
               "--checkpoint-dir", str(tmp / f"{name}-ckpt"), "--run-dir", str(self.run), "--status-interval", "0",
               str(prog.exe), str(self.dir), str(ITERS), str(EVERY)]
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail(f"the job did not end within {TIMEOUT_S} s:\n{self.log.read_text()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher's session: its workers and proxies too
            self.proc.wait(timeout=30)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in (self.run / "events.jsonl").read_text().splitlines() if line.strip()]

    def progress(self, rank: int) -> int:
        try:
            return int.from_bytes((self.dir / f"progress-rank{rank}").read_bytes(), "little")
        except (OSError, ValueError):
            return 0

    def final(self, rank: int) -> bytes:
        return (self.dir / f"final-rank{rank}.bin").read_bytes()


# Rank 0 of the rebuilt communicator makes its new unique id: the replacement, when stage 0 died.
# Three stages: the middle one has two survivors as neighbours, which must agree on an iteration.
@pytest.mark.parametrize("world,victim", [(2, 1), (2, 0), (3, 1)])
def test_a_dead_stage_is_replaced_alone_and_replays_from_the_survivors_log(prog: Program, tmp_path: Path,
                                                                        world: int, victim: int) -> None:
    flags = ("--transparent", "--plugin", "logging", "--hang-timeout", "2", "--max-restarts", "1")
    clean = Job(prog, tmp_path, "clean", world)
    try:
        assert clean.wait() == 0, clean.log.read_text()
        expected = [clean.final(r) for r in range(world)]
    finally:
        clean.close()

    job = Job(prog, tmp_path, "killed", world, *flags)
    try:
        # Past a global checkpoint and two iterations into the next, so that some are replayed.
        at = random.choice([k for k in range(EVERY + 2, ITERS - 10) if k % EVERY in (2, 3)])
        deadline = time.monotonic() + TIMEOUT_S
        while job.progress(victim) < at and job.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)  # polling the program's progress: the moment is meant to be random
        starts = {e["rank"]: e["pid"] for e in job.events() if e["event"] == "worker_start"}
        assert job.proc.poll() is None and job.progress(victim) < ITERS, "the job ended before the kill"
        os.kill(starts[victim], signal.SIGKILL)
        rc = job.wait()
        log = job.log.read_text()
        assert rc == 0, log
        events = job.events()
        kinds = [e["event"] for e in events]
        worker_starts = [e for e in events if e["event"] == "worker_start"]
        # The survivors kept their processes; only the victim got a replacement.
        assert [e["rank"] for e in worker_starts] == [*range(world), victim] and "restart" not in kinds, kinds
        survivors = [r for r in range(world) if r != victim]
        replaced = [e for e in events if e["event"] == "stage_replaced"]
        assert len(replaced) == 1 and replaced[0]["rank"] == victim, replaced
        recs = [e for e in events if e["event"] == "transparent_recovery"]
        assert sorted(e["rank"] for e in recs) == survivors and all(e["recovered"] for e in recs), recs
        assert all(e["pid"] == starts[e["rank"]] for e in recs), (recs, starts)
        caught = [e for e in events if e["event"] == "stage_caught_up"]
        assert len(caught) == 1 and caught[0]["rank"] == victim, caught
        assert caught[0]["pid"] == worker_starts[-1]["pid"], caught
        assert caught[0]["checkpoint"] % EVERY == 0 and caught[0]["replayed"] >= 1, caught
        assert "transparent recovery is off" not in log, log
        summary = [e for e in events if e["event"] == "recovery_summary"]
        assert len(summary) == 1 and summary[0]["scope"] == "stage", summary
        for r in range(world):
            assert job.final(r) == expected[r], f"rank {r}'s weights differ from the failure-free run"
    finally:
        job.close()
