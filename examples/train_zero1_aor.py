"""Deterministic ZeRO-1 training with in-memory snapshots protected by AOR (used by the tests).

Each process is one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) and talks
to its node's keeper at $JITCKPT_SNAPSHOT_SOCKET. The optimizer is a ZeroRedundancyOptimizer
(Adam), so each rank holds one partition of the optimizer state; parameters go to the keepers
through SnapshotTaker (arc/aec), partitions through AOR. Gradients are averaged with one
all-reduce of the flattened gradients in a fixed order. Prints one JSON line per event on stdout.
"""
import argparse
import datetime
import hashlib
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from jitckpt.snapshot.aor import OptimizerReplica, ReplicaStats, successor_peer
from jitckpt.snapshot.aor_log import GradientLog
from jitckpt.snapshot.aor_store import AorSnapshotter, PartitionCopier, restore_with_aor, save_own_partition
from jitckpt.snapshot.client import SnapshotTaker
from train_snapshot import backward_averaged, make_model  # same directory: on sys.path


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--scheme", default="aec", choices=["arc", "aec"])
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--zero", default="recompute", choices=["recompute", "copy", "log"],
                   help="protect the peer's partition by recomputing it every step (OptimizerReplica), "
                        "by receiving it at every snapshot (PartitionCopier), or by receiving it every "
                        "--copy-every snapshots and logging its gradients in between (GradientLog)")
    p.add_argument("--copy-every", type=int, default=4, help="log mode: the partition copy interval")
    p.add_argument("--restore", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--pause-at", type=int, default=-1,
                   help="after committing step N's snapshot, print 'paused' and block on stdin (log "
                        "mode: each rank first saves its own partition of N, as a survivor would)")
    p.add_argument("--pause-mid", type=int, default=-1,
                   help="in step N, before waiting for its snapshot (parameter and AOR writes may "
                        "still be running), print 'paused' and block on stdin")
    return p.parse_args()


def emit(**kw):
    print(json.dumps(kw), flush=True)


def state_digest(opt) -> str:
    """sha256 of this rank's partition state tensors (compared across runs by the test)."""
    h = hashlib.sha256()
    sd = opt.state_dict()["state"]
    for i in sorted(sd):
        for k in sorted(sd[i]):
            h.update(f"{i}.{k}".encode())
            h.update(sd[i][k].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model(args.hidden)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    peer = successor_peer(rank, world, args.ranks_per_node)
    start, peer_state = 0, None
    if args.restore:
        res = restore_with_aor(zero=zero, peer=peer, ranks_per_node=args.ranks_per_node,
                               model=model if args.zero == "log" else None)
        if res.state is not None:
            model.load_state_dict(res.state["model"])
            start, peer_state = int(res.state["step"]), res.peer_state
        emit(event="restored", rank=rank, source=res.source, step=res.step, own_from=res.own_from,
             remote=res.remote, decoded=res.decoded, replayed=res.replayed, seconds=res.seconds,
             skipped=[list(s) for s in res.skipped])
    replica = None
    if args.zero == "recompute":
        replica = OptimizerReplica(zero=zero, peer=peer, start_step=start)
        if peer_state is not None:
            replica.load_state_dict(peer_state)  # after the parameters: it re-copies the peer's
    step = start
    snap = SnapshotTaker(state_fn=lambda: {"step": step, "model": model.state_dict()},
                         scheme=args.scheme, ranks_per_node=args.ranks_per_node)
    aor = (AorSnapshotter(replica=replica) if replica is not None
           else PartitionCopier(zero=zero, ranks_per_node=args.ranks_per_node))
    grad_log = (GradientLog(zero=zero, peer=peer, every=args.copy_every, start_step=start)
                if args.zero == "log" else None)
    if args.restore and start:
        snap.skip(start)  # the keepers hold it already
    for step in range(start, args.steps):
        # log mode: a copy every --copy-every steps; after a resume, at once (the step after the
        # restored one, whose partition objects exist already), so the new nodes hold a base too
        copy_due = grad_log is None or step % args.copy_every == 0 or (args.restore and step == start + 1)
        if snap.begin(step) and copy_due:
            aor.begin(step)
            if grad_log is not None:
                grad_log.begin(step)
        zero.zero_grad()
        loss = backward_averaged(model, step, rank, world, args.batch, snap)
        if step == args.pause_mid:
            emit(event="paused", rank=rank, step=step, snapshot=None)
            sys.stdin.read()
        aor.wait()           # before snap.wait(): its all-ranks-committed check then covers AOR
        committed = snap.wait()
        if step == args.pause_at:
            if grad_log is not None:
                save_own_partition(zero, step=step)
            emit(event="paused", rank=rank, step=step, snapshot=committed)
            sys.stdin.read()
        if replica is not None:
            replica.capture()
        if grad_log is not None:
            grad_log.capture(step)
        zero.step()
        emit(event="step", rank=rank, step=step, snapshot=committed, loss=loss.item())
    replica_ok = replica.matches_live_parameters() if replica is not None else None
    aor.close()
    snap.close()
    if grad_log is not None:
        grad_log.close()
    if replica is not None:
        replica.close()
    if args.out and rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    st = replica.stats if replica is not None else ReplicaStats()
    emit(event="done", rank=rank, partition_sha256=state_digest(zero.optim), replica_params_ok=replica_ok,
         taken=snap.stats.taken, aor={"bytes": aor.bytes_written, "write_s": aor.write_seconds,
                                      "updates": st.updates, "update_s": st.update_seconds,
                                      "copy_s": st.copy_seconds, "blocked_s": st.blocked_seconds})
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
