"""On-disk format of SWIFT pipeline logs: records with (iteration, micro-batch, src, dst, seq).

A stage's log directory holds chunk files ``chunk-g<gen>-<n>-it<lo>-<hi>.log``: an 8-byte
little-endian header length, a JSON header (records, and dtype/shape/offset of each tensor),
then the raw tensor bytes. Raw bytes rather than ``torch.save`` because the writer thread must
hold the GIL as little as possible (file writes and hashing release it; pickling does not). A
record of
kind ``"send"`` carries the outgoing tensor (logged at the sender, upstream backup); kind
``"recv"`` carries only a digest of a received tensor (``"<algorithm>:<hex>"``, xxh3-128 when
the ``xxhash`` package is there, else blake2b: a divergence check, not a security boundary),
kept by the receiver so a replayed sender's outputs can be checked for divergence. Files are written to a temporary name
and renamed, so a reader never sees a torn chunk.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

CHUNK_RE = re.compile(r"^chunk-g(\d+)-(\d+)-it(\d+)-(\d+)\.log$")
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

    def to_row(self) -> list:
        """Compact list form stored in chunk headers (cheap to build in the writer thread)."""
        k = self.key
        return [k.iteration, k.micro_batch, k.payload, k.src, k.dst, self.seq,
                self.generation, self.kind, self.digest]

    @staticmethod
    def from_row(row: list) -> "LogRecord":
        """Inverse of :meth:`to_row`."""
        it, mb, payload, src, dst, seq, gen, kind, digest = row
        return LogRecord(key=MessageKey(iteration=it, micro_batch=mb, payload=payload, src=src,
                                        dst=dst), seq=seq, generation=gen, kind=kind,
                         digest=digest)


def _bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor without copying."""
    if not t.numel():
        return memoryview(b"")
    if t.dtype in _NUMPY_OK:
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


_NUMPY_OK = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
             torch.int16, torch.int8, torch.uint8, torch.bool}


try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised only without the optional package
    _xxhash = None

DIGEST_ALGORITHMS = ("xxh3_128", "blake2b")
DEFAULT_DIGEST = "xxh3_128" if _xxhash is not None else "blake2b"


def tensor_digest(tensor: torch.Tensor, algorithm: str = DEFAULT_DIGEST) -> str:
    """Bitwise digest ``"<algorithm>:<32 hex>"`` of a tensor's dtype, shape and bytes.

    xxh3-128 costs about a tenth of SHA-256 here and runs in the writer for every received
    tensor. The algorithm is part of the digest, so :func:`digest_matches` always recomputes
    with the one the receiver used."""
    if algorithm not in DIGEST_ALGORITHMS:
        raise ValueError(f"digest algorithm must be one of {DIGEST_ALGORITHMS}, got {algorithm!r}")
    if algorithm == "xxh3_128" and _xxhash is None:
        raise ValueError("digest xxh3_128 needs the 'xxhash' package: pip install xxhash")
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    h = _xxhash.xxh3_128(head) if algorithm == "xxh3_128" else hashlib.blake2b(head, digest_size=16)
    h.update(_bytes(t))  # both drop the GIL for large buffers
    return f"{algorithm}:{h.hexdigest()}"


def digest_matches(tensor: torch.Tensor, digest: str) -> tuple[bool, str]:
    """Whether ``tensor`` has ``digest`` (a :func:`tensor_digest`), and the digest it has."""
    algorithm, sep, _ = digest.partition(":")
    if not sep or algorithm not in DIGEST_ALGORITHMS:
        raise ValueError(f"logged digest {digest[:48]!r} names no known algorithm "
                         f"({', '.join(DIGEST_ALGORITHMS)}): the log was written by another "
                         "jitckpt version; replay from the global checkpoint instead")
    mine = tensor_digest(tensor, algorithm)
    return mine == digest, mine


def chunk_name(generation: int, number: int, lo: int, hi: int) -> str:
    """File name of a chunk holding iterations ``lo..hi``."""
    return f"chunk-g{generation}-{number:06d}-it{lo}-{hi}.log"


def write_chunk(directory: Path, name: str, records: list[LogRecord],
                tensors: list[Optional[torch.Tensor]]) -> Path:
    """Atomically write one chunk file (tmp + rename); tensors must be contiguous CPU."""
    metas, offset = [], 0
    for t in tensors:
        if t is None:
            metas.append(None)
            continue
        n = t.numel() * t.element_size()
        metas.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "offset": offset, "nbytes": n})
        offset += n
    header = json.dumps({"records": [r.to_row() for r in records],
                         "tensors": metas}).encode()
    path = directory / name
    tmp = directory / f".{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for t in tensors:
            if t is not None:
                f.write(_bytes(t))
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
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    payload = memoryview(data)[8 + n:]
    out = []
    for r, m in zip(header["records"], header["tensors"]):
        t = None
        if m is not None:
            dtype = getattr(torch, m["dtype"])
            raw = bytearray(payload[m["offset"]:m["offset"] + m["nbytes"]])
            t = (torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(m["shape"])
                 if m["nbytes"] else torch.empty(m["shape"], dtype=dtype))
        out.append((LogRecord.from_row(r), t))
    return out
