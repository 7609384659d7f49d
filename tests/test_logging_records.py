"""The SWIFT log chunk layout (jitckpt/swift/pipeline/logging_records.py, version 1): round trip
of every dtype, empty and 0-d tensors included, the documented bytes (the same ones
interposer/tests/unit_tests.cc asserts for libjit.so's writer), one dtype table in both languages,
and a clear error naming the file and the problem for anything but a complete chunk."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch

from jitckpt.swift.pipeline.logging_records import (ACTIVATION, DTYPE_NAMES, GRADIENT, MAGIC,
                                                    ChunkFormatError, LogRecord, MessageKey,
                                                    read_chunk, tensor_digest, write_chunk)

REPO = Path(__file__).resolve().parents[1]
NAME = "chunk-g0-000000-it1-1.log"
# One int32 send record {5, -6, 7}, laid out as the module docstring says (unit_tests.cc: kGoldenChunk).
GOLDEN = bytes.fromhex(
    "4a495453574c47010100000000000000"  # magic "JITSWLG" v1, 1 record, reserved
    "0700000000000000" "0300000000000000"  # iteration 7, seq 3
    "0000000000000000" "0c00000000000000"  # offset 0, nbytes 12
    "01000000" "00000000" "01000000" "02000000"  # micro_batch 1, src 0, dst 1, generation 2
    "01" "01" "00" "09" "01" "000000"  # activation, send, no digest, int32, ndim 1, reserved
    "00000000000000000000000000000000"  # digest bytes
    "0300000000000000"  # dims [3]
    "05000000faffffff07000000")  # the tensor's bytes


def _rec(i: int, kind: str = "send", digest: str = "", payload: str = ACTIVATION) -> LogRecord:
    return LogRecord(key=MessageKey(iteration=1, micro_batch=i, payload=payload, src=0, dst=1),
                     seq=i, generation=0, kind=kind, digest=digest)


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    """Distinct bit patterns for any dtype (random bytes viewed as it)."""
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_dtype_round_trips_with_empty_and_0d_tensors(tmp_path):
    tensors = [None]
    for name in DTYPE_NAMES:
        dtype = getattr(torch, name)
        tensors += [_sample(dtype, (2, 3)), _sample(dtype, ()), _sample(dtype, (0, 4)), _sample(dtype, (5,))]
    tensors.append(None)
    recs = [_rec(i, "send" if t is not None else "recv",
                 "" if t is not None else tensor_digest(torch.ones(i), "blake2b"),
                 GRADIENT if i % 2 else ACTIVATION) for i, t in enumerate(tensors)]
    write_chunk(tmp_path, NAME, recs, tensors)
    back = read_chunk(tmp_path / NAME)
    assert [r for r, _ in back] == recs
    for (_, got), want in zip(back, tensors):
        assert got is None if want is None else _same_bits(got, want)
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary name


def test_writer_lays_out_the_documented_bytes(tmp_path):
    rec = LogRecord(key=MessageKey(iteration=7, micro_batch=1, payload=ACTIVATION, src=0, dst=1),
                    seq=3, generation=2, kind="send", digest="")
    write_chunk(tmp_path, NAME, [rec], [torch.tensor([5, -6, 7], dtype=torch.int32)])
    assert (tmp_path / NAME).read_bytes() == GOLDEN
    # A digest is its algorithm's code and its 16 bytes.
    digest = tensor_digest(torch.ones(2), "xxh3_128")
    write_chunk(tmp_path, NAME, [_rec(0, "recv", digest)], [None])
    data = (tmp_path / NAME).read_bytes()
    assert data[16 + 50] == 1 and data[16 + 56:16 + 72] == bytes.fromhex(digest.split(":")[1])
    assert len(data) == 16 + 72


def test_the_dtype_table_is_the_one_of_libjit():
    cc = (REPO / "interposer" / "src" / "log_chunk.cc").read_text()
    table = re.findall(r'\{(\d+), "(\w+)", (\d+), \w+\}', cc)
    assert [(int(code), name) for code, name, _ in table] == list(enumerate(DTYPE_NAMES, 1))
    assert all(int(size) == getattr(torch, name).itemsize for _, name, size in table)


def _documented(text: str) -> tuple[list[str], str]:
    """The layout table's lines and the dtype paragraph of a docstring or a // comment."""
    lines = [line.strip().removeprefix("//").strip() for line in text.splitlines()]
    start, end = lines.index("offset  size  field"), next(
        i for i, line in enumerate(lines) if line.startswith("data section:"))
    codes = lines.index(next(line for line in lines if line.startswith("dtype codes")))
    return lines[start:end + 1], " ".join(lines[codes:lines.index("", codes) if "" in lines[codes:] else None])


def test_the_layout_is_documented_the_same_in_both_languages():
    import jitckpt.swift.pipeline.logging_records as records
    header = (REPO / "interposer" / "src" / "log_chunk.h").read_text().split("#pragma once")[0]
    table, codes = _documented(records.__doc__)
    assert (table, codes) == _documented(header)
    assert len(table) == 23 and "20 complex128." in codes
    assert codes.startswith("dtype codes (torch names): " + ", ".join(
        f"{c} {n}" for c, n in enumerate(DTYPE_NAMES, 1)))


