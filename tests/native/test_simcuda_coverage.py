"""Every CUDA runtime and NCCL symbol PyTorch (cu130) imports is exported by simcuda, correctly versioned."""
from __future__ import annotations

import subprocess
import sys

import pytest

from simcuda_progs.simcuda_harness import BUILD, REPO, require_toolchain

pytestmark = pytest.mark.native


def test_torch_imports_all_exported() -> None:
    require_toolchain()
    proc = subprocess.run([sys.executable, str(REPO / "simcuda" / "tools" / "symbol_coverage.py"),
                           "--build-dir", str(BUILD)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cudart: 106 imported by torch, 106 exported" in proc.stdout
    assert "nccl: 51 imported by torch, 51 exported" in proc.stdout
    assert "0 missing, 0 wrong version" in proc.stdout
