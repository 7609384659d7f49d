"""Transparent recovery (issue 16), measured in one run on simcuda with the data-parallel CUDA+NCCL
program of the tests (dp_cuda, dim = batch = 1024):

* ``journal``: the replay journal's steady-state cost. 2 ranks in proxy mode with the journal on
  (the default) and off (``JITCKPT_REPLAY_LIMIT_MB=0``), alternating; the median of the paired
  ratios of each run's median step time.
* ``recovery``: one rank under ``jitckpt run --transparent``; the all-reduce of step ``--fail-at``
  returns ncclSystemError (simcuda's ``SIMCUDA_FAIL_MODE=error``, once). Time lost = the job's wall
  time minus a failure-free job's, each the median of ``--reps`` runs:
  - transparent: the journal on. dp_train marks its minibatches, so libjit.so saves the buffers of
    the minibatch's start from the old proxy, starts a new one, recreates the handles and the
    communicator, restores the buffers and replays the minibatch (the log line gives the breakdown);
  - user-level: the journal off (``JITCKPT_REPLAY_LIMIT_MB=0``), so the error reaches the program:
    the jitckpt runtime saves a JIT checkpoint, the launcher restarts the worker, which resumes
    from it.
* ``optimizer_step_2_ranks``: 2 ranks, an all-reduce inside the optimizer step fails on rank 1
  after the optimizer kernel ran: ``--plugin undo`` (inverse kernel, replay) vs user-level (no
  consistent state to save: a restart from the start); see :func:`optimizer_step_recovery`.
* ``recovery_2_ranks``: the same with 2 ranks (``--hang-timeout 1`` in every variant). Rank 1's
  all-reduce fails; rank 0's hangs and is found at the hang timeout. Transparent: both ranks agree
  through the launcher's store, rebuild the communicator and replay the minibatch (its recovery
  time is the slowest rank's ``total_s``, which includes waiting for the other's word); user-level:
  JIT checkpoints and a restart.

    .venv/bin/python bench/bench_transparent_recovery.py [--quick] [--reps N] [--out FILE]

Verified on simcuda only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_proxy import REPO, clean_env, dp_step_times, emit  # noqa: E402
from dp_build import DP_LIBS, DRIVER, need_build  # noqa: E402
import proc_tree  # noqa: E402

SIZE = 1024


def journal_overhead(steps: int, pairs: int, tmp: Path) -> dict:
    """Paired runs with the journal on and off; the order alternates from pair to pair (on-off,
    off-on, ...) so a machine growing busier or quieter during the bench does not favour one side."""
    runs: dict[str, list[float]] = {"journal_on": [], "journal_off": []}
    variants = {"journal_on": {}, "journal_off": {"JITCKPT_REPLAY_LIMIT_MB": "0"}}
    for rep in range(pairs):
        for name in (("journal_on", "journal_off") if rep % 2 == 0 else ("journal_off", "journal_on")):
            runs[name].append(statistics.median(dp_step_times("proxy", steps, SIZE, tmp / f"{name}{rep}",
                                                              **variants[name])))
    paired = [on / off - 1 for on, off in zip(runs["journal_on"], runs["journal_off"])]
    return {"overhead": statistics.median(paired), "paired_overheads": paired, "runs_s": runs, "steps": steps,
            "dim": SIZE, "batch": SIZE, "ranks": 2}


def launcher_job(tmp: Path, steps: int, fail_at: int | None, journal: bool, ranks: int = 1,
                 extra_args: tuple[str, ...] = (), **extra_env: str) -> dict:
    """`ranks` ranks under jitckpt run --transparent; NCCL operation `fail_at` (1-based, per
    process) fails once on the last rank."""
    tmp.mkdir(parents=True)
    env = clean_env(SIMCUDA_KERNEL_LIB=str(DP_LIBS / "libdp_train_kernels.so"), **extra_env)
    if fail_at is not None:
        env.update(SIMCUDA_FAIL_MODE="error", SIMCUDA_FAIL_AT=str(fail_at), SIMCUDA_FAIL_ONCE=str(tmp / "fired"),
                   SIMCUDA_FAIL_RANK=str(ranks - 1))
    if not journal:
        env["JITCKPT_REPLAY_LIMIT_MB"] = "0"
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", str(ranks), "--hang-timeout", "1",
           "--checkpoint-dir", str(tmp / "ckpt"),
           "--run-dir", str(tmp / "run"), "--max-restarts", "1", "--status-interval", "0", "--transparent",
           *extra_args, str(DRIVER), "--jitckpt", "--lib-dir", str(DP_LIBS), "--steps", str(steps), "--dim", str(SIZE),
           "--batch", str(SIZE), "--out", str(tmp / "final{rank}.bin")]
    t0 = time.monotonic()
    proc = proc_tree.run(cmd, env=env, stderr=subprocess.STDOUT, cwd=REPO, timeout=600)  # a timeout kills its workers too
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the job failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}")
    if fail_at is not None and not (tmp / "fired").exists():
        raise SystemExit(f"the fault was not injected:\n{proc.stdout[-4000:]}")
    events = [json.loads(line) for line in (tmp / "run" / "events.jsonl").read_text().splitlines() if line.strip()]
    recs = [e for e in events if e["event"] == "transparent_recovery" and e.get("recovered")]
    slowest = max(recs, key=lambda e: e["total_s"]) if len(recs) == ranks else None
    breakdown = {k: round(slowest[k] * 1e3, 2) for k in ("save_s", "agree_s", "new_proxy_s", "recreate_s",
                                                        "communicators_s", "restore_s", "replay_s", "synchronize_s")
                 } if slowest else None
    return {"wall_s": wall, "replayed_calls": slowest["calls"] if slowest else None,
            "undone": slowest.get("undone") if slowest else None,
            "minibatch_calls": slowest["minibatch_calls"] if slowest else None,
            "recovery_ms": slowest["total_s"] * 1e3 if slowest else None, "breakdown_ms": breakdown,
            "restarted": any(e["event"] == "restart" for e in events),
            "final": b"".join((tmp / f"final{r}.bin").read_bytes() for r in range(ranks))}


def recovery(steps: int, fail_at: int, reps: int, tmp: Path, ranks: int = 1) -> dict:
    walls: dict[str, list[float]] = {"clean": [], "transparent": [], "user_level": []}
    replays, finals = [], set()
    for rep in range(reps):
        clean = launcher_job(tmp / f"clean{rep}", steps, None, True, ranks)
        transparent = launcher_job(tmp / f"transparent{rep}", steps, fail_at, True, ranks)
        user = launcher_job(tmp / f"user{rep}", steps, fail_at, False, ranks)
        if transparent["recovery_ms"] is None or transparent["restarted"]:
            raise SystemExit("the transparent run did not recover in place")
        if not user["restarted"]:
            raise SystemExit("the user-level run did not restart")
        walls["clean"].append(clean["wall_s"])
        walls["transparent"].append(transparent["wall_s"])
        walls["user_level"].append(user["wall_s"])
        replays.append({k: transparent[k] for k in ("replayed_calls", "minibatch_calls", "recovery_ms", "breakdown_ms")})
        finals.update({clean["final"], transparent["final"], user["final"]})
    clean = statistics.median(walls["clean"])
    lost_t = statistics.median(walls["transparent"]) - clean
    lost_u = statistics.median(walls["user_level"]) - clean
    in_place_s = statistics.median(r["recovery_ms"] for r in replays) / 1e3
    return {"clean_s": clean, "transparent_lost_s": lost_t, "user_level_lost_s": lost_u,
            "speedup": lost_u / lost_t if lost_t > 0 else float("inf"),
            "transparent_recovery_s": in_place_s, "speedup_vs_recovery_time": lost_u / in_place_s,
            "replays": replays, "bitwise_equal_finals": len(finals) == 1, "walls_s": walls, "steps": steps,
            "fail_at": fail_at, "dim": SIZE, "batch": SIZE, "ranks": ranks}


def optimizer_step_recovery(steps: int, fail_step: int, reps: int, tmp: Path, ranks: int = 2) -> dict:
    """dp_cuda with an all-reduce inside its optimizer step, after the optimizer kernel
    (DP_TRAIN_CHECK_REPLICAS=after); that all-reduce of step `fail_step` fails on the last rank.
    Transparent: `--plugin undo` (each rank runs the inverse SGD kernel, then replays the
    minibatch). User-level: the same failure without the plugin; no rank can save its torn state, so
    each gives up after --save-timeout (5 s here, 120 s by default) and the job restarts from the
    start. Both variants run with --save-timeout 5."""
    import struct

    walls: dict[str, list[float]] = {"clean": [], "transparent": [], "user_level": []}
    replays, max_diff = [], 0.0
    args = ("--save-timeout", "5")
    env = {"DP_TRAIN_CHECK_REPLICAS": "after"}
    fail_at = 2 * fail_step + 2  # each step makes two NCCL calls; the second is in the optimizer step
    for rep in range(reps):
        clean = launcher_job(tmp / f"clean{rep}", steps, None, True, ranks, args, **env)
        transparent = launcher_job(tmp / f"undo{rep}", steps, fail_at, True, ranks, ("--plugin", "undo", *args), **env)
        user = launcher_job(tmp / f"user{rep}", steps, fail_at, True, ranks, args, **env)
        if transparent["recovery_ms"] is None or transparent["restarted"] or not transparent["undone"]:
            raise SystemExit("the transparent run did not undo and recover in place")
        if not user["restarted"] or user["final"] != clean["final"]:
            raise SystemExit("the user-level run did not restart, or did not end bitwise")
        walls["clean"].append(clean["wall_s"])
        walls["transparent"].append(transparent["wall_s"])
        walls["user_level"].append(user["wall_s"])
        replays.append({k: transparent[k] for k in ("replayed_calls", "minibatch_calls", "undone", "recovery_ms",
                                                    "breakdown_ms")})
        n = len(clean["final"]) // 4
        a, b = struct.unpack(f"{n}f", clean["final"]), struct.unpack(f"{n}f", transparent["final"])
        max_diff = max(max_diff, max(abs(x - y) for x, y in zip(a, b)))
    clean = statistics.median(walls["clean"])
    lost_u = statistics.median(walls["user_level"]) - clean
    in_place_s = statistics.median(r["recovery_ms"] for r in replays) / 1e3
    return {"clean_s": clean, "transparent_lost_s": statistics.median(walls["transparent"]) - clean,
            "user_level_lost_s": lost_u, "transparent_recovery_s": in_place_s,
            "speedup_vs_recovery_time": lost_u / in_place_s, "replays": replays,
            "undo_max_abs_difference": max_diff, "walls_s": walls, "steps": steps, "fail_step": fail_step,
            "dim": SIZE, "batch": SIZE, "ranks": ranks, "save_timeout_s": 5}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and runs (make bench)")
    ap.add_argument("--reps", type=int, default=None, help="runs per variant (default 5, 2 with --quick)")
    ap.add_argument("--journal-pairs", type=int, default=None,
                    help="journal on/off run pairs (default 9, 3 with --quick): more narrow the median")
    ap.add_argument("--only-journal", action="store_true", help="measure the journal's overhead only")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    args = ap.parse_args()
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    if args.journal_pairs is not None and args.journal_pairs < 1:
        ap.error("--journal-pairs must be at least 1")
    need_build()
    steps, reps = (200, 2) if args.quick else (400, 5)
    reps = args.reps or reps
    with tempfile.TemporaryDirectory() as d:
        result = {"journal": journal_overhead(steps, args.journal_pairs or (3 if args.quick else 9),
                                              Path(d) / "journal")}
        if args.only_journal:
            return emit(result, args.out)
        result |= {"recovery": recovery(steps * 2, steps, reps, Path(d) / "recovery"),
                   "recovery_2_ranks": recovery(steps * 2, steps, reps, Path(d) / "recovery2", ranks=2),
                   "optimizer_step_2_ranks": optimizer_step_recovery(steps * 2, steps, reps, Path(d) / "opt2")}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
