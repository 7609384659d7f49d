"""`make gpu-check`: what only a GPU shows, in one command with a deadline (docs/gpu-check.md).

On a machine with an NVIDIA GPU it builds the native parts against the real toolkit and NCCL and
runs each check of tests/gpu/checks.py in a process of its own, with its own timeout, then writes
``gpu-check.json`` and ``gpu-check.md`` (a table) into ``--out``. Without a GPU it says so and exits
0 having run nothing; ``--simulate`` runs the same checks on simcuda (what ``make test`` does), where
a check that needs a real device says so as skipped. Exit status: 0 when no check failed.

Only the standard library here: the GPU machine has a preinstalled python3 and no network.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).resolve().parent / "checks.py"
# The checks, in order, with their deadlines (seconds): 8 minutes in all with the build.
PLAN = (("programs", 120), ("arena", 60), ("transparent_recovery", 90), ("torch_observe", 90),
        ("user_level_jit", 120), ("numbers", 90))
BUILD_TIMEOUT_S = 300


def find_gpu() -> Optional[str]:
    """The GPU's name (``nvidia-smi -L``'s first line), or None when there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    return lines[0] if out.returncode == 0 and lines else None


def build(build_dir: Path, log: Path) -> Optional[str]:
    """Configure and build the native parts with this Python; None, or why it failed."""
    cmake = shutil.which("cmake")
    if cmake is None:
        return "cmake not found"
    try:
        pybind = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], capture_output=True, text=True,
                                timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pybind = ""
    # No GoogleTest there, and another compiler: no unit tests, warnings do not fail the build.
    configure = [cmake, "-S", str(REPO), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                 "-DJITCKPT_UNIT_TESTS=OFF", "-DJITCKPT_WERROR=OFF",
                 f"-DPython_EXECUTABLE={sys.executable}", *([f"-Dpybind11_DIR={pybind}"] if pybind else [])]
    jobs = str(max(1, min(16, os.cpu_count() or 1)))
    with open(log, "w") as f:
        for cmd in (configure, [cmake, "--build", str(build_dir), f"-j{jobs}"]):
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                return f"{cmd[1]} ran past {BUILD_TIMEOUT_S} s (log: {log})"
            if rc != 0:
                return f"{' '.join(cmd[:2])} failed with {rc} (log: {log})"
    return None


def vendor_wheels(wheels: Path, site: Path) -> list:
    """Unpack each wheel in ``wheels`` whose module this Python lacks into ``site`` (a wheel is
    its site-packages layout, zipped: no pip, no network needed); the modules unpacked."""
    import importlib.util
    import zipfile

    done = []
    for whl in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        module = whl.name.split("-")[0]
        if importlib.util.find_spec(module) is not None:
            continue
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
        done.append(module)
    return done


def run_check(name: str, timeout: int, out: Path, env: dict) -> dict:
    """One check in a process group of its own, killed at its deadline; its result."""
    result_file = out / f"{name}.json"
    log = out / f"{name}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(CHECKS), name, "--result", str(result_file)], cwd=REPO, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what it started too
            except ProcessLookupError:
                pass
            proc.wait()
    seconds = time.monotonic() - t0
    if result_file.is_file():
        res = json.loads(result_file.read_text())
    elif rc is None:
        res = {"status": "fail", "detail": f"ran past its {timeout} s deadline"}
    else:
        res = {"status": "fail", "detail": f"exited with {rc} without a result"}
    if res["status"] == "fail":
        res["log_tail"] = log.read_text(errors="replace")[-3000:]
    return {"name": name, "seconds": round(seconds, 2), **res}


def table(report: dict) -> str:
    lines = [f"# gpu-check: {report['device']}", "",
             f"{report['when']}; {'simulated on simcuda' if report['simulate'] else 'measured on this GPU'}", "",
             "| check | status | s | what it showed |", "|---|---|---|---|"]
    for c in report["checks"]:
        shown = c.get("detail", "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {c['name']} | {c['status']} | {c['seconds']} | {shown} |")
    for c in report["checks"]:
        for k, v in c.get("numbers", {}).items():
            lines.append(f"| {c['name']}: {k} | number | | {v} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for gpu-check.json and gpu-check.md")
    ap.add_argument("--simulate", action="store_true", help="no GPU: run the checks on simcuda")
    ap.add_argument("--build-dir", type=Path, default=None,
                    help="native build to use or make (default: build/native with --simulate, build/gpu-check on a GPU)")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--wheels", type=Path, default=REPO / "build" / "gpu-wheels",
                    help="wheels of the packages jitckpt needs beyond the machine's (make gpu-wheels)")
    args = ap.parse_args()
    gpu = find_gpu()
    args.out.mkdir(parents=True, exist_ok=True)
    if gpu is None and not args.simulate:
        print("gpu-check: no GPU here (no nvidia-smi, or it lists none): nothing run. On a machine with an "
              "NVIDIA GPU: make gpu-check OUT=DIR; here, on simcuda: make gpu-check SIMULATE=1 OUT=DIR")
        (args.out / "gpu-check.json").write_text(json.dumps({"device": None, "checks": []}))
        return 0
    device = "simcuda" if args.simulate else gpu
    build_dir = args.build_dir or REPO / "build" / ("native" if args.simulate else "gpu-check")
    why = None if (args.simulate and (build_dir / "lib" / "libjit.so").is_file()) else build(
        build_dir, args.out / "build.log")
    site = build_dir / "gpu-check-site"
    vendored = vendor_wheels(args.wheels, site)
    if vendored:
        print(f"gpu-check: unpacked {', '.join(vendored)} from {args.wheels} (this Python lacks them)", flush=True)
    env = {**os.environ, "JITCKPT_BUILD_DIR": str(build_dir), "JITCKPT_NATIVE_DIR": str(build_dir / "lib"),
           "JITCKPT_TEST_DEVICE": "simcuda" if args.simulate else "cuda",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), *([str(site)] if vendored else []),
                                                        os.environ.get("PYTHONPATH")]))}
    wanted = [c for c in args.only.split(",") if c]
    checks = []
    for name, timeout in PLAN:
        if wanted and name not in wanted:
            continue
        if why is not None:
            checks.append({"name": name, "seconds": 0, "status": "fail", "detail": f"not run: the build failed: {why}"})
            continue
        print(f"gpu-check: {name} (at most {timeout} s) ...", flush=True)
        checks.append(run_check(name, timeout, args.out, env))
        print(f"gpu-check: {name}: {checks[-1]['status']} {checks[-1].get('detail', '')}", flush=True)
    report = {"device": device, "simulate": args.simulate, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "python": sys.version.split()[0], "vendored": vendored, "checks": checks}
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu-check.md").write_text(table(report))
    print(table(report))
    return 1 if any(c["status"] == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
