"""Proxy mode's cost (issue 15), measured in one run on simcuda:

* per call, as a genuine nvcc program sees it (tests/native/simcuda_progs/call_latency.cu): a
  synchronous round trip (``cudaGetDevice``) and two stream-ordered calls that are enqueued without
  a reply (``cudaEventRecord``, a kernel launch), directly on simcuda, under observe mode and under
  proxy mode;
* per training step: the data-parallel CUDA+NCCL program of the tests (dp_cuda, 2 ranks) under
  observe mode and under proxy mode, alternating, the median step time of each, for a model of
  dim = batch = 1024 (``step``, the target's row) and of the tests' 256 (``step_small``).

    .venv/bin/python bench/bench_proxy.py [--quick] [--reps N] [--out FILE]

Verified on simcuda only: the proxy's cost is the ring and the second process, which a GPU does
not change; the kernels and collectives are simcuda's CPU versions.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "native"))

from dp_build import DP_LIBS, DRIVER, LIBJIT, SIMCUDA, need_build  # noqa: E402
from simcuda_progs.simcuda_harness import build_program, parse_kv  # noqa: E402

MODES = {"direct": {}, "observe": {"LD_PRELOAD": str(LIBJIT)},
         "proxy": {"LD_PRELOAD": str(LIBJIT), "JITCKPT_MODE": "proxy"}}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "SIMCUDA_")) and k != "LD_PRELOAD"}
    env.update(LD_LIBRARY_PATH=str(SIMCUDA), PYTHONPATH=str(REPO), **extra)
    return env


def call_latency(iters: int, rounds: int) -> dict:
    """Per-call medians (ns) of call_latency.cu in each mode, the best of ``rounds``; on simcuda, or
    on the GPU where the harness runs programs on the real runtime (make gpu-check)."""
    prog = build_program("call_latency", kernels=True, nccl=False)
    best: dict[str, dict[str, float]] = {}
    for _ in range(rounds):  # alternate the modes; keep each one's best round (scheduler noise)
        for mode, extra in MODES.items():
            env = {k: v for k, v in prog.env(**extra).items() if not k.startswith("JITCKPT_") or k in extra}
            out = subprocess.run([str(prog.exe), str(iters)], env=env, capture_output=True, text=True,
                                 timeout=300).stdout
            kv = parse_kv(out)
            if kv.get("ok") != "1":
                raise SystemExit(f"call_latency failed in {mode} mode:\n{out}")
            row = {k: float(kv[k]) for k in ("clock_ns", "sync_ns", "cold_sync_ns", "cold_step_ns", "event_record_ns",
                                                  "launch_ns")}
            if mode not in best or row["sync_ns"] < best[mode]["sync_ns"]:
                best[mode] = row
    return best


def dp_step_times(mode: str, steps: int, size: int, tmp: Path, **extra_env: str) -> list[float]:
    tmp.mkdir(parents=True)
    env = clean_env(SIMCUDA_KERNEL_LIB=str(DP_LIBS / "libdp_train_kernels.so"), **MODES[mode], **extra_env)
    procs = [subprocess.Popen([sys.executable, str(DRIVER), "--lib-dir", str(DP_LIBS), "--rank", str(r), "--world", "2",
                               "--id-file", str(tmp / "id"), "--steps", str(steps), "--ckpt-dir", str(tmp / "ck"),
                               "--out", str(tmp / "out{rank}.bin"), "--dim", str(size), "--batch", str(size),
                               "--step-times", str(tmp / f"times{r}.json")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"dp_train failed in {mode} mode:\n{out}\n{err}")
    finally:
        for p in procs:
            p.kill()
    # A step ends on every rank with the all-reduce: rank 0's times are the job's.
    return json.loads((tmp / "times0.json").read_text())[5:]  # without the first steps (warm-up)


def emit(result: dict, out: Path | None) -> int:
    """The result as JSON, to `out` or stdout; the exit status."""
    text = json.dumps(result, indent=1)
    if out:
        out.write_text(text)
    else:
        print(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls and steps (make bench)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    ap.add_argument("--reps", type=int, default=None,
                    help="observe/proxy run pairs per model size (default 9, 3 with --quick): more narrow the "
                         "median on a noisy machine")
    args = ap.parse_args()
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    need_build()
    iters, rounds, steps, reps = (5000, 2, 200, 3) if args.quick else (20000, 3, 400, 9)
    reps = args.reps or reps
    calls = call_latency(iters, rounds)
    # Two model sizes: the tests' small one (steps of ~0.3 ms on simcuda, where the proxy's fixed
    # cost per step shows most) and a larger one (~ms steps, still far below a GPU training step).
    steps_by_size = {}
    with tempfile.TemporaryDirectory() as d:
        for size in (256, 1024):
            medians: dict[str, list[float]] = {"observe": [], "proxy": []}
            for rep in range(reps):  # alternate the modes; each run's median step, then the median run
                for mode in medians:
                    times = dp_step_times(mode, steps, size, Path(d) / f"{size}-{mode}{rep}")
                    medians[mode].append(statistics.median(times))
            observe, proxy = statistics.median(medians["observe"]), statistics.median(medians["proxy"])
            # Each proxy run against the observe run just before it (same machine state): the
            # median of these paired ratios is the overhead; their spread is the VM's noise.
            paired = [p / o - 1 for o, p in zip(medians["observe"], medians["proxy"])]
            steps_by_size[size] = {"observe_s": observe, "proxy_s": proxy, "overhead": statistics.median(paired),
                                   "paired_overheads": paired,
                                   "extra_us": (proxy - observe) * 1e6, "observe_runs_s": medians["observe"],
                                   "proxy_runs_s": medians["proxy"], "steps": steps, "dim": size, "batch": size}
    result = {
        "calls": calls,
        "enqueue_median_ns": max(calls["proxy"]["event_record_ns"], calls["proxy"]["launch_ns"]),
        "round_trip_median_ns": calls["proxy"]["sync_ns"],
        # What waking a sleeping peer costs on this machine: a step pays it twice more through a
        # proxy (client -> proxy at the first call, proxy -> client at the synchronize).
        "cold_round_trip_median_ns": calls["proxy"]["cold_sync_ns"],
        # The same machine without a proxy: a kernel and a synchronize after 1 ms of quiet wake
        # simcuda's idle stream thread and then the caller. On this VM an idle thread takes
        # milliseconds to wake (the vCPU halts); bare metal takes microseconds.
        "cold_step_direct_median_ns": calls["direct"]["cold_step_ns"],
        "cold_step_proxy_median_ns": calls["proxy"]["cold_step_ns"],
        "step": steps_by_size[1024],
        "step_small": steps_by_size[256],
        "fast_path": "spin-then-futex ring; stream-ordered calls are one message with no reply",
    }
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
