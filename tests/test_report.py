"""`jitckpt report`: summary numbers and timeline PNG from synthetic event logs."""
from __future__ import annotations

import argparse
import json
import types

import pytest

from jitckpt.observability import events
from jitckpt.observability.events import EventLog
from jitckpt.observability.report import load_run, register, summarize

T0 = 1_000.0


def _log(tmp_path, monkeypatch, gen=0):
    """An EventLog whose clock is controlled by the returned setter (emit() stamps time.time())."""
    clock = {"t": T0}
    monkeypatch.setattr(events, "time", types.SimpleNamespace(time=lambda: clock["t"]))

    def at(t):
        clock["t"] = T0 + t

    return EventLog(tmp_path / "events.jsonl", gen=gen), at


def write_two_failure_job(tmp_path, monkeypatch):
    """A 4-rank job with one periodic checkpoint and two failures, both recovered via JIT."""
    log, at = _log(tmp_path, monkeypatch)
    at(0)
    log.emit("job_start", nproc=4, nnodes=1, world_size=4, script="train.py",
             checkpoint_dir=str(tmp_path / "ckpt"), hang_timeout=2.0)
    for r in range(4):
        log.emit("worker_start", rank=r, pid=100 + r, warm=False)
    for i in range(1, 10):
        at(i)
        for r in (0, 1):
            log.emit("step", rank=r, step=i, step_time=0.5)
    at(5.5)
    log.emit("checkpoint_saved", rank=0, step=5, bytes=2_000_000, seconds=2.0, path="p0", kind="periodic")
    log.emit("checkpoint_saved", rank=1, step=5, bytes=2_000_000, seconds=2.5, path="p1", kind="periodic")
    # Failure 1: rank 1 exits; rank 0 then reports a hang for the same incident.
    at(10.0)
    log.emit("failure_detected", kind="exit", rank=1, pid=101, node="n0", detail="exit 1", detect_time=0.5)
    at(10.2)
    log.emit("failure_detected", kind="hang", rank=0, pid=100, node="n0", detail="hang", detect_time=None)
    at(11.5)
    for r, sec in ((0, 1.0), (2, 1.5), (3, 1.2)):
        log.emit("checkpoint_saved", rank=r, step=10, bytes=1_000_000, seconds=sec, path=f"j{r}", kind="jit")
    at(14.5)
    log.emit("restart", reason="failure", restart_count=1)
    log = EventLog(log.path, gen=1)  # the relaunched job's generation
    at(15.3)
    log.emit("restore", rank=0, step=10, path="j0", seconds=0.8)
    log.emit("resumed", step=10, steps_redone=1)
    log.emit("recovery_summary", failure_kind="exit", failed_ranks=[1], detect_s=0.5, save_s=1.5,
             restart_s=3.0, restore_s=0.8, total_s=5.8, checkpoint_bytes=3_000_000,
             step_failed=10, step_resumed=10, steps_redone=1)
    for i in range(10, 25):
        at(6 + i)
        log.emit("step", rank=0, step=i, step_time=0.5)
    # Failure 2: rank 3 killed by a signal.
    at(30.0)
    log.emit("failure_detected", kind="signal", rank=3, pid=103, node="n0", detail="SIGKILL", detect_time=0.2)
    at(31.0)
    log.emit("checkpoint_saved", rank=0, step=25, bytes=1_000_000, seconds=1.1, path="k0", kind="jit")
    at(33.7)
    log.emit("recovery_summary", failure_kind="signal", failed_ranks=[3], detect_s=0.2, save_s=1.0,
             restart_s=2.0, restore_s=0.5, total_s=3.7, checkpoint_bytes=1_000_000,
             step_failed=25, step_resumed=25, steps_redone=0)
    at(40.0)
    log.emit("job_end", status="ok", exit_code=0, restarts=2)
    return tmp_path


