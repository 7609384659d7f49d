"""A native worker that cannot save is not waited for (issue 43 item 2), on simcuda.

`jitckpt run --transparent --no-python` of streams_pinned_sendrecv.cu on 2 ranks (nvcc-compiled CUDA +
NCCL). Rank 0's device gets a sticky error that recurs in every proxy (no SIMCUDA_FAIL_ONCE), so its
transparent recovery fails and the program exits; rank 1, whose collective waits for rank 0, is a
CUDA program with no save path. libjit.so registered it so (its Hello says it cannot save), and the
launcher restarts the job at once, saying why, instead of waiting --save-timeout for a JIT checkpoint
that never comes. With no checkpoint anywhere the restart runs the program from its start, as for any
failure with nothing saved. Verified on simcuda only.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dp_build import ProcessTree
from simcuda_progs.simcuda_harness import REPO, Program, build_program

pytestmark = pytest.mark.native

WORLD, STEPS = 2, 200
SAVE_TIMEOUT_S = 30
NOT_WAITED_S = 5  # failure found -> restart: well inside --save-timeout (it took ~30 s before the fix)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def prog() -> Program:
    return build_program("streams_pinned_sendrecv", kernels=True, nccl=True)


def wrapper(prog: Program, tmp: Path) -> Path:
    """The worker: the program, with the fault in generation 0 only (every proxy of that generation
    faults at the same call, the replay's included) and a unique-id file of each generation's own (a
    restarted rank 1 must not read generation 0's)."""
    script = tmp / "worker.sh"
    script.write_text("#!/bin/sh\n"
                      'if [ "$TORCHELASTIC_RESTART_COUNT" != 0 ]; then\n'
                      "  unset SIMCUDA_FAIL_MODE SIMCUDA_FAIL_RANK SIMCUDA_FAIL_AT\n"
                      "fi\n"
                      f'exec "{prog.exe}" ring env env "{tmp}/uid-$TORCHELASTIC_RESTART_COUNT" {STEPS}\n')
    script.chmod(0o755)
    return script


def test_a_native_rank_with_no_save_path_is_not_waited_for_after_a_failure(prog: Program, tmp_path: Path) -> None:
    env = {k: v for k, v in prog.env().items() if not k.startswith("JITCKPT_")}
    env.update(PYTHONPATH=str(REPO), SIMCUDA_FAIL_MODE="sticky", SIMCUDA_FAIL_RANK="0", SIMCUDA_FAIL_AT="40")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", str(WORLD), "--transparent", "--no-python",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(run), "--max-restarts", "1",
           "--save-timeout", str(SAVE_TIMEOUT_S), "--hang-timeout", "10", "--status-interval", "0",
           str(wrapper(prog, tmp_path))]
    job = ProcessTree(cmd, tmp_path / "job.log", env)
    try:
        rc = job.wait(TIMEOUT_S)
    finally:
        job.close()
    out = job.log.read_text()
    assert rc == 0, out
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    # Rank 0's transparent recovery failed: the fault came back in the replay.
    recs = [e for e in events if e["event"] == "transparent_recovery" and e["gen"] == 0 and e["rank"] == 0]
    assert recs and not recs[0]["recovered"] and "failed again" in recs[0]["reason"], recs
    failure = next(e for e in events if e["event"] == "failure_detected")
    assert failure["gen"] == 0 and failure["rank"] == 0, failure
    # The launcher said at once why it does not wait for rank 1, in its log and its event log...
    assert "rank 1 (a native program) registered no save path: not waiting for its JIT checkpoint" in out, out
    said = [e for e in events if e["event"] == "warning" and e["gen"] == 0]
    assert [(e["rank"], "registered no save path" in e["reason"]) for e in said] == [(1, True)], said
    # ...and restarted well inside --save-timeout, rank 1 still running (killed, not waited for).
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["t"] - failure["t"] < NOT_WAITED_S, (restart, failure)
    assert f"no complete JIT checkpoint from every shard within {SAVE_TIMEOUT_S}s" not in out, out
    # Nothing was saved, so the restart ran the program from its start; both ranks ended well.
    assert not [e for e in events if e["event"] == "checkpoint_saved"], events
    starts = [(e["gen"], e["role"]) for e in events if e["event"] == "worker_start"]
    assert starts == [(0, "initial")] * WORLD + [(1, "restart")] * WORLD, starts
    assert out.count("ok=1") == WORLD, out
    assert events[-1]["event"] == "job_end" and events[-1]["status"] == "ok", events[-1]
