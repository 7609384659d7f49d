"""Streaming checksums for in-memory snapshot objects.

xxHash3-64 (about twice zlib's CRC32 speed here, and the checksum is on the restore path) from
jitckpt's native module ``_copy_hash`` (built with the package), else from the ``xxhash``
package; zlib CRC32 when neither is there. The algorithm's name is stored next to each checksum,
so a reader always verifies with the algorithm the writer used.
"""
from __future__ import annotations

import mmap
import warnings
import zlib
from typing import Any, Optional

import numpy as np

try:
    from jitckpt import _copy_hash as _native
except ImportError:  # a pure-Python install
    _native = None
try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised only without the optional package
    _xxhash = None

ALGORITHMS = ("xxh3_64", "crc32")
# A floating type's element size and exponent bits: all of them set is a NaN or an Inf.
_EXPONENT = {"torch.float16": (2, 0x7C00), "torch.bfloat16": (2, 0x7F80),
             "torch.float32": (4, 0x7F800000), "torch.float64": (8, 0x7FF0000000000000)}
DEFAULT_ALGORITHM = "xxh3_64" if _native is not None or _xxhash is not None else "crc32"


class Checksum:
    """Incremental checksum; ``update(buffer)`` or ``copy(dst, src)``, then ``value()`` (an int)."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"checksum algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm == "xxh3_64" and _native is None and _xxhash is None:
            raise ValueError("checksum xxh3_64 needs jitckpt's native module or the 'xxhash' package: "
                             "pip install xxhash")
        self.algorithm = algorithm
        self._h: Any = None
        self._one_pass = algorithm == "xxh3_64" and _native is not None
        if algorithm == "xxh3_64":
            self._h = _native.Xxh3() if self._one_pass else _xxhash.xxh3_64()
        self._crc = 0

    def update(self, data: Any, *, finite: Any = None) -> bool:
        """Hash the bytes of ``data``. ``finite``: a floating torch dtype the bytes hold; returns
        False if one of them is NaN or Inf (checked natively for float16/bfloat16/float32/float64,
        block by block while in cache), True otherwise."""
        exponent = _EXPONENT.get(str(finite)) if finite is not None else None
        if self._one_pass:
            itemsize, mask = exponent or (0, 0)
            ok = self._h.update(data, itemsize=itemsize, exponent_mask=mask)
            if finite is None or exponent is not None:
                return ok
        elif self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
        return finite is None or _all_finite(data, finite)

    def copy(self, dst: np.ndarray, src: Optional[np.ndarray], *, bypass_cache: bool = False) -> None:
        """Copy ``src`` into ``dst`` (uint8 arrays of one length; None: zero-fill) and hash the bytes.

        Natively in one pass (each block hashed while in cache, the GIL released); ``bypass_cache``
        writes a large copy with streaming stores, for memory this process will not read soon (the
        keeper's). Otherwise a numpy copy (glibc memcpy), then a hash of the copy."""
        if self._one_pass:
            self._h.copy(dst, src, bypass_cache=bypass_cache)
            return
        if src is None:
            dst.fill(0)
        else:
            np.copyto(dst, src)
        self.update(dst)

    def copy_flat(self, dst: np.ndarray, flat: Any, start: int, *, bypass_cache: bool = False) -> None:
        """Copy bytes ``[start, start + len(dst))`` of :class:`~jitckpt.snapshot.layout.FlatState`
        ``flat`` into uint8 array ``dst`` and hash them, as :meth:`copy` of each piece in turn:
        natively in one call (the GIL released once, whatever the number of tensors), else piece
        by piece."""
        if self._one_pass:
            addrs, offsets, sizes = flat.pieces()
            self._h.copy_gather(dst, addrs, offsets, sizes, start, bypass_cache=bypass_cache)
            return
        for pos, src, k in flat.segments(start, len(dst)):
            self.copy(dst[pos:pos + k], src, bypass_cache=bypass_cache)

    def value(self) -> int:
        return self._h.intdigest() if self._h is not None else self._crc


def copy_bytes(dst: np.ndarray, src: np.ndarray, *, bypass_cache: bool = False) -> None:
    """Copy uint8 array ``src`` into ``dst`` (one length), the GIL released. ``bypass_cache``:
    natively with streaming stores, which skip reading ``dst``'s lines first (about 30 % faster
    than memcpy for a large copy here) and leave none of them in cache; numpy's copy without the
    native module."""
    if _native is not None:
        _native.copy(dst, src, bypass_cache=bypass_cache)
    else:
        np.copyto(dst, src)


def _all_finite(data: Any, dtype: Any) -> bool:
    """Whether the ``dtype`` elements in buffer ``data`` are all finite (no native check for it)."""
    import torch  # local: only a check without the native module gets here

    if memoryview(data).nbytes == 0:
        return True
    with warnings.catch_warnings():  # a read-only buffer (the keeper's object) is only read here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
    # a finite sum proves every element finite; a non-finite one may be an overflow only
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def checksum_of(data: Any, algorithm: str = DEFAULT_ALGORITHM, chunk: int = 8 << 20) -> int:
    """Checksum of a whole buffer, fed in chunks (keeps the GIL released for long stretches)."""
    mv = memoryview(data).cast("B")
    h = Checksum(algorithm)
    for off in range(0, len(mv), chunk):
        h.update(mv[off:off + chunk])
    return h.value()


def copy_verified(src: Any, algorithm: str = DEFAULT_ALGORITHM, chunk: int = 1 << 20) -> tuple[Any, int]:
    """A private copy of buffer ``src`` (a uint8 tensor) and the checksum of the bytes copied.

    One pass (:meth:`Checksum.copy`). The copy lives in its own anonymous mapping, paged as the
    system's transparent huge page policy says: advising huge pages made a 256 MiB restore 4x
    slower on our VM, where each fresh 2 MiB page is backed by the host on first touch (100 MB/s
    vs 1 GB/s for 4 KiB pages, measured).
    """
    import torch  # local: the checksum functions above do not need it

    n = src.numel()
    h = Checksum(algorithm)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8), h.value()
    # MAP_POPULATE: the kernel faults the pages in one call, about twice as fast as one trap
    # per page during the copy (256 MiB: 88 ms vs 167 ms for allocate + copy, measured here).
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    dst = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
    d, s = dst.numpy(), src.numpy()
    for off in range(0, n, chunk):  # chunks: the fallback hashes each copied chunk while in cache
        h.copy(d[off:off + chunk], s[off:off + chunk])
    return dst, h.value()
