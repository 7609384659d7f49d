"""A small, really full file system for tests: a size-limited tmpfs mounted on a test directory.

Writes to it fail with ENOSPC exactly as on a full disk (RLIMIT_FSIZE would give EFBIG instead).
Mounting needs root (or CAP_SYS_ADMIN); where it is refused the test is skipped with the reason.
"""
from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

PAGE = 4096  # tmpfs allocates whole pages


@contextlib.contextmanager
def small_fs(mountpoint: Path, size: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` bytes on ``mountpoint`` (created); unmount it afterwards."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to simulate a full disk: {p.stderr.strip() or p.returncode}")
    try:
        yield mountpoint
    finally:
        # Lazy: a process the test failed to clean up must not leave the mount behind.
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=30)


def fill(mountpoint: Path, *, leave: int = 0) -> Path:
    """Fill the file system on ``mountpoint`` until about ``leave`` bytes (whole pages) are free."""
    free = shutil.disk_usage(mountpoint).free
    filler = mountpoint / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler
