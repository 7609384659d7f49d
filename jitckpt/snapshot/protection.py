"""Which bytes each rank snapshots, and how a lost node's bytes come back (REFT's ARC and AEC).

The flat state (see :mod:`jitckpt.snapshot.layout`) is cut into one *node shard* ``X_k`` of ``S`` bytes per
node ``k`` (zero padded), and each node shard into one *part* per local rank, so every rank copies
only its share: rank ``l`` of node ``k`` writes object ``x{k}.{l}``. Data-parallel replicas hold
the whole state, so redundancy is made from local memory, with no traffic between nodes while
training (REFT section 4.2):

* ``arc`` (Asynchronous Redundant Copying): node ``k`` also stores its successor's shard
  ``X_{k+1 mod m}``; the same object key lives on two nodes.
* ``aec`` (Asynchronous Erasure Coding): each node shard is cut into ``m-1`` segments of
  ``L = S/(m-1)`` bytes; node ``i`` stores the XOR parity
  ``P_i = XOR_{k != i} X_k[seg(k, i)]`` with ``seg(k, i) = (i - k - 1) mod m``, so every segment of
  every shard is covered by exactly one parity on another node. Redundancy is ``S/(m-1)`` per node
  instead of ``S``. A lost ``X_k`` is decoded segment by segment:
  ``X_k[s] = P_i XOR (XOR_{j != i, k} X_j[seg(j, i)])`` with ``i = (k + 1 + s) mod m``.

Both survive the loss of any one node of the group (ARC: any set of non-adjacent nodes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from jitckpt.snapshot.checksum import checksum_of

SCHEMES = ("none", "arc", "aec")


@dataclass(frozen=True)
class ObjectSpec:
    """One snapshot object: ``size`` bytes, the XOR of the flat-state ranges in ``sources``."""

    key: str
    size: int
    sources: tuple  # ((flat_offset, length), ...); one source means a plain copy


class ProtectionPlan:
    """Shard and protect a flat state of ``total_bytes`` over ``num_nodes`` x ``ranks_per_node``."""

    def __init__(self, *, scheme: str, num_nodes: int, ranks_per_node: int, total_bytes: int) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"snapshot protection must be one of {SCHEMES}, got {scheme!r}")
        if num_nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"need num_nodes >= 1 and ranks_per_node >= 1, got {num_nodes}, "
                             f"{ranks_per_node}")
        if scheme != "none" and num_nodes < 2:
            raise ValueError(f"protection {scheme!r} needs at least 2 nodes (got 1): a lost node's "
                             "data must live on another node; use scheme='none' on one node")
        if total_bytes < 0:
            raise ValueError(f"total_bytes must be >= 0, got {total_bytes}")
        self.scheme, self.m, self.r, self.total = scheme, num_nodes, ranks_per_node, total_bytes
        # Parts and parity parts must be whole 8-byte words (XOR runs on int64 views).
        unit = 8 * ranks_per_node * max(1, num_nodes - 1)
        per_node = -(-total_bytes // num_nodes)
        self.S = max(unit, -(-per_node // unit) * unit)
        self.part = self.S // ranks_per_node
        self.L = self.S // max(1, num_nodes - 1)
        self.parity_part = self.L // ranks_per_node

    @property
    def padded_total(self) -> int:
        return self.m * self.S

    def describe(self) -> dict:
        return {"scheme": self.scheme, "num_nodes": self.m, "ranks_per_node": self.r,
                "total_bytes": self.total}

    # Objects -------------------------------------------------------------------------------------
    def data_spec(self, k: int, l: int) -> ObjectSpec:
        return ObjectSpec(f"x{k}.{l}", self.part, ((k * self.S + l * self.part, self.part),))

    def _seg(self, k: int, i: int) -> int:
        return (i - k - 1) % self.m

    def parity_spec(self, i: int, l: int) -> ObjectSpec:
        srcs = tuple((k * self.S + self._seg(k, i) * self.L + l * self.parity_part, self.parity_part)
                     for k in range(self.m) if k != i)
        return ObjectSpec(f"p{i}.{l}", self.parity_part, srcs)

    def rank_objects(self, node: int, local_rank: int) -> list[ObjectSpec]:
        """What this rank writes into its node's keeper for one snapshot."""
        out = [self.data_spec(node, local_rank)]
        if self.scheme == "arc":
            out.append(self.data_spec((node + 1) % self.m, local_rank))
        elif self.scheme == "aec":
            out.append(self.parity_spec(node, local_rank))
        return out

    def holders(self, key: str) -> list[int]:
        """Nodes that store object ``key``."""
        kind, k = key[0], int(key[1:].split(".")[0])
        if kind == "x":
            return [k] + ([(k - 1) % self.m] if self.scheme == "arc" else [])
        return [k]

    # Recovery ------------------------------------------------------------------------------------
    def fetch_list(self, available: set) -> Optional[list[str]]:
        """Object keys to gather to rebuild the whole state from ``available``, or None if it
        cannot be rebuilt (more lost than the scheme protects)."""
        need: list[str] = []
        missing = []
        for k in range(self.m):
            for l in range(self.r):
                key = f"x{k}.{l}"
                (need if key in available else missing).append(key)
        if not missing:
            return need
        if self.scheme != "aec":
            return None
        lost_nodes = {int(key[1:].split(".")[0]) for key in missing}
        if len(lost_nodes) > 1:
            return None  # XOR parity decodes one erasure per part
        (k,) = lost_nodes
        lost_parts = {int(key.split(".")[1]) for key in missing}
        # Decoding part l needs every other node's part l (all present: only node k lost data) and
        # the parity parts p{i}.{l} of the m-1 other nodes.
        for l in lost_parts:
            for i in range(self.m):
                if i == k:
                    continue
                pk = f"p{i}.{l}"
                if pk not in available:
                    return None
                need.append(pk)
        return need

    def assemble(self, objects: Mapping[str, torch.Tensor],
                 covers: Optional[Mapping[str, tuple]] = None) -> torch.Tensor:
        """The padded flat state (uint8 tensor) from data parts, decoding missing ones from parity.

        With a single data part (one node, one rank) that part *is* the flat state and is returned
        without a copy. ``covers``: parity key -> (checksum of each of its ranges as its writer
        read them, algorithm); each decoded range is checked against it, and a mismatch (the
        nodes' replicas of the state were not the same bytes) raises ValueError.
        """
        whole = objects.get("x0.0")
        if self.m * self.r == 1 and whole is not None and whole.numel() == self.padded_total:
            return whole
        flat = torch.empty(self.padded_total, dtype=torch.uint8)
        missing = []
        for k in range(self.m):
            for l in range(self.r):
                spec = self.data_spec(k, l)
                off, n = spec.sources[0]
                obj = objects.get(spec.key)
                if obj is None:
                    missing.append((k, l))
                    continue
                _check_size(spec.key, obj, n)
                flat[off:off + n].copy_(obj)
        for k, l in missing:
            if self.scheme != "aec":
                raise ValueError(f"snapshot object x{k}.{l} is missing and scheme {self.scheme!r} "
                                 "has no parity to decode it from")
            for s in range(self.m - 1):
                i = (k + 1 + s) % self.m
                pspec = self.parity_spec(i, l)
                parity = objects.get(pspec.key)
                if parity is None:
                    raise ValueError(f"cannot decode x{k}.{l}: parity {pspec.key} is missing too "
                                     "(more than one node of the group lost)")
                _check_size(pspec.key, parity, self.parity_part)
                dst_off = k * self.S + s * self.L + l * self.parity_part
                dst = flat[dst_off:dst_off + self.parity_part]
                dst.copy_(parity)
                for off, n in pspec.sources:
                    if k * self.S <= off < (k + 1) * self.S:
                        continue  # the erased term itself
                    xor_into(dst, flat[off:off + n])
                expect = (covers or {}).get(pspec.key)
                if expect is not None and len(expect[0]) == len(pspec.sources):
                    sums, algo = expect
                    if checksum_of(dst.numpy(), algo) != sums[k - (k > i)]:  # sources skip node i
                        raise ValueError(
                            f"x{k}.{l} decoded from parity {pspec.key} differs from the bytes node {i} "
                            "hashed when it wrote that parity: the nodes' copies of the state were not "
                            "the same (ranks whose parameters or optimizer state diverged?)")
        return flat


def _check_size(key: str, obj: torch.Tensor, n: int) -> None:
    if obj.numel() != n:
        raise ValueError(f"snapshot object {key} has {obj.numel()} bytes, the plan expects {n}")


def xor_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst ^= src`` for uint8 tensors whose length is a multiple of 8 (int64 words)."""
    if dst.numel() != src.numel():
        raise ValueError(f"xor_into: length mismatch {dst.numel()} vs {src.numel()}")
    if dst.numel() % 8 == 0 and dst.storage_offset() % 8 == 0 and src.storage_offset() % 8 == 0:
        dst.view(torch.int64).bitwise_xor_(src.view(torch.int64))
    else:
        dst.bitwise_xor_(src)
