"""Run `jitckpt run` jobs from tests: bounded in time, every process cleaned up by PID."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_ddp.py"


@dataclass
class JobResult:
    rc: int
    out: str
    workdir: Path
    ckpt: Path
    log: list
    events: list

    def final_params(self) -> dict:
        return torch.load(self.workdir / "final.pt", weights_only=True)

    def ev(self, name: str) -> list:
        return [e for e in self.events if e["event"] == name]

    def show_on_failure(self) -> None:
        """Print the job's whole output and its events but steps: pytest shows captured output in
        full when the test fails (an assertion message is cut short)."""
        print(self.out)
        for e in self.events:
            if e["event"] != "step":
                print(e)


def kill_tree(pid: int) -> None:
    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def run_bounded(cmd: list, *, cwd: Path, timeout: float, env: Optional[dict] = None) -> tuple[int, str]:
    """Run ``cmd`` (jitckpt on PYTHONPATH) in its own session; on any exit or the deadline its
    whole process tree is killed. Returns (exit code, combined output)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"job timed out after {timeout}s:\n{out[-6000:]}")
    finally:
        kill_tree(proc.pid)
    return proc.returncode, out


# A failure-free reference run restarts nothing: without warm standbys (each imports torch as
# training runs) it does not compete with its own workers for the machine's 2 cores.
COLD = ["--warm-standby", "0"]


def run_job(workdir: Path, *, nproc: int, script_args: list, launcher_args: Optional[list] = None,
            timeout: float = 180.0, script: Path = TRAIN, env: Optional[dict] = None,
            ckpt: Optional[Path] = None) -> JobResult:
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt or workdir / "ckpt"
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", str(nproc),
           "--checkpoint-dir", str(ckpt), "--run-dir", str(workdir / "run"),
           "--status-interval", "0", *(launcher_args or []), str(script),
           "--out", str(workdir / "final.pt"), "--steps-log", str(workdir / "train.jsonl"), *script_args]
    rc, out = run_bounded(cmd, cwd=workdir, env=env, timeout=timeout)
    events = _read_jsonl(workdir / "run" / "events.jsonl")
    # No worker may outlive its launcher.
    for e in events:
        if e["event"] == "worker_start" and psutil.pid_exists(e["pid"]):
            try:
                p = psutil.Process(e["pid"])
                if p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    raise AssertionError(f"worker pid {e['pid']} outlived the launcher")
            except psutil.NoSuchProcess:
                pass
    return JobResult(rc, out, workdir, ckpt, _read_jsonl(workdir / "train.jsonl"), events)


def start_launcher(workdir: Path, argv: list) -> subprocess.Popen:
    """``jitckpt run *argv`` in ``workdir`` (created), in a session of its own, its output in
    ``workdir/out.txt``; the caller kills it with :func:`kill_tree`."""
    workdir.mkdir(parents=True)
    with open(workdir / "out.txt", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "jitckpt", "run", *argv], cwd=workdir,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_records(path: Path, count: int, procs: list, timeout: float = 120.0) -> None:
    """Until the JSON-lines log ``path`` (a training's --steps-log) holds ``count`` records; fails if
    one of ``procs`` ends first or the time is up."""
    import time

    deadline = time.monotonic() + timeout
    while len(_read_jsonl(path)) < count:
        assert time.monotonic() < deadline, f"{path}: fewer than {count} records after {timeout:.0f} s"
        assert all(p.poll() is None for p in procs), f"a launcher ended early: {[p.returncode for p in procs]}"
        time.sleep(0.05)  # polling the training's progress


def _read_jsonl(path: Path) -> list:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out
