"""Streaming checksums for in-memory snapshot objects.

xxHash3-64 when the ``xxhash`` package is installed (about twice zlib's CRC32 speed here, and the
checksum is on the restore path), zlib CRC32 otherwise. The algorithm's name is stored next to
each checksum, so a reader always verifies with the algorithm the writer used.
"""
from __future__ import annotations

import mmap
import zlib
from typing import Any

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised only without the optional package
    _xxhash = None

ALGORITHMS = ("xxh3_64", "crc32")
DEFAULT_ALGORITHM = "xxh3_64" if _xxhash is not None else "crc32"


class Checksum:
    """Incremental checksum; ``update(buffer)`` then ``value()`` (an int)."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"checksum algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm == "xxh3_64" and _xxhash is None:
            raise ValueError("checksum xxh3_64 needs the 'xxhash' package: pip install xxhash")
        self.algorithm = algorithm
        self._h: Any = _xxhash.xxh3_64() if algorithm == "xxh3_64" else None
        self._crc = 0

    def update(self, data: Any) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int:
        return self._h.intdigest() if self._h is not None else self._crc


def checksum_of(data: Any, algorithm: str = DEFAULT_ALGORITHM, chunk: int = 8 << 20) -> int:
    """Checksum of a whole buffer, fed in chunks (keeps the GIL released for long stretches)."""
    mv = memoryview(data).cast("B")
    h = Checksum(algorithm)
    for off in range(0, len(mv), chunk):
        h.update(mv[off:off + chunk])
    return h.value()


def copy_verified(src: Any, algorithm: str = DEFAULT_ALGORITHM, chunk: int = 1 << 20) -> tuple[Any, int]:
    """A private copy of buffer ``src`` (a uint8 tensor) and the checksum of the bytes copied.

    One pass: each chunk is hashed from the copy while it is still in cache. (Copying the next
    chunk on a helper thread meanwhile was slower on a loaded machine: one thread wake-up per
    chunk.) The copy lives in its own anonymous mapping, paged as the system's transparent huge
    page policy says: advising huge pages made a 256 MiB restore 4x slower on our VM, where
    each fresh 2 MiB page is backed by the host on first touch (100 MB/s vs 1 GB/s for 4 KiB
    pages, measured).
    """
    import numpy as np  # local: the checksum functions above need neither
    import torch

    n = src.numel()
    h = Checksum(algorithm)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8), h.value()
    # MAP_POPULATE: the kernel faults the pages in one call, about twice as fast as one trap
    # per page during the copy (256 MiB: 88 ms vs 167 ms for allocate + copy, measured here).
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    dst = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
    mv, d, s = memoryview(m), dst.numpy(), src.numpy()
    try:
        for off in range(0, n, chunk):
            # numpy's copy is glibc memcpy (about 1.7x torch's single-thread uint8 copy_ here)
            np.copyto(d[off:off + chunk], s[off:off + chunk])
            h.update(mv[off:off + chunk])
    finally:
        mv.release()
    return dst, h.value()
