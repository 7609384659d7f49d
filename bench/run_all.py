"""`make bench`: every benchmark in quick mode, then one table of ratios, each with its target.

Each benchmark runs as its own process and writes its JSON into a scratch directory (the committed
numbers in bench/results/ come from full runs and are not overwritten); the table reads those
files. Quick mode has fewer repetitions: its ratios are noisier than the committed ones, and a
"no" here on this shared 2-core machine is a prompt to run that benchmark in full, not a verdict.

Usage: python bench/run_all.py [--only NAME ...] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import proc_tree
from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Ratio:
    """One row: a number read from a benchmark's JSON and the target it is held to."""

    what: str
    read: Callable[[dict], float]
    fmt: str                      # e.g. "{:.2f}x" or "{:+.2%}"
    target: str                   # as the README/issue states it
    meets: Optional[Callable[[float], bool]] = None
    meets_in: Optional[Callable[[dict], bool]] = None  # a target read against other numbers of the same JSON


@dataclass(frozen=True)
class Bench:
    name: str
    argv: Callable[[Path], list]  # output file -> command line
    ratios: tuple
    stdout_json: bool = False     # the benchmark prints its JSON instead of writing a file
    timeout: float = 900.0


EARLY_FAIL_STEPS = (2, 10)  # bench_recovery.py's: failures soon after the first step
API_LABELS = {"protect": "protect()", "init": "init() API"}


def _early_rows() -> tuple:
    """bench_recovery.py's early failures: each API's failure-to-resumed time, and how many of
    the restarts found their warm standbys ready."""
    rows = []
    for step in EARLY_FAIL_STEPS:
        for api, label in API_LABELS.items():
            rows.append(Ratio(f"recovery, failure at step {step}: jitckpt {label}, failure to resumed at the "
                              "failed minibatch",
                              lambda d, s=str(step), a=api: d["recovery"]["early"][a][s]["resumed_s"],
                              "{:.2f} s", "< 0.3 s", lambda v: v < 0.3))
        rows.append(Ratio(f"  restarts after the failure at step {step} that found the warm standbys ready "
                          "(both APIs)",
                          lambda d, s=str(step): _ready_fraction(d["recovery"]["early"], s), "{:.0%}", "(for reference)"))
    return tuple(rows)


def _ready_fraction(early: dict, step: str) -> float:
    """Of both APIs' runs with a failure at ``step``, the fraction whose restart found ready standbys."""
    rows = [early[api][step] for api in API_LABELS]
    return sum(r["standbys_ready_runs"] for r in rows) / sum(len(r["runs"]) for r in rows)


def _aor(key: str, mode: str) -> Callable[[dict], float]:
    """bench_aor.py's median over ranks of ``key`` (overhead_pct, work_pct_of_step) for ``mode``, as a fraction."""
    return lambda d: d[key][mode] / 100


