"""The native one-pass copy + XXH3-64 (jitckpt._copy_hash) against the xxhash package and numpy."""
from __future__ import annotations

import numpy as np
import pytest

xxhash = pytest.importorskip("xxhash")
_copy_hash = pytest.importorskip("jitckpt._copy_hash", reason="native module not built (make native)")

from jitckpt.snapshot import checksum  # noqa: E402
from jitckpt.snapshot.checksum import Checksum  # noqa: E402

# Around the 16-byte store alignment, the 64-byte store loop, the 64 KiB hash block and the
# 256 KiB streaming threshold.
SIZES = [0, 1, 15, 16, 17, 63, 64, 65, 4095, 65535, 65536, 65537, (256 << 10) - 1, 256 << 10,
         (1 << 20) + 7]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bypass_cache", [False, True])
def test_copy_equals_memcpy_and_xxh3_at_any_alignment(n: int, bypass_cache: bool) -> None:
    rng = np.random.default_rng(n)
    src_buf = rng.integers(0, 256, n + 64, dtype=np.uint8)
    dst_buf = np.full(n + 64, 7, dtype=np.uint8)
    for src_off, dst_off in [(0, 0), (1, 0), (0, 3), (5, 13)]:
        src, dst = src_buf[src_off:src_off + n], dst_buf[dst_off:dst_off + n]
        h = Checksum("xxh3_64")
        h.copy(dst, src, bypass_cache=bypass_cache)
        assert np.array_equal(dst, src)
        assert h.value() == xxhash.xxh3_64(src.tobytes()).intdigest()
        assert dst_buf[dst_off + n:].tolist() == [7] * (64 - dst_off)  # nothing written past the end
        dst_buf[:] = 7


def test_pieces_hash_as_one_stream_and_none_zero_fills() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 70_000, dtype=np.uint8), rng.integers(0, 256, 300_001, dtype=np.uint8)
    out = np.ones(a.size + 100 + b.size, dtype=np.uint8)
    h = Checksum("xxh3_64")
    h.copy(out[:a.size], a, bypass_cache=True)
    h.copy(out[a.size:a.size + 100], None)
    h.copy(out[a.size + 100:], b, bypass_cache=True)
    expect = a.tobytes() + bytes(100) + b.tobytes()
    assert out.tobytes() == expect
    assert h.value() == xxhash.xxh3_64(expect).intdigest()


def test_update_matches_the_package_and_the_fallback_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.random.default_rng(1).integers(0, 256, 100_003, dtype=np.uint8)
    native = Checksum("xxh3_64")
    native.update(data)
    monkeypatch.setattr(checksum, "_native", None)  # a pure-Python install
    fallback, dst = Checksum("xxh3_64"), np.empty_like(data)
    fallback.copy(dst, data, bypass_cache=True)
    assert np.array_equal(dst, data)
    assert native.value() == fallback.value() == xxhash.xxh3_64(data.tobytes()).intdigest()


def test_bad_buffers_are_refused_without_writing() -> None:
    h = Checksum("xxh3_64")
    dst = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="src has 9 bytes, dst 8"):
        h.copy(dst, np.ones(9, dtype=np.uint8))
    assert not dst.any()
    readonly = np.zeros(8, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        h.copy(readonly, np.ones(8, dtype=np.uint8))
    with pytest.raises(TypeError, match="C-contiguous"):
        h.copy(np.zeros(16, dtype=np.uint8)[::2], np.ones(8, dtype=np.uint8))


FLOATS = ["float16", "bfloat16", "float32", "float64"]


@pytest.mark.parametrize("dtype_name", FLOATS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
def test_update_finds_a_nan_or_inf_anywhere_and_passes_the_largest_finite(dtype_name: str, native: bool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore's verifier: hash + NaN/Inf check of each floating tensor's bytes."""
    import torch

    if not native:
        monkeypatch.setattr(checksum, "_native", None)
    dtype = getattr(torch, dtype_name)
    n = (200 << 10) // dtype.itemsize + 3  # several 64 KiB blocks and a ragged end
    big = torch.full((n,), torch.finfo(dtype).max, dtype=dtype)  # every exponent bit but one: finite
    big[::7] = -torch.finfo(dtype).max
    big[1::5] = torch.finfo(dtype).tiny / 2  # subnormal
    src = big.view(torch.uint8).numpy()
    h = Checksum("xxh3_64")
    assert h.update(src, finite=dtype) is True
    assert h.value() == xxhash.xxh3_64(src.tobytes()).intdigest()
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, (64 << 10) // dtype.itemsize, n - 1):  # first, a block's first, last
            t = big.clone()
            t[at] = bad
            src = t.view(torch.uint8).numpy()
            h = Checksum("xxh3_64")
            assert h.update(src, finite=dtype) is False, (bad, at)
            assert h.value() == xxhash.xxh3_64(src.tobytes()).intdigest()  # still hashed: the caller decides
    assert Checksum("xxh3_64").update(src) is True  # not asked: no check


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
def test_copy_bytes_streams_or_not_and_writes_exactly_its_range(n: int, native: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    if not native:
        monkeypatch.setattr(checksum, "_native", None)
    rng = np.random.default_rng(n)
    src_buf = rng.integers(0, 256, n + 64, dtype=np.uint8)
    dst_buf = np.full(n + 64, 7, dtype=np.uint8)
    for bypass_cache in (False, True):
        for src_off, dst_off in [(0, 0), (3, 0), (0, 5), (9, 13)]:
            checksum.copy_bytes(dst_buf[dst_off:dst_off + n], src_buf[src_off:src_off + n], bypass_cache=bypass_cache)
            assert np.array_equal(dst_buf[dst_off:dst_off + n], src_buf[src_off:src_off + n])
            assert dst_buf[:dst_off].tolist() == [7] * dst_off and dst_buf[dst_off + n:].tolist() == [7] * (64 - dst_off)
            dst_buf[:] = 7
    with pytest.raises(ValueError):
        checksum.copy_bytes(np.zeros(8, dtype=np.uint8), np.ones(9, dtype=np.uint8))
