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

from typing import Any, Callable

import torch
import torch.distributed as dist


def _leaves(obj: Any, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, out)


def _replace(obj: Any, take: Callable[[], torch.Tensor]) -> Any:
    """``obj`` with each tensor leaf, in :func:`_leaves` order, replaced by ``take()``."""
    if isinstance(obj, torch.Tensor):
        return take()
    if isinstance(obj, dict):
        try:
            out = type(obj)()
        except TypeError:  # a dict subclass that needs arguments: its items are what count
            out = {}
        for k, v in obj.items():
            out[k] = _replace(v, take)
        if hasattr(obj, "__dict__"):  # OrderedDict's _metadata (state_dict version info)
            out.__dict__.update(obj.__dict__)
        return out
    if isinstance(obj, list):
        return [_replace(v, take) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_replace(v, take) for v in obj)
    return obj


def share_rank0(parts: list, *, group: Any = None) -> list:
    """Collective: ``parts`` (state subtrees with the same tensor shapes on every rank) with every
    tensor leaf replaced by a new tensor holding rank 0's values; other leaves are kept. One
    broadcast of all their bytes; the live tensors are not touched."""
    tensors: list[torch.Tensor] = []
    for p in parts:
        _leaves(p, tensors)
    if not tensors or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return parts
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse:
            raise ValueError(f"snapshot state: a per-rank tensor on {t.device} "
                             f"{'(sparse) ' if t.is_sparse else ''}cannot be snapshotted; keep it on the CPU")
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 8) * 8)  # aligned: a uint8 slice views as any dtype
    flat = torch.zeros(starts[-1], dtype=torch.uint8)
    for t, start, n in zip(tensors, starts, sizes):
        flat[start:start + n] = t.detach().reshape(-1).view(torch.uint8)
    dist.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    it = iter(zip(tensors, starts, sizes))

    def take() -> torch.Tensor:
        t, start, n = next(it)
        return flat[start:start + n].view(t.dtype).reshape(t.shape)

    return [_replace(p, take) for p in parts]
