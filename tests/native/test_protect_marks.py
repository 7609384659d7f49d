"""``jitckpt.protect()``'s minibatch marks in proxy mode (issue 43 item 3): a transparent recovery
replays the failed minibatch on the buffers as they are at the failure, so the minibatch's journal
must hold the copies of its batch to the device. A PyTorch loop copies the batch before it calls the
model; protect() marks the minibatch when the previous optimizer step returns (and at restore()),
not in the forward pre-hook, which comes after those copies.

The script is protect_train.py: a torch module and optimizer whose work runs on simcuda through
ctypes (simcuda_progs/protect_input.cu), the batch copied into one reused device buffer that the
forward scales in place. Verified on simcuda only.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dp_build import need_cpu_torch
from simcuda_progs.simcuda_harness import BUILD, REPO, Program, build_program

pytestmark = pytest.mark.native
LIBJIT = BUILD / "lib" / "libjit.so"
SCRIPT = Path(__file__).resolve().parent / "protect_train.py"
STEPS = 8
FAIL_AT = 3  # the third all-reduce: step 2, before replay validation at minibatch 5
TIMEOUT_S = 90


@pytest.fixture(scope="module")
def lib() -> Program:
    if not LIBJIT.exists():
        pytest.skip(f"{LIBJIT} missing: run `make native`")
    need_cpu_torch()
    return build_program("protect_input", kernels=True, nccl=True, nvcc_flags=("-shared", "-Xcompiler", "-fPIC"))


def train(lib: Program, tmp: Path, name: str, **extra: str) -> tuple[int, bytes | None, str]:
    """protect_train.py in its own directory: exit code, final parameters, output."""
    run_dir = tmp / name
    run_dir.mkdir()
    out = run_dir / "params.bin"
    env = {k: v for k, v in lib.env(**extra).items() if not k.startswith("JITCKPT_") or k in extra}
    env.update(PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(lib.exe), str(STEPS), str(out)], cwd=run_dir, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, out.read_bytes() if out.exists() else None, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(lib: Program, tmp_path_factory) -> bytes:
    rc, params, out = train(lib, tmp_path_factory.mktemp("ref"), "direct")  # on simcuda, no libjit.so
    assert rc == 0 and params, out
    return params


def test_a_replayed_minibatch_gets_its_batch_again_after_the_forward_rewrote_the_input(
        lib: Program, reference: bytes, tmp_path: Path) -> None:
    """The all-reduce of step 2 fails (ncclSystemError): the new proxy replays step 2 from its mark.
    Marked after the batch's copies, the replay would scale the already scaled input buffer again
    and the run would end with other parameters; marked before them, it copies the batch again and
    ends bitwise equal to a failure-free run. Replay validation at minibatch 5 then also finds the
    minibatch's replay, from its start and from its state before the optimizer step, bitwise."""
    fired = tmp_path / "fired"
    rc, params, out = train(lib, tmp_path, "proxy", LD_PRELOAD=str(LIBJIT), JITCKPT_MODE="proxy",
                            SIMCUDA_FAIL_MODE="error", SIMCUDA_FAIL_AT=str(FAIL_AT), SIMCUDA_FAIL_ONCE=str(fired))
    assert fired.exists(), ("the fault was not injected", out)
    assert rc == 0, out
    assert re.search(r"recovered: jitckpt-proxy pid \d+ took over after replaying", out), out
    assert params == reference, ("the recovered run's parameters differ from a failure-free run's: the replayed "
                                 "minibatch did not get its batch again", out)
    assert re.search(r"replay validation at minibatch 5: replaying its \d+ calls .* bitwise", out), out
