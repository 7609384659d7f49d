"""Build and run the simcuda test programs (tests/native/test_simcuda_*.py).

Programs are compiled once per source content: nvcc -cudart shared for the program, g++ with
simcuda/host_kernel.h for its host kernel library, cached under <build>/simcuda_test_progs/, so
all test modules (and reruns) share the few-second nvcc builds. Every process started here has a
deadline and is killed by PID when a test ends.
"""
from __future__ import annotations

import hashlib
import os
import queue
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]
PROGS = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("JITCKPT_BUILD_DIR", REPO / "build" / "native"))
SIMCUDA_LIBS = BUILD / "lib" / "simcuda"
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
NVCC = CUDA_HOME / "bin" / "nvcc"
MARKS_H = REPO / "interposer" / "include" / "jitckpt" / "marks.h"
COMPILE_TIMEOUT_S = 180
# `make sanitize` runs these programs on an ASan or TSan build of simcuda and libjit.so: the
# sanitizer's runtime must be loaded first, before the uninstrumented program's libraries.
SANITIZER_RUNTIME = os.environ.get("JITCKPT_SANITIZER_RUNTIME", "")
# `make gpu-check` on a machine with a GPU (tests/gpu/gpu_check.py) sets "cuda": the same nvcc builds
# then run on the real CUDA runtime, driver and NCCL, their device kernels on the GPU.
DEVICE = os.environ.get("JITCKPT_TEST_DEVICE", "simcuda")


def real_runtime_path() -> str:
    """LD_LIBRARY_PATH for the real libcudart.so.13 (the toolkit's) and libnccl.so.2 (the wheel's)."""
    dirs = [CUDA_HOME / "lib64", CUDA_HOME / "targets" / "x86_64-linux" / "lib", nccl_wheel_dir() / "lib"]
    return ":".join([*(str(d) for d in dirs if d.is_dir()), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])


def nccl_wheel_dir() -> Path:
    """nvidia-nccl-cu13's package dir (headers and the real libnccl.so.2 to link against)."""
    import nvidia.nccl  # type: ignore[import-not-found]

    return Path(list(nvidia.nccl.__path__)[0])


def require_toolchain() -> None:
    """Skip with a reason naming what is missing and how to get it."""
    if not NVCC.exists():
        pytest.skip(f"nvcc not found at {NVCC}: install the CUDA 13 toolkit or set CUDA_HOME")
    if DEVICE == "cuda":
        return
    for lib in ("libcudart.so.13", "libnccl.so.2"):
        if not (SIMCUDA_LIBS / lib).exists():
            pytest.skip(f"{SIMCUDA_LIBS / lib} missing: run `make native` (or set JITCKPT_BUILD_DIR)")


@dataclass(frozen=True)
class Program:
    """A compiled test program and (if it has kernels) its host kernel library."""

    exe: Path
    kernel_lib: Optional[Path]

    def env(self, **extra: str) -> dict[str, str]:
        """Environment that runs the program on simcuda (on the GPU with ``JITCKPT_TEST_DEVICE=cuda``),
        with SIMCUDA_* from the caller cleared."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIMCUDA_") and k != "LD_PRELOAD"}
        if DEVICE == "cuda":
            env["LD_LIBRARY_PATH"] = real_runtime_path()
        else:
            env["LD_LIBRARY_PATH"] = str(SIMCUDA_LIBS)
            if self.kernel_lib:
                env["SIMCUDA_KERNEL_LIB"] = str(self.kernel_lib)
        env.update(extra)
        if SANITIZER_RUNTIME:
            env["LD_PRELOAD"] = ":".join(filter(None, (SANITIZER_RUNTIME, env.get("LD_PRELOAD"))))
        return env


def _run_compiler(cmd: list[str]) -> None:
    """Run a compiler command with a timeout; raise with its output if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")


