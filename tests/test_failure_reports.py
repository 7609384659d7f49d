"""Issue 13 item 9: what the launcher says about a failure is right: the steps redone when no
rank saved, the failed rank of a hang (never the rank that reported it), failures during a
recovery, and no "restarting" when no restart follows."""
from __future__ import annotations

import pytest

import re
import signal
import types

from jobs import run_job

from jitckpt.launcher.jit_recovery import FailureRecord, JitRecovery
from jitckpt.observability.report import load_run

HANG = ["--hang-timeout", "auto:floor=3,mult=10,startup=60,warmup=3"]


def test_no_rank_saved_counts_every_minibatch_redone(tmp_path):
    """Both ranks die at minibatch 12: nobody saves, the job resumes from the periodic checkpoint
    of step 10 and redoes minibatches 10, 11 and 12 (the step at failure used to be the stale
    heartbeat's, 0, giving "0 -> 10, redone 1")."""
    res = run_job(tmp_path, nproc=2, script_args=["--steps", "16", "--inject", "0:0:12:kill",
                                                  "--inject", "0:1:12:kill"],
                  launcher_args=["--periodic-every", "5"], timeout=240)
    assert res.rc == 0, res.out[-4000:]
    assert not [e for e in res.ev("checkpoint_saved") if e["kind"] == "jit"]
    s = res.ev("recovery_summary")[0]
    assert (s["step_failed"], s["step_resumed"], s["steps_redone"]) == (12, 10, 3), s
    assert s["failed_ranks"] == [0, 1]
    assert "12 → 10" in res.out


@pytest.mark.slow  # the fault matrix's gil/stop cases and the e2e hang cases cover hang recovery in the fast suite
def test_hang_names_the_hung_rank_not_the_reporter(tmp_path):
    res = run_job(tmp_path, nproc=3, script_args=["--steps", "12", "--inject", "0:1:6:stop"],
                  launcher_args=HANG, timeout=240)
    assert res.rc == 0, res.out[-4000:]
    (f,) = res.ev("failure_detected")
    assert f["kind"] == "hang" and f["rank"] is None and f["reporter"] in (0, 2), f
    assert f"by rank {f['reporter']}, failed rank not known yet" in res.out
    assert "on rank 0" not in res.out and "on rank 2" not in res.out and "rank=None" not in res.out
    assert "failure (hang) of rank 1, detected by rank" in res.out
    assert res.ev("recovery_summary")[0]["failed_ranks"] == [1]
    assert [r.failed_ranks for r in load_run(res.workdir / "run").recoveries] == [[1]]


def test_failure_during_recovery_without_restarts_left(tmp_path):
    """The second failure hits the recovery and --max-restarts is used up: the failure line says
    so instead of "restarting", and the kinds are not chained into "X during recovery from X
    during recovery from ..."."""
    res = run_job(tmp_path, nproc=2, script_args=["--steps", "12", "--inject", "0:1:5:kill",
                                                  "--inject", "1:1:0:restore"],
                  launcher_args=["--max-restarts", "1"], timeout=240)
    assert res.rc == 1, res.out[-4000:]
    # The launcher's lines: [jitckpt HH:MM:SS] (a worker's add its rank).
    lines = [line for line in res.out.splitlines() if re.match(r"\[jitckpt \d\d:\d\d:\d\d\] failure \(", line)]
    assert len(lines) == 2, res.out[-4000:]
    # The death is seen as the signal, or first as the survivor's collective error.
    assert re.match(r"\[jitckpt [\d:]+\] failure \((signal|error)\) of rank 1", lines[0]), lines
    assert re.match(r"\[jitckpt [\d:]+\] failure \((signal|error) during recovery from (signal|error)\) "
                    r"of rank 1", lines[1]), lines
    tail = res.out[res.out.index(lines[1]):]
    assert "no restart" in tail and "restarting" not in tail, tail
    assert tail.index("no restart") < tail.index("--max-restarts=1 is used up")


def _finish(pending, failure, restarts_left=True, workers=()):
    """JitRecovery.finish without processes: the record it leaves and whether it said restarting."""
    shown = []
    jit = JitRecovery(cfg=types.SimpleNamespace(), coord=None, emit=None,
                      display=types.SimpleNamespace(
                          show_failure=lambda f, restarting: shown.append(restarting)))
    jit.pending = pending
    jit.finish(list(workers), failure, restarting=restarts_left)
    return jit.pending, shown[0]


def test_failures_during_recovery_are_counted_not_chained():
    rec = FailureRecord(gen=0, kind="signal", rank=1, detail="", t_detect=1.0, failed_ranks=[1])
    rec, restarting = _finish(None, rec)
    assert (rec.label, restarting) == ("signal", True)
    for gen, nth in ((1, None), (2, "2nd"), (3, "3rd"), (4, "4th")):
        rec, restarting = _finish(rec, FailureRecord(gen=gen, kind="exit", rank=0, detail="",
                                                     t_detect=gen + 1.0, failed_ranks=[0]),
                                  restarts_left=gen < 4)
        expected = ("exit during recovery from signal" if nth is None
                    else f"exit, the {nth} failure during recovery from signal")
        assert rec.label == expected and rec.t_detect == 1.0
        assert restarting == (gen < 4)
    assert rec.kind == "exit" and sorted(rec.failed_ranks) == [0, 1]


def test_a_rank_that_killed_itself_is_failed_one_the_launcher_killed_is_not():
    """CI saw failed_ranks [0] for two ranks that both SIGKILLed themselves: the launcher found
    rank 1's exit by poll() before reading its EOF, and took every SIGKILL for its own."""
    def worker(rank, killed):
        return types.SimpleNamespace(rank=rank, exit_code=-signal.SIGKILL, killed=killed)

    for kind, expected in (("signal", [0, 1]), ("hang", [0, 1, 2])):
        rec = FailureRecord(gen=0, kind=kind, rank=0, detail="", t_detect=1.0, failed_ranks=[0])
        rec, _ = _finish(None, rec, workers=[worker(1, killed=False), worker(2, killed=True)])
        # After a hang, a rank still silent when killed is a culprit too.
        assert sorted(rec.failed_ranks) == expected, kind
