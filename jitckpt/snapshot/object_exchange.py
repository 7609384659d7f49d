"""One keeper object sent to the rank that protects it while the peer's is received (REFT's ARC).

Rank ``r`` sends its own object to its *protector* and receives its *peer*'s, straight into its node's
keeper (no staging copy), and checks it against the checksum its owner computed while writing it. With
two nodes the protector and the peer are the same rank. Used for ZeRO partitions
(:class:`~jitckpt.snapshot.aor_store.PartitionCopier`) and DTensor shards
(:mod:`jitckpt.snapshot.shard_snapshots`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from jitckpt.snapshot.checksum import Checksum
from jitckpt.snapshot.keeper_client import KeeperClient

MASK64 = (1 << 64) - 1


def _signed(v: int) -> int:
    """An unsigned 64-bit checksum as an int64 tensor element (and back with ``& MASK64``)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _both(send: torch.Tensor, recv: torch.Tensor, *, protector: int, peer: int, group: Any, tag: int) -> None:
    works = [dist.isend(send, dst=protector, group=group, tag=tag), dist.irecv(recv, src=peer, group=group, tag=tag)]
    for w in works:
        w.wait()


def exchange(keeper: KeeperClient, *, own: Any, own_size: int, own_checksum: Checksum, peer_key: str, step: int,
             protector: int, peer: int, group: Any) -> tuple[int, int]:
    """Send this rank's object (mapping ``own`` of ``own_size`` bytes, hashed as ``own_checksum``) to
    ``protector``; receive ``peer``'s into keeper object ``peer_key`` of ``step``. Returns its (size,
    checksum); the caller commits it. ValueError if it changed in transit."""
    head = torch.tensor([own_size, _signed(own_checksum.value())], dtype=torch.int64)
    peer_head = torch.empty(2, dtype=torch.int64)
    _both(head, peer_head, protector=protector, peer=peer, group=group, tag=0)
    size, want = int(peer_head[0]), int(peer_head[1]) & MASK64
    into = keeper.begin(peer_key, step, size)
    _both(torch.frombuffer(own, dtype=torch.uint8, count=own_size), torch.frombuffer(into, dtype=torch.uint8, count=size),
          protector=protector, peer=peer, group=group, tag=1)
    got = Checksum(own_checksum.algorithm)
    got.update(memoryview(into)[:size])
    if got.value() != want:
        raise ValueError(f"keeper object {peer_key} of step {step} from rank {peer} changed in transit")
    return size, want
