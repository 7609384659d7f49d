"""Transparent recovery (issue 16), measured in one run on simcuda with the data-parallel CUDA+NCCL
program of the tests (dp_cuda, dim = batch = 1024):

* ``journal``: the replay journal's steady-state cost. 2 ranks in proxy mode with the journal on
  (the default) and off (``JITCKPT_REPLAY_LIMIT_MB=0``), alternating; the median of the paired
  ratios of each run's median step time.
* ``recovery``: one rank under ``jitckpt run --transparent``, its jitckpt-proxy SIGKILLed at the
  same moment of the run (``--kill-after`` s after the proxy starts). Time lost = the job's wall
  time minus a failure-free job's, each the median of ``--reps`` runs:
  - transparent: the journal on; libjit.so starts a new proxy and replays (the log line gives the
    replay time and the number of calls);
  - user-level: the journal off, so the worker fails and the launcher restarts it (one rank has no
    replica to save from: it starts again from its newest checkpoint, here none).
  Multi-rank transparent recovery (communicators rebuilt with the peers) is not built, so the
  comparison is on one rank.

    .venv/bin/python bench/bench_transparent_recovery.py [--quick] [--reps N] [--out FILE]

Verified on simcuda only.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_proxy import REPO, clean_env, dp_step_times, emit  # noqa: E402
from dp_build import DP_LIBS, DRIVER, need_build  # noqa: E402

SIZE = 1024


def journal_overhead(steps: int, reps: int, tmp: Path) -> dict:
    runs: dict[str, list[float]] = {"journal_on": [], "journal_off": []}
    for rep in range(reps):
        runs["journal_on"].append(statistics.median(dp_step_times("proxy", steps, SIZE, tmp / f"on{rep}")))
        runs["journal_off"].append(statistics.median(
            dp_step_times("proxy", steps, SIZE, tmp / f"off{rep}", JITCKPT_REPLAY_LIMIT_MB="0")))
    paired = [on / off - 1 for on, off in zip(runs["journal_on"], runs["journal_off"])]
    return {"overhead": statistics.median(paired), "paired_overheads": paired, "runs_s": runs, "steps": steps,
            "dim": SIZE, "batch": SIZE, "ranks": 2}


def launcher_job(tmp: Path, steps: int, kill_after: float | None, journal: bool) -> dict:
    """One rank under jitckpt run --transparent; its proxy killed `kill_after` s after it started."""
    tmp.mkdir(parents=True)
    env = clean_env(SIMCUDA_KERNEL_LIB=str(DP_LIBS / "libdp_train_kernels.so"))
    if not journal:
        env["JITCKPT_REPLAY_LIMIT_MB"] = "0"
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "1", "--checkpoint-dir", str(tmp / "ckpt"),
           "--run-dir", str(tmp / "run"), "--max-restarts", "1", "--status-interval", "0", "--transparent",
           str(DRIVER), "--jitckpt", "--lib-dir", str(DP_LIBS), "--steps", str(steps), "--dim", str(SIZE),
           "--batch", str(SIZE), "--out", str(tmp / "final{rank}.bin")]
    log = open(tmp / "launcher.log", "w")
    t0 = time.monotonic()
    job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        victim = None
        if kill_after is not None:
            deadline = time.monotonic() + 60
            while victim is None and time.monotonic() < deadline and job.poll() is None:
                found = [p for p in psutil.Process(job.pid).children(recursive=True) if p.name() == "jitckpt-proxy"]
                victim = found[0] if found else None
                time.sleep(0.01)  # polling for the proxy to exist, bounded by the deadline
            if victim is None:
                raise SystemExit(f"no jitckpt-proxy appeared:\n{(tmp / 'launcher.log').read_text()}")
            time.sleep(kill_after)
            victim.kill()
        rc = job.wait(timeout=600)
    finally:
        if job.poll() is None:
            for p in psutil.Process(job.pid).children(recursive=True):
                p.kill()
            job.kill()
        log.close()
    wall = time.monotonic() - t0
    text = (tmp / "launcher.log").read_text()
    if rc != 0:
        raise SystemExit(f"the job failed (rc {rc}):\n{text[-4000:]}")
    m = re.search(r"replaying (\d+) calls in ([0-9.]+) ms", text)
    return {"wall_s": wall, "replayed_calls": int(m.group(1)) if m else None,
            "replay_ms": float(m.group(2)) if m else None, "restarted": "restarting" in text,
            "final": (tmp / "final0.bin").read_bytes()}


def recovery(steps: int, kill_after: float, reps: int, tmp: Path) -> dict:
    walls: dict[str, list[float]] = {"clean": [], "transparent": [], "user_level": []}
    replays, finals = [], set()
    for rep in range(reps):
        clean = launcher_job(tmp / f"clean{rep}", steps, None, True)
        transparent = launcher_job(tmp / f"transparent{rep}", steps, kill_after, True)
        user = launcher_job(tmp / f"user{rep}", steps, kill_after, False)
        if transparent["replay_ms"] is None or transparent["restarted"]:
            raise SystemExit("the transparent run did not recover in place")
        if not user["restarted"]:
            raise SystemExit("the user-level run did not restart")
        walls["clean"].append(clean["wall_s"])
        walls["transparent"].append(transparent["wall_s"])
        walls["user_level"].append(user["wall_s"])
        replays.append({"calls": transparent["replayed_calls"], "ms": transparent["replay_ms"]})
        finals.update({clean["final"], transparent["final"], user["final"]})
    clean = statistics.median(walls["clean"])
    lost_t = statistics.median(walls["transparent"]) - clean
    lost_u = statistics.median(walls["user_level"]) - clean
    return {"clean_s": clean, "transparent_lost_s": lost_t, "user_level_lost_s": lost_u,
            "speedup": lost_u / lost_t if lost_t > 0 else float("inf"), "replays": replays,
            "bitwise_equal_finals": len(finals) == 1, "walls_s": walls, "steps": steps, "kill_after_s": kill_after,
            "dim": SIZE, "batch": SIZE, "ranks": 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and runs (make bench)")
    ap.add_argument("--reps", type=int, default=None, help="runs per variant (default 5, 2 with --quick)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    args = ap.parse_args()
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    need_build()
    steps, reps = (200, 2) if args.quick else (400, 5)
    reps = args.reps or reps
    with tempfile.TemporaryDirectory() as d:
        result = {"journal": journal_overhead(steps, reps, Path(d) / "journal"),
                  "recovery": recovery(steps * 2, 1.0, reps, Path(d) / "recovery")}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
