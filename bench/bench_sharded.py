"""Issue 44 benchmarks on one FSDP2 workload, HSDP on a 2x2 mesh (4 ranks, CPU, gloo), measured in one run:

1. Save time: jitckpt's JIT save after a failure (rank 3 lost: each survivor its parts as DCP chunks,
   no collective, through the checkpoint store: fsynced, CRC32C; rank 3's partner writes its whole
   shard) against ``torch.distributed.checkpoint.save`` of the same model and optimizer state
   (``get_state_dict``, collective, every rank, fsynced), interleaved, in one job
   (bench/sharded_save_probe.py); the slowest rank of each, beside the floor: the same bytes per rank
   written raw as one fsynced file each, and jitckpt's save with every rank alive (preemption,
   periodic), which splits each shard over its replicas as DCP does.
2. Recovery, failure to the failed minibatch done again: `jitckpt run` (a SIGKILLed rank's shards
   come back from its replica group), and with ``--recovery inprocess`` (the survivors keep their
   processes), against torchrun restarting the job from
   ``torch.distributed.checkpoint.async_save`` every 10 steps and every step (examples/train_ddp.py
   --parallel hsdp --baseline-dcp-every N).
3. Steady state, end to end: median step time of the jitckpt runs' and the torchrun runs' steps
   before the failure (this VM's run-to-run spread is about +-10 %; section 6 resolves the bound).
4. Full sharding (FSDP2 on a 1-D mesh of 4 ranks: no replica) with ``--snapshot-every 1``: recovery
   from the keepers' shard snapshots (and with ``--recovery inprocess``) against torchrun + DCP
   ``async_save`` every 10 steps and every
   step, and what the snapshots cost a step: the median step with ``--snapshot-every 1`` against the
   same jitckpt job without snapshots (end to end: inside this VM's spread only a large cost shows).
5. What a shard snapshot costs the step it ends, resolved: one rank's shard of that job (its quarter
   of the parameters and of both Adam moments, 25 MB) written into a real keeper by
   ``ShardSnapshots.take`` (the synchronous part: copy + checksum + commit), median of repetitions,
   against one memcpy of the same bytes (the floor), and over section 4's median step.
6. Steady-state bound for FSDP2 (full sharding, 4 ranks, no snapshots), with bench_recovery.py's
   accounting: (a) the CPU per step of the launcher's own processes and of its runtime's threads in
   the workers (`jitckpt run` against torchrun, from the kernel's clocks), over the median step;
   (b) what the training thread's step gains: the hooks and every region FSDP2's all-gathers and
   reduce-scatters enter, counted in a real job and timed in it (bench/sharded_hook_probe.py).

Model: the 8.4 M-parameter MLP of bench_recovery.py (1024-2048-2048-1024), Adam, batch 32.
Usage: python bench/bench_sharded.py [--quick] [--recovery-only] [--out bench/results/sharded.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_recovery import (MODEL, back_at_failed_step, jitrun, launcher_cpu, read_log, run,  # noqa: E402
                            torchrun)

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


def _timed_run(d: Path, cmd: list, fail: Optional[int]) -> dict:
    """Run ``cmd`` in ``d`` (created); its steady step time and, with a failure at ``fail``, how long
    from it to the failed minibatch done again and how many minibatches were redone."""
    d.mkdir()
    run(cmd, d)
    log = read_log(d / "log.jsonl")
    out = {"step_s": steady(log, fail if fail is not None else 10 ** 9)}
    if fail is not None:
        t_fail, t_back, first = back_at_failed_step(log, fail)
        out.update(total_s=t_back - t_fail, resumed_at=first, minibatches_redone=fail - first + 1)
    return out


def _against_torchrun(res: dict, work: Path, layout: list, steps: int, fail: int, ours: str, tag: str) -> None:
    """Add torchrun + DCP async_save every 10 steps and every step (the same job and failure) to
    ``res``, with the speedup of ``res[ours]`` against each."""
    for name, every in (("torchrun_dcp10", 10), ("torchrun_dcp1", 1)):
        d = work / f"{tag}-{name}"
        res[name] = _timed_run(d, torchrun(NPROC, [*MODEL, *layout, "--steps", str(steps), "--steps-log",
                                                   str(d / "log.jsonl"), "--no-jitckpt", "--baseline-dcp-every",
                                                   str(every), "--baseline-dir", str(d / "ckpt"),
                                                   "--inject", f"0:1:{fail}:kill"], d, max_restarts=1), fail)
        res[f"speedup_vs_{name}"] = res[name]["total_s"] / res[ours]["total_s"]
        res[f"step_time_{ours}_over_{name}"] = res[ours]["step_s"] / res[name]["step_s"]


def _jitckpt(work: Path, tag: str, layout: list, steps: int, fail: Optional[int], extra: list = ()) -> dict:
    d = work / tag
    inject = ["--inject", f"0:1:{fail}:kill"] if fail is not None else []
    return _timed_run(d, jitrun(NPROC, [*MODEL, *layout, "--steps", str(steps), "--steps-log", str(d / "log.jsonl"),
                                        *inject], d, extra=["--hang-timeout", "30", *extra]), fail)


def recovery(work: Path, steps: int, fail: int) -> dict:
    res = {"jitckpt": _jitckpt(work, "rec-jitckpt", HSDP, steps, fail),
           # The survivors keep their processes (issue 48): no restarted rank but the lost one.
           "jitckpt_inprocess": _jitckpt(work, "rec-inprocess", HSDP, steps, fail, ["--recovery", "inprocess"])}
    _against_torchrun(res, work, HSDP, steps, fail, "jitckpt", "rec")
    for name in ("torchrun_dcp10", "torchrun_dcp1"):
        res[f"inprocess_speedup_vs_{name}"] = res[name]["total_s"] / res["jitckpt_inprocess"]["total_s"]
    return res


FSDP = ["--parallel", "fsdp"]


def shard_snapshots(work: Path, steps: int, fail: int) -> dict:
    """Section 4: full sharding, a SIGKILLed rank's shard from its keeper."""
    res = {"snapshots": _jitckpt(work, "shards-snapshots", FSDP, steps, fail, ["--snapshot-every", "1"]),
           "snapshots_inprocess": _jitckpt(work, "shards-inprocess", FSDP, steps, fail,
                                           ["--snapshot-every", "1", "--recovery", "inprocess"]),
           "no_snapshots": _jitckpt(work, "shards-none", FSDP, steps, None)}
    _against_torchrun(res, work, FSDP, steps, fail, "snapshots", "shards")
    for name in ("torchrun_dcp10", "torchrun_dcp1"):
        res[f"inprocess_speedup_vs_{name}"] = res[name]["total_s"] / res["snapshots_inprocess"]["total_s"]
    res["step_time_snapshots_over_none"] = res["snapshots"]["step_s"] / res["no_snapshots"]["step_s"]
    return res