def test_two_failures_summary_numbers(tmp_path, monkeypatch):
    s = load_run(write_two_failure_job(tmp_path, monkeypatch))
    assert s.world_size == 4
    assert s.status == "ok" and s.exit_code == 0
    assert s.duration_s == pytest.approx(40.0)
    assert s.failures == 2  # the hang report of rank 0 joins rank 1's incident
    assert s.restarts == 2
    r1, r2 = s.recoveries
    assert (r1.failure_kind, r1.failed_ranks, r1.recovered) == ("exit", [1], True)
    assert r1.t_failure - T0 == pytest.approx(9.5)  # detected at 10.0, 0.5 s after it happened
    assert r1.phase_seconds() == {"detect": 0.5, "save": 1.5, "restart": 3.0, "restore": 0.8}
    assert (r2.failure_kind, r2.failed_ranks, r2.steps_redone) == ("signal", [3], 0)
    assert s.recovery_total_s == pytest.approx(9.5)
    assert s.steps_redone == 1
    assert s.step_time_median == pytest.approx(0.5)
    assert s.last_step == 24
    assert s.checkpoints == {"periodic": 1, "jit": 2}
    # One value per checkpoint, the slowest rank's: periodic 2.5, jit 1.5 and 1.1. The model's o is
    # what a periodic checkpoint costs: the JIT saves (after failures only) do not count.
    assert sorted(s.checkpoint_seconds) == [1.1, 1.5, 2.5]
    assert s.checkpoint_time_median == pytest.approx(2.5)
    assert s.checkpoint_bytes == 8_000_000
    # r = mean of detect + restart + restore = ((0.5+3+0.8) + (0.2+2+0.5)) / 2
    assert s.restart_cost_mean == pytest.approx(3.5)
    # 4 GPUs x (9.5 s of recovery + 1 redone step x 0.5 s)
    assert s.wasted_gpu_seconds == pytest.approx(40.0)


def test_unrecovered_failure_and_torn_last_line(tmp_path, monkeypatch):
    log, at = _log(tmp_path, monkeypatch)
    log.emit("job_start", nproc=2, nnodes=1, world_size=2, script="x.py", checkpoint_dir="c", hang_timeout=1)
    at(3)
    log.emit("failure_detected", kind="hang", rank=0, pid=1, node="n0", detail="", detect_time=1.0)
    with open(log.path, "a") as f:
        f.write('{"t": 1004, "event": "job_')  # a writer killed mid-line
    s = load_run(tmp_path)
    assert s.failures == 1
    (r,) = s.recoveries
    assert r.recovered is False and r.detect_s == 1.0 and r.failure_kind == "hang"
    assert s.restart_cost_mean is None  # nothing recovered, nothing to measure
    assert s.status is None


def test_summary_without_failure_event_is_its_own_incident():
    s = summarize([
        {"t": 1.0, "event": "job_start", "gen": 0, "world_size": 2},
        {"t": 9.0, "event": "recovery_summary", "gen": 1, "failure_kind": "error", "failed_ranks": [0],
         "detect_s": 1, "save_s": 1, "restart_s": 1, "restore_s": 1, "total_s": 4},
    ])
    assert s.failures == 1 and s.recoveries[0].t_failure == pytest.approx(5.0)


def test_stage_replacements_are_separate_recovered_failures():
    """--recovery stage: each death is replaced alone and closed by its own summary."""
    evs = [{"t": 1.0, "event": "job_start", "gen": 0, "world_size": 4}]
    for i, (t, rank) in enumerate(((5.0, 2), (7.0, 1))):
        evs += [
            {"t": t, "event": "failure_detected", "gen": i, "kind": "signal", "rank": rank},
            {"t": t, "event": "stage_replaced", "gen": i + 1, "rank": rank, "generation": i + 1,
             "restart_count": i + 1},
            {"t": t + 0.5, "event": "recovery_summary", "gen": i + 1, "failure_kind": "signal",
             "failed_ranks": [rank], "detect_s": 0.0, "save_s": 0.0, "restart_s": 0.1,
             "restore_s": 0.4, "total_s": 0.5, "checkpoint_bytes": 0, "step_failed": None,
             "step_resumed": 4, "steps_redone": i + 1, "scope": "stage"},
        ]
    s = summarize(evs)
    assert [(r.failed_ranks, r.recovered, r.steps_redone) for r in s.recoveries] == \
        [([2], True, 1), ([1], True, 2)]
    assert s.recovery_total_s == pytest.approx(1.0)


def _parser():
    p = argparse.ArgumentParser(prog="jitckpt")
    register(p.add_subparsers(dest="cmd", required=True))
    return p


def test_cli_table_json_and_plot(tmp_path, monkeypatch, capsys):
    run = write_two_failure_job(tmp_path, monkeypatch)
    args = _parser().parse_args(["report", str(run), "--plot", str(tmp_path / "t.png")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Failures and recovery phases" in out
    assert "signal" in out and "exit" in out and "\x1b[" not in out  # plain text when piped
    png = (tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    args = _parser().parse_args(["report", str(run), "--json"])
    assert args.func(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["failures"] == 2 and d["restarts"] == 2
    assert [r["total_s"] for r in d["recoveries"]] == [5.8, 3.7]


def test_cli_missing_run_dir(tmp_path, capsys):
    args = _parser().parse_args(["report", str(tmp_path / "nope")])
    assert args.func(args) == 2
    assert "no event log" in capsys.readouterr().err


@pytest.mark.parametrize("content", [
    bytes(range(256)) * 16,                      # binary: used to die with a raw UnicodeDecodeError
    b"\xff\xfe\x00garbage\n" * 10,
    b"just some text\nnot json\n",
    b'{"step": 3, "loss": 0.5}\n',               # JSON lines, but a training log, not events
])
def test_cli_file_that_is_not_an_event_log(tmp_path, capsys, content):
    bad = tmp_path / "model.bin"
    bad.write_bytes(content)
    args = _parser().parse_args(["report", str(bad)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert f"{bad} is not a jitckpt event log" in err and "events.jsonl" in err
    from jitckpt.cli import main

    assert main(["analyze", "--from-run", str(bad)]) == 2
    assert f"{bad} is not a jitckpt event log" in capsys.readouterr().err


def test_cli_checkpoint_dir_picks_its_newest_run(tmp_path, monkeypatch, capsys):
    import os

    ckpt = tmp_path / "ckpt"
    old, new = ckpt / "runs" / "20260101-000000-aaaaaa", ckpt / "runs" / "20260102-000000-bbbbbb"
    for d in (old, new):
        d.mkdir(parents=True)
    write_two_failure_job(new, monkeypatch)
    (old / "events.jsonl").write_text(json.dumps({"t": 1.0, "event": "job_start", "gen": 0}) + "\n")
    os.utime(old / "events.jsonl", (1, 1))  # the older run
    args = _parser().parse_args(["report", str(ckpt), "--json"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert f"the newest run in {ckpt}: {new}" in captured.err
    assert json.loads(captured.out)["failures"] == 2


def test_timeline_has_a_lane_per_rank_start_up_and_each_recovery_zoomed_with_labelled_phases(tmp_path, monkeypatch):
    import matplotlib.text

    s = load_run(write_two_failure_job(tmp_path, monkeypatch))
    from jitckpt.observability.report import build_timeline

    fig = build_timeline(s)
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    for rank in range(4):  # world size 4: every rank has its lane, those without step events too
        assert f"rank {rank}" in texts, texts
    assert "start-up" in texts
    zooms = [t for t in texts if t.startswith("#") and ", rank " in t]
    assert zooms == ["#1 exit, rank 1", "#2 signal, rank 3"], zooms
    for phase, seconds in (("detect", 0.5), ("save", 1.5), ("restart", 3.0), ("restore", 0.8)):
        assert f"{phase}\n{seconds:.2f} s" in texts, (phase, texts)
    assert any(t.startswith("redo\n") for t in texts)  # 1 minibatch redone x the median step time
    import matplotlib.pyplot as plt
    plt.close(fig)
