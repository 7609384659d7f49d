"""Deterministic data-parallel training with in-memory snapshots (used by tests and the demo).

Each process is one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) and
talks to its node's keeper at $JITCKPT_SNAPSHOT_SOCKET. Gradients are averaged with one
all-reduce of the flattened gradients in a fixed order, so a resumed run is bitwise identical to
an uninterrupted one. Prints one JSON line per event on stdout.
"""
import argparse
import datetime
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from jitckpt.snapshot.client import SnapshotTaker
from jitckpt.snapshot.restore import restore


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--scheme", default="aec", choices=["none", "arc", "aec"])
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--flush-every", type=int, default=0)
    p.add_argument("--ckpt", default="", help="checkpoint root (disk tier)")
    p.add_argument("--restore", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--pause-at", type=int, default=-1,
                   help="after committing step N's snapshot, print 'paused' and block on stdin (the "
                        "test kills a node there)")
    p.add_argument("--pause-mid", type=int, default=-1,
                   help="in step N, before waiting for its snapshot (the copy may still be running), "
                        "print 'paused' and block on stdin")
    return p.parse_args()


def emit(**kw):
    print(json.dumps(kw), flush=True)


def make_model(hidden):
    """The deterministic MLP of the snapshot examples (seeded by the caller)."""
    return nn.Sequential(nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 8))


def backward_averaged(model, step, rank, world, batch, snap):
    """Step ``step``'s deterministic batch, backward, gradients averaged by one flat all-reduce in a
    fixed order (announced to ``snap`` as an idle window); returns the detached loss."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch, 32, generator=g)
    y = torch.randn(batch, 8, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    with snap.idle():
        dist.all_reduce(flat)
    flat /= world
    off = 0
    for p in model.parameters():
        p.grad.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()
    return loss.detach()


def main():
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model(args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    start = 0
    if args.restore:
        res = restore(ranks_per_node=args.ranks_per_node, checkpoint_dir=args.ckpt or None)
        if res.state is not None:
            model.load_state_dict(res.state["model"])
            opt.load_state_dict(res.state["optimizer"])
            start = int(res.state["step"])
        emit(event="restored", rank=rank, source=res.source, step=res.step, decoded=res.decoded,
             remote=res.remote, seconds=res.seconds, skipped=[list(s) for s in res.skipped])
    step = start
    snap = SnapshotTaker(state_fn=lambda: {"step": step, "model": model.state_dict(),
                                           "optimizer": opt.state_dict()},
                         scheme=args.scheme, every=args.every, ranks_per_node=args.ranks_per_node,
                         flush_dir=args.ckpt or None, flush_every=args.flush_every)
    if args.restore and start:
        snap.skip(start)
    for step in range(start, args.steps):
        snap.begin(step)
        opt.zero_grad()
        loss = backward_averaged(model, step, rank, world, args.batch, snap)
        if step == args.pause_mid:
            emit(event="paused", rank=rank, step=step, snapshot=None)
            sys.stdin.read()
        committed = snap.wait()
        if step == args.pause_at:
            emit(event="paused", rank=rank, step=step, snapshot=committed)
            sys.stdin.read()
        opt.step()
        emit(event="step", rank=rank, step=step, snapshot=committed, loss=loss.item())
    snap.close()
    if args.out and rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    emit(event="done", rank=rank, stats={"taken": snap.stats.taken, "flushed": snap.stats.flushed,
                                         "chunks": snap.stats.chunks})
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
