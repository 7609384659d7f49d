"""Transparent recovery with minibatch marks (issue 16): dp_train.cu marks each minibatch and its
optimizer step (include/jitckpt/marks.h), so proxy mode's replay journal keeps only what built the
device state (allocations, streams, events, the communicator) plus the current minibatch's calls.
When NCCL fails in the forward/backward part of a step, libjit.so copies the buffers that existed
at the minibatch's start out of the old proxy, starts a new one, recreates the objects, puts the
buffers back and replays the minibatch: the run ends bitwise equal to a failure-free run, and the
replay is as long at step 150 as at step 20.

A proxy lost with its memory (killed, a sticky device error) cannot be recovered this way on one
rank: the parameters would have to come from a data-parallel replica (not built yet), and the
process fails with that reason. Verified on simcuda only.
"""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dp_build import DP_LIBS, DRIVER, LIBJIT, REPO, dp_env, need_build

pytestmark = pytest.mark.native
STEPS = 200
TIMEOUT_S = 120


def run_one_rank(tmp: Path, name: str, **extra: str) -> tuple[int, bytes | None, str]:
    """dp_train.py as rank 0 of 1: exit code, final state, output."""
    out = tmp / f"{name}.bin"
    proc = subprocess.run([sys.executable, str(DRIVER), "--lib-dir", str(DP_LIBS), "--rank", "0", "--world", "1",
                           "--id-file", str(tmp / f"{name}.id"), "--steps", str(STEPS), "--ckpt-dir",
                           str(tmp / f"{name}-ckpt"), "--out", str(out)],
                          env=dp_env(**extra), capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, out.read_bytes() if out.exists() else None, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    need_build()
    rc, state, out = run_one_rank(tmp_path_factory.mktemp("ref"), "ref")  # directly on simcuda: the marks are no-ops
    assert rc == 0 and state, out
    return state


def proxy_with_fault(tmp: Path, mode: str, at: int) -> dict[str, str]:
    return {"LD_PRELOAD": str(LIBJIT), "JITCKPT_MODE": "proxy", "SIMCUDA_FAIL_MODE": mode,
            "SIMCUDA_FAIL_AT": str(at), "SIMCUDA_FAIL_ONCE": str(tmp / f"fired-{mode}-{at}")}


def test_an_nccl_failure_replays_one_minibatch_on_the_saved_buffers_and_ends_bitwise(reference: bytes,
                                                                                    tmp_path: Path) -> None:
    """The all-reduce of one step returns ncclSystemError (one early step, one late random step):
    recovered with no error seen, bitwise; the same number of calls are replayed both times."""
    late = random.randrange(100, STEPS - 5)
    replayed = {}
    for at in (20, late):
        rc, state, out = run_one_rank(tmp_path, f"at{at}", **proxy_with_fault(tmp_path, "error", at))
        assert (tmp_path / f"fired-error-{at}").exists(), "the fault was not injected"
        assert rc == 0, (at, out)
        assert state == reference, (at, "the recovered run's parameters differ", out)
        m = re.search(r"NCCL failed: unhandled system error.*\(in ncclAllReduce\).*\n.*recovered: jitckpt-proxy pid \d+ "
                      r"took over after replaying \d+ calls \((\d+) of this minibatch\) in [\d.]+ ms \(save buffers [\d.]+ ms, new proxy [\d.]+ "
                      r"ms, recreate handles and communicators [\d.]+ ms, restore buffers [\d.]+ ms", out)
        assert m, (at, out)
        replayed[at] = int(m.group(1))
    # One step's calls (kernels, event records and waits, the all-reduce, the sentinel event libjit.so
    # records after it) up to the failed one, whichever step failed: the journal does not grow.
    assert replayed[20] == replayed[late] and 0 < replayed[20] < 20, replayed


@pytest.mark.parametrize("mode", ["crash", "sticky"])
def test_a_proxy_lost_with_its_memory_after_marks_fails_with_the_reason(tmp_path: Path, mode: str) -> None:
    """The parameters were only in the lost proxy's memory, and one rank has no replica: the process
    gets the error (it does not go on with wrong buffers), and stderr says why recovery refused."""
    rc, state, out = run_one_rank(tmp_path, mode, **proxy_with_fault(tmp_path, mode, 20))
    assert rc != 0 and state is None, out
    # A killed proxy: the recovery is tried and fails. A sticky error: refused while the proxy (and
    # its error) is still there, and the program gets that error, as without a proxy.
    said = "transparent recovery failed" if mode == "crash" else "not recovered transparently"
    assert f"{said}: the parameters and optimizer state were in the lost proxy's device memory" in out, out


def test_jitckpt_run_transparent_reports_the_save_recreate_restore_replay_breakdown(tmp_path: Path,
                                                                                   reference: bytes) -> None:
    """The same NCCL failure under `jitckpt run --transparent` with dp_train.py's jitckpt script
    (whose jitckpt.mark_step also marks the minibatch): no restart, one transparent_recovery record
    with every phase of the breakdown, and `jitckpt report` shows them."""
    need_build()
    run = tmp_path / "run"
    env = dp_env(SIMCUDA_FAIL_MODE="error", SIMCUDA_FAIL_AT="30", SIMCUDA_FAIL_ONCE=str(tmp_path / "fired"))
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "1", "--transparent", "--checkpoint-dir",
           str(tmp_path / "ckpt"), "--run-dir", str(run), "--max-restarts", "0", "--status-interval", "0",
           str(DRIVER), "--jitckpt", "--lib-dir", str(DP_LIBS), "--steps", str(STEPS), "--out",
           str(tmp_path / "out{rank}.bin")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert (tmp_path / "fired").exists(), "the fault was not injected"
    assert (tmp_path / "out0.bin").read_bytes() == reference, out
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    assert [e["event"] for e in events].count("worker_start") == 1, "the worker was restarted"
    recs = [e for e in events if e["event"] == "transparent_recovery"]
    assert len(recs) == 1 and recs[0]["recovered"] is True, recs
    rec = recs[0]
    phases = ("save_s", "new_proxy_s", "recreate_s", "restore_s", "replay_s", "synchronize_s")
    assert all(rec[p] >= 0 for p in phases) and rec["save_s"] > 0 and rec["restore_s"] > 0, rec
    assert sum(rec[p] for p in phases) <= rec["total_s"] + 1e-6, rec
    report = subprocess.run([sys.executable, "-m", "jitckpt", "report", str(run)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stdout + report.stderr
    for column in ("save buffers", "recreate handles", "restore buffers"):
        assert column in report.stdout, report.stdout
