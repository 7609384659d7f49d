"""How jitckpt's costs grow with the model and the job (issue 19): for each model size and rank
count, one run of each, on this machine (CPU, gloo, one node):

* recovery: a rank SIGKILLed at step ``--fail-at`` under `jitckpt run`; the time from the failure to
  training resumed at the failed minibatch (detection, JIT save, restart, restore) and to that
  minibatch done again, from the event log and the training log;
* steady state: the median step time under `jitckpt run` against plain torchrun, the same steps
  (from the first one after jitckpt's warm standbys were ready, as bench_recovery.py does).

Model: the MLP of bench_recovery.py (1024 -> hidden -> hidden -> 1024, Adam), hidden chosen for the
parameter counts asked (8 M: 2048; 64 M: 7168; 256 M: 15104, about 8 GB per rank at its peak
(parameters, gradients, Adam, DDP's buckets, the restore's copy): as large as this 24 GB machine
takes for 2 ranks; 512 M: 21504). Writes JSON and a plot under bench/results/; the rows of an
earlier run for other sizes or rank counts are kept.

Usage: python bench/bench_scale.py [--sizes 8,64] [--ranks 2,3,4] [--steps 30] [--fail-at 20]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_recovery import (TRAIN, back_at_failed_step, first_step_after_standbys, jitrun, read_log, run,  # noqa: E402
                            step_times, torchrun)

HIDDEN = {8: 2048, 64: 7168, 256: 15104, 512: 21504}  # millions of parameters -> hidden width


def model_args(millions: int) -> list:
    return ["--in-dim", "1024", "--hidden", str(HIDDEN[millions]), "--layers", "2", "--out-dim", "1024",
            "--batch", "8", "--lr", "0.001"]


def params(millions: int) -> int:
    h = HIDDEN[millions]
    return 1024 * h + h + h * h + h + h * 1024 + 1024


def recovery(work: Path, millions: int, ranks: int, steps: int, fail_at: int) -> dict:
    d = work / f"rec-{millions}-{ranks}"
    d.mkdir()
    run(jitrun(ranks, [*model_args(millions), "--steps", str(steps), "--steps-log", str(d / "log.jsonl"),
                       "--inject", f"0:{ranks - 1}:{fail_at}:kill"], d, extra=["--hang-timeout", "60"]), d,
        timeout=3600)
    log = read_log(d / "log.jsonl")
    t_fail, t_back, first = back_at_failed_step(log, fail_at)
    ev = [json.loads(x) for x in (d / "run" / "events.jsonl").read_text().splitlines()]
    restores = [e for e in ev if e["event"] == "restore"]
    t_resumed = max(e["t"] for e in restores)  # every rank loaded its state: training resumes
    return {"resumed_s": t_resumed - t_fail, "redone_s": t_back - t_fail, "resumed_at": first,
            "detect_s": next(e["t"] for e in ev if e["event"] == "failure_detected") - t_fail,
            "save_s": max(e["t"] for e in ev if e["event"] == "checkpoint_saved") - t_fail,
            "checkpoint_bytes": max(e["bytes"] for e in ev if e["event"] == "checkpoint_saved"),
            "restore_s": max(e["seconds"] for e in restores)}


def overhead(work: Path, millions: int, ranks: int, steps: int) -> dict:
    logs = {}
    for kind in ("plain", "jit"):
        d = work / f"ovh-{millions}-{ranks}-{kind}"
        d.mkdir()
        args = [*model_args(millions), "--steps", str(steps), "--steps-log", str(d / "log.jsonl")]
        if kind == "plain":
            run(torchrun(ranks, [*args, "--no-jitckpt"], d), d, timeout=3600)
        else:
            run(jitrun(ranks, args, d), d, timeout=3600)
            try:
                skip = max(3, first_step_after_standbys(d)[0])
            except RuntimeError:
                skip = steps
        logs[kind] = read_log(d / "log.jsonl")
    plain, jit = step_times(logs["plain"], skip), step_times(logs["jit"], skip)
    if len(plain) < 3 or len(jit) < 3:
        return {"overhead": None, "why": f"fewer than 3 steps after the standbys were ready (from step {skip})"}
    return {"overhead": statistics.median(jit) / statistics.median(plain) - 1, "steps_from": skip,
            "median_step_plain_s": statistics.median(plain), "median_step_jitckpt_s": statistics.median(jit)}


def plot(rows: list, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, ranks in enumerate(sorted({r["ranks"] for r in rows})):
        mine = sorted((r for r in rows if r["ranks"] == ranks), key=lambda r: r["params"])
        xs, c = [r["params"] / 1e6 for r in mine], f"C{i}"
        a.plot(xs, [r["recovery"]["resumed_s"] for r in mine], "o-", color=c, label=f"{ranks} ranks: resumed")
        a.plot(xs, [r["recovery"]["redone_s"] for r in mine], "x--", color=c, label=f"{ranks} ranks: failed step redone")
        b.plot(xs, [100 * (r["overhead"]["overhead"] or 0) for r in mine], "o-", color=c,
               label=f"{ranks} ranks (one run each)")
    a.set(xscale="log", xlabel="parameters (millions)", ylabel="seconds after the SIGKILL",
          title="recovery (jitckpt run, one node, CPU)")
    b.set(xscale="log", xlabel="parameters (millions)", ylabel="% step time vs torchrun",
          title="steady-state overhead")
    b.axhline(0, color="grey", lw=0.5)
    for ax in (a, b):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64", help="millions of parameters, of 8, 64, 256, 512")
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fail-at", type=int, default=20)
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "scale.json")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    if any(s not in HIDDEN for s in sizes):
        ap.error(f"--sizes: each one of {sorted(HIDDEN)}")
    ranks = [int(x) for x in a.ranks.split(",")]
    if any(r < 2 for r in ranks) or not 0 < a.fail_at < a.steps - 1:
        ap.error("--ranks >= 2 each, and 0 < --fail-at < --steps - 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jitckpt-scale-") as tmp:
        for millions in sizes:
            for n in ranks:
                t0 = time.monotonic()
                row = {"params": params(millions), "ranks": n,
                       "recovery": recovery(Path(tmp), millions, n, a.steps, a.fail_at),
                       "overhead": overhead(Path(tmp), millions, n, a.steps)}
                row["bench_seconds"] = time.monotonic() - t0
                rows.append(row)
                print(json.dumps(row), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    # The rows of an earlier run (other sizes or rank counts) stay: a large size can be run on its own.
    if a.out.exists():
        measured = {(r["params"], r["ranks"]) for r in rows}
        old = json.loads(a.out.read_text())
        if (old.get("steps"), old.get("fail_at")) == (a.steps, a.fail_at):
            rows = sorted([r for r in old["rows"] if (r["params"], r["ranks"]) not in measured] + rows,
                          key=lambda r: (r["params"], r["ranks"]))
    a.out.write_text(json.dumps({"script": str(TRAIN.name), "steps": a.steps, "fail_at": a.fail_at, "rows": rows},
                                indent=1) + "\n")
    plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
