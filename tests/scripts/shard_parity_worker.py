"""One rank of tests/test_shard_parity.py: ShardSnapshots of uneven made-up shards with
``--snapshot-protection`` ``--scheme``, written for steps 1..N (--steps), or (--restore) surveyed,
loaded and compared bitwise with what was written. Events are JSON lines on stdout; the process
exits when its stdin closes."""
import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from jitckpt.snapshot.shard_snapshots import ShardSnapshots


def shard(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 1000 + 337 * rank  # uneven shards: the parity pads them to one size
    return {"model": {"w": torch.randn(n, generator=g)},
            "optim": {"w": {"exp_avg": torch.randn(n // 2 + rank, generator=g, dtype=torch.float64)}},
            "step": step, "rng": {"torch": torch.arange(256, dtype=torch.uint8)}}


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def event(name: str, **kw) -> None:
    print(json.dumps({"event": name, "rank": dist.get_rank(), **kw}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scheme", required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--timeout", type=float, default=40)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--restore", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    snaps = ShardSnapshots(socket_path=os.environ["JITCKPT_SNAPSHOT_SOCKET"], every=1,
                           ranks_per_node=a.ranks_per_node, shard_id=rank, num_shards=world, replica_id=0,
                           mesh="parity-test", protection=a.scheme)
    if not a.restore:
        for step in range(1, a.steps + 1):
            snaps.take(step, shard(step, rank))
            snaps.agree_begin(step)
            snaps.agree_wait()
        event("paused", snapshot=a.steps, bytes=snaps.bytes_written)
    else:
        choice = snaps.survey()
        if choice is None:
            event("restored", step=None)
        else:
            got, how = snaps.load(choice)
            event("restored", step=choice.step, how=how, equal=equal(got, shard(choice.step, rank)))
        snaps.settle(-1 if choice is None else choice.step)
    event("done")
    sys.stdin.read()
    snaps.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
