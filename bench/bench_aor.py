"""AOR (ZeRO-1 optimizer partition protection) cost on the training step, measured in one run (CPU, gloo).

Two rank processes, each with its own snapshot keeper (two simulated nodes), train an MLP with
ZeroRedundancyOptimizer(Adam). Blocks of 10 steps rotate through the modes, so load drifts on this
shared machine hit all alike:

* ``none``: no protection;
* ``recompute@N``: REFT's AOR, ``OptimizerReplica.capture()`` every step (the peer partition's
  gradients copied, its optimizer step recomputed on a worker thread) plus ``AorSnapshotter``
  writing both partitions to the keeper at every N-th step;
* ``copy@N``: ``PartitionCopier``, which at every N-th step sends this rank's partition to its
  protector and writes its own and the received one to the keeper (no recompute);
* ``log+copy@N``: AOR's log mode (:mod:`jitckpt.snapshot.aor_log`), a partition current at every
  step: ``copy@N``, plus :class:`GradientLog` writing every step the peer partition's all-reduced
  gradients (hashed) into its keeper ring, and at each copy the peer partition's parameters (the
  replay's base). A restore replays at most N optimizer steps onto the last copy (its time is in
  tests/test_snapshot_aor.py's restore event, not here). One log (ring of 20) serves both N: the
  per-step write is the same.

With N = 10 the snapshot is the block's step 5 (N = 20: every other block's). The first step of each block is not counted (the
previous block's last recompute may still run in it); a block's cost is the mean of its other
steps, a mode's the median of its blocks. A step is zero_grad + forward + backward + one flat
gradient all-reduce + [capture] + zero.step(). Also reported per rank: the gradient copy per
capture, the recompute's CPU time per update, the copy's exchange time and bytes per snapshot,
and each mode's own CPU work as a share of a step (the ceiling: on 2 busy cores nothing hides
it). Parameter snapshots are not included (bench_snapshot.py). The replica's state is not checked
here (the rotation skips updates); tests/test_snapshot_aor.py checks exactness of both modes.

Usage: python bench/bench_aor.py [--hidden 1024 --layers 4 --rounds 4] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench_snapshot import start_keeper  # noqa: E402  (this directory is on sys.path)

BLOCK = 10
MODES = ("none", "recompute@1", "copy@1", "recompute@10", "copy@10", "log+copy@10", "log+copy@20")
LOG_RING = 10  # copy interval the ring is sized for (2 * 10 slots); the per-step write is the same
RECOMPUTE_BASE = 1_000_000  # the replica's step numbers: never a copy step's (same keeper keys)


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from jitckpt.snapshot.aor import OptimizerReplica, successor_peer
    from jitckpt.snapshot.aor_log import GradientLog
    from jitckpt.snapshot.aor_store import AorSnapshotter, PartitionCopier

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    sock = os.environ["JITCKPT_SNAPSHOT_SOCKET"]
    torch.manual_seed(0)
    mods: list = []
    for _ in range(args.layers):
        mods += [nn.Linear(args.hidden, args.hidden), nn.Tanh()]
    model = nn.Sequential(*mods)
    params = list(model.parameters())
    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=1e-4)
    replica = OptimizerReplica(zero=zero, peer=successor_peer(rank, world, 1), start_step=RECOMPUTE_BASE)
    writer = AorSnapshotter(replica=replica, socket_path=sock)
    copier = PartitionCopier(zero=zero, ranks_per_node=1, socket_path=sock)
    log = GradientLog(zero=zero, peer=replica.peer, every=LOG_RING, socket_path=sock)
    # Map every buffer of the ring (two versions per key) before anything is timed: a real log maps
    # each once in its first 2 * ring steps, and each first mapping costs ~5 ms here (MAP_POPULATE).
    for p in params:
        p.grad = torch.zeros_like(p)
    for k in range(2 * LOG_RING):
        log.capture(k)
    for k in range(2):
        log.begin(k)
    log.wait()
    log.writes, log.write_seconds, log.cpu_seconds, log.blocked_seconds = 0, 0.0, 0.0, 0.0
    log_base = 2 * LOG_RING  # the timed steps' numbers in the log: after the warm-up's
    log_steps = 0
    blocks: dict = {m: [] for m in MODES}
    snaps = {"recompute": 0, "copy": 0, "log+copy": 0}
    seen = {m: 0 for m in MODES}  # steps run in each mode: its copy steps are every N of them
    cycle = [m for m in MODES]
    for step in range(BLOCK * len(MODES) * (args.rounds + 1)):
        b, i = divmod(step, BLOCK)
        mode = cycle[b % len(cycle)]
        kind, _, every = mode.partition("@")
        n = int(every or 1)
        snap = kind != "none" and seen[mode] % n == (n // 2 if n > 1 else 0)
        seen[mode] += 1
        if i == 0:
            times: list = []
        x = torch.randn(32, args.hidden)
        t0 = time.perf_counter()
        aor = writer if kind == "recompute" else copier  # log+copy: the copier at its snapshots
        if snap:
            aor.begin(replica.step if kind == "recompute" else step)
            if kind == "log+copy":
                log.begin(log_base + step)
            snaps[kind] += 1
        zero.zero_grad()
        model(x).square().mean().backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        if snap:
            aor.wait()
        if kind == "recompute":
            replica.capture()
        if kind == "log+copy":
            log.capture(log_base + step)
            log_steps += 1
        zero.step()
        if i:
            times.append(time.perf_counter() - t0)
        if i == BLOCK - 1 and b >= len(MODES):  # the first round warms allocators, keepers, workers
            blocks[mode].append(statistics.fmean(times))
    log.wait()
    log_timed = (log.write_seconds, log.cpu_seconds, log.blocked_seconds)
    # Each mode's per-snapshot work alone on an idle machine (both ranks only do this): the
    # ceilings' terms, free of the time-slicing with the trainer that the in-training times hold.
    idle = {"recompute": [], "copy": [], "log": []}
    for k in range(5):
        replica.capture()
        replica.state_dict()  # the update done: time the write alone
        dist.barrier()
        t0 = time.perf_counter()
        writer.begin(replica.step)
        writer.wait()
        idle["recompute"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        copier.begin(RECOMPUTE_BASE // 2 + k)
        copier.wait()
        idle["copy"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        log.capture(log_base + BLOCK * len(MODES) * (args.rounds + 1) + k)
        log.wait()
        idle["log"].append(time.perf_counter() - t0)
    writer.close()
    copier.close()
    log.close()
    replica.close()
    st = replica.stats
    n = max(st.updates, 1)
    print(json.dumps({
        "rank": rank, "params": sum(p.numel() for p in params),
        "peer_params": sum(p.numel() for ps in replica.live for p in ps),
        "step_s": {m: statistics.median(v) for m, v in blocks.items()},
        "copy_ms_per_capture": 1e3 * st.copy_seconds / n,
        "blocked_ms_per_capture": 1e3 * st.blocked_seconds / n,
        "update_ms_per_update": 1e3 * st.update_seconds / n,
        "update_cpu_ms_per_update": 1e3 * st.update_cpu_seconds / n,
        "recompute_write_ms_per_snapshot": 1e3 * writer.write_seconds / max(snaps["recompute"], 1),
        "copy_exchange_ms_per_snapshot": 1e3 * copier.write_seconds / max(snaps["copy"] + snaps["log+copy"], 1),
        # per logged step: its gradient entry, and the bases of its copy steps
        "log_write_ms_per_step": 1e3 * log_timed[0] / max(log_steps, 1),
        "log_write_cpu_ms_per_step": 1e3 * log_timed[1] / max(log_steps, 1),
        "log_blocked_ms_per_step": 1e3 * log_timed[2] / max(log_steps, 1),
        "log_write_idle_ms": 1e3 * statistics.median(idle["log"]),
        "recompute_write_idle_ms": 1e3 * statistics.median(idle["recompute"]),
        "copy_exchange_idle_ms": 1e3 * statistics.median(idle["copy"]),
        "copy_bytes_received_per_snapshot": copier.bytes_received / max(snaps["copy"] + 5, 1),
    }), flush=True)
    dist.destroy_process_group()


def derive(o: dict) -> None:
    """Each mode's overhead over ``none`` and its own work as a share of a step (percent)."""
    none = o["step_s"]["none"]
    o["overhead_pct"] = {m: 100.0 * (t / none - 1.0) for m, t in o["step_s"].items() if m != "none"}
    # The ceilings: each mode's own work per step (the recompute's CPU time; the writes and the
    # exchange timed alone on the idle machine). With every core busy training, as here, nothing
    # can hide it; REFT's ~0.6 % for recompute needs host cores idle while devices compute.
    recompute = o["copy_ms_per_capture"] + o["update_cpu_ms_per_update"]
    o["work_pct_of_step"] = {
        f"recompute@{n}": 100.0 * (recompute + o["recompute_write_idle_ms"] / n) / (1e3 * none)
        for n in (1, 10)} | {
        f"copy@{n}": 100.0 * o["copy_exchange_idle_ms"] / n / (1e3 * none) for n in (1, 10)} | {
        # the log's writes (its worker's CPU time in training), plus copy@N's exchange
        f"log+copy@{n}": 100.0 * (o["log_write_cpu_ms_per_step"] + o["copy_exchange_idle_ms"] / n) / (1e3 * none)
        for n in (10, 20)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="blocks of 10 steps per mode (after one warm-up round)")
    p.add_argument("--out", default="")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.rank:
        rank_main(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "JITCKPT_SNAPSHOT_RANKS_PER_NODE": "1"}
    argv = [sys.executable, __file__, "--rank", "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--rounds", str(args.rounds)]
    with tempfile.TemporaryDirectory(prefix="jitckpt-aor-") as tmp:
        socks = [os.path.join(tmp, f"keeper{r}.sock") for r in range(2)]
        procs = [start_keeper(sock, r) for r, sock in enumerate(socks)]
        try:
            ranks = [subprocess.Popen(argv, env={**env, "RANK": str(r), "JITCKPT_SNAPSHOT_SOCKET": socks[r]},
                                      stdout=subprocess.PIPE, text=True) for r in range(2)]
            procs += ranks
            outs = [json.loads(pr.communicate(timeout=600)[0].strip().splitlines()[-1]) for pr in ranks]
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
                pr.wait(10)
    for o in outs:
        derive(o)
    result = {"config": vars(args) | {"rank": None}, "modes": list(MODES), "ranks": outs,
              "overhead_pct": {m: statistics.median(o["overhead_pct"][m] for o in outs) for m in MODES[1:]},
              "work_pct_of_step": {m: statistics.median(o["work_pct_of_step"][m] for o in outs) for m in MODES[1:]},
              "load_average": os.getloadavg()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
