"""On-disk format of SWIFT pipeline logs: records with (iteration, micro-batch, src, dst, seq).

A stage's log directory holds chunk files ``chunk-g<gen>-<n>-it<lo>-<hi>.log``. A record of kind
``"send"`` carries the outgoing tensor (logged at the sender, upstream backup); kind ``"recv"``
carries only a digest of a received tensor (``"<algorithm>:<32 hex>"``, xxh3-128 when the
``xxhash`` package is there, else blake2b: a divergence check, not a security boundary), kept by
the receiver so a replayed sender's outputs can be checked for divergence. Files are written to
a temporary name and renamed, so a reader never sees a torn chunk. Raw tensor bytes rather than
``torch.save`` because the writer thread must hold the GIL as little as possible (file writes
and hashing release it; pickling does not).

Chunk layout, version 1: fixed little-endian binary, no padding between fields. libjit.so
reads and writes the same layout; ``interposer/src/log_chunk.h`` documents it in the same words
(tests/test_logging_records.py checks that they stay the same)::

    offset  size  field
    file header (16 bytes)
    0       8     magic "JITSWLG" followed by the format version, 0x01
    8       4     u32 record count
    12      4     u32 reserved, 0
    each record: a fixed 72-byte part, then ndim i64 dimensions
    0       8     i64 iteration
    8       8     i64 seq (the sender's per-destination sequence number)
    16      8     u64 offset of the tensor's bytes from the start of the data section
    24      8     u64 nbytes of the tensor (product of the dimensions x the dtype's size)
    32      4     i32 micro_batch
    36      4     i32 src
    40      4     i32 dst
    44      4     i32 generation
    48      1     u8 payload: 1 activation, 2 gradient
    49      1     u8 kind: 1 send, 2 recv
    50      1     u8 digest algorithm: 0 none (digest ""), 1 xxh3_128, 2 blake2b
    51      1     u8 dtype code (table below); 0 no tensor (then ndim, offset, nbytes are 0)
    52      1     u8 ndim (0 for a 0-d tensor)
    53      3     reserved, 0
    56      16    the digest's 16 bytes (the 32 hex digits); zeros with algorithm 0
    72      8*n   i64 dimensions
    data section: right after the last record, the tensors' bytes back to back in record order

dtype codes (torch names): 1 float32, 2 float64, 3 float16, 4 bfloat16, 5 int8, 6 uint8,
7 int16, 8 uint16, 9 int32, 10 uint32, 11 int64, 12 uint64, 13 bool, 14 float8_e4m3fn,
15 float8_e5m2, 16 float8_e4m3fnuz, 17 float8_e5m2fnuz, 18 complex32, 19 complex64,
20 complex128. A reader checks everything (magic and version, codes, reserved bytes, sizes,
offsets, truncation, trailing bytes) and names the file and the problem; a chunk of another
format version (the JSON-header chunks of earlier jitckpt versions included) cannot be replayed.
"""
from __future__ import annotations

import hashlib
import math
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
OTHER_VERSION = "written by another jitckpt version; replay from the global checkpoint instead"


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
                         f"({', '.join(DIGEST_ALGORITHMS)}): the log was {OTHER_VERSION}")
    mine = tensor_digest(tensor, algorithm)
    return mine == digest, mine


def chunk_name(generation: int, number: int, lo: int, hi: int) -> str:
    """File name of a chunk holding iterations ``lo..hi``."""
    return f"chunk-g{generation}-{number:06d}-it{lo}-{hi}.log"


# --- chunk layout, version 1 (see the module docstring; log_chunk.h has the same definition) ---
MAGIC = b"JITSWLG\x01"  # the last byte is the format version
_FILE_HEADER = struct.Struct("<8sII")  # magic, record count, reserved
_RECORD = struct.Struct("<qqQQiiiiBBBBB3s16s")  # the fixed part of a record, 72 bytes
_PAYLOADS = (ACTIVATION, GRADIENT)  # code = index + 1
_KINDS = ("send", "recv")
# dtype code = index + 1; codes never change within a format version (0 = no tensor).
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16",
               "int32", "uint32", "int64", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
               "float8_e4m3fnuz", "float8_e5m2fnuz", "complex32", "complex64", "complex128")
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_NAMES, 1)}
_HEX32 = re.compile(r"[0-9a-f]{32}")


class ChunkFormatError(ValueError):
    """A file that is not a complete, well-formed chunk of this format version."""


