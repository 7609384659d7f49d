"""Runs the C++ unit tests of libjit.so's CUDA-free building blocks (interposer/tests/unit_tests.cc)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.native

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("JITCKPT_BUILD_DIR", REPO / "build" / "native"))
BINARY = BUILD / "bin" / "interposer_unit_tests"


def test_interposer_unit_tests_pass() -> None:
    if not BINARY.exists():
        pytest.skip(f"{BINARY} is missing: build with `make native` (or set JITCKPT_BUILD_DIR)")
    proc = subprocess.run([str(BINARY)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK (0 failed checks)")
