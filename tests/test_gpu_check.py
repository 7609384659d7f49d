"""`make gpu-check` (tests/gpu/gpu_check.py): without a GPU it runs nothing and says so; simulated
on simcuda every check runs end to end in its own process and lands in gpu-check.json and the table."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "tests" / "gpu" / "gpu_check.py"
sys.path.insert(0, str(REPO / "tests" / "gpu"))
from gpu_check import PLAN, find_gpu  # noqa: E402


def test_without_a_gpu_it_says_so_runs_nothing_and_exits_0(tmp_path):
    if find_gpu() is not None:
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, str(RUNNER), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "no GPU here" in out.stdout and "SIMULATE=1" in out.stdout
    assert json.loads((tmp_path / "gpu-check.json").read_text()) == {"device": None, "checks": []}
    assert not (tmp_path / "build.log").exists()  # nothing built either


@pytest.mark.native
def test_simulated_every_check_runs_in_its_own_process_and_reports(tmp_path):
    if not (REPO / "build" / "native" / "lib" / "libjit.so").is_file() or shutil.which("nvcc") is None and \
            not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("needs `make native` and nvcc")
    out = subprocess.run([sys.executable, str(RUNNER), "--out", str(tmp_path), "--simulate"], capture_output=True,
                         text=True, timeout=sum(t for _, t in PLAN) + 60)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["device"] == "simcuda" and report["simulate"] is True
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert list(status) == [name for name, _ in PLAN]
    assert status["programs"] == "pass" and status["numbers"] == "pass", report
    assert status["torch_observe"] == status["user_level_jit"] == "skip"  # this torch has no CUDA device
    assert status["arena"] == status["transparent_recovery"] == "pass", report  # simcuda's driver: the VMM arena
    numbers = next(c for c in report["checks"] if c["name"] == "numbers")["numbers"]
    assert {"direct sync_ns", "observe sync_ns", "proxy sync_ns"} <= set(numbers)
    table = (tmp_path / "gpu-check.md").read_text()
    assert "simulated on simcuda" in table and all(f"| {name} |" in table for name, _ in PLAN)


def test_a_check_that_ends_without_a_result_is_a_failure_with_its_log(tmp_path, monkeypatch):
    import gpu_check

    fake = tmp_path / "checks.py"
    fake.write_text("import sys\nprint('about to die')\nsys.exit(3)\n")
    monkeypatch.setattr(gpu_check, "CHECKS", fake)
    res = gpu_check.run_check("programs", 30, tmp_path, env={})
    assert res["status"] == "fail" and "exited with 3" in res["detail"] and "about to die" in res["log_tail"]
    fake.write_text("import time\ntime.sleep(60)\n")
    res = gpu_check.run_check("programs", 1, tmp_path, env={})
    assert res["status"] == "fail" and "deadline" in res["detail"] and res["seconds"] < 30


def test_wheels_of_missing_modules_are_unpacked_and_present_ones_left(tmp_path):
    import zipfile

    import gpu_check

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for module in ("jitckpt_absent_mod", "json"):  # json: this Python has it
        with zipfile.ZipFile(wheels / f"{module}-1.0-cp312-cp312-manylinux_2_28_x86_64.whl", "w") as z:
            z.writestr(f"{module}/__init__.py", "VALUE = 7\n")
    site = tmp_path / "site"
    assert gpu_check.vendor_wheels(wheels, site) == ["jitckpt_absent_mod"]
    assert (site / "jitckpt_absent_mod" / "__init__.py").is_file() and not (site / "json").exists()
    assert gpu_check.vendor_wheels(tmp_path / "none", site) == []
