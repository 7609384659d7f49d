"""On-disk format of SWIFT pipeline logs: records with (iteration, micro-batch, src, dst, seq).

A stage's log directory holds chunk files ``chunk-g<gen>-<n>-it<lo>-<hi>.pt``, each a
``torch.save`` of ``{"records": [dict, ...], "tensors": [Tensor | None, ...]}``. A record of
kind ``"send"`` carries the outgoing tensor (logged at the sender, upstream backup); kind
``"recv"`` carries only the blake2b digest of a received tensor, kept by the receiver so a
replayed sender's outputs can be checked for divergence. Files are written to a temporary name
and renamed, so a reader never sees a torn chunk.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

CHUNK_RE = re.compile(r"^chunk-g(\d+)-(\d+)-it(\d+)-(\d+)\.pt$")
ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class MessageKey:
    """Identifies one point-to-point message of the training schedule (the paper's timestamp
    plus sender/receiver): ``payload`` is ``"activation"`` (forward) or ``"gradient"``."""

    iteration: int
    micro_batch: int
    payload: str
    src: int
    dst: int


@dataclass(frozen=True)
class LogRecord:
    """One logged message: its key, the sender's per-destination sequence number, the
    process-group generation it was sent in, the record kind and the tensor digest."""

    key: MessageKey
    seq: int
    generation: int
    kind: str  # "send" (tensor stored) or "recv" (digest only)
    digest: str

    def to_dict(self) -> dict:
        """Plain-dict form stored in chunk files."""
        d = asdict(self)
        d["key"] = asdict(self.key)
        return d

    @staticmethod
    def from_dict(d: dict) -> "LogRecord":
        """Inverse of :meth:`to_dict`."""
        return LogRecord(key=MessageKey(**d["key"]), seq=d["seq"], generation=d["generation"],
                         kind=d["kind"], digest=d["digest"])


def tensor_digest(tensor: torch.Tensor) -> str:
    """Bitwise digest of a tensor's dtype, shape and bytes (for divergence detection)."""
    t = tensor.detach().contiguous().cpu()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def chunk_name(generation: int, number: int, lo: int, hi: int) -> str:
    """File name of a chunk holding iterations ``lo..hi``."""
    return f"chunk-g{generation}-{number:06d}-it{lo}-{hi}.pt"


def write_chunk(directory: Path, name: str, records: list[LogRecord],
                tensors: list[Optional[torch.Tensor]]) -> Path:
    """Atomically write one chunk file (tmp + rename)."""
    path = directory / name
    tmp = directory / f".{name}.tmp"
    torch.save({"records": [r.to_dict() for r in records], "tensors": tensors}, tmp)
    os.replace(tmp, path)
    return path


def iter_chunks(directory: Path) -> Iterator[tuple[Path, int, int, int, int]]:
    """Yield ``(path, generation, number, lo, hi)`` for each complete chunk in a directory."""
    if not directory.is_dir():
        return
    for p in sorted(directory.iterdir()):
        m = CHUNK_RE.match(p.name)
        if m:
            g, n, lo, hi = (int(x) for x in m.groups())
            yield p, g, n, lo, hi


def read_chunk(path: Path) -> list[tuple[LogRecord, Optional[torch.Tensor]]]:
    """Load one chunk file as (record, tensor-or-None) pairs."""
    data = torch.load(path, weights_only=True)
    return [(LogRecord.from_dict(r), t) for r, t in zip(data["records"], data["tensors"])]
