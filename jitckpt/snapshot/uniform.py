"""Make the per-rank parts of a snapshot state the same on every rank (rank 0's).

ARC and AEC protect a node's shard with bytes the *other* nodes copy from their own replica of the
state (:mod:`jitckpt.snapshot.protection`): they assume every rank's flat state is byte for byte
the same. Parameters and optimizer state are (data parallelism keeps them so); RNG states are not
when a script seeds by rank, nor are buffers without DDP's ``broadcast_buffers``, nor a per-rank
object in ``extra``. With AEC an XOR decode then mixes two ranks' different bytes, and the error
lands in *another* region of the decoded shard, at the same offset: a lost node came back with
garbage parameters (found from outside: ZeRO + rank-seeded dropout, three nodes, AEC). So before
a snapshot is flattened, every tensor outside the replicated parts is replaced by rank 0's, in one
broadcast: the snapshot then holds one replica's per-rank state, as a JIT checkpoint does (every
rank resumes with the loaded replica's RNG and buffers).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from jitckpt.snapshot.layout import FlatState, rebuild


def share_rank0(parts: list, *, group: Any = None) -> list:
    """Collective: ``parts`` (state subtrees with the same tensor shapes on every rank) with every
    tensor leaf replaced by a new tensor holding rank 0's values; other leaves are this rank's.
    The subtrees are laid out as a snapshot is (:class:`FlatState`), rank 0's bytes broadcast in
    one piece, and the trees rebuilt over them; the live tensors are not touched."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return parts
    flat = FlatState(parts)
    if not flat.tensors:
        return parts
    buf = torch.empty(flat.total, dtype=torch.uint8)
    flat.read_into(0, buf)
    dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return rebuild(flat.layout, buf.numpy())
