"""Issue 44 benchmarks on one FSDP2 workload, HSDP on a 2x2 mesh (4 ranks, CPU, gloo), measured in one run:

1. Save time: jitckpt's JIT save of the state (each rank its own DCP shard, no collective, through
   the checkpoint store: fsynced, CRC32C) against ``torch.distributed.checkpoint.save`` of the same
   model and optimizer state (``get_state_dict``, collective, fsynced), interleaved, in one job
   (bench/sharded_save_probe.py); the slowest rank of each, beside the floor: each rank writing its
   own shard's bytes as one fsynced file (a JIT save after a failure writes a whole shard on the
   lost rank's partner; DCP, all ranks alive, spreads each replicated chunk over the replicas), and
   jitckpt's save with every rank alive (preemption, periodic), which splits each shard over its
   replicas as DCP does.
2. Recovery, failure to the failed minibatch done again: `jitckpt run` (a SIGKILLed rank's shards
   come back from its replica group) against torchrun restarting the job from
   ``torch.distributed.checkpoint.async_save`` every 10 steps and every step (examples/train_ddp.py
   --parallel hsdp --baseline-dcp-every N).
3. Steady state, end to end: median step time of the jitckpt runs' and the torchrun runs' steps
   before the failure (this VM's run-to-run spread is about +-10 %; the CPU-accounting bound of
   bench_recovery.py is not measured for FSDP2 yet).
4. Full sharding (FSDP2 on a 1-D mesh of 4 ranks: no replica) with ``--snapshot-every 1``: recovery
   from the keepers' shard snapshots against torchrun + DCP ``async_save`` every 10 steps and every
   step, and what the snapshots cost a step: the median step with ``--snapshot-every 1`` against the
   same jitckpt job without snapshots (end to end: inside this VM's spread only a large cost shows).

Model: the 8.4 M-parameter MLP of bench_recovery.py (1024-2048-2048-1024), Adam, batch 32.
Usage: python bench/bench_sharded.py [--quick] [--out bench/results/sharded.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_recovery import ENV, MODEL, back_at_failed_step, jitrun, read_log, run, torchrun  # noqa: E402

NPROC = 4
HSDP = ["--parallel", "hsdp"]


def save_times(work: Path, reps: int) -> dict:
    d = work / "save"
    d.mkdir()
    out = d / "save.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
         str(ROOT / "bench" / "sharded_save_probe.py"), "--reps", str(reps), "--dir", str(d), "--out", str(out)], d)
    res = json.loads(out.read_text())
    res["jit_over_dcp"] = res["jit_s"] / res["dcp_s"]
    res["jit_over_floor"] = res["jit_s"] / res["floor_s"]
    res["split_over_dcp"] = res["split_s"] / res["dcp_s"]
    return res


def steady(log: list, before: int) -> float:
    return statistics.median(r["dt"] for r in log if r.get("gen", 0) == 0 and "step" in r and 2 <= r["step"] < before)


def recovery(work: Path, steps: int, fail: int) -> dict:
    res: dict = {}
    d = work / "rec-jitckpt"
    d.mkdir()
    run(jitrun(NPROC, [*MODEL, *HSDP, "--steps", str(steps), "--steps-log", str(d / "log.jsonl"),
                       "--inject", f"0:1:{fail}:kill"], d, extra=["--hang-timeout", "30"]), d)
    log = read_log(d / "log.jsonl")
    t_fail, t_back, first = back_at_failed_step(log, fail)
    res["jitckpt"] = {"total_s": t_back - t_fail, "resumed_at": first, "minibatches_redone": fail - first + 1,
                      "step_s": steady(log, fail)}
    for name, every in (("torchrun_dcp10", 10), ("torchrun_dcp1", 1)):
        d = work / f"rec-{name}"
        d.mkdir()
        run(torchrun(NPROC, [*MODEL, *HSDP, "--steps", str(steps), "--steps-log", str(d / "log.jsonl"),
                             "--no-jitckpt", "--baseline-dcp-every", str(every), "--baseline-dir", str(d / "ckpt"),
                             "--inject", f"0:1:{fail}:kill"], d, max_restarts=1), d)
        log = read_log(d / "log.jsonl")
        t_fail, t_back, first = back_at_failed_step(log, fail)
        res[name] = {"total_s": t_back - t_fail, "resumed_at": first, "minibatches_redone": fail - first + 1,
                     "step_s": steady(log, fail)}
        res[f"speedup_vs_{name}"] = res[name]["total_s"] / res["jitckpt"]["total_s"]
        res[f"step_time_jitckpt_over_{name}"] = res["jitckpt"]["step_s"] / res[name]["step_s"]
    return res


FSDP = ["--parallel", "fsdp"]


def shard_snapshots(work: Path, steps: int, fail: int) -> dict:
    """Section 4: full sharding, a SIGKILLed rank's shard from its keeper."""
    res: dict = {}
    for name, extra, inject in (("snapshots", ["--snapshot-every", "1"], ["--inject", f"0:1:{fail}:kill"]),
                                ("no_snapshots", [], [])):
        d = work / f"shards-{name}"
        d.mkdir()
        run(jitrun(NPROC, [*MODEL, *FSDP, "--steps", str(steps), "--steps-log", str(d / "log.jsonl"), *inject], d,
                   extra=["--hang-timeout", "30", *extra]), d)
        log = read_log(d / "log.jsonl")
        res[name] = {"step_s": steady(log, fail)}
        if inject:
            t_fail, t_back, first = back_at_failed_step(log, fail)
            res[name].update(total_s=t_back - t_fail, resumed_at=first, minibatches_redone=fail - first + 1)
    for name, every in (("torchrun_dcp10", 10), ("torchrun_dcp1", 1)):
        d = work / f"shards-{name}"
        d.mkdir()
        run(torchrun(NPROC, [*MODEL, *FSDP, "--steps", str(steps), "--steps-log", str(d / "log.jsonl"),
                             "--no-jitckpt", "--baseline-dcp-every", str(every), "--baseline-dir", str(d / "ckpt"),
                             "--inject", f"0:1:{fail}:kill"], d, max_restarts=1), d)
        log = read_log(d / "log.jsonl")
        t_fail, t_back, first = back_at_failed_step(log, fail)
        res[name] = {"total_s": t_back - t_fail, "resumed_at": first, "minibatches_redone": fail - first + 1,
                     "step_s": steady(log, fail)}
        res[f"speedup_vs_{name}"] = res[name]["total_s"] / res["snapshots"]["total_s"]
    res["step_time_snapshots_over_none"] = res["snapshots"]["step_s"] / res["no_snapshots"]["step_s"]
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sharded.json"))
    args = p.parse_args()
    steps, fail, reps = (24, 19, 3) if args.quick else (40, 29, 7)
    with tempfile.TemporaryDirectory(prefix="jitckpt-bench-sharded-") as tmp:
        work = Path(tmp)
        res = {"workload": "FSDP2 HSDP 2x2, 8.4M-parameter MLP, Adam, 4 ranks, gloo, CPU",
               "save": save_times(work, reps), "recovery": recovery(work, steps, fail),
               "shard_snapshots": shard_snapshots(work, steps, fail)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
