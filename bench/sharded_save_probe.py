"""One job (torchrun, 4 ranks, HSDP 2x2): jitckpt's JIT save of an FSDP2 state against DCP ``save`` of
the same state, interleaved, each timed on its slowest rank (bench/bench_sharded.py).

The JIT save is the one after a failure: rank 3 is lost (it writes nothing), its replica partner
(rank 1) writes its own half of their shard and then rank 3's, ranks 0 and 2 their halves of the
other shard (:mod:`jitckpt.runtime.shard_parts`). The floor beside it: the same bytes per rank as
plain fsynced files, all ranks at once (the partner's whole shard is what a failure makes it
write; DCP, every rank alive, writes half a shard on each rank). ``split``: jitckpt's save with
every rank alive (a preemption, a periodic save), half a shard each, as DCP."""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
import train_ddp  # noqa: E402

from jitckpt.checkpoint_store import write_checkpoint  # noqa: E402
from jitckpt.runtime.protected_state import Protected  # noqa: E402
from jitckpt.runtime.shard_parts import PartFill  # noqa: E402


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sys.argv = [sys.argv[0], "--in-dim", "1024", "--hidden", "2048", "--layers", "2", "--out-dim", "1024"]
    margs = train_ddp.parse()
    model = train_ddp.shard_fsdp2(train_ddp.build(margs), world, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 1024), torch.randn(32, 1024)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    state = Protected(model, opt)
    pos = state.sharded.position
    local = [t.to_local() if hasattr(t, "to_local") else t for t in state.sharded.tensors.values()]
    local += [v.to_local() if hasattr(v, "to_local") else v for st in opt.state.values() for v in st.values()]
    blob = b"".join(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() for t in local)
    lost = 3
    partner = next(r for r in pos.replica_ranks if r != lost) if lost in pos.replica_ranks else None
    jit, split, ref, floor = [], [], [], []

    def save(root: Path, i: int, replica: Optional[int]) -> tuple:
        part = pos.replica_id if replica is None else replica
        shard_id, num_shards = state.sharded.select_part(part)
        return write_checkpoint(root, state.save, kind="jit", step=i, rank=rank, world_size=world, gen=0,
                                shard_id=shard_id, num_shards=num_shards, fsync=True,
                                part=None if replica is None else shard_id)

    def jit_save(i: int) -> float:  # after rank 3's loss
        root = Path(args.dir) / "jit"
        dist.barrier()
        t0 = time.perf_counter()
        if rank != lost:
            fill = PartFill(root=str(root), gen=0, step=i, replica=pos.replica_id, replica_ranks=pos.replica_ranks,
                            on_this_node=lambda r: True, lost=lambda: {lost})
            fill.write(lambda replica: save(root, i, replica))
        return slowest(time.perf_counter() - t0)

    def split_save(i: int) -> float:  # every rank alive: its own part only
        dist.barrier()
        t0 = time.perf_counter()
        save(Path(args.dir) / "split", i, None)
        return slowest(time.perf_counter() - t0)

    mine = b"" if rank == lost else blob if rank == partner else blob[: len(blob) // 2]
    for i in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        with open(Path(args.dir) / f"raw-{rank}-{i}", "wb") as f:
            f.write(mine)
            f.flush()
            os.fsync(f.fileno())
        floor.append(slowest(time.perf_counter() - t0))
        jit.append(jit_save(i))
        split.append(split_save(i))
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(args.dir) / f"dcp-{i}"))
        ref.append(slowest(time.perf_counter() - t0))
    if rank == 0:
        nbytes = sum(p.numel() * p.element_size() for p in msd.values()) * 3  # params + Adam's two moments
        Path(args.out).write_text(json.dumps({"jit_s": statistics.median(jit), "dcp_s": statistics.median(ref),
                                              "floor_s": statistics.median(floor), "split_s": statistics.median(split),
                                              "split_runs": split, "jit_runs": jit, "dcp_runs": ref,
                                              "floor_runs": floor, "state_bytes_whole": nbytes,
                                              "shard_bytes_per_rank": len(blob),
                                              "floor": "rank 3 lost: rank 1 its whole shard, ranks 0 and 2 half one"}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
