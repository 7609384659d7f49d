"""`jitckpt analyze` command line: flags, --from-run, --json, --plot, errors."""
from __future__ import annotations

import argparse
import json

import pytest

from jitckpt.observability import analyze_cli
from jitckpt.observability.analysis import SECONDS_PER_DAY
from tests.test_report import write_two_failure_job


def _run(argv, capsys):
    p = argparse.ArgumentParser(prog="jitckpt")
    analyze_cli.register(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(["analyze", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_parse_gpus():
    assert analyze_cli.parse_gpus("8,4,4") == [4, 8]
    assert analyze_cli.parse_gpus("8:64") == [8, 16, 32, 64]
    assert analyze_cli.parse_gpus("3:10") == [3, 6, 10]
    for bad in ("0", "a,b", "64:8", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="bad GPU count list"):
            analyze_cli.parse_gpus(bad)


def test_json_from_flags(capsys):
    rc, out, _ = _run(["-o", "4", "-r", "10", "-f", str(1e-4 * SECONDS_PER_DAY), "-m", "0.5",
                       "--jit-overhead", "0.01", "-N", "2", "--gpu-hour-price", "3", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert d["params"]["failure_rate"] == pytest.approx(1e-4)
    assert set(d["sources"].values()) == {"flag"}
    (row,) = d["rows"]
    assert row["optimal_frequency"] == pytest.approx(0.005)  # same hand values as test_analysis
    assert row["wf_periodic"] == pytest.approx(0.042 / 1.042)
    assert row["wf_jit"] == pytest.approx(0.01245 / 1.01245)
    assert row["cost_transparent"] == pytest.approx(2 * 720 * 3 * 0.01005 / 1.01005)


def test_table_and_plot(tmp_path, capsys):
    png = tmp_path / "wf.png"
    rc, out, err = _run(["-N", "4:64", "--gpu-hour-price", "4", "--plot", str(png)], capsys)
    assert rc == 0
    assert "c* (ckpt/hour" in out and "$/month" in out and "1/(GPU·day)" in out
    assert "\x1b[" not in out
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    assert str(png) in err


def test_from_run_takes_measurements_and_flags_override(tmp_path, monkeypatch, capsys):
    run = write_two_failure_job(tmp_path, monkeypatch)
    rc, out, _ = _run(["--from-run", str(run), "--baseline-step-time", "0.4", "-N", "4", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    p = d["params"]
    assert p["overhead"] == pytest.approx(2.5)  # the periodic checkpoint's time (slowest rank), not the JIT saves
    assert p["restart_cost"] == pytest.approx(3.5)  # mean detect + restart + restore
    assert p["minibatch_time"] == pytest.approx(0.5)  # median step time
    assert p["jit_overhead"] == pytest.approx(0.25)  # 0.5 s vs 0.4 s baseline
    assert d["sources"]["overhead"].startswith("run ")
    assert d["sources"]["failure_rate"] == "default"  # one job cannot measure f

    rc, out, _ = _run(["--from-run", str(run), "-o", "7", "-N", "4", "--json"], capsys)
    d = json.loads(out)
    assert d["params"]["overhead"] == 7 and d["sources"]["overhead"] == "flag"
    assert d["params"]["jit_overhead"] == 0 and "default" in d["sources"]["jit_overhead"]


def test_ends_with_the_action_for_the_measured_job_and_names_the_columns(tmp_path, monkeypatch, capsys):
    run = write_two_failure_job(tmp_path, monkeypatch)  # a 4-rank job, 0.5 s steps
    rc, out, _ = _run(["--from-run", str(run), "-N", "4,1024"], capsys)
    assert rc == 0
    lines = [line for line in out.splitlines() if line.strip()]
    import re
    m = re.match(r"For this job \(4 GPUs\): `jitckpt run --periodic-every (\d+)` steps \(every ([\d.]+) minutes at "
                 r"0.5 s a step\) as the fallback tier\.", lines[-1])
    assert m, lines[-1]
    assert abs(int(m.group(1)) * 0.5 / 60 - float(m.group(2))) <= 0.01 * float(m.group(2))  # steps x m = interval
    assert "user JIT is what `jitckpt run` gives" in out and "`jitckpt run --transparent`" in out


def test_errors(tmp_path, capsys):
    rc, _, err = _run(["--from-run", str(tmp_path / "missing")], capsys)
    assert rc == 2 and "no event log" in err
    rc, _, err = _run(["-o", "0"], capsys)
    assert rc == 2 and "overhead must be positive" in err
    with pytest.raises(SystemExit):
        _run(["-m", "-1"], capsys)
    assert "must be a finite number >= 0" in capsys.readouterr().err
