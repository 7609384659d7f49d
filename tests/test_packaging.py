"""`pip install <repo>` as a user runs it (isolated build, a fresh venv, no toolkit hints) ships the
native parts, built against the CUDA and NCCL headers of NVIDIA's wheels when no toolkit is given,
and keeps simcuda's stand-in libraries out of the loader's way (issue 18). Slow: it builds
everything (minutes on 2 cores)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd: list, *, cwd: Path, env: dict, timeout: float) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r.stdout


@pytest.mark.timeout(1800)
def test_pip_install_ships_the_native_parts_and_doctor_reports_them(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_HOME", "LD_LIBRARY_PATH",
                                                             "JITCKPT_NATIVE_DIR")}
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env, timeout=120)
    py = venv / "bin" / "python"
    # The headers come from the build requirements (NVIDIA's wheels), as on a machine without a CUDA
    # toolkit: CMake is told to ignore the toolkit this machine has.
    toolkit = ["/usr/local/cuda/include", str(Path("/usr/local/cuda/include").resolve())]
    env["CMAKE_ARGS"] = "-DCMAKE_IGNORE_PATH=" + ";".join(toolkit)
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(REPO)], cwd=tmp_path, env=env, timeout=1700)
    del env["CMAKE_ARGS"]
    # Runtime dependencies (torch is large) from this environment's site-packages.
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path, env=env, timeout=60).strip())
    (site / "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pkg = Path(_run([str(py), "-c", "import jitckpt, os; print(os.path.dirname(jitckpt.__file__))"],
                    cwd=tmp_path, env=env, timeout=60).strip())
    assert pkg.is_relative_to(site), pkg  # the installed copy, not the repo's
    _run([str(py), "-c", "import jitckpt._native"], cwd=tmp_path, env=env, timeout=60)
    doctor = json.loads(_run([str(venv / "bin" / "jitckpt"), "doctor", "--json"], cwd=tmp_path, env=env,
                             timeout=120))
    native = doctor["native"]
    # the snapshot tier's native copy + checksum, from the installed package, used without being asked
    assert native["jitckpt._copy_hash"]["one_pass"], native
    assert Path(native["jitckpt._copy_hash"]["path"]).parent == pkg, native
    assert native["libjit.so"] == str(pkg / "lib" / "libjit.so"), native
    assert native["jitckpt-proxy"] == str(pkg / "lib" / "jitckpt-proxy"), native
    built = native["jitckpt._native"]["built_with"]
    assert built["cuda_runtime_version"] >= 13000 and "nvidia" in built["cuda_include"], built
    assert built["nccl_version"].startswith("2."), built
    # simcuda's libcudart.so.13 and libnccl.so.2 are only in jitckpt/lib/simcuda, which nothing puts on
    # the loader's path: libjit.so has no RPATH/RUNPATH, and a process here does not load them.
    dynamic = subprocess.run(["readelf", "-d", str(pkg / "lib" / "libjit.so")], capture_output=True, text=True,
                             timeout=60).stdout
    assert "RPATH" not in dynamic and "RUNPATH" not in dynamic, dynamic
    assert not list((pkg / "lib").glob("libcudart*")) and not list((pkg / "lib").glob("libnccl*"))
    for soname, info in doctor["runtime"].items():
        assert "simcuda" not in (info.get("kind") or ""), (soname, info)
    # The daemon's schema (daemon.proto, compiled at import) ships in the wheel: importing it from the
    # installed copy compiles the installed file.
    schema = _run([str(py), "-c", "import jitckpt.daemon.schema as s, os; print(os.path.dirname(s.__file__))"],
                  cwd=tmp_path, env=env, timeout=120).strip()
    assert Path(schema) == pkg / "daemon" and (pkg / "daemon" / "daemon.proto").is_file(), schema
