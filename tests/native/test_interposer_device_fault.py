"""A sticky device fault is reported (and the JIT callback run) before the application sees it.

On a GPU a device fault (illegal address, ECC, ...) is sticky: every later runtime call returns it,
so an application often first meets it from a launch, an event record or the launch check
(cudaGetLastError), not from a synchronization. libjit.so must report it and hold the calling thread
until the callback has run, whichever interposed call returned it; otherwise the error reaches the
application first and it exits with an error instead of the JIT exit code (the flake this covers:
a rank whose all-reduce set a sticky fault exited 1 when the next cudaEventRecord saw it first).
The fault is set with simcuda's private simcudaSetStickyError. Verified on simcuda.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_interposer_gil import BLOCKER, LIBJIT, REPO, SIMCUDA, TIMEOUT_S

pytestmark = pytest.mark.native

CALLS = {"cudaGetLastError": 0, "cudaPeekAtLastError": 1, "cudaMemsetAsync": 2, "cudaEventRecord": 3}
CUDA_ERROR_ILLEGAL_ADDRESS = 700

SCRIPT = textwrap.dedent("""
    import ctypes, json, sys
    from jitckpt import _native
    lib = ctypes.PyDLL(sys.argv[2])
    dev = ctypes.c_void_p()
    host = (ctypes.c_float * 4)()
    assert lib.blocker_upload(ctypes.byref(dev), host, 4) == 0
    seen = []
    _native.set_failure_callback(lambda kind, detail: seen.append((kind, detail)), resume=True)
    rc = lib.sticky_fault_then(int(sys.argv[1]), dev)
    # What the application saw when the call returned: the callback must already have run.
    print(json.dumps({"rc": rc, "seen_before_return": list(seen)}), flush=True)
""")


@pytest.mark.parametrize("call", list(CALLS))
def test_sticky_fault_reported_before_call_returns(call: str) -> None:
    for p in (LIBJIT, SIMCUDA / "libcudart.so.13", BLOCKER):
        if not p.exists():
            pytest.skip(f"{p} is missing: build with `make native` (or set JITCKPT_BUILD_DIR)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "SIMCUDA_"))}
    env.update(LD_PRELOAD=str(LIBJIT), LD_LIBRARY_PATH=str(SIMCUDA), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(CALLS[call]), str(BLOCKER)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["rc"] == CUDA_ERROR_ILLEGAL_ADDRESS, got  # the application still gets the real error
    assert len(got["seen_before_return"]) == 1, (got, proc.stderr)
    kind, detail = got["seen_before_return"][0]
    assert kind == "cuda_error" and detail == f"{call} returned cudaErrorIllegalAddress", detail
