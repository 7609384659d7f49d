"""Which ranks are replicas when DDP runs over a sub-group: pipeline stages, each a plain module in
DDP over its own data-parallel group (Megatron-style PP x DP, no DTensor).

The ranks of one DDP group hold the same state; the groups hold different state (one stage
each). Without this, ``protect()`` took every rank for a replica of every other, and a stage
resumed from another stage's checkpoint. Each DDP group becomes a shard (``shard_id`` = its rank
in the order of the groups' lowest ranks). The groups are compared as membership masks in one
all-gather of int64 tensors: nothing is pickled.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


class DdpGroupError(ValueError):
    """The DDP groups of a job do not split it into disjoint replica groups."""


def ddp_shards(model: Any) -> Optional[tuple[int, int]]:
    """Collective when ``model`` holds DDP modules: (shard_id, num_shards) when its DDP group is
    smaller than the job, else None. DdpGroupError (every rank alike) when the groups overlap,
    leave ranks out, or one rank's modules use different groups."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not (dist.is_available() and dist.is_initialized()) or not isinstance(model, torch.nn.Module):
        return None
    world = dist.get_world_size()
    groups = {tuple(sorted(dist.get_process_group_ranks(m.process_group)))
              for m in model.modules() if isinstance(m, DDP)}
    # Every rank takes part, also one without DDP or with several groups: the verdict is shared.
    mask = torch.zeros(world, dtype=torch.int64)
    if len(groups) == 1:
        mask[list(next(iter(groups)))] = 1
    elif groups:
        mask[:] = -1
    masks = [torch.empty(world, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(masks, mask)
    rows = {tuple(int(v) for v in m) for m in masks}
    if all(sum(r) == world for r in rows) or not groups and all(sum(r) == 0 for r in rows):
        return None  # DDP over the whole job (or none): every rank is a replica
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
