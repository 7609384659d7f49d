"""libjit.so in front of the real CUDA runtime, and the jitckpt._native control module.

Needs the native build (``make native``): build/native/lib/libjit.so, the nvcc-built probe in
build/native/tests/dp_cuda, and jitckpt/_native*.so. No GPU is needed: without one the real
libcudart.so.13 returns error codes, and the point is that they come back unchanged.
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
PROBE = BUILD / "tests" / "dp_cuda" / "passthrough_probe"
REAL_CUDART_DIR = Path("/usr/local/cuda/lib64")
TIMEOUT_S = 60


def need(*paths: Path) -> None:
    """Skip the test, naming the missing artifact and how to build it."""
    for p in paths:
        if not p.exists():
            pytest.skip(f"{p} is missing: build with `make native` (or set JITCKPT_BUILD_DIR)")


def clean_env(**extra: str) -> dict[str, str]:
    """Environment without any inherited preload/verbosity, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "JITCKPT_VERBOSE", "JITCKPT_HANG_TIMEOUT")}
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # subprocess.run kills the child (by PID) if it outlives the timeout.
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)


def test_probe_references_versioned_cudart_symbols() -> None:
    """The probe imports cudaX@libcudart.so.13 like torch does, so the next test covers that case."""
    need(PROBE)
    syms = run(["readelf", "--dyn-syms", "-W", str(PROBE)], clean_env()).stdout
    assert "cudaStreamWaitEvent@libcudart.so.13" in syms
    assert "__cudaLaunchKernel@libcudart.so.13" in syms


@pytest.mark.parametrize("suffix", ["", "_ptsz"], ids=["legacy-stream", "per-thread-stream"])
def test_real_cudart_results_unchanged_under_preload(suffix: str) -> None:
    """Same with the probe built with --default-stream per-thread (cudaX_ptsz / cudaMemcpy_ptds)."""
    probe = PROBE.with_name(PROBE.name + suffix)
    need(LIBJIT, probe, REAL_CUDART_DIR / "libcudart.so.13")
    base = clean_env(LD_LIBRARY_PATH=str(REAL_CUDART_DIR))
    plain = run([str(probe)], base)
    pre = run([str(probe)], {**base, "LD_PRELOAD": str(LIBJIT), "JITCKPT_VERBOSE": "1"})
    assert plain.returncode == 0, plain.stderr
    assert pre.returncode == 0, pre.stderr
    # Same call, same real error code, line by line (no GPU here: e.g. cudaErrorInsufficientDriver).
    assert pre.stdout == plain.stdout
    lines = plain.stdout.splitlines()
    assert len(lines) >= 15
    assert any("cudaError" in line and "cudaSuccess" not in line for line in lines)
    # The versioned references were bound to libjit.so's unversioned definitions, which forwarded
    # to the real runtime (the verbose log names each symbol when it is first resolved).
    ptsz = {"": "", "_ptsz": "_ptsz"}[suffix]
    for sym in (f"cudaEventRecord{ptsz}", f"cudaStreamWaitEvent{ptsz}", f"cudaMemcpyAsync{ptsz}",
                f"__cudaLaunchKernel{ptsz}", f"cudaLaunchKernel{ptsz}", f"cudaStreamSynchronize{ptsz}",
                f"cudaMemsetAsync{ptsz}", "cudaMemcpy_ptds" if ptsz else "cudaMemcpy", "cudaDeviceSynchronize",
                "cudaGetLastError"):
        assert f"interposed {sym} -> 0x" in pre.stderr, (sym, pre.stderr)
    assert "cannot find the next definition" not in pre.stderr


def test_torch_cuda_available_unchanged_under_preload() -> None:
    need(LIBJIT)
    probe = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    version = run([sys.executable, "-c", "import torch; print(torch.version.cuda)"], clean_env())
    if version.returncode != 0 or version.stdout.strip() in ("", "None"):
        pytest.skip("the installed torch is not a CUDA build (torch.version.cuda is None)")
    plain = run([sys.executable, "-c", probe], clean_env())
    pre = run([sys.executable, "-c", probe], clean_env(LD_PRELOAD=str(LIBJIT)))
    assert plain.returncode == 0 and pre.returncode == 0, (plain.stderr, pre.stderr)
    assert pre.stdout == plain.stdout


def test_native_module_without_preload_reports_and_validates() -> None:
    from jitckpt import _native

    status = _native.status()
    assert status["preloaded"] is False
    assert "LD_PRELOAD" in status["reason"]
    assert _native.preloaded() is False
    assert _native.configure(mode="observe", hang_timeout=5.0) is False  # valid, nothing to apply
    with pytest.raises(ValueError, match="only mode='observe'"):
        _native.configure(mode="transparent")
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        _native.configure(hang_timeout=0)
    with pytest.raises(ValueError, match="bad hang timeout option 'mult=x'"):
        _native.configure(hang_timeout="auto:floor=3,mult=x")
    assert _native.configure(hang_timeout="auto:floor=3,startup=9") is False  # the grammar parses
    with pytest.raises(ValueError, match="unknown phase 'fwd'.*forward"):
        _native.set_phase("fwd")
    with pytest.raises(ValueError, match="step must be >= 0"):
        _native.mark_minibatch(-1)
    with pytest.raises(TypeError, match="must be callable"):
        _native.set_failure_callback(42)
    with pytest.raises(RuntimeError, match="LD_PRELOAD"):
        _native.trigger_failure("manual", "no libjit.so here")