BENCHES = [
    Bench("recovery", lambda out: [sys.executable, str(BENCH / "bench_recovery.py"), "--quick",
                                   "--out", str(out)],
          (Ratio("recovery: torchrun + save every 10 / jitckpt (time to the failed step redone)",
                 lambda d: d["recovery"]["speedup"], "{:.2f}x", "> 1x", lambda v: v > 1),
           Ratio("recovery: torchrun + DCP async_save every 10 / jitckpt",
                 lambda d: d["recovery"]["speedup_vs_torchrun_dcp10"], "{:.2f}x", ">= 5x", lambda v: v >= 5),
           Ratio("recovery: torchrun + DCP async_save every step / jitckpt",
                 lambda d: d["recovery"]["speedup_vs_torchrun_dcp1"], "{:.2f}x", ">= 2x", lambda v: v >= 2),
           Ratio("recovery: jitckpt, failure to resumed at the failed minibatch",
                 lambda d: d["recovery"]["jitckpt"]["resumed_s"], "{:.2f} s", "< 0.3 s", lambda v: v < 0.3),
           Ratio("recovery: jitckpt init() API (the paper's save_fn + get_checkpoint_path), failure to resumed "
                 "at the failed minibatch", lambda d: d["recovery"]["jitckpt_init"]["resumed_s"], "{:.2f} s",
                 "< 0.3 s", lambda v: v < 0.3),
           Ratio("  init() API: failure to the failed step redone",
                 lambda d: d["recovery"]["jitckpt_init"]["total_s"], "{:.2f} s", "(for reference)"),
           *_early_rows(),
           Ratio("  ceiling: in-process floor (new group, standby builds model + DDP, state broadcast)",
                 lambda d: d["recovery"]["inprocess_floor"]["floor_s"], "{:.2f} s", "(same run)"),
           Ratio("  jitckpt resumed / in-process floor",
                 lambda d: d["recovery"]["resumed_over_inprocess_floor"], "{:.2f}x", "(for reference)"),
           Ratio("recovery: jitckpt, failure to the failed step redone",
                 lambda d: d["recovery"]["jitckpt"]["total_s"], "{:.2f} s", "(for reference)"),
           Ratio("steady state: DCP async_save every step, mean step overhead",
                 lambda d: d["overhead"]["mean_step_overhead_torchrun_dcp1"], "{:+.1%}", "(baseline)"),
           Ratio("steady state: DCP async_save every 10, mean step overhead",
                 lambda d: d["overhead"]["mean_step_overhead_torchrun_dcp10"], "{:+.1%}", "(baseline)"),
           Ratio("steady state: jitckpt, mean step overhead vs torchrun (end to end)",
                 lambda d: d["overhead"]["mean_step_overhead_jitckpt"], "{:+.1%}", "(noise, next row)"),
           Ratio("  run-to-run spread of torchrun's own median step, same run (max / min - 1; 0 in quick mode: one run)",
                 lambda d: max(d["overhead"]["run_median_step_s"]["plain"]) / min(d["overhead"]["run_median_step_s"]["plain"]) - 1,
                 "{:+.1%}", "(for reference)"),
           Ratio("standby start-up: median step 3-60, warm standbys vs --warm-standby 0 (init() job, interleaved runs)",
                 lambda d: d["overhead"]["standby_startup"]["jitckpt_over_warm_standby_0"], "{:+.1%}",
                 "within run-to-run spread (next row)",
                 meets_in=lambda d: d["overhead"]["standby_startup"]["within_spread"]),
           Ratio("  run-to-run spread of those two variants' median step 3-60, same runs (the larger max / min - 1)",
                 lambda d: d["overhead"]["standby_startup"]["compared_spread"], "{:+.1%}", "(for reference)"),
           Ratio("  run-to-run spread of torchrun's median step 3-60, same runs (max / min - 1)",
                 lambda d: d["overhead"]["standby_startup"]["torchrun_spread"], "{:+.1%}", "(for reference)"),
           Ratio("  standby start-up: CPU its processes take per step 3-60 beyond --warm-standby 0 / step "
                 "(kernel clocks; its bound)", lambda d: d["overhead"]["standby_startup"]["startup_cpu_fraction"],
                 "{:+.2%}", "(for reference)"),
           Ratio("steady state: CPU jitckpt adds per step (its processes and threads beyond torchrun's "
                 "agent, and its hooks) / step: the overhead's bound",
                 lambda d: d["overhead"]["own_cpu_extra_fraction"] + d["overhead"]["hook_cost_fraction"],
                 "{:+.2%}", "< 0.5 %", lambda v: v < 0.005),
           Ratio("recovery: minibatches redone by jitckpt", lambda d: d["recovery"]["jitckpt"]["minibatches_redone"],
                 "{:.0f}", "<= 1", lambda v: v <= 1),
           Ratio("steady state: jitckpt hook cost / step", lambda d: d["overhead"]["hook_cost_fraction"],
                 "{:.3%}", "< 1 %", lambda v: v < 0.01),
           Ratio("JIT checkpoint write / raw write+fsync bandwidth", lambda d: d["write"]["fraction_of_raw"],
                 "{:.0%}", ">= 85 %", lambda v: v >= 0.85))),
    Bench("pipeline_logging", lambda out: [sys.executable, str(BENCH / "bench_pipeline_logging.py"), "--quick",
                                           "--out", str(out)],
          (Ratio("SWIFT logging: throughput loss", lambda d: d["throughput"]["loss_fraction"], "{:+.2%}",
                 "< 2 %", lambda v: v < 0.02),
           Ratio("SWIFT logging: stage recovery / restart of all stages",
                 lambda d: d["recovery"]["logging_over_restart"], "{:.2f}x", "< 0.5x", lambda v: v < 0.5))),
    Bench("snapshot", lambda out: [sys.executable, str(BENCH / "bench_snapshot.py"), "--quick", "--out", str(out)],
          (Ratio("snapshot every step: step overhead", lambda d: d["overhead_fraction"], "{:+.2%}", "< 1 %",
                 lambda v: v < 0.01),
           Ratio("  ceiling: the same bytes copied + checksummed on the other core (same run)",
                 lambda d: d["ceiling_overhead_fraction"], "{:+.2%}", "(physical limit)"),
           Ratio("  a deep model (1680 tensors, steps of ~20 ms): a step with a snapshot, extra time (mean)",
                 lambda d: d["trainer_begin_many_tensors"]["extra_seconds_per_step"] * 1000, "{:+.1f} ms",
                 "(for reference)"),
           Ratio("  of which the trainer's begin() (state_fn + walk of the state, mean)",
                 lambda d: d["trainer_begin_many_tensors"]["begin_seconds_mean"] * 1000, "{:.1f} ms",
                 "(for reference)"),
           Ratio("restore from memory vs cold torch.load", lambda d: d["restore_speedup_vs_disk_cold"], "{:.2f}x",
                 ">= 10x", lambda v: v >= 10),
           Ratio("restore into the model, buffers mapped ahead by the standby / one memcpy of the state",
                 lambda d: d["restore_total_over_one_memcpy"], "{:.2f}x", "<= 1.5x", lambda v: v <= 1.5),
           Ratio("  for reference: memcpy + checksum on one core / one memcpy (same run)",
                 lambda d: d["restore_ceiling_one_copy"]["memcpy_and_checksum_seconds_median"]
                 / d["restore_ceiling_one_copy"]["memcpy_seconds_median"], "{:.2f}x", "(for reference)"),
           Ratio("  restore mapping in the call (no standby) / one memcpy",
                 lambda d: d["restore_cold_map_total_over_one_memcpy"], "{:.2f}x", "(for reference)"),
           Ratio("  ceiling of that: keeper reply + map (pages faulted) + one memcpy / one memcpy (same run)",
                 lambda d: d["restore_ceiling_one_copy"]["map_and_memcpy_seconds_median"]
                 / d["restore_ceiling_one_copy"]["memcpy_seconds_median"], "{:.2f}x", "(physical limit)"),
           Ratio("  ceiling: one memcpy vs cold torch.load (same run)",
                 lambda d: d["restore_ceiling_one_copy"]["max_speedup_of_a_one_copy_restore"], "{:.2f}x",
                 "(physical limit)"))),
    *(Bench(f"restore_{name}", lambda out, extra=extra: [sys.executable, str(BENCH / "bench_restore_ranks.py"), *extra,
                                                        "--trials", "5", "--out", str(out)],
            (Ratio(f"restore, 2 ranks on {where}, into the model / one memcpy", lambda d: d["memory_over_one_memcpy"],
                   "{:.2f}x", "<= 1.5x", lambda v: v <= 1.5),
             Ratio(f"  ceiling: that restore / (one memcpy + {ceiling})", lambda d, key=key: d[key], "{:.2f}x",
                   "(same run)"),
             Ratio("  page-cached torch.load + load_state_dict / that restore",
                   lambda d: d["memory_speedup_vs_disk_warm"], "{:.2f}x", "> 1x", lambda v: v > 1)))
      for name, extra, where, ceiling, key in (
          ("ranks", [], "one node", "one all-reduce of the verdict", "memory_over_memcpy_agreed"),
          ("nodes", ["--nodes", "2"], "2 nodes", "every part broadcast from its holder", "memory_over_memcpy_transfer"))),
    Bench("sharded", lambda out: [sys.executable, str(BENCH / "bench_sharded.py"), "--quick", "--out", str(out)],
          (Ratio("FSDP2 (HSDP 2x2): JIT save after a failure / DCP save of the same state", lambda d: d["save"]["jit_over_dcp"],
                 "{:.2f}x", "<= 1.2x", lambda v: v <= 1.2),
           Ratio("  JIT save / floor: the same bytes per rank written raw + fsynced (same run)",
                 lambda d: d["save"]["jit_over_floor"], "{:.2f}x", "(physical limit)"),
           Ratio("  every rank alive (preemption, periodic; replicas split a shard) / DCP save",
                 lambda d: d["save"]["split_over_dcp"], "{:.2f}x", "<= 1.2x", lambda v: v <= 1.2),
           Ratio("FSDP2 recovery speedup vs torchrun + DCP async_save every 10",
                 lambda d: d["recovery"]["speedup_vs_torchrun_dcp10"], "{:.1f}x", ">= 10x", lambda v: v >= 10),
           Ratio("FSDP2 recovery speedup vs torchrun + DCP async_save every step",
                 lambda d: d["recovery"]["speedup_vs_torchrun_dcp1"], "{:.1f}x", ">= 5x", lambda v: v >= 5),
           Ratio("  the same with --recovery inprocess (the survivors keep their processes)",
                 lambda d: d["recovery"]["inprocess_speedup_vs_torchrun_dcp10"], "{:.1f}x", ">= 10x", lambda v: v >= 10),
           Ratio("  --recovery inprocess vs torchrun + DCP async_save every step",
                 lambda d: d["recovery"]["inprocess_speedup_vs_torchrun_dcp1"], "{:.1f}x", ">= 5x", lambda v: v >= 5),
           Ratio("  FSDP2 step time, jitckpt / torchrun + DCP every 10 (end to end)",
                 lambda d: d["recovery"]["step_time_jitckpt_over_torchrun_dcp10"], "{:.3f}x", "(for reference)"),
           Ratio("FSDP2 full sharding, --snapshot-every 1 (shard from the keeper): recovery speedup vs torchrun + DCP "
                 "async_save every 10", lambda d: d["shard_snapshots"]["speedup_vs_torchrun_dcp10"], "{:.1f}x", ">= 10x",
                 lambda v: v >= 10),
           Ratio("  the same vs torchrun + DCP async_save every step",
                 lambda d: d["shard_snapshots"]["speedup_vs_torchrun_dcp1"], "{:.1f}x", ">= 5x", lambda v: v >= 5),
           Ratio("  minibatches redone", lambda d: d["shard_snapshots"]["snapshots"]["minibatches_redone"], "{:d}",
                 "<= 1", lambda v: v <= 1),
           Ratio("  step time with shard snapshots every step / without (end to end)",
                 lambda d: d["shard_snapshots"]["step_time_snapshots_over_none"], "{:.3f}x", "(for reference)"),
           Ratio("  a rank's shard snapshot write (25 MB into the keeper, synchronous) / step",
                 lambda d: d["shard_snapshot_write"]["take_over_step"], "{:.2%}", "(for reference)"),
           Ratio("  that write / one memcpy of the same bytes (same run)",
                 lambda d: d["shard_snapshot_write"]["take_over_memcpy"], "{:.2f}x", "(physical limit)"),
           Ratio("FSDP2 full sharding, steady state: launchers' own CPU + training thread's hooks / step",
                 lambda d: d["steady"]["bound_fraction"], "{:.2%}", "< 0.5 %", lambda v: v < 0.005),
           Ratio("  of which the training thread's (hooks, FSDP2's collective regions)",
                 lambda d: d["steady"]["thread_fraction"], "{:.3%}", "(same run)"))),
    Bench("aor", lambda out: [sys.executable, str(BENCH / "bench_aor.py"), "--rounds", "8", "--out", str(out)],
          (Ratio("AOR (ZeRO-1 partitions) copy, snapshot every 10: step overhead", _aor("overhead_pct", "copy@10"),
                 "{:+.1%}", "< 5 %", lambda v: v < 0.05),
           Ratio("  ceiling: its own work (partition exchange / 10) / step", _aor("work_pct_of_step", "copy@10"),
                 "{:.1%}", "(same run)"),
           Ratio("AOR recompute (REFT), snapshot every 10: step overhead", _aor("overhead_pct", "recompute@10"),
                 "{:+.1%}", "(same run)"),
           Ratio("  ceiling: its own work (gradient copy + recomputed step + writes / 10) / step",
                 _aor("work_pct_of_step", "recompute@10"), "{:.1%}", "(same run)"),
           Ratio("AOR copy, snapshot every step: step overhead", _aor("overhead_pct", "copy@1"), "{:+.1%}",
                 "(same run)"),
           Ratio("AOR recompute, snapshot every step: step overhead", _aor("overhead_pct", "recompute@1"),
                 "{:+.1%}", "(same run)"),
           Ratio("  ceiling: the cheaper mode's own work / step", lambda d: min(
               d["work_pct_of_step"]["copy@1"], d["work_pct_of_step"]["recompute@1"]) / 100, "{:.1%}", "(same run)"),
           Ratio("AOR log mode (--snapshot-zero log: gradient log + copy every 20), every step "
                 "restorable: step overhead", _aor("overhead_pct", "log+copy@20"), "{:+.1%}",
                 "< 5 % (every step)", lambda v: v < 0.05),
           Ratio("  ceiling: the log's CPU + partition exchange / 20, per step", _aor("work_pct_of_step", "log+copy@20"),
                 "{:.1%}", "(same run)"),
           Ratio("AOR log mode with a copy every 10: step overhead", _aor("overhead_pct", "log+copy@10"), "{:+.1%}",
                 "(same run)"),
           Ratio("  ceiling: the log's CPU + partition exchange / 10, per step", _aor("work_pct_of_step", "log+copy@10"),
                 "{:.1%}", "(same run)"))),
    Bench("interposer", lambda out: [sys.executable, str(BENCH / "bench_interposer.py"), "--backend", "real",
                                     "--iters", "50000", "--rounds", "3", "--json"],
          (Ratio("libjit.so pass-through: worst extra ns per call (real libcudart, no GPU)",
                 lambda d: max(c["overhead"] for c in d["calls"].values()), "{:+.1f} ns", "< 20 ns", lambda v: v < 20),),
          stdout_json=True),
    Bench("proxy_ring", lambda out: [str(BENCH.parent / "build" / "native" / "bin" / "ring_latency_bench"), "100000"],
          (Ratio("proxy ring: asynchronous call enqueue, median (2 processes)",
                 lambda d: d["enqueue_median_ns"], "{:.0f} ns", "< 1000 ns", lambda v: v < 1000),
           Ratio("proxy ring: synchronous round trip, median (2 processes)",
                 lambda d: d["round_trip_median_ns"], "{:.0f} ns", "< 10000 ns", lambda v: v < 10000),
           Ratio("  ceiling: timing one call (steady_clock::now twice)", lambda d: d["clock_overhead_ns"],
                 "{:.0f} ns", "(measurement floor)")),
          stdout_json=True, timeout=120.0),
    Bench("inprocess", lambda out: [sys.executable, str(BENCH / "bench_inprocess.py"), "--reps", "1", "--out", str(out)],
          (Ratio("in-process recovery: failure to the failed minibatch resumed (s)",
                 lambda d: d["inprocess"]["resumed_s"], "{:.3f}", "< 0.2 s", lambda v: v < 0.2),
           Ratio("  restart / in-process, to resumed (same run)",
                 lambda d: d["ratios"]["resumed_restart_over_inprocess"], "{:.2f}x", ">= 1x", lambda v: v >= 1),
           Ratio("  compiled: restart / in-process, to the failed minibatch done again",
                 lambda d: d["ratios"]["total_compiled_restart_over_inprocess"], "{:.2f}x", "> 1x", lambda v: v > 1),
           Ratio("  torchrun + DCP async_save every 10 / in-process",
                 lambda d: d["ratios"]["total_dcp10_over_inprocess"], "{:.1f}x", ">= 20x", lambda v: v >= 20))),
    Bench("proxy_mode", lambda out: [sys.executable, str(BENCH / "bench_proxy.py"), "--quick", "--out", str(out)],
          (Ratio("proxy mode: stream-ordered call enqueue, median (cudaEventRecord, launch; nvcc program)",
                 lambda d: d["enqueue_median_ns"], "{:.0f} ns", "< 1000 ns", lambda v: v < 1000),
           Ratio("proxy mode: synchronous round trip, median (cudaGetDevice; nvcc program)",
                 lambda d: d["round_trip_median_ns"], "{:.0f} ns", "< 10000 ns", lambda v: v < 10000),
           Ratio("proxy mode: dp_cuda step time vs observe mode (2 ranks, dim=batch=1024)",
                 lambda d: d["step"]["overhead"], "{:+.2%}", "< 3 %", lambda v: v < 0.03),
           Ratio("  same, dim=batch=256 (steps of ~0.3 ms: the fixed cost per step shows most)",
                 lambda d: d["step_small"]["overhead"], "{:+.2%}", "(for reference)"),
           Ratio("  its extra time per step", lambda d: d["step_small"]["extra_us"], "{:.0f} us", "(for reference)"),
           Ratio("  after 1 ms idle: a round trip that must wake the sleeping proxy",
                 lambda d: d["cold_round_trip_median_ns"] / 1000, "{:.0f} us", "(for reference)"),
           Ratio("  ceiling: after 1 ms idle, kernel + synchronize directly on simcuda (no proxy)",
                 lambda d: d["cold_step_direct_median_ns"] / 1000, "{:.0f} us", "(physical floor: waking an idle thread)")),
          timeout=600.0),
    Bench("transparent_recovery", lambda out: [sys.executable, str(BENCH / "bench_transparent_recovery.py"), "--quick",
                                               "--out", str(out)],
          (Ratio("replay journal: dp_cuda step time, journal on vs off (2 ranks, proxy mode)",
                 lambda d: d["journal"]["overhead"], "{:+.2%}", "< 3 %", lambda v: v < 0.03),
           Ratio("NCCL failure, 1 rank: user-level time lost / transparent recovery time",
                 lambda d: d["recovery"]["speedup_vs_recovery_time"], "{:.1f}x", ">= 10x", lambda v: v >= 10),
           Ratio("  transparent recovery (save, new proxy, recreate, restore, replay one minibatch)",
                 lambda d: d["recovery"]["transparent_recovery_s"] * 1000, "{:.0f} ms", "(for reference)"),
           Ratio("  user-level: wall time lost (JIT save, restart, resume)",
                 lambda d: d["recovery"]["user_level_lost_s"], "{:.2f} s", "(for reference)"),
           Ratio("NCCL failure, 2 ranks: user-level time lost / transparent recovery time (slowest rank)",
                 lambda d: d["recovery_2_ranks"]["speedup_vs_recovery_time"], "{:.1f}x", ">= 10x",
                 lambda v: v >= 10),
           Ratio("  transparent recovery, slowest rank (waits a hang timeout of 1 s for its peer's word)",
                 lambda d: d["recovery_2_ranks"]["transparent_recovery_s"] * 1000, "{:.0f} ms", "(for reference)"),
           Ratio("  transparent: wall time lost", lambda d: d["recovery_2_ranks"]["transparent_lost_s"], "{:.2f} s",
                 "(for reference)"),
           Ratio("  user-level: wall time lost (JIT save, restart, resume)",
                 lambda d: d["recovery_2_ranks"]["user_level_lost_s"], "{:.2f} s", "(for reference)")),
          timeout=1500.0),
]


