"""Issue 48: in-process recovery against the restart path, in one run on this machine.

The recovery bench's workload (bench_recovery.py: the 8.4 M-parameter MLP, Adam, batch 32, 2 ranks,
gloo, rank 1 SIGKILLs itself at step 25 of 40), each variant ``--reps`` times, runs interleaved:

* ``restart``: `jitckpt run` (``--recovery jit``): the survivors save, every rank restarts on warm standbys;
* ``inprocess``: `jitckpt run --recovery inprocess`: the survivors save and go on in their processes,
  a warm standby takes rank 1;
* the same two with the forward through ``torch.compile`` (``--compile``): a restart compiles again in
  every rank, in-process only in the replacement (both with inductor's on-disk cache warm);
* ``inprocess_snapshot``: in-process with ``--snapshot-every 1``: the standby takes rank 1's state from
  the node's snapshot keeper, from buffers it mapped ahead, at memory speed;
* ``torchrun_dcp10``: torchrun + ``torch.distributed.checkpoint.async_save`` every 10 steps, restarting
  from the newest complete checkpoint (what users pick today).

For each: ``resumed_s``, failure to the failed minibatch resumed (every rank restored, about to run
it again: the issue's measure), and ``total_s``, failure to that minibatch done again (the only one
the torchrun baseline has: it has no restore report); the medians, and the ratios the issue names.
* with ``--torchft-python PY`` (a python that has ``torchft``): torchft's peer recovery of the same
  workload, two replica groups of one rank (bench/torchft_peer.py), its lighthouse started here;
* with ``--ft-launcher PATH`` (``pip install nvidia-resiliency-ext``): NVIDIA's ``ft_launcher`` in-job
  restart in torchrun's place, the job resuming from DCP ``async_save`` every 10 steps.

Usage: python bench/bench_inprocess.py [--reps 3] [--torchft-python PY] [--out bench/results/inprocess.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_recovery as br  # noqa: E402
import proc_tree  # noqa: E402

STEPS, FAIL_STEP = 40, 25
VARIANTS = {  # name -> (launcher flags, script flags)
    "restart": ((), ()),
    "inprocess": (("--recovery", "inprocess"), ()),
    "restart_compiled": ((), ("--compile",)),
    "inprocess_compiled": (("--recovery", "inprocess"), ("--compile",)),
    # The standby restores from the node's keeper (buffers it mapped ahead) instead of a checkpoint.
    "inprocess_snapshot": (("--recovery", "inprocess", "--snapshot-every", "1"), ()),
}


def kept(d: Path) -> list:
    """The ranks the recovery kept in their processes (the launcher's summary)."""
    ev = br.read_log(d / "run" / "events.jsonl")
    summary = next((e for e in ev if e["event"] == "recovery_summary"), {})
    return summary.get("kept_ranks", [])


def torchft_recovery(work: Path, python: str, steps: int = 80) -> dict:
    """torchft's peer recovery on the same workload (bench/torchft_peer.py): two replica groups of one
    rank, its lighthouse started here, group 1 SIGKILLed at FAIL_STEP and restarted by its torchrun.
    ``survivor_back_s``: failure to the surviving group's FAIL_STEP done (with the quorum it has left:
    torchft takes that step without the lost group's data); ``rejoined_s``: failure to the first step
    both groups take together again."""
    work.mkdir()
    log = work / "log.jsonl"
    port = _free_port()
    env = {**br.ENV, "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
    lighthouse = subprocess.Popen([str(Path(python).parent / "torchft_lighthouse"), "--min_replicas", "1",
                                   "--quorum_tick_ms", "100", "--join_timeout_ms", "1000",
                                   "--heartbeat_timeout_ms", "1000", "--bind", f"127.0.0.1:{port}"],
                                  stdout=open(work / "lighthouse.txt", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
    groups = []
    try:
        for g in (0, 1):
            groups.append(subprocess.Popen([python, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                           "--max-restarts", "1", "--monitor-interval", "0.1",
                                           "--master-port", str(_free_port()), str(ROOT / "bench" / "torchft_peer.py"),
                                           "--steps", str(steps), "--fail-step", str(FAIL_STEP), "--steps-log", str(log)],
                                          cwd=work, env={**env, "REPLICA_GROUP_ID": str(g)},
                                          stdout=open(work / f"group{g}.txt", "w"), stderr=subprocess.STDOUT))
        for p in groups:
            p.wait(timeout=300)
    finally:
        for p in groups:
            proc_tree.kill_tree(p.pid)
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait(timeout=10)
    rows = br.read_log(log)
    t_fail = next(r["t"] for r in rows if "dying" in r)
    back = min(r["t"] for r in rows if r.get("group") == 0 and r.get("step") == FAIL_STEP)
    together = [r["t"] for r in rows if r.get("launch") == 1 and r.get("participants") == 2]
    return {"survivor_back_s": back - t_fail, "rejoined_s": (min(together) - t_fail) if together else None,
            "steps": steps, "note": "torchft takes the failed step with the groups left: not the failure-free result"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(work: Path, reps: int) -> dict:
    runs: dict = {name: [] for name in [*VARIANTS, "torchrun_dcp10"]}
    for i in range(reps):
        for name, (launcher, script) in VARIANTS.items():
            d = work / f"{name}-{i}"
            row = br.jit_recovery_once(d, STEPS, FAIL_STEP, launcher=launcher, script=script)
            row["kept_ranks"] = kept(d)
            runs[name].append(row)
            print(f"{name} #{i}: resumed {row['resumed_s']:.3f} s, back at the failed step {row['total_s']:.3f} s, "
                  f"kept {row['kept_ranks']}", flush=True)
        row = br.baseline_recovery(work / f"dcp10-{i}", "torchrun_dcp10", STEPS, FAIL_STEP)
        runs["torchrun_dcp10"].append(row)
        print(f"torchrun_dcp10 #{i}: back at the failed step {row['total_s']:.3f} s", flush=True)
    out: dict = {}
    for name, rows in runs.items():
        out[name] = {k: statistics.median(r[k] for r in rows) for k in ("resumed_s", "total_s", "restore_s",
                                                                       "restart_s", "save_s")
                     if all(k in r for r in rows)}
        out[name]["runs"] = rows
    m = {name: out[name] for name in out}
    out["ratios"] = {
        "resumed_restart_over_inprocess": m["restart"]["resumed_s"] / m["inprocess"]["resumed_s"],
        "total_restart_over_inprocess": m["restart"]["total_s"] / m["inprocess"]["total_s"],
        "total_compiled_restart_over_inprocess": m["restart_compiled"]["total_s"] / m["inprocess_compiled"]["total_s"],
        "total_dcp10_over_inprocess": m["torchrun_dcp10"]["total_s"] / m["inprocess"]["total_s"],
        "resumed_restart_over_inprocess_snapshot": m["restart"]["resumed_s"] / m["inprocess_snapshot"]["resumed_s"],
        "total_dcp10_over_inprocess_snapshot": m["torchrun_dcp10"]["total_s"] / m["inprocess_snapshot"]["total_s"],
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "inprocess.json"))
    ap.add_argument("--workdir", default="")
    ap.add_argument("--ft-launcher", default="",
                    help="NVIDIA's ft_launcher (pip install nvidia-resiliency-ext): adds its in-job restart + DCP every 10")
    ap.add_argument("--torchft-python", default="",
                    help="a python with torchft installed (pip install torchft): adds torchft's peer recovery")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="jitckpt-bench-inprocess-"))
    results = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": STEPS, "fail_step": FAIL_STEP,
               **measure(work, a.reps)}
    if a.torchft_python:  # torchft's peer recovery, its own venv (pip install torchft)
        results["torchft"] = torchft_recovery(work / "torchft", a.torchft_python)
        print("torchft:", json.dumps(results["torchft"]), flush=True)
    if a.ft_launcher:  # NVIDIA's in-job restart (pip install nvidia-resiliency-ext) + DCP every 10 steps
        rows = [br.baseline_recovery(work / f"ft_launcher-{i}", "torchrun_dcp10", STEPS, FAIL_STEP, launcher=a.ft_launcher)
                for i in range(a.reps)]
        results["ft_launcher_dcp10"] = {"total_s": statistics.median(r["total_s"] for r in rows), "runs": rows}
        results["ratios"]["total_ft_launcher_dcp10_over_inprocess"] = (
            results["ft_launcher_dcp10"]["total_s"] / results["inprocess"]["total_s"])
        print("ft_launcher + DCP every 10:", json.dumps(results["ft_launcher_dcp10"]["total_s"]), flush=True)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1, default=str)[:4000])
    for name in [*VARIANTS, "torchrun_dcp10"]:
        r = results[name]
        print(f"{name:20s} resumed {r.get('resumed_s', float('nan')):6.3f} s   back at the failed step {r['total_s']:6.3f} s")
    print("ratios:", json.dumps(results["ratios"], indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {a.out}")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
