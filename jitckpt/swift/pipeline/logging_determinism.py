"""Determinism settings that logging-based replay depends on, applied and checked.

Replay reproduces a lost stage bitwise only if the same inputs give the same outputs: the
replacement must run with the settings the original stage ran with. ``apply_determinism``
sets them and returns a manifest; ``check_determinism`` compares two manifests and raises
:class:`DeterminismMismatchError` naming every difference.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

MANIFEST = "determinism.json"


class DeterminismMismatchError(RuntimeError):
    """The replaying process's determinism settings differ from the logged run's."""


def apply_determinism(*, num_threads: int = 1) -> dict:
    """Make this process's torch CPU math deterministic; return the settings as a dict.

    Sets ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic/no benchmark (as in
    SWIFT §6; no effect on CPU) and a fixed intra-op thread count, since the thread count can
    change reduction order.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(num_threads)
    return current_determinism()


def current_determinism() -> dict:
    """The settings that affect bitwise reproducibility in this process."""
    return {
        "torch": torch.__version__,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "num_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
    }


def write_manifest(directory: Path, settings: dict) -> None:
    """Record the settings next to a stage's logs."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps(settings, sort_keys=True))


def read_manifest(directory: Path) -> dict:
    """Settings recorded by :func:`write_manifest`; a missing manifest is an error."""
    path = directory / MANIFEST
    if not path.exists():
        raise DeterminismMismatchError(
            f"{path} is missing: the logging run did not record its determinism settings "
            "(call write_manifest(log_dir, apply_determinism()) when logging starts)")
    return json.loads(path.read_text())


def check_determinism(expected: dict, actual: dict | None = None) -> None:
    """Raise if ``actual`` (default: this process) differs from ``expected`` in any setting."""
    actual = current_determinism() if actual is None else actual
    diffs = [f"{k}: logged run {expected.get(k)!r}, this process {actual.get(k)!r}"
             for k in sorted(set(expected) | set(actual)) if expected.get(k) != actual.get(k)]
    if diffs:
        raise DeterminismMismatchError(
            "replay would not be bitwise reproducible; determinism settings differ ("
            + "; ".join(diffs) + "). Call apply_determinism() with the logged run's settings.")
