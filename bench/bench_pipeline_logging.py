"""SWIFT logging-based pipeline recovery benchmarks, measured in one run (CPU, gloo, 4 stages).

1. Throughput with logging vs without: failure-free runs, interleaved repeats; throughput of a
   run = iterations/s between the end of warm-up and the last iteration, timed at stage 0 (the
   last stage to finish each 1F1B iteration); medians over repeats.
2. Recovery time (failure -> every stage has completed the failed iteration again) of
   logging-based single-stage recovery vs restarting all stages from the global checkpoint.
   The failure is the same in both: stage 2 SIGKILLs itself in iteration FAIL_IT, the global
   checkpoint is at iteration CKPT. Interleaved repeats, medians.

Model per stage: LAYERS x (Linear(HIDDEN, HIDDEN) + Tanh), MICRO micro-batches of MB_SIZE rows.
Usage: python bench/bench_pipeline_logging.py [--quick] [--out bench/results/pipeline_logging.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _example():
    spec = importlib.util.spec_from_file_location("pipeline_logging_example",
                                                  ROOT / "examples" / "pipeline_logging.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def throughput(res, warmup: int) -> float:
    """Iterations/s at stage 0 after ``warmup`` iterations."""
    done = {int(k): v for k, v in res.stats[0]["completed_at"].items()}
    last = max(done)
    return (last - warmup) / (done[last] - done[warmup])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline_logging.json"))
    args = ap.parse_args(argv)
    ex = _example()
    reps = 2 if args.quick else 5
    rec_reps = 1 if args.quick else 3
    model = dict(hidden=256, layers_per_stage=4, micro_batches=8, micro_batch_size=32)
    iters, warmup = (12, 3) if args.quick else (24, 4)
    ckpt, fail_it = 10, 18
    tmp = Path(tempfile.mkdtemp(prefix="bench_pipeline_logging_"))
    results: dict = {"model": model, "machine": {"cpus": __import__("os").cpu_count(),
                                                 "python": platform.python_version()}}
    try:
        # ---- 1. throughput, interleaved -------------------------------------------------
        tp = {"logging": [], "no_logging": []}
        logged_bytes = []
        for r in range(reps):
            for mode in (("logging", "no_logging") if r % 2 == 0 else ("no_logging", "logging")):
                d = tmp / f"tp-{mode}-{r}"
                res = ex.run_pipeline(ex.PipelineRun(
                    run_dir=str(d), iterations=iters, checkpoint_every=1000,
                    logging=(mode == "logging"), timeout=300.0, **model))
                assert res.ok
                tp[mode].append(throughput(res, warmup))
                if mode == "logging":
                    logged_bytes.append(sum(st.get("bytes_logged", 0)
                                            for st in res.stats.values()) / iters)
                shutil.rmtree(d, ignore_errors=True)
                print(f"throughput {mode:10s} rep {r}: {tp[mode][-1]:.2f} it/s", flush=True)
        med = {k: statistics.median(v) for k, v in tp.items()}
        loss = 1 - med["logging"] / med["no_logging"]
        results["throughput"] = {
            "iterations": iters, "warmup": warmup, "repeats": reps,
            "it_per_s": tp, "median_it_per_s": med, "loss_fraction": loss,
            "logged_bytes_per_iteration": statistics.median(logged_bytes),
            "target_loss_fraction": 0.02, "meets_target": loss < 0.02}
        # ---- 2. recovery time, interleaved ----------------------------------------------
        rec = {"logging": [], "restart": []}
        for r in range(rec_reps):
            for mode in ("logging", "restart") if r % 2 == 0 else ("restart", "logging"):
                d = tmp / f"rec-{mode}-{r}"
                res = ex.run_pipeline(ex.PipelineRun(
                    run_dir=str(d), iterations=fail_it + 1, checkpoint_every=ckpt,
                    logging=(mode == "logging"), recovery=mode, fail_stage=2,
                    fail_iteration=fail_it, fail_op=3, timeout=300.0, **model))
                assert res.ok and res.recovery_time is not None
                rec[mode].append(res.recovery_time)
                shutil.rmtree(d, ignore_errors=True)
                print(f"recovery {mode:8s} rep {r}: {rec[mode][-1]:.2f} s", flush=True)
        rmed = {k: statistics.median(v) for k, v in rec.items()}
        ratio = rmed["logging"] / rmed["restart"]
        results["recovery"] = {
            "checkpoint_iteration": ckpt, "failed_iteration": fail_it, "failed_stage": 2,
            "repeats": rec_reps, "seconds": rec, "median_seconds": rmed,
            "logging_over_restart": ratio, "target_ratio": 0.5, "meets_target": ratio < 0.5}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"throughput: logging {med['logging']:.2f} it/s vs none {med['no_logging']:.2f} it/s "
          f"-> loss {loss * 100:.2f}% (target < 2%)")
    print(f"recovery: logging {rmed['logging']:.2f} s vs restart-all {rmed['restart']:.2f} s "
          f"-> ratio {ratio:.2f} (target < 0.5)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
