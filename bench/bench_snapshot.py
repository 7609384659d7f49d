"""In-memory snapshot tier (issue 5), measured in one run on this machine (CPU, one trainer process).

1. Steady-state overhead of a snapshot every step vs none: the same process alternates steps with
   and without a snapshot (interleaved, so machine load drifts hit both alike); medians compared.
   Each snapshot copies the whole state (parameters + Adam moments) into the keeper's memory on a
   background thread and hashes it; the trainer only waits if the copy is not done by
   optimizer.step().
2. Restore of that same state: from the keeper's memory (verify checksums, rebuild, load_state_dict)
   vs torch.load of the same state from a file + load_state_dict, cold (page cache dropped for the
   file with posix_fadvise) and warm.

Usage: python bench/bench_snapshot.py [--quick] [--out bench/results/snapshot.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jitckpt.checkpoint_store import find_latest, write_checkpoint  # noqa: E402
from jitckpt.snapshot_client import SnapshotTaker  # noqa: E402
from jitckpt.snapshot_restore import restore  # noqa: E402


def build(hidden: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mods: list = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.Tanh()]
    model = nn.Sequential(*mods)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def state_of(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}


def start_keeper(sock: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "jitckpt.snapshot_keeper", "--socket", sock,
                          "--max-lifetime", "600"], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = p.stdout.readline()
    if not line.startswith("ready"):
        p.kill()
        raise RuntimeError(f"snapshot keeper did not start: {line!r}")
    return p


def drop_file_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and trials (smoke test)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=20, help="step pairs (with/without snapshot)")
    ap.add_argument("--nice", type=int, default=0, help="nice value of the snapshot thread")
    ap.add_argument("--chunk", type=int, default=1 << 20, help="snapshot chunk bytes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "snapshot.json"))
    a = ap.parse_args()
    pairs, trials = (4, 2) if a.quick else (a.pairs, 5)
    torch.set_num_threads(1)  # the trainer's compute; the snapshot thread gets the other core
    tmp = Path(tempfile.mkdtemp(prefix="snapbench", dir="/tmp"))
    keeper = start_keeper(str(tmp / "k.sock"))
    try:
        model, opt = build(a.hidden, a.layers)
        step = 0
        snap = SnapshotTaker(state_fn=lambda: state_of(step, model, opt), socket_path=str(tmp / "k.sock"),
                             scheme="none", ranks_per_node=1, thread_nice=a.nice,
                             chunk_bytes=a.chunk)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(a.batch, a.hidden, generator=g)
        times: dict[str, list] = {"snapshot": [], "none": []}
        for step in range(2 * pairs + 2):
            with_snap = step % 2 == 0
            t0 = time.perf_counter()
            if with_snap:
                snap.begin(step)
            opt.zero_grad()
            model(x).square().mean().backward()
            with snap.idle():
                pass  # a data-parallel job's gradient all-reduce would be this idle window
            snap.wait()
            opt.step()
            dt = time.perf_counter() - t0
            if step >= 2:  # first pair: warm-up (page faults in fresh keeper buffers, Adam state)
                times["snapshot" if with_snap else "none"].append(dt)
        snap.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        overhead = med["snapshot"] / med["none"] - 1
        state_bytes = snap.stats.bytes_copied / max(snap.stats.taken, 1)
        copy_s = snap.stats.copy_seconds / max(snap.stats.taken, 1)
        blocked_s = snap.stats.blocked_seconds / max(snap.stats.taken, 1)

        # The last committed snapshot is state (last_snapshot_step); take it from memory and disk.
        last = snap._last_committed
        mem_times, mem_restore_only, ref = [], [], None
        for _ in range(trials):
            t0 = time.perf_counter()
            res = restore(socket_path=str(tmp / "k.sock"), ranks_per_node=1)
            model.load_state_dict(res.state["model"])
            opt.load_state_dict(res.state["optimizer"])
            mem_times.append(time.perf_counter() - t0)
            mem_restore_only.append(res.seconds)
            assert (res.source, res.step) == ("memory", last), (res.source, res.step, res.skipped)
            ref = res.state
        path = tmp / "state.pt"
        torch.save(ref, path)
        cold, warm = [], []
        for _ in range(trials):
            for which in ("cold", "warm"):
                if which == "cold":
                    drop_file_cache(path)
                t0 = time.perf_counter()
                sd = torch.load(path, map_location="cpu", weights_only=True)
                model.load_state_dict(sd["model"])
                opt.load_state_dict(sd["optimizer"])
                (cold if which == "cold" else warm).append(time.perf_counter() - t0)
        # The same state through the shared on-disk format, verified (CRC32) like every disk tier.
        ckdir, _ = write_checkpoint(tmp / "ckpt", lambda d: torch.save(ref, Path(d) / "state.pt"),
                                    kind="snapshot", step=last, rank=0, world_size=1, gen=0)
        verified = []
        for _ in range(trials):
            drop_file_cache(ckdir / "state.pt")
            t0 = time.perf_counter()
            found, _meta = find_latest(tmp / "ckpt")
            sd = torch.load(found / "state.pt", map_location="cpu", weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
            verified.append(time.perf_counter() - t0)
        for k, v in ref["model"].items():  # both tiers hold the same bits
            assert torch.equal(v, sd["model"][k])
        res_mem, res_cold, res_warm = (statistics.median(v) for v in (mem_times, cold, warm))
        out = {
            "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
            "model": {"hidden": a.hidden, "layers": a.layers, "batch": a.batch,
                      "params": sum(p.numel() for p in model.parameters())},
            "snapshot_bytes": int(state_bytes),
            "snapshot_thread_nice": a.nice,
            "chunk_bytes": a.chunk,
            "step_seconds_median": med,
            "steps_measured": {k: len(v) for k, v in times.items()},
            "overhead_fraction": overhead,
            "snapshot_copy_seconds_mean": copy_s,
            "snapshot_blocked_seconds_mean": blocked_s,
            "snapshot_chunks_by_window": snap.stats.chunks,
            "restore_memory_seconds_median": res_mem,
            "restore_disk_cold_seconds_median": res_cold,
            "restore_disk_warm_seconds_median": res_warm,
            "restore_memory_verify_and_rebuild_seconds_median": statistics.median(mem_restore_only),
            "restore_disk_verified_cold_seconds_median": statistics.median(verified),
            "restore_speedup_vs_disk_verified_cold": statistics.median(verified) / res_mem,
            "restore_speedup_vs_disk_cold": res_cold / res_mem,
            "restore_speedup_vs_disk_warm": res_warm / res_mem,
            "state_file_bytes": path.stat().st_size,
        }
    finally:
        keeper.kill()
        keeper.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"state {state_bytes / 2**20:.1f} MiB; step median {med['none'] * 1e3:.1f} ms without, "
          f"{med['snapshot'] * 1e3:.1f} ms with a snapshot every step: overhead {overhead * 100:+.2f} % "
          f"(copy {copy_s * 1e3:.1f} ms in the background, trainer blocked {blocked_s * 1e3:.2f} ms)")
    print(f"restore: memory {res_mem * 1e3:.1f} ms, disk cold {res_cold * 1e3:.1f} ms "
          f"({res_cold / res_mem:.1f}x), disk warm {res_warm * 1e3:.1f} ms ({res_warm / res_mem:.1f}x)")
    print(f"restore via checkpoint_store (find_latest verifies CRC32, cold): "
          f"{out['restore_disk_verified_cold_seconds_median'] * 1e3:.1f} ms "
          f"({out['restore_speedup_vs_disk_verified_cold']:.1f}x)")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
