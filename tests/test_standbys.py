"""Warm standbys (issue 43 item 4): a plain Python job's are forked by the standby template, which
imported torch once, so a failure at any step after the first restarts on ready standbys, and
their start takes no CPU from training; each is still a process of its own, as a fresh one is.
Standbys of their own (with LD_PRELOAD) import torch at idle CPU and I/O priority."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from jobs import COLD, ROOT, run_job

PROBE = ROOT / "tests" / "scripts" / "standby_probe.py"


@pytest.mark.parametrize("launcher_args", [pytest.param([], id="template"),
                                           pytest.param(COLD, id="warm-standby-0", marks=pytest.mark.slow)])
def test_every_worker_is_a_process_of_its_own_child_of_the_launcher(tmp_path: Path, launcher_args: list) -> None:
    """Its own session, its parent the launcher (a fork's intermediate parent exited: the launcher
    is the subreaper), normal CPU and I/O priority, its own numpy and Python random state."""
    job = run_job(tmp_path, nproc=2, script=PROBE, script_args=[], launcher_args=launcher_args, timeout=120)
    job.show_on_failure()
    assert job.rc == 0
    ranks = [json.loads((tmp_path / f"final.pt.{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["sid"] == r["pid"] and r["parent"].startswith("jitckpt launcher"), r
        assert r["sched_other"] and r["ioprio_class"] in (0, 2), r  # none (the default) or best effort
    assert ranks[0]["numpy"] != ranks[1]["numpy"] and ranks[0]["random"] != ranks[1]["random"], ranks


@pytest.mark.slow  # make test's 15-minute budget: standbys stay fast in the other tests here and in every e2e recovery
def test_a_failure_soon_after_the_first_step_restarts_on_ready_standbys_bitwise(tmp_path: Path) -> None:
    """Rank 1 killed at its 7th step, 0.6 s into training, under protect() and under the paper's
    init() API: the standbys were forked once both ranks trained, so the restart found them ready
    (they used to import torch for seconds then, taking the training's CPU, and the restart took
    3-7 s); bitwise against one failure-free run (both APIs train alike), one minibatch redone."""
    common = ["--steps", "10", "--step-sleep", "0.1"]
    ref = run_job(tmp_path / "ref", nproc=2, script_args=common, launcher_args=COLD)
    assert ref.rc == 0
    want = ref.final_params()
    for api in ("protect", "init"):
        job = run_job(tmp_path / api, nproc=2, script_args=[*common, "--api", api, "--inject", "0:1:6:kill"])
        job.show_on_failure()
        assert job.rc == 0, api
        (summary,) = job.ev("recovery_summary")
        assert summary["standbys"] == "ready" and summary["steps_redone"] == 1, (api, summary)
        assert all(e["warm"] for e in job.ev("worker_start") if e["gen"] == 1), api
        got = job.final_params()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), api


@pytest.mark.slow  # ~7 s; the fast test above checks the summary's 'ready'
def test_without_a_ready_standby_the_summary_says_why(tmp_path: Path) -> None:
    job = run_job(tmp_path, nproc=2, script_args=["--steps", "6", "--inject", "0:1:3:kill"], launcher_args=COLD)
    job.show_on_failure()
    assert job.rc == 0
    (summary,) = job.ev("recovery_summary")
    assert summary["standbys"] == "not ready: rank 0: --warm-standby 0; rank 1: --warm-standby 0", summary
    assert "restarted on warm standbys" in job.out and "no, not ready" in job.out


def test_a_standby_of_its_own_imports_torch_on_an_idle_thread_and_keeps_its_own_priority() -> None:
    """The thread that imports runs at SCHED_IDLE and the idle I/O class; the process's main thread
    (the worker-to-be) stays at normal priority: unprivileged, it could not get it back."""
    code = textwrap.dedent("""
        import ctypes, json, os, platform, threading
        import jitckpt.runtime.standby as standby
        seen = {}
        real = standby.import_torch
        def probe():
            n = {"x86_64": 252, "aarch64": 31}[platform.machine()]
            seen["idle"] = os.sched_getscheduler(0) == os.SCHED_IDLE
            seen["ioprio_class"] = ctypes.CDLL(None).syscall(n, 1, 0) >> 13
            seen["thread"] = threading.current_thread().name
            real()
        standby.import_torch = probe
        standby.import_torch_at_idle_priority()
        seen["main_normal"] = os.sched_getscheduler(0) == os.SCHED_OTHER
        print(json.dumps(seen))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen == {"idle": True, "ioprio_class": 3, "thread": "jitckpt-standby-import", "main_normal": True}


@pytest.mark.slow  # ~15 s: the template's loss is rare; the fast suite covers its normal life
def test_a_job_whose_standby_template_is_killed_goes_on_with_standbys_of_their_own(tmp_path: Path) -> None:
    """The template SIGKILLed (an OOM kill, say) at step 2; rank 1 dies at step 8: the standbys
    already forked take the restart, the next ones are processes of their own (the launcher says
    so), and the job ends bitwise."""
    import psutil

    from jobs import kill_tree, start_launcher, wait_for_records

    common = ["--steps", "14", "--step-sleep", "0.1"]
    ref = run_job(tmp_path / "ref", nproc=2, script_args=common, launcher_args=COLD)
    assert ref.rc == 0
    d = tmp_path / "job"
    launcher = start_launcher(d, ["--nproc-per-node", "2", "--checkpoint-dir", str(d / "ckpt"), "--run-dir",
                                  str(d / "run"), "--status-interval", "0", str(ROOT / "examples" / "train_ddp.py"),
                                  *common, "--inject", "0:1:8:kill", "--out", str(d / "final.pt"),
                                  "--steps-log", str(d / "train.jsonl")])
    try:
        wait_for_records(d / "train.jsonl", 4, [launcher])
        (template,) = [p for p in psutil.Process(launcher.pid).children()
                       if " ".join(p.cmdline()).startswith("jitckpt template")]
        template.kill()
        assert launcher.wait(timeout=120) == 0, (d / "out.txt").read_text()[-4000:]
    finally:
        kill_tree(launcher.pid)
    out = (d / "out.txt").read_text()
    assert "standbys start as processes of their own" in out, out[-4000:]
    want, got = ref.final_params(), torch.load(d / "final.pt", weights_only=True)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
