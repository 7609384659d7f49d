"""XOR parity of DTensor shard snapshots across nodes (REFT's AEC, for ``dt.r<rank>`` objects).

The ranks with the same local rank on the ``m >= 3`` nodes form a group. Their shard objects
``X_0 .. X_{m-1}`` (``X_k`` on node ``k``), zero-padded to one size ``S`` (a multiple of
``8 (m-1)``: XOR runs on int64 words), are cut into ``m-1`` segments of ``L = S/(m-1)`` bytes.
Node ``i``'s rank keeps ``P_i = XOR_{k != i} X_k[seg(k, i)]`` with ``seg(k, i) = (i - k - 1) mod m``
(the segment scheme of :mod:`jitckpt.snapshot.protection`), so every segment of every object is
in exactly one parity, on another node. A lost node ``k``'s object comes back as
``X_k[s] = P_i XOR (XOR_{j not in {i, k}} X_j[seg(j, i)])`` with ``i = (k + 1 + s) mod m``. Each
node keeps ``S/(m-1)`` bytes per object, against ARC's ``S``; one lost node per group is decoded.

The parity object (``dtp.r<rank>``, :func:`~jitckpt.snapshot.keeper_object.write_object`: JSON,
never pickle) records the size and checksum of every object it covers, so a decoded object is
checked against the checksum its owner computed while writing it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from jitckpt.snapshot.checksum import Checksum
from jitckpt.snapshot.keeper_client import KeeperClient
from jitckpt.snapshot.keeper_object import write_object
from jitckpt.snapshot.object_exchange import MASK64, _signed
from jitckpt.snapshot.protection import xor_into
from jitckpt.snapshot.shard_keys import parity_key

KIND = "dtensor-parity"
_TAG = 20  # point-to-point tags of the parity exchange (ARC's exchange uses 0 and 1)


@dataclass(frozen=True)
class ParityLayout:
    """The segment arithmetic of one group: ``nodes`` objects padded to ``size`` bytes."""

    nodes: int
    size: int

    def __post_init__(self) -> None:
        if self.nodes < 3:
            raise ValueError(f"XOR parity needs 3 or more nodes, not {self.nodes} (with 2 it is a copy: ARC)")
        if self.size <= 0 or self.size % (8 * (self.nodes - 1)):
            raise ValueError(f"parity size {self.size} is not a positive multiple of 8 x {self.nodes - 1}")

    @staticmethod
    def for_sizes(sizes: list, nodes: int) -> "ParityLayout":
        unit = 8 * (nodes - 1)
        return ParityLayout(nodes, max(unit, -(-max(sizes) // unit) * unit))

    @property
    def seg_len(self) -> int:
        return self.size // (self.nodes - 1)

    def seg(self, k: int, i: int) -> int:
        """The segment of node ``k``'s object that node ``i``'s parity covers (``k != i``)."""
        return (i - k - 1) % self.nodes

    def holder(self, k: int, s: int) -> int:
        """The node whose parity covers segment ``s`` of node ``k``'s object."""
        return (k + 1 + s) % self.nodes

    def segment(self, data: torch.Tensor, s: int) -> torch.Tensor:
        """Bytes ``[s L, (s+1) L)`` of ``data`` (uint8) zero-padded to ``size``: a view where it can be."""
        lo, n = s * self.seg_len, self.seg_len
        if lo + n <= data.numel():
            return data[lo:lo + n]
        out = torch.zeros(n, dtype=torch.uint8)
        if lo < data.numel():
            out[:data.numel() - lo] = data[lo:]
        return out


def _group(rank: int, rpn: int, nodes: int) -> list:
    return [k * rpn + rank % rpn for k in range(nodes)]


