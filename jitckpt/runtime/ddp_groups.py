"""Which ranks are replicas when DDP runs over a sub-group: pipeline stages, each a plain module in
DDP over its own data-parallel group (Megatron-style PP x DP, no DTensor); and, without DDP, which
ranks hold the same parameters (stages without data parallelism are shards of their own).

The ranks of one DDP group hold the same state; the groups hold different state (one stage
each). Without this, ``protect()`` took every rank for a replica of every other, and a stage
resumed from another stage's checkpoint. Each DDP group becomes a shard (``shard_id`` = its rank
in the order of the groups' lowest ranks). The groups are compared as membership masks in one
all-gather of int64 tensors: nothing is pickled.
"""
from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist


class DdpGroupError(ValueError):
    """The DDP groups of a job do not split it into disjoint replica groups."""


def _cpu_group() -> Any:
    """A group that runs collectives of CPU tensors: the default one unless it has no gloo (NCCL)."""
    return None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")


def _digest(model: torch.nn.Module) -> torch.Tensor:
    """This rank's state as two int64: the names, shapes and dtypes of its state dict, and the
    bytes of its parameters (integer sums: exact, whatever the summation order). Buffers are left
    out of the second: replicas may hold their own (BatchNorm statistics without DDP)."""
    sd = model.state_dict(keep_vars=True)
    structure = zlib.crc32(";".join(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in sd.items()
                                    if isinstance(v, torch.Tensor)).encode())
    content = 0
    for _, p in model.named_parameters():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(p.element_size())
        if ints is None or p.numel() == 0 or p.is_meta:
            continue
        total = int(torch.sum(p.detach().contiguous().view(ints), dtype=torch.int64))
        content = (content * 1000003 + total) % (1 << 61)
    return torch.tensor([structure, content], dtype=torch.int64)


def _plain_shards(model: torch.nn.Module, group: Any) -> Optional[tuple[int, int]]:
    """No DDP anywhere: the ranks are replicas when their state is the same (see :func:`_digest`);
    otherwise each distinct state is a shard of its own, held by the ranks that have it (pipeline
    stages as plain modules). None: every rank is a replica."""
    mine = _digest(model)
    every = [torch.empty(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=group)
    rows = list(dict.fromkeys(tuple(int(v) for v in d) for d in every))  # in the order of their lowest rank
    if len(rows) == 1:
        return None
    return rows.index(tuple(int(v) for v in mine)), len(rows)


def ddp_shards(model: Any) -> Optional[tuple[int, int]]:
    """Collective: (shard_id, num_shards) when the ranks do not all hold the same state, else
    None. With DDP modules, each DDP group is a shard when the groups are smaller than the job;
    DdpGroupError (every rank alike) when the groups overlap, leave ranks out, or one rank's
    modules use different groups. Without DDP and DTensor anywhere, ranks whose parameters differ
    at protect() are shards of their own (:func:`_plain_shards`)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not (dist.is_available() and dist.is_initialized()) or not isinstance(model, torch.nn.Module):
        return None
    world = dist.get_world_size()
    if world == 1:
        return None
    group = _cpu_group()
    groups = {tuple(sorted(dist.get_process_group_ranks(m.process_group)))
              for m in model.modules() if isinstance(m, DDP)}
    # Every rank takes part, also one without DDP or with several groups: the verdict is shared.
    mask = torch.zeros(world, dtype=torch.int64)
    if len(groups) == 1:
        mask[list(next(iter(groups)))] = 1
    elif groups:
        mask[:] = -1
    masks = [torch.empty(world, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(masks, mask, group=group)
    rows = {tuple(int(v) for v in m) for m in masks}
    if all(sum(r) == world for r in rows):
        return None  # DDP over the whole job: every rank is a replica
    if not groups and all(sum(r) == 0 for r in rows):
        from jitckpt.runtime.sharded_layout import dtensor_layout

        # DTensor models (FSDP2, TP) map their shards themselves, from their meshes.
        return None if dtensor_layout(model) is not None else _plain_shards(model, group)
    if any(-1 in r for r in rows):
        raise DdpGroupError("jitckpt.protect(): a rank's model holds DDP modules over different process groups; "
                            "pass shard_id/num_shards (ranks with the same shard_id hold the same state)")
    distinct = sorted(rows, key=lambda r: r.index(1) if 1 in r else world)
    if any(sum(r[i] for r in distinct) != 1 for i in range(world)):  # each rank in exactly one group
        found = [[i for i, v in enumerate(r) if v] for r in distinct if any(r)]
        raise DdpGroupError("jitckpt.protect(): the DDP process groups of the ranks do not split the job into "
                            f"disjoint groups (found {found}; ranks without DDP: "
                            f"{[i for i in range(world) if all(not r[i] for r in distinct)]}); pass "
                            "shard_id/num_shards (ranks with the same shard_id hold the same state)")
    return distinct.index(tuple(int(v) for v in mask)), len(distinct)