def snapshot_write(reps: int, step_s: float) -> dict:
    """Section 5, in this process: ``ShardSnapshots.take`` of one rank's shard vs one memcpy."""
    import time

    import torch

    from bench_snapshot import start_keeper
    from jitckpt.snapshot.shard_snapshots import ShardSnapshots

    dims = [(2048, 1024), (2048,), (2048, 2048), (2048,), (1024, 2048), (1024,)]  # MODEL's layers
    params = {f"p{i}": torch.randn(*d[:1], *d[1:]).view(-1)[: max(1, torch.Size(d).numel() // NPROC)].clone()
              for i, d in enumerate(dims)}
    state = {"model": params,
             "optim": {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v),
                           "step": torch.tensor(7.0)} for k, v in params.items()},
             "step": 7, "rng": {"torch": torch.get_rng_state()}}
    nbytes = sum(v.nbytes * 3 for v in params.values())
    with tempfile.TemporaryDirectory(prefix="jitckpt-shardsnap-") as tmp:
        sock = str(Path(tmp) / "k.sock")
        keeper = start_keeper(sock)
        try:
            snaps = ShardSnapshots(socket_path=sock, every=1, ranks_per_node=1, shard_id=0, num_shards=NPROC,
                                   replica_id=0, mesh="bench")
            takes = []
            for step in range(1, reps + 1):
                t0 = time.perf_counter()
                snaps.take(step, state)
                takes.append(time.perf_counter() - t0)
            snaps.close()
        finally:
            keeper.kill()
            keeper.wait(timeout=10)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    copies = []
    for _ in range(reps):
        t0 = time.perf_counter()
        flat.copy_(src)
        copies.append(time.perf_counter() - t0)
    take_s, copy_s = statistics.median(takes[1:] or takes), statistics.median(copies)
    return {"bytes": nbytes, "take_s": take_s, "memcpy_s": copy_s, "take_over_memcpy": take_s / copy_s,
            "step_s": step_s, "take_over_step": take_s / step_s}