def exchange_parity(keeper: KeeperClient, *, own: Any, own_size: int, own_checksum: Checksum, step: int,
                    rank: int, ranks_per_node: int, nodes: int, group: Any, header: dict) -> tuple[dict, int]:
    """Collective of ``group`` (every rank): send each other node's rank of this group the segment of
    this rank's object (``own``, ``own_size`` bytes, hashed as ``own_checksum``) its parity covers,
    XOR the segments received into this node's parity and write it (``dtp.r<rank>`` of ``step``,
    ``header`` plus what it covers). Returns its keeper commit entry (the caller commits) and size."""
    head = torch.tensor([own_size, _signed(own_checksum.value())], dtype=torch.int64)
    heads = [torch.empty(2, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(heads, head, group=group)
    members = _group(rank, ranks_per_node, nodes)
    sizes = [int(heads[r][0]) for r in members]
    layout = ParityLayout.for_sizes(sizes, nodes)
    me = rank // ranks_per_node
    data = torch.frombuffer(own, dtype=torch.uint8, count=own_size)
    sends = {k: layout.segment(data, layout.seg(me, k)) for k in range(nodes) if k != me}
    recvs = {k: torch.empty(layout.seg_len, dtype=torch.uint8) for k in range(nodes) if k != me}
    works = [dist.isend(t, dst=members[k], group=group, tag=_TAG) for k, t in sends.items()]
    works += [dist.irecv(t, src=members[k], group=group, tag=_TAG) for k, t in recvs.items()]
    for w in works:
        w.wait()
    parity = torch.zeros(layout.seg_len, dtype=torch.uint8)
    for t in recvs.values():
        xor_into(parity, t)
    covers = {str(r): [int(heads[r][0]), int(heads[r][1]) & MASK64] for r in members}
    key = parity_key(rank)
    _, size, h = write_object(keeper, key=key, step=step, state={"parity": parity},
                              header=header | {"kind": KIND, "nodes": nodes, "size": layout.size,
                                               "algo": own_checksum.algorithm, "covers": covers})
    return {"key": key, "step": step, "checksum": h.value(), "algo": h.algorithm}, size


def decode_sources(lost: int, *, ranks_per_node: int, nodes: int) -> list:
    """For each segment of rank ``lost``'s object: (the rank whose parity holds it, the ranks whose
    own objects' segments are XORed with it). Every rank of the group but ``lost`` takes part."""
    k = lost // ranks_per_node
    members = _group(lost, ranks_per_node, nodes)
    out = []
    for s in range(nodes - 1):
        i = (k + 1 + s) % nodes
        out.append((members[i], [members[j] for j in range(nodes) if j not in (i, k)]))
    return out


def send_for_decode(*, lost: int, rank: int, ranks_per_node: int, nodes: int, size: int, own: torch.Tensor,
                    parity: torch.Tensor, group: Any = None) -> list:
    """This rank's part in decoding ``lost``'s object (padded ``size``): its parity where it holds a
    segment's, its own object's segment where it is XORed in. Returns the pending (send, tensor)s:
    the tensors must live until the sends are waited for."""
    layout = ParityLayout(nodes, size)
    me, out = rank // ranks_per_node, []
    for s, (holder, others) in enumerate(decode_sources(lost, ranks_per_node=ranks_per_node, nodes=nodes)):
        if holder == rank:
            t = parity.contiguous()
        elif rank in others:
            t = layout.segment(own, layout.seg(me, holder // ranks_per_node)).contiguous()
        else:
            continue
        out.append((dist.isend(t, dst=lost, group=group, tag=_TAG + 1 + s), t))
    return out


def receive_decoded(*, lost: int, ranks_per_node: int, nodes: int, size: int, group: Any = None) -> torch.Tensor:
    """On rank ``lost``: its object (padded ``size`` bytes) rebuilt from the others' parts."""
    layout = ParityLayout(nodes, size)
    out = torch.empty(size, dtype=torch.uint8)
    parts = []
    for s, (holder, others) in enumerate(decode_sources(lost, ranks_per_node=ranks_per_node, nodes=nodes)):
        dst = out[s * layout.seg_len:(s + 1) * layout.seg_len]
        bufs = [torch.empty(layout.seg_len, dtype=torch.uint8) for _ in others]
        works = [dist.irecv(dst, src=holder, group=group, tag=_TAG + 1 + s)]
        works += [dist.irecv(b, src=r, group=group, tag=_TAG + 1 + s) for r, b in zip(others, bufs)]
        parts.append((dst, bufs, works))
    for dst, bufs, works in parts:
        for w in works:
            w.wait()
        for b in bufs:
            xor_into(dst, b)
    return out
