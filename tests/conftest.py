import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("PYTHONPATH", str(ROOT))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@contextlib.contextmanager
def keeper_process(sock: str) -> Iterator:
    """A snapshot keeper process listening on ``sock`` (its Popen), killed by PID on exit."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "jitckpt.snapshot.keeper", "--socket", sock,
                             "--max-lifetime", "120"], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()  # blocks until the keeper listens (it exits on failure: EOF)
        assert line.startswith("ready"), line
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def keeper(tmp_path):
    """A snapshot keeper process on a socket in ``tmp_path``: (socket path, Popen); killed after."""
    sock = str(tmp_path / "k.sock")
    with keeper_process(sock) as proc:
        yield sock, proc

# CI runs the property-based tests on a fixed sequence of examples, so a run is reproducible.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass

# Several tests fork worker processes from this process (torch already imported, so they start at
# once). GNU OpenMP is not fork-safe: once this process has run a parallel region, a forked child's
# first parallel region can hang. One intra-op thread here means no OpenMP pool is ever started in
# the pytest process (children and subprocesses choose their own thread counts).
try:
    import torch as _torch

    _torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="module")
def fault_references(tmp_path_factory):
    """The failure-free run of a fault-harness config (tests/fault_harness.py), once per module and config."""
    from fault_harness import run_reference

    cache: dict = {}

    def get(cfg):
        if cfg not in cache:
            cache[cfg] = run_reference(tmp_path_factory.mktemp(f"ref-{cfg.id}"), cfg)
        return cache[cfg]

    return get