def _code(table: tuple, value: str, what: str) -> int:
    if value not in table:
        raise ValueError(f"{what} {value!r} is none of {', '.join(table)}")
    return table.index(value) + 1


def _encode_digest(digest: str) -> tuple[int, bytes]:
    """(algorithm code, 16 bytes) of ``""`` or a :func:`tensor_digest`."""
    if not digest:
        return 0, bytes(16)
    algorithm, _, hexdigits = digest.partition(":")
    if algorithm not in DIGEST_ALGORITHMS or not _HEX32.fullmatch(hexdigits):
        raise ValueError(f"digest {digest[:48]!r} is neither empty nor "
                         f"'<{'|'.join(DIGEST_ALGORITHMS)}>:<32 lowercase hex digits>'")
    return DIGEST_ALGORITHMS.index(algorithm) + 1, bytes.fromhex(hexdigits)


def _encode_record(rec: LogRecord, tensor: Optional[torch.Tensor], offset: int) -> tuple[bytes, int]:
    """A record's fixed part and dimensions, and the byte count of its tensor."""
    k = rec.key
    payload = _code(_PAYLOADS, k.payload, "payload")
    kind = _code(_KINDS, rec.kind, "kind")
    algorithm, digest = _encode_digest(rec.digest)
    if tensor is None:
        dtype, shape, offset, nbytes = 0, (), 0, 0
    else:
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _DTYPE_CODES:
            raise ValueError(f"dtype {name} has no code in the chunk format (it knows "
                             f"{', '.join(DTYPE_NAMES)})")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("tensors must be contiguous and on the CPU")
        dtype, shape = _DTYPE_CODES[name], tuple(tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
    try:
        return (_RECORD.pack(k.iteration, rec.seq, offset, nbytes, k.micro_batch, k.src, k.dst,
                             rec.generation, payload, kind, algorithm, dtype, len(shape),
                             bytes(3), digest)
                + struct.pack(f"<{len(shape)}q", *shape)), nbytes
    except struct.error as e:  # a number out of its field's range, or more than 255 dimensions
        raise ValueError(f"does not fit the chunk layout: {e}") from None


def write_chunk(directory: Path, name: str, records: list[LogRecord],
                tensors: list[Optional[torch.Tensor]]) -> Path:
    """Atomically write one chunk file (tmp + rename); tensors must be contiguous CPU.

    A record the layout cannot hold (unknown dtype, payload, kind or digest form, a number out
    of its field's range) is a ValueError naming the record; nothing is written then."""
    if len(records) != len(tensors):
        raise ValueError(f"{len(records)} records but {len(tensors)} tensors")
    parts, offset = [_FILE_HEADER.pack(MAGIC, len(records), 0)], 0
    for i, (rec, t) in enumerate(zip(records, tensors)):
        try:
            part, nbytes = _encode_record(rec, t, offset)
        except ValueError as e:
            raise ValueError(f"chunk {name}: record {i} ({rec}): {e}") from None
        parts.append(part)
        offset += nbytes
    path = directory / name
    tmp = directory / f".{name}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(b"".join(parts))
            for t in tensors:
                if t is not None:
                    f.write(_bytes(t))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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


def _check_magic(data: bytes) -> None:
    if data.startswith(MAGIC):
        if len(data) < _FILE_HEADER.size:
            raise ChunkFormatError(f"truncated: {len(data)} bytes, shorter than the "
                                   f"{_FILE_HEADER.size}-byte file header")
        return
    if len(data) >= len(MAGIC) and data.startswith(MAGIC[:-1]):
        raise ChunkFormatError(f"chunk format version {data[len(MAGIC) - 1]}, this jitckpt reads "
                               f"version {MAGIC[-1]}: {OTHER_VERSION}")
    if data[8:9] == b"{":  # an 8-byte length, then a JSON header: the format before version 1
        raise ChunkFormatError(f"a chunk with a JSON header: {OTHER_VERSION}")
    if MAGIC.startswith(data):
        raise ChunkFormatError(f"truncated: {len(data)} bytes, shorter than the "
                               f"{_FILE_HEADER.size}-byte file header")
    raise ChunkFormatError(f"not a SWIFT log chunk: starts with {data[:8]!r}, not {MAGIC!r}")


def _decode_record(data: bytes, pos: int, i: int) -> tuple[LogRecord, int, tuple, int, int, int]:
    """Record ``i`` at ``pos``: (record, dtype code, shape, offset, nbytes, end of the record)."""
    if len(data) - pos < _RECORD.size:
        raise ChunkFormatError(f"record {i}: truncated (the file ends inside it)")
    (it, seq, offset, nbytes, mb, src, dst, gen, payload, kind, algorithm, dtype, ndim, reserved,
     digest) = _RECORD.unpack_from(data, pos)
    pos += _RECORD.size
    for what, code, lowest, highest in (("payload", payload, 1, len(_PAYLOADS)),
                                        ("kind", kind, 1, len(_KINDS)),
                                        ("digest algorithm", algorithm, 0, len(DIGEST_ALGORITHMS)),
                                        ("dtype", dtype, 0, len(DTYPE_NAMES))):
        if not lowest <= code <= highest:
            raise ChunkFormatError(f"record {i}: unknown {what} code {code}")
    if reserved != bytes(3):
        raise ChunkFormatError(f"record {i}: reserved bytes are not 0")
    if algorithm == 0 and digest != bytes(16):
        raise ChunkFormatError(f"record {i}: digest bytes without a digest algorithm")
    if len(data) - pos < 8 * ndim:
        raise ChunkFormatError(f"record {i}: truncated (the file ends inside its dimensions)")
    shape = struct.unpack_from(f"<{ndim}q", data, pos)
    pos += 8 * ndim
    if dtype == 0:
        if ndim or offset or nbytes:
            raise ChunkFormatError(f"record {i}: no tensor, yet ndim {ndim}, offset {offset}, "
                                   f"nbytes {nbytes}")
    else:
        if any(d < 0 for d in shape):
            raise ChunkFormatError(f"record {i}: negative dimension in shape {list(shape)}")
        name = DTYPE_NAMES[dtype - 1]
        want = math.prod(shape) * getattr(torch, name).itemsize
        if nbytes != want:
            raise ChunkFormatError(f"record {i}: nbytes {nbytes}, but shape {list(shape)} of "
                                   f"{name} is {want} bytes")
    rec = LogRecord(key=MessageKey(iteration=it, micro_batch=mb, payload=_PAYLOADS[payload - 1],
                                   src=src, dst=dst), seq=seq, generation=gen,
                    kind=_KINDS[kind - 1],
                    digest=f"{DIGEST_ALGORITHMS[algorithm - 1]}:{digest.hex()}" if algorithm else "")
    return rec, dtype, shape, offset, nbytes, pos


def read_chunk(path: Path) -> list[tuple[LogRecord, Optional[torch.Tensor]]]:
    """Load one chunk file as (record, tensor-or-None) pairs.

    Anything but a complete chunk of this format version is a :class:`ChunkFormatError`
    naming the file and the problem."""
    data = Path(path).read_bytes()
    try:
        return _decode(data)
    except ChunkFormatError as e:
        raise ChunkFormatError(f"{path}: {e}") from None


def _decode(data: bytes) -> list[tuple[LogRecord, Optional[torch.Tensor]]]:
    _check_magic(data)
    _, count, reserved = _FILE_HEADER.unpack_from(data)
    if reserved:
        raise ChunkFormatError(f"reserved header field is {reserved}, not 0")
    if count * _RECORD.size > len(data) - _FILE_HEADER.size:
        raise ChunkFormatError(f"truncated: {count} records need more than the file's "
                               f"{len(data)} bytes")
    entries, pos = [], _FILE_HEADER.size
    for i in range(count):
        *entry, pos = _decode_record(data, pos, i)
        entries.append(entry)
    available, end, out = len(data) - pos, 0, []
    for i, (rec, dtype, shape, offset, nbytes) in enumerate(entries):
        t = None
        if dtype:
            if offset + nbytes > available:
                raise ChunkFormatError(
                    f"record {i}: tensor bytes [{offset}, {offset + nbytes}) of the data section "
                    f"lie beyond the end of the file ({available} bytes of data): truncated")
            if offset != end:
                raise ChunkFormatError(f"record {i}: tensor at offset {offset} of the data "
                                       f"section, expected {end} (tensors are back to back)")
            end += nbytes
            torch_dtype = getattr(torch, DTYPE_NAMES[dtype - 1])
            raw = bytearray(memoryview(data)[pos + offset:pos + end])
            t = (torch.frombuffer(raw, dtype=torch.uint8).view(torch_dtype).reshape(shape)
                 if nbytes else torch.empty(shape, dtype=torch_dtype))
        out.append((rec, t))
    if end != available:
        raise ChunkFormatError(f"{available - end} bytes after the last tensor")
    return out
