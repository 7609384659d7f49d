"""In-memory restore with several ranks on one node (issue 19): what each rank pays, measured in one run.

Two ranks (gloo, CPU, ``torch.set_num_threads(1)``) hold the same MLP + Adam as bench_snapshot.py and
snapshot it once through one keeper (scheme none: each rank writes its part of the flat state).
Then, repetitions interleaved, every rank at once:

* memory: ``restore(into=<the live state>, keeper=<a client that mapped the keeper's buffers
  ahead>)``, as the warm standbys of a one-node job hold it (collective: each rank verifies its
  share of the keeper's objects, the ranks agree on the step, then every rank copies every object
  from the node's keeper straight into its model and optimizer and checks its share for NaN/Inf)
  + ``load_state_dict`` (which then copies nothing);
* memory_cold_map: the same with a fresh keeper client, which maps the buffers in the call;
* memory_private: ``restore()`` without ``into`` (a private copy assembled from the objects) +
  ``load_state_dict``;
* disk warm: ``torch.load(weights_only=True)`` of the same state from a page-cached file +
  ``load_state_dict``;
* one memcpy of the state's bytes into faulted memory (the ceiling of any one-copy restore);
* memcpy_agreed: the same memcpy, then one all-reduce of a few integers (the ceiling of a
  one-copy restore whose ranks must agree on the verdict; it includes their skew).

Medians over repetitions of rank 0's times (the ranks restore together), and every trial. Results as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_snapshot import build, med, start_keeper, state_of, timed  # noqa: E402


def _rank(rank: int, world: int, nodes: int, socks: list, port: int, tmp: str, trials: int, out: str) -> None:
    from jitckpt.snapshot.client import SnapshotTaker
    from jitckpt.snapshot.keeper_client import KeeperClient
    from jitckpt.snapshot.restore import restore

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = build(1024, 4)
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    rpn = world // nodes
    sock = socks[rank // rpn]  # this rank's node's keeper
    snap = SnapshotTaker(state_fn=lambda: state_of(7, model, opt), socket_path=sock, scheme="none",
                         ranks_per_node=rpn)
    assert snap.begin(7) and snap.wait() == 7
    snap.close()
    path = Path(tmp) / f"state{rank}.pt"
    torch.save(state_of(7, model, opt), path)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))
    src = np.random.default_rng(rank).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)

    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])

    premapped = KeeperClient(sock)  # as a one-node job's warm standby holds it (jitckpt.snapshot.premap)
    premapped.premap()

    def memory(direct: bool, keeper: Optional[KeeperClient] = None) -> None:
        into = state_of(0, model, opt) if direct else None  # the live tensors, as protect() passes them
        res = restore(socket_path=sock, ranks_per_node=rpn, into=into, keeper=keeper)
        assert (res.source, res.step) == ("memory", 7), (res.source, res.step, res.skipped)
        assert res.mapped_ahead == (keeper is not None)
        load(res.state)

    def copy_and_agree() -> None:
        np.copyto(dst, src)
        dist.all_reduce(torch.ones(5, dtype=torch.int64), op=dist.ReduceOp.MIN)

    # Several nodes: every data part crosses the process group from the rank holding it (the
    # other nodes' parts must; a one-copy restore cannot do with fewer bytes over the network).
    part = -(-nbytes // world)
    received = torch.empty(part, dtype=torch.uint8)

    def copy_and_transfer() -> None:
        np.copyto(dst, src)
        for holder in range(world):
            dist.broadcast(received, src=holder)

    variants = {"memory": lambda: memory(True, premapped), "memory_private": lambda: memory(False),
                "disk_warm": lambda: load(torch.load(path, map_location="cpu", weights_only=True)),
                "memcpy": lambda: np.copyto(dst, src)}
    if nodes == 1:
        variants.update(memory_cold_map=lambda: memory(True), memcpy_agreed=copy_and_agree)
    else:
        variants.update(memcpy_transfer=copy_and_transfer)
    times: dict = {k: [] for k in variants}
    names = list(variants)
    def settle() -> None:
        """The previous variant's mappings are unmapped (or populated) on helper threads: let them
        finish, so that no variant pays for another's (a restarted rank has none running)."""
        for t in threading.enumerate():
            if t.name.startswith("jitckpt-keeper-"):
                t.join(timeout=10)

    for i in range(trials + 1):
        for name in names[i % len(names):] + names[:i % len(names)]:
            settle()
            dist.barrier()  # every rank starts each variant together
            t, _ = timed(variants[name])
            if i:  # trial 0 warms up
                times[name].append(t)
    premapped.close()
    if rank == 0:
        m = {k: med(v) for k, v in times.items()}
        result = {"what": f"issue 19: in-memory restore with {world} ranks on {nodes} node(s)",
                  "ranks": world, "nodes": nodes, "state_bytes_per_rank": nbytes, "seconds_median": m,
                  "memory_over_one_memcpy": m["memory"] / m["memcpy"],
                  "memory_private_over_one_memcpy": m["memory_private"] / m["memcpy"],
                  "memory_speedup_vs_disk_warm": m["disk_warm"] / m["memory"]}
        if nodes == 1:
            result.update(memory_over_memcpy_agreed=m["memory"] / m["memcpy_agreed"],
                          memory_cold_map_over_one_memcpy=m["memory_cold_map"] / m["memcpy"])
        else:
            result.update(memory_over_memcpy_transfer=m["memory"] / m["memcpy_transfer"])
        result["seconds_all"] = times  # every trial: the spread is as telling as the medians
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1,
                    help="simulated nodes, each with its own keeper (the ranks split evenly among them)")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--out", default=None, help="default: bench/results/restore_ranks.json "
                    "(one node) or restore_nodes.json")
    a = ap.parse_args()
    if a.nodes < 1 or a.ranks % a.nodes:
        ap.error(f"--ranks {a.ranks} do not split evenly over --nodes {a.nodes}")
    a.out = a.out or str(ROOT / "bench" / "results" / ("restore_ranks.json" if a.nodes == 1 else "restore_nodes.json"))
    tmp = tempfile.mkdtemp(prefix="restorebench", dir="/tmp")
    socks = [str(Path(tmp) / f"k{n}.sock") for n in range(a.nodes)]
    keepers = []
    try:
        keepers += [start_keeper(sock) for sock in socks]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(a.ranks, a.nodes, socks, port, tmp, a.trials, a.out), nprocs=a.ranks)
    finally:
        for keeper in keepers:
            keeper.kill()
            keeper.wait(timeout=10)
    d = json.loads(Path(a.out).read_text())
    m = d["seconds_median"]
    if a.nodes > 1:
        print(f"{a.ranks} ranks on {a.nodes} nodes, {d['state_bytes_per_rank'] / 2**20:.1f} MiB of state each: "
              f"restore + load_state_dict {m['memory'] * 1e3:.1f} ms = {d['memory_over_one_memcpy']:.2f}x one memcpy "
              f"({m['memcpy'] * 1e3:.1f} ms), {d['memory_over_memcpy_transfer']:.2f}x one memcpy + every part "
              f"broadcast from its holder ({m['memcpy_transfer'] * 1e3:.1f} ms); page-cached torch.load + "
              f"load_state_dict {m['disk_warm'] * 1e3:.1f} ms ({d['memory_speedup_vs_disk_warm']:.2f}x); "
              f"without into (private copy) {m['memory_private'] * 1e3:.1f} ms "
              f"({d['memory_private_over_one_memcpy']:.2f}x)")
        print(f"wrote {a.out}")
        return 0
    print(f"{a.ranks} ranks on one node, {d['state_bytes_per_rank'] / 2**20:.1f} MiB of state each: restore + "
          f"load_state_dict {m['memory'] * 1e3:.1f} ms = {d['memory_over_one_memcpy']:.2f}x one memcpy "
          f"({m['memcpy'] * 1e3:.1f} ms), {d['memory_over_memcpy_agreed']:.2f}x one memcpy + one all-reduce "
          f"({m['memcpy_agreed'] * 1e3:.1f} ms); page-cached torch.load + load_state_dict {m['disk_warm'] * 1e3:.1f} ms "
          f"({d['memory_speedup_vs_disk_warm']:.2f}x); mapping in the call {m['memory_cold_map'] * 1e3:.1f} ms "
          f"({d['memory_cold_map_over_one_memcpy']:.2f}x); private copy {m['memory_private'] * 1e3:.1f} ms "
          f"({d['memory_private_over_one_memcpy']:.2f}x)")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