def steady_bound(work: Path, steps: int, reps: int) -> dict:
    """Section 6: (a) the launchers' own CPU per step, jitckpt against torchrun, median over
    ``reps`` interleaved runs each; (b) the training thread's added cost per step (the probe)."""
    cpu: dict = {"torchrun": [], "jitckpt": []}
    step_s = []
    window = {"from_step": steps // 2, "to_step": steps - 3}
    for i in range(reps):
        for kind in cpu:
            d = work / f"steady-{kind}-{i}"
            d.mkdir()
            args = [*MODEL, *FSDP, "--steps", str(steps), "--steps-log", str(d / "log.jsonl")]
            cmd = torchrun(NPROC, [*args, "--no-jitckpt"], d) if kind == "torchrun" else jitrun(NPROC, args, d)
            cpu[kind].append(launcher_cpu(cmd, d, **window))
            if kind == "torchrun":
                step_s.append(steady(read_log(d / "log.jsonl"), steps))
    own = {k: statistics.median(r["own_cpu_per_step_s"] for r in v) for k, v in cpu.items()}
    mp = statistics.median(step_s)
    d = work / "steady-probe"
    d.mkdir()
    out = d / "probe.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
         str(ROOT / "bench" / "sharded_hook_probe.py"), "--out", str(out)], d)
    probe = json.loads(out.read_text())
    return {"median_step_torchrun_s": mp, "own_cpu_per_step_s": own, "own_cpu_runs": cpu,
            "own_cpu_extra_fraction": (own["jitckpt"] - own["torchrun"]) / mp,
            "thread": probe, "thread_fraction": probe["worst"]["fraction"],
            "bound_fraction": (own["jitckpt"] - own["torchrun"]) / mp + probe["worst"]["fraction"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sharded.json"))
    p.add_argument("--recovery-only", action="store_true", help="sections 2 and 4 only (the recoveries)")
    args = p.parse_args()
    steps, fail, reps = (24, 19, 3) if args.quick else (40, 29, 7)
    with tempfile.TemporaryDirectory(prefix="jitckpt-bench-sharded-") as tmp:
        work = Path(tmp)
        res = {"workload": "FSDP2 HSDP 2x2, 8.4M-parameter MLP, Adam, 4 ranks, gloo, CPU"}
        if not args.recovery_only:
            res["save"] = save_times(work, reps)
        res.update(recovery=recovery(work, steps, fail), shard_snapshots=shard_snapshots(work, steps, fail))
        if not args.recovery_only:
            res["shard_snapshot_write"] = snapshot_write(reps * 5, res["shard_snapshots"]["no_snapshots"]["step_s"])
            res["steady"] = steady_bound(work, max(steps, 30), 1 if args.quick else 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
