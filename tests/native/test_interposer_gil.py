"""The JIT callback runs while the main thread holds the GIL and is blocked in cudaStreamSynchronize.

The main thread calls, through ctypes.PyDLL (which keeps the GIL), a helper that blocks a stream
with a host function, has libjit.so report a failure from there, and then waits in
cudaStreamSynchronize. libjit.so's watchdog thread must take the GIL from it (signal hand-off) and
the callback's plain cudaMemcpy must not queue behind the blocked stream (legacy default stream
semantics: it would) -- libjit.so moves it to a fresh stream. Verified on simcuda.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.native

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("JITCKPT_BUILD_DIR", REPO / "build" / "native"))
LIBJIT = BUILD / "lib" / "libjit.so"
SIMCUDA = BUILD / "lib" / "simcuda"
BLOCKER = BUILD / "tests" / "dp_cuda" / "libgil_blocker.so"
TIMEOUT_S = 60

SCRIPT = textwrap.dedent("""
    import ctypes, json, os, sys, threading
    from jitckpt import _native
    mode = sys.argv[1]
    lib = ctypes.PyDLL(sys.argv[2])
    n = 1000
    expected = [float(i) * 0.5 for i in range(n)]
    host = (ctypes.c_float * n)(*expected)
    dev = ctypes.c_void_p()
    assert lib.blocker_upload(ctypes.byref(dev), host, n) == 0
    release_r, release_w = os.pipe()
    main_ident = threading.main_thread().ident

    def save(kind, detail):
        _native.set_save_thread(True)  # already so on the watchdog thread; needed on a deferred saver
        out = (ctypes.c_float * n)()
        rc = lib.copy_to_host(out, dev, n)  # plain cudaMemcpy on the legacy default stream
        status = _native.status()
        print(json.dumps({"kind": kind, "detail": detail, "copy_rc": rc, "copy_ok": list(out) == expected,
                          "on_main": threading.get_ident() == main_ident,
                          "preemptions": status["gil_preemptions"], "saving": status["saving"],
                          "redirect_active": status["redirect_active"]}), flush=True)

    def on_failure(kind, detail):
        if mode == "deferred":  # only schedule the save; it runs after the callback has returned
            threading.Thread(target=lambda: (save(kind, detail), os._exit(76))).start()
            return
        save(kind, detail)
        if mode == "exit":
            raise SystemExit(75)
        os.write(release_w, b"x")  # let the blocked stream finish; main gets the GIL back

    _native.set_failure_callback(on_failure, gil_grace_s=0.1, resume=(mode == "return"))
    rc = lib.block_and_sync(release_r)  # holds the GIL; returns only after the callback released it
    print(json.dumps({"main_resumed": True, "sync_rc": rc, "preemptions": _native.status()["gil_preemptions"],
                      "redirect_active": _native.status()["redirect_active"]}), flush=True)
""")


def run_blocked_main(mode: str) -> subprocess.CompletedProcess[str]:
    for p in (LIBJIT, SIMCUDA / "libcudart.so.13", BLOCKER):
        if not p.exists():
            pytest.skip(f"{p} is missing: build with `make native` (or set JITCKPT_BUILD_DIR)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "SIMCUDA_"))}
    env.update(LD_PRELOAD=str(LIBJIT), LD_LIBRARY_PATH=str(SIMCUDA), PYTHONPATH=str(REPO))
    # subprocess.run kills the child by PID if the hand-off deadlocks.
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, str(BLOCKER)], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=REPO)


def test_callback_preempts_gil_holder_blocked_in_cuda_and_saves() -> None:
    proc = run_blocked_main("exit")
    assert proc.returncode == 75, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(lines) == 1, proc.stdout  # the main thread never came back
    got = lines[0]
    assert got["kind"] == "hang" and "host function" in got["detail"]
    assert got["on_main"] is False
    assert got["preemptions"] >= 1  # the GIL was taken from the blocked main thread by the signal
    assert got["saving"] is True and got["redirect_active"] is True
    assert got["copy_rc"] == 0 and got["copy_ok"] is True  # copied on the fresh stream, no deadlock


def test_save_scheduled_on_another_thread_runs_with_main_still_parked() -> None:
    proc = run_blocked_main("deferred")
    assert proc.returncode == 76, proc.stderr
    (got,) = (json.loads(line) for line in proc.stdout.splitlines())
    # The callback returned; the main thread stayed parked without the GIL and the copy was still
    # redirected, so the other Python thread could save.
    assert got["on_main"] is False and got["preemptions"] >= 1
    assert got["saving"] is True and got["redirect_active"] is True
    assert got["copy_rc"] == 0 and got["copy_ok"] is True


def test_gil_handed_back_when_callback_returns_with_resume() -> None:
    proc = run_blocked_main("return")
    assert proc.returncode == 0, proc.stderr
    cb, main = (json.loads(line) for line in proc.stdout.splitlines())
    assert cb["copy_ok"] is True and cb["preemptions"] >= 1
    # The parked main thread re-took the GIL, its cudaStreamSynchronize completed, redirect is off.
    assert main == {"main_resumed": True, "sync_rc": 0, "preemptions": cb["preemptions"], "redirect_active": False}