PRELOADED_SCRIPT = textwrap.dedent("""
    import json, threading
    from jitckpt import _native
    assert _native.configure(mode="observe", hang_timeout=2.5) is True
    _native.mark_minibatch(7)
    _native.set_phase("backward")
    before = _native.status()
    seen = {}
    done = threading.Event()
    def cb(kind, detail):
        seen.update(kind=kind, detail=detail, on_main=threading.current_thread() is threading.main_thread(),
                    saving=_native.status()["saving"], redirect=_native.status()["redirect_active"])
        done.set()
    _native.set_failure_callback(cb)
    _native.trigger_failure("manual", "test report")
    assert done.wait(20), "callback did not run"
    print(json.dumps({"before": before, "seen": seen, "after": _native.status()}))
""")


def test_native_module_preloaded_status_markers_and_callback() -> None:
    need(LIBJIT)
    proc = run([sys.executable, "-c", PRELOADED_SCRIPT], clean_env(LD_PRELOAD=str(LIBJIT)))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    before, seen, after = out["before"], out["seen"], out["after"]
    assert before["preloaded"] is True and before["mode"] == "observe"
    assert Path(before["library"]).resolve() == LIBJIT.resolve()
    assert before["hang_timeout"] == 2.5
    assert before["step"] == 7 and before["phase"] == "backward"
    assert before["in_flight"] == [] and before["nccl_streams"] == [] and before["last_error"] is None
    # The callback ran once, on libjit.so's watchdog thread.
    assert seen == {"kind": "manual", "detail": "test report", "on_main": False, "saving": True,
                    "redirect": False}  # no CUDA runtime in this process: no save stream
    assert after["last_error"]["kind"] == "manual"
    assert after["last_error"]["step"] == 7 and after["last_error"]["phase"] == "backward"
    assert after["watchdog_running"] is True


DOCUMENTED_AUTO = "auto:floor=30,mult=10,startup=120,window=64,warmup=3"


@pytest.mark.parametrize("value,policy,now", [
    (None, DOCUMENTED_AUTO, 120.0),  # unset: the one default, auto
    ("1.5", "1.5", 1.5),
    ("auto", DOCUMENTED_AUTO, 120.0),
    ("auto:floor=3,mult=10,startup=60,warmup=3", "auto:floor=3,mult=10,startup=60,window=64,warmup=3", 60.0),
    ("soon", DOCUMENTED_AUTO, 120.0),  # refused, with a word on stderr
])
def test_hang_timeout_from_environment(value, policy, now) -> None:
    """libjit.so reads the launcher's grammar: `auto:...` was once ignored (300 s) in every worker."""
    need(LIBJIT)
    script = "import json; from jitckpt import _native; s = _native.status(); " \
             "print(json.dumps([s['hang_timeout_policy'], s['hang_timeout']]))"
    env = clean_env(LD_PRELOAD=str(LIBJIT), **({} if value is None else {"JITCKPT_HANG_TIMEOUT": value}))
    proc = run([sys.executable, "-c", script], env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [policy, now]
    assert ("ignoring JITCKPT_HANG_TIMEOUT=soon" in proc.stderr) == (value == "soon"), proc.stderr


@pytest.mark.parametrize("flag", [[], ["--hang-timeout", "auto"]], ids=["default", "explicit-auto"])
def test_launcher_hang_timeout_reaches_libjit_as_documented(tmp_path, flag) -> None:
    """`jitckpt run --preload-libjit` with no --hang-timeout, and with `auto` typed: every worker's
    libjit.so runs the documented policy (floor 30 s, 10x, 120 s at start)."""
    need(LIBJIT)
    script = tmp_path / "show.py"
    out = tmp_path / "policy"
    script.write_text(textwrap.dedent(f"""
        import json, os
        import jitckpt
        jitckpt.init(lambda path: None)
        from jitckpt import _native
        s = _native.status()
        with open({str(out)!r} + os.environ["RANK"], "w") as f:
            json.dump([s["hang_timeout_policy"], s["hang_timeout"]], f)
    """))
    proc = subprocess.run([sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2",
                           "--preload", "libjit", *flag, "--run-dir", str(tmp_path / "run"),
                           "--checkpoint-dir", str(tmp_path / "ckpt"), str(script)],
                          env=clean_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ignoring JITCKPT_HANG_TIMEOUT" not in proc.stdout + proc.stderr
    for rank in (0, 1):
        assert json.loads((tmp_path / f"policy{rank}").read_text()) == [DOCUMENTED_AUTO, 120.0]
