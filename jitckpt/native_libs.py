"""Where the native libraries are: the installed wheel (jitckpt/lib) or a dev build (build/native/lib)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

_PKG = Path(__file__).resolve().parent


def native_lib_dir() -> Optional[Path]:
    """Directory holding libjit.so (and simcuda/), or None if jitckpt was built without them."""
    candidates = [os.environ.get("JITCKPT_NATIVE_DIR"), _PKG / "lib",
                  _PKG.parent / "build" / "native" / "lib"]
    for c in candidates:
        if c and (Path(c) / "libjit.so").is_file():
            return Path(c)
    return None


def libjit_path() -> Path:
    d = native_lib_dir()
    if d is None:
        raise FileNotFoundError(
            "libjit.so not found: build it (`make native`, or `pip install .` with the CUDA headers and "
            "nvidia-nccl-cu13 present) or pass its path, e.g. --preload /path/to/libjit.so")
    return d / "libjit.so"