def build_program(name: str, *, kernels: bool, nccl: bool, nvcc_flags: tuple[str, ...] = (),
                  headers: tuple[Path, ...] = ()) -> Program:
    """Compile simcuda_progs/<name>.cu (cached by content and flags); skip if the toolchain is missing.
    ``headers``: extra headers the program includes (their directories go on nvcc's include path
    as ``<dir>/..`` of ``<dir>/<name>``, and their contents into the cache key)."""
    require_toolchain()
    headers = (*headers, MARKS_H)  # any program may mark its minibatches
    src = PROGS / f"{name}.cu"
    header = REPO / "simcuda" / "include" / "simcuda" / "host_kernel.h"
    extra = b"".join(h.read_bytes() for h in (*headers, *sorted(PROGS.glob("*.h"))))  # shared headers too
    digest = hashlib.sha256(src.read_bytes() + header.read_bytes() + extra
                            + repr((kernels, nccl, nvcc_flags)).encode()).hexdigest()[:16]
    variant = name + "".join("_" + f.strip("-").replace(" ", "_").replace("=", "_") for f in nvcc_flags)
    out = BUILD / "simcuda_test_progs" / f"{variant}-{digest}"
    exe, klib = out / name, out / f"{name}_kernels.so"
    if not exe.exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        cmd = [str(NVCC), "-cudart", "shared", *nvcc_flags, "-o", str(tmp / name), str(src)]
        for h in headers:
            cmd += ["-I", str(h.parent.parent)]
        if nccl:
            wheel = nccl_wheel_dir()
            # Link against NVIDIA's real libnccl.so.2: the binary must run unchanged on simcuda's.
            cmd += ["-I", str(wheel / "include"), "-L", str(wheel / "lib"), "-l:libnccl.so.2"]
        _run_compiler(cmd)
        if kernels:
            _run_compiler(["g++", "-std=c++17", "-O1", "-x", "c++", "-shared", "-fPIC", "-DSIMCUDA_HOST_KERNELS",
                           "-include", "simcuda/host_kernel.h", "-I", str(REPO / "simcuda" / "include"),
                           "-I", str(CUDA_HOME / "include"), str(src), "-o", str(tmp / klib.name)])
        for stale in out.parent.glob(f"{variant}-*"):  # builds of older sources
            if stale != tmp:
                shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(out)
    return Program(exe, klib if kernels else None)


def parse_kv(text: str) -> dict[str, str]:
    """`key=value` lines of a program's output."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and " " not in line.split("=", 1)[0])


@dataclass
class RankProcess:
    """One running rank: its Popen, and its stdout lines collected by a reader thread."""

    rank: int
    proc: subprocess.Popen
    lines: "queue.Queue[Optional[str]]" = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    def start_reader(self) -> None:
        """Collect stdout lines on a daemon thread (None marks EOF), so waits can have deadlines."""

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
            self.lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def wait_for(self, key: str, timeout: float) -> str:
        """Value of the first `key=` line, waiting at most `timeout` seconds."""
        line = self.wait_for_line(lambda line: line.startswith(key + "="), f"'{key}='", timeout)
        return line.split("=", 1)[1]

    def wait_for_line(self, match: Callable[[str], bool], what: str, timeout: float) -> str:
        """The first output line that `match`es, waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        for line in self.seen:
            if match(line):
                return line
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: no {what} within {timeout}s; output so far: {self.seen}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise EOFError(f"rank {self.rank} exited (rc={self.proc.poll()}) before {what}; output: {self.seen}")
            self.seen.append(line)
            if match(line):
                return line

    def finish(self, timeout: float) -> dict[str, str]:
        """Wait for exit (bounded) and return all key=value output."""
        self.proc.wait(timeout=timeout)
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
        return parse_kv("\n".join(self.seen))


class RankGroup:
    """Starts the ranks of one NCCL job (rank 0 first, for its unique id) and kills them all on exit."""

    def __init__(self, program: Program, mode: str, nranks: int, *, env: Optional[dict[str, str]] = None,
                 window_ms: int = 1500, stdin: bool = False,
                 rank_env: Optional[Callable[[int], dict[str, str]]] = None) -> None:
        self.program, self.mode, self.nranks = program, mode, nranks
        self.env = env or program.env()
        self.rank_env = rank_env  # per-rank additions to env
        self.window_ms, self.stdin = window_ms, stdin
        self.ranks: list[RankProcess] = []

    def _spawn(self, rank: int, uid: str) -> RankProcess:
        """Start one rank (rank 0 gets no uid: it creates and prints one)."""
        cmd = [str(self.program.exe), self.mode, str(rank), str(self.nranks), uid or "-", str(self.window_ms)]
        env = {**self.env, **(self.rank_env(rank) if self.rank_env else {})}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL, text=True)
        rp = RankProcess(rank, proc)
        rp.start_reader()
        self.ranks.append(rp)
        return rp

    def __enter__(self) -> "RankGroup":
        """Start rank 0, read its unique id, start the other ranks with it."""
        try:
            uid = self._spawn(0, "").wait_for("uid", timeout=30)
            for r in range(1, self.nranks):
                self._spawn(r, uid)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """SIGKILL every rank still alive (by PID) and reap it."""
        for rp in self.ranks:
            if rp.proc.poll() is None:
                try:
                    os.kill(rp.proc.pid, 9)  # SIGKILL also ends a SIGSTOPped rank
                except ProcessLookupError:
                    pass
            try:
                rp.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
