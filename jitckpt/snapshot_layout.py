"""Flatten a training state (nested dicts/lists of tensors and plain values) into one byte space.

A snapshot copies byte ranges of this space, so sharding and parity never need to know where one
tensor ends: tensor ``i`` occupies ``[offsets[i], offsets[i] + nbytes[i])``, each start aligned to
64 bytes, gaps are zero. The *skeleton* is the state with every tensor replaced by a reference;
pickled, it travels with the snapshot and :func:`rebuild` turns skeleton + bytes back into the
same state, bit for bit.
"""
from __future__ import annotations

import bisect
import pickle
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor of the state lives in the flat byte space."""

    index: int
    dtype: str
    shape: tuple
    offset: int
    nbytes: int


def _map_containers(obj: Any, fn: Any) -> Any:
    """Apply fn to the members of dicts/lists/tuples; keep dict subclasses and their attributes
    (a module state_dict's ``_metadata`` carries version numbers load_state_dict reads)."""
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = fn(v)
        if type(obj) is not dict:
            out.__dict__.update(getattr(obj, "__dict__", {}))
        return out
    if isinstance(obj, list):
        return [fn(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(fn(v) for v in obj)
    return obj


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class FlatState:
    """A state's tensors laid end to end; reads any byte range of the layout into a buffer."""

    def __init__(self, state: Any) -> None:
        self.tensors: list[torch.Tensor] = []   # uint8 views of the state's tensors (no copy)
        self.offsets: list[int] = []
        self._pos = 0
        skeleton = self._strip(state)
        self.total = self._pos
        self.skeleton = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)

    def _strip(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._add(obj)
        return _map_containers(obj, self._strip)

    def _add(self, t: torch.Tensor) -> TensorRef:
        if t.device.type != "cpu":
            raise ValueError(
                f"snapshot: tensor on {t.device} - this implementation snapshots CPU tensors only "
                "(move the state to CPU in state_fn, or snapshot on a CPU build)")
        if t.is_sparse or t.is_quantized:
            raise ValueError("snapshot: sparse and quantized tensors are not supported; densify them "
                             "in state_fn")
        flat = t.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        u8 = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        ref = TensorRef(len(self.tensors), str(t.dtype).removeprefix("torch."), tuple(t.shape),
                        self._pos, u8.numel())
        self.tensors.append(u8)
        self.offsets.append(self._pos)
        self._pos = _align(self._pos + u8.numel())
        return ref

    def read_into(self, start: int, out: torch.Tensor) -> None:
        """Copy bytes ``[start, start + len(out))`` of the layout into uint8 tensor ``out``.

        Bytes past the end of the state or between tensors read as zero.
        """
        n, pos = out.numel(), 0
        i = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        while pos < n:
            at = start + pos
            if i >= len(self.tensors) or at < self.offsets[i]:
                nxt = self.offsets[i] if i < len(self.tensors) else at + (n - pos)
                gap = min(nxt - at, n - pos)
                out[pos:pos + gap].zero_()
                pos += gap
                continue
            t, off = self.tensors[i], at - self.offsets[i]
            if off >= t.numel():
                i += 1
                continue
            take = min(t.numel() - off, n - pos)
            out[pos:pos + take].copy_(t[off:off + take])
            pos += take


def rebuild(skeleton: bytes, flat: Any) -> Any:
    """The state from its pickled skeleton and a buffer holding the flat bytes (tensors share it)."""
    buf = memoryview(flat).cast("B")

    def fill(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            dtype = getattr(torch, obj.dtype)
            if obj.nbytes == 0:
                return torch.empty(obj.shape, dtype=dtype)
            u8 = torch.frombuffer(buf, dtype=torch.uint8, count=obj.nbytes, offset=obj.offset)
            return u8.view(dtype).reshape(obj.shape)
        return _map_containers(obj, fill)

    return fill(pickle.loads(skeleton))
