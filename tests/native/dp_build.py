"""Where the native build puts what the dp_cuda tests run (libjit.so, simcuda, the DP program), the
environment they run it in, and the process tree of a job they start."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("JITCKPT_BUILD_DIR", REPO / "build" / "native"))
LIBJIT = BUILD / "lib" / "libjit.so"
SIMCUDA = BUILD / "lib" / "simcuda"
DP_LIBS = BUILD / "tests" / "dp_cuda"
DRIVER = REPO / "tests" / "native" / "dp_cuda" / "dp_train.py"


def need_build() -> None:
    """Skip, naming the missing file, unless the native build is there."""
    for p in (LIBJIT, SIMCUDA / "libcudart.so.13", SIMCUDA / "libnccl.so.2", DP_LIBS / "libdp_train.so",
              DP_LIBS / "libdp_train_kernels.so"):
        if not p.exists():
            pytest.skip(f"{p} is missing: build with `make native` (or set JITCKPT_BUILD_DIR)")


def need_cpu_torch() -> None:
    """Skip where a torch process runs a simcuda program: a CUDA build of torch (PyPI's torch 2.11,
    the GPU machine's) loads NVIDIA's libcudart and libnccl ahead of simcuda's, and in proxy mode
    registers its own kernels with the proxy."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} is a CUDA build: its CUDA libraries take the place of "
                    "simcuda's in the training process (these tests need a CPU build of torch)")


def dp_env(**extra: str) -> dict[str, str]:
    """This environment without jitckpt's, simcuda's and LD_PRELOAD settings, plus simcuda's
    libraries and the dp_cuda kernels, and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "SIMCUDA_")) and k != "LD_PRELOAD"}
    env.update(LD_LIBRARY_PATH=str(SIMCUDA), PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1",
               SIMCUDA_KERNEL_LIB=str(DP_LIBS / "libdp_train_kernels.so"), **extra)
    return env


class ProcessTree:
    """A command with its output in `log`; close() kills every process seen in its tree, by PID."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        self.seen: dict[int, psutil.Process] = {}

    def descendants(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for k in kids:
            self.seen.setdefault(k.pid, k)
        return kids

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.descendants()
            try:
                return self.proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for p in self.seen.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=10)
