"""Where the native build puts what the dp_cuda tests run: libjit.so, simcuda, the DP program."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("JITCKPT_BUILD_DIR", REPO / "build" / "native"))
LIBJIT = BUILD / "lib" / "libjit.so"
SIMCUDA = BUILD / "lib" / "simcuda"
DP_LIBS = BUILD / "tests" / "dp_cuda"
DRIVER = REPO / "tests" / "native" / "dp_cuda" / "dp_train.py"


def need_build() -> None:
    """Skip, naming the missing file, unless the native build is there."""
    for p in (LIBJIT, SIMCUDA / "libcudart.so.13", SIMCUDA / "libnccl.so.2", DP_LIBS / "libdp_train.so",
              DP_LIBS / "libdp_train_kernels.so"):
        if not p.exists():
            pytest.skip(f"{p} is missing: build with `make native` (or set JITCKPT_BUILD_DIR)")
