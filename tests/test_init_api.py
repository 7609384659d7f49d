"""Issue 13 item 8: a job that uses the paper's API, ``jitckpt.init(save_fn, step_fn=...)`` and
``jitckpt.get_checkpoint_path()`` without ``mark_step`` (tests/scripts/train_init.py), gets the
same recovery report as a ``protect()`` job, and is told that ``--periodic-every`` cannot work."""
from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from jobs import run_job

from jitckpt.observability.report import load_run

INIT_SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_init.py"


def test_init_job_recovery_is_summarized_and_periodic_warns(tmp_path):
    res = run_job(tmp_path, nproc=2, script=INIT_SCRIPT, script_args=["--inject", "0:1:8:kill"],
                  launcher_args=["--periodic-every", "3"], timeout=240)
    assert res.rc == 0, res.out[-4000:]
    # The first optimizer step after the restart is the "resumed" signal (no mark_step needed).
    summaries = res.ev("recovery_summary")
    assert len(summaries) == 1, res.out[-4000:]
    s = summaries[0]
    assert (s["failed_ranks"], s["step_failed"], s["step_resumed"], s["steps_redone"]) == ([1], 8, 8, 1), s
    run = load_run(res.workdir / "run")
    assert [(r.recovered, r.failed_ranks, r.steps_redone) for r in run.recoveries] == [(True, [1], 1)]
    # --periodic-every has no safe point to save at: said once per worker, not silently ignored.
    warnings = res.ev("warning")
    assert warnings and all(w["rank"] == 0 for w in warnings), warnings
    assert "--periodic-every 3" in warnings[0]["reason"] and "mark_step" in warnings[0]["reason"]
    assert "no periodic checkpoint is taken" in res.out
    assert {e["kind"] for e in res.ev("checkpoint_saved")} == {"jit"}
    # Its heartbeat comes from the optimizer steps: the step events are there too.
    assert res.ev("step") or run.last_step is None


@pytest.mark.slow  # make test's 15-minute budget: test_preemption's non-zero exit case stays fast
def test_rank_leaving_with_exit_code_0_is_its_failure(tmp_path):
    """sys.exit(0) in the middle of training: the rank waits in jitckpt's exit barrier, its peers
    in a collective it will never join. That is reported as that rank's failure within
    PEER_EXIT_GRACE (5 s), long before the hang timeout, and the job recovers."""
    res = run_job(tmp_path, nproc=2, script=INIT_SCRIPT, script_args=["--inject", "0:1:6:exit0"],
                  launcher_args=["--hang-timeout", "100"], timeout=240)
    assert res.rc == 0, res.out[-4000:]
    failures = res.ev("failure_detected")
    assert [(f["kind"], f["rank"], f["reporter"]) for f in failures] == [("exit", 1, 0)], failures
    assert failures[0]["detail"].startswith("rank 1 left the job"), failures[0]
    summaries = res.ev("recovery_summary")
    assert [(s["failed_ranks"], s["step_resumed"], s["steps_redone"]) for s in summaries] == [([1], 6, 1)]
    assert summaries[0]["detect_s"] < 60  # not the hang timeout
    assert (res.workdir / "final.pt").exists()


def test_a_rank_killed_while_a_process_it_forked_holds_its_descriptors_is_seen_dead_at_once(tmp_path):
    """Rank 1 forks a helper (as a DataLoader or torch.compile worker would) and is SIGKILLed: the
    helper keeps the launcher's control channel and rank 1's gloo sockets open, so neither the
    channel's EOF nor a reset connection tells of the death, and rank 0 waits in its all-reduce.
    The launcher sees the exit itself within a second or two (not rank 0's 100 s hang timeout),
    kills the helper with the dead rank's process group, and the job recovers."""
    res = run_job(tmp_path, nproc=2, script=INIT_SCRIPT, script_args=["--inject", "0:1:5:fork-kill"],
                  launcher_args=["--hang-timeout", "100"], timeout=240)
    death = json.loads((tmp_path / "train.jsonl.death").read_text())
    try:
        assert res.rc == 0, res.out[-4000:]
        failures = res.ev("failure_detected")
        assert [(f["kind"], f["rank"]) for f in failures] == [("signal", 1)], failures
        assert failures[0]["t"] - death["t"] < 5, (failures[0], death)
        summaries = res.ev("recovery_summary")
        assert [(s["failed_ranks"], s["step_resumed"], s["steps_redone"]) for s in summaries] == [([1], 5, 1)]
        assert not psutil.pid_exists(death["helper"]) or psutil.Process(death["helper"]).status() == psutil.STATUS_ZOMBIE, \
            "the dead rank's helper outlived the job"
    finally:
        if psutil.pid_exists(death["helper"]):
            psutil.Process(death["helper"]).kill()