def run(bench: Bench, scratch: Path, console: Console) -> tuple[Optional[dict], str]:
    out = scratch / f"{bench.name}.json"
    t0 = time.monotonic()
    console.print(f"[bold]-- {bench.name}[/bold] (quick)")
    try:
        proc = proc_tree.run(bench.argv(out), timeout=bench.timeout, cwd=BENCH.parent)
    except subprocess.TimeoutExpired as e:
        (scratch / f"{bench.name}.log").write_text((e.output or "") + (e.stderr or ""))
        return None, f"timed out after {bench.timeout:.0f} s"
    finally:  # what it orphaned (this process is their subreaper) ends with it
        left = proc_tree.kill_descendants()
        if left:
            console.print(f"   [yellow]{bench.name} left {len(left)} processes running: killed {left}[/yellow]")
    (scratch / f"{bench.name}.log").write_text(proc.stdout + proc.stderr)
    console.print(f"   {time.monotonic() - t0:.0f} s, exit {proc.returncode}")
    if proc.returncode != 0:
        return None, f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
    try:
        text = proc.stdout if bench.stdout_json else out.read_text()
        return json.loads(text), ""
    except (OSError, ValueError) as e:
        return None, f"no result: {e}"


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=[b.name for b in BENCHES], help="run only these")
    ap.add_argument("--keep", default="", help="directory for the JSON and logs (default: a temp dir)")
    args = ap.parse_args(argv)
    proc_tree.become_subreaper()
    console = Console() if sys.stdout.isatty() else Console(width=150)  # a log keeps whole rows
    benches = [b for b in BENCHES if not args.only or b.name in args.only]
    scratch_ctx = tempfile.TemporaryDirectory(prefix="jitckpt-bench-") if not args.keep else None
    scratch = Path(args.keep or scratch_ctx.name)
    scratch.mkdir(parents=True, exist_ok=True)
    table = Table(title="jitckpt benchmarks (quick mode, this machine, one run each)")
    for col in ("benchmark", "ratio", "measured", "target", "met"):
        table.add_column(col)
    failed = 0
    for bench in benches:
        data, error = run(bench, scratch, console)
        for r in bench.ratios:
            if data is None:
                table.add_row(bench.name, r.what, "-", r.target, f"[red]{error}[/red]")
                continue
            try:
                value = float(r.read(data))
                ok = r.meets(value) if r.meets is not None else r.meets_in(data) if r.meets_in is not None else None
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:
                table.add_row(bench.name, r.what, "-", r.target, f"[red]missing {e}[/red]")
                continue
            met = "-" if ok is None else ("yes" if ok else "[yellow]no[/yellow]")
            table.add_row(bench.name, r.what, r.fmt.format(value), r.target, met)
        failed += data is None
    console.print(table)
    if args.keep:
        console.print(f"JSON and logs in {scratch}")
    elif scratch_ctx is not None:
        scratch_ctx.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