def test_writer_refuses_what_the_layout_cannot_hold(tmp_path):
    t = torch.zeros(2)
    for rec, tensor, message in [
            (_rec(0), torch.zeros(2, device="meta"), "contiguous and on the CPU"),
            (_rec(0), torch.zeros(4, 2).t(), "contiguous and on the CPU"),
            (_rec(0, digest="d"), t, "digest 'd' is neither empty nor"),
            (_rec(0, digest="xxh3_128:" + "A" * 32), t, "32 lowercase hex digits"),
            (_rec(0, kind="both"), t, "kind 'both' is none of send, recv"),
            (_rec(0, payload="weights"), t, "payload 'weights' is none of activation, gradient"),
            (LogRecord(key=MessageKey(1, 0, ACTIVATION, 0, 2 ** 31), seq=0, generation=0, kind="send",
                       digest=""), t, "does not fit the chunk layout"),
            (_rec(0), torch.zeros((1,) * 256), "does not fit the chunk layout")]:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            write_chunk(tmp_path, NAME, [_rec(1), rec], [t, tensor])
        assert f"chunk {NAME}: record 1 (" in str(info.value)
    with pytest.raises(ValueError, match="1 records but 2 tensors"):
        write_chunk(tmp_path, NAME, [_rec(0)], [t, t])
    assert not list(tmp_path.iterdir())  # nothing written, no temporary left behind


def test_an_unknown_dtype_is_named(tmp_path, monkeypatch):
    import jitckpt.swift.pipeline.logging_records as records
    monkeypatch.setattr(records, "_DTYPE_CODES", {n: c for n, c in records._DTYPE_CODES.items()
                                                  if n != "bfloat16"})
    with pytest.raises(ValueError, match="dtype bfloat16 has no code in the chunk format"):
        write_chunk(tmp_path, NAME, [_rec(0)], [torch.zeros(1, dtype=torch.bfloat16)])


def _patched(at: int, raw: bytes) -> bytes:
    return GOLDEN[:at] + raw + GOLDEN[at + len(raw):]


OTHER = "written by another jitckpt version; replay from the global checkpoint instead"
DAMAGE = [
    ("empty", b"", "truncated: 0 bytes, shorter than the 16-byte file header"),
    ("header cut", GOLDEN[:10], "shorter than the 16-byte file header"),
    ("record cut", GOLDEN[:40], "truncated: 1 records need more"),
    ("dims cut", GOLDEN[:16 + 72 + 4], "record 0: truncated (the file ends inside its dimensions)"),
    ("tensor cut", GOLDEN[:-1], "lie beyond the end of the file (11 bytes of data): truncated"),
    ("trailing", GOLDEN + b"x", "1 bytes after the last tensor"),
    ("bad magic", _patched(0, b"XIT"), "not a SWIFT log chunk"),
    ("other version", _patched(7, b"\x02"), f"chunk format version 2, this jitckpt reads version 1: {OTHER}"),
    ("old JSON", struct.pack("<Q", 15) + b'{"records": []}', f"a chunk with a JSON header: {OTHER}"),
    ("reserved header", _patched(12, b"\x01"), "reserved header field is 1, not 0"),
    ("too many records", _patched(8, b"\x10"), "truncated: 16 records need more"),
    ("offset beyond the end", _patched(16 + 16, struct.pack("<Q", 1000)),
     "tensor bytes [1000, 1012) of the data section lie beyond"),
    ("payload code", _patched(16 + 48, b"\x03"), "record 0: unknown payload code 3"),
    ("kind code", _patched(16 + 49, b"\x00"), "record 0: unknown kind code 0"),
    ("digest code", _patched(16 + 50, b"\x07"), "record 0: unknown digest algorithm code 7"),
    ("dtype code", _patched(16 + 51, b"\x63"), "record 0: unknown dtype code 99"),
    ("reserved bytes", _patched(16 + 54, b"\x01"), "record 0: reserved bytes are not 0"),
    ("stray digest", _patched(16 + 60, b"\x01"), "record 0: digest bytes without a digest algorithm"),
    ("nbytes", _patched(16 + 24, b"\x08"), "record 0: nbytes 8, but shape [3] of int32 is 12 bytes"),
    ("negative dim", _patched(16 + 72, struct.pack("<q", -1)), "record 0: negative dimension in shape [-1]"),
    ("tensor without dtype", _patched(16 + 51, b"\x00"), "record 0: no tensor, yet ndim 1"),
]


@pytest.mark.parametrize("data,message", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_reader_names_the_file_and_the_problem(tmp_path, data, message):
    path = tmp_path / NAME
    path.write_bytes(data)
    with pytest.raises(ChunkFormatError) as info:
        read_chunk(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), str(info.value)


def test_reader_wants_the_tensors_back_to_back(tmp_path):
    t = torch.arange(3, dtype=torch.int32)
    write_chunk(tmp_path, NAME, [_rec(0), _rec(1)], [t, t])
    data = bytearray((tmp_path / NAME).read_bytes())
    second = 16 + 72 + 8  # the second record's fixed part, after the first's one dimension
    assert struct.unpack_from("<Q", data, second + 16) == (12,)
    struct.pack_into("<Q", data, second + 16, 0)  # both tensors at offset 0
    (tmp_path / NAME).write_bytes(bytes(data))
    with pytest.raises(ChunkFormatError, match=re.escape(
            "record 1: tensor at offset 0 of the data section, expected 12 (tensors are back to back)")):
        read_chunk(tmp_path / NAME)


def test_reader_reads_the_golden_chunk(tmp_path):
    (tmp_path / NAME).write_bytes(GOLDEN)
    [(rec, t)] = read_chunk(tmp_path / NAME)
    assert rec == LogRecord(key=MessageKey(iteration=7, micro_batch=1, payload=ACTIVATION, src=0, dst=1),
                            seq=3, generation=2, kind="send", digest="")
    assert torch.equal(t, torch.tensor([5, -6, 7], dtype=torch.int32))
    assert MAGIC == GOLDEN[:8]
