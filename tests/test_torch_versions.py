"""torch 2.11, the GPU machine's version (issue 46): the parts of the suite that touch torch's
version-sensitive internals (SWIFT's inverses, DDP's and FSDP2's wrapped internals, the recoveries
that rest on them, the framework integrations) run again under a venv with torch 2.11.

`make venv-torch2.11` makes that venv (.venv-torch2.11; the PyPI wheel, a CUDA build that runs on
the CPU here, or `TORCH211_INDEX=--index-url https://download.pytorch.org/whl/cpu` for the CPU
wheel); `JITCKPT_TORCH211_VENV` names another. The whole fast suite passed on it once
(jitckpt/torch_compat.py TESTED says so); this slow test keeps the version-sensitive part honest.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("JITCKPT_TORCH211_VENV", REPO / ".venv-torch2.11"))
PART = ["tests/test_torch_compat.py", "tests/test_swift_undo.py", "tests/test_swift_undo_dp.py",
        "tests/test_undo_plugin.py", "tests/test_ddp_init_sync.py", "tests/test_e2e_recovery.py",
        "tests/test_protected_state.py", "tests/test_sharded_layouts.py", "tests/test_shard_parts.py",
        "tests/test_init_api.py", "tests/test_integration_transformers.py", "tests/test_integration_lightning.py",
        "tests/test_inprocess_units.py", "tests/test_inprocess_recovery.py"]
TIMEOUT_S = 1800


@pytest.mark.slow
def test_the_version_sensitive_part_of_the_suite_passes_on_torch_2_11() -> None:
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no torch 2.11 venv at {VENV}: `make venv-torch2.11` makes one (or set JITCKPT_TORCH211_VENV)")
    version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("2.11."), version.stdout + version.stderr
    env = {**os.environ, "JITCKPT_BUILD_DIR": str(REPO / "build" / "native")}
    # pytest's own timeout kills the run and its children by process group at the deadline.
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *PART], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
