"""Which torch versions jitckpt supports, how each was checked, and what it does on the others: one
table, one check.

jitckpt reaches into torch in two version-sensitive ways:

* SWIFT update-undo (``jitckpt.swift.undo``) inverts optimizer steps transcribed from the update
  rules of torch 2.13's SGD, Adam and AdamW. An inverse of the wrong update rule silently corrupts
  the model, so it runs only on a version whose update rules were compared with those
  (:func:`require_tested_torch`).
* The worker runtime wraps DDP internals (``_pre_forward``, the reducer's bucket rebuild), c10d's
  ``Work.wait`` and FSDP2's hooks. They are checked for presence where they are used, and the suite
  exercises them on each version of :data:`TESTED`.

Outside :data:`TESTED` jitckpt refuses at the start, naming the range and the fix
(:func:`require_supported_torch`: ``jitckpt run`` before it starts a worker, a worker's runtime for
a job under torchrun). CI tests the pinned version (Makefile ``TORCH_SPEC``); add a version only
after the whole suite passed on it, and keep pyproject.toml's ``torch`` bound the range of the table.
"""
from __future__ import annotations

import re
from importlib import metadata
from typing import Optional

# The torch minor versions jitckpt supports: the whole fast suite (`make test`'s pytest) passed on
# each (2.13: CI's pin; 2.11 and 2.12: PyPI's 2.11.0+cu130 and 2.12.0+cu130 builds, run on the CPU;
# 2.11 is the GPU machine's build, and tests/test_torch_versions.py runs the version-sensitive part
# again on it, slow). SGD's, Adam's and AdamW's update rules are the same code in all three (their
# sources differ in comments, annotations and the device of a CPU step counter's constructor only).
TESTED: tuple[tuple[int, int], ...] = ((2, 11), (2, 12), (2, 13))
RANGE = f"{min(TESTED)[0]}.{min(TESTED)[1]} to {max(TESTED)[0]}.{max(TESTED)[1]}"
PIP_SPEC = f"torch>={min(TESTED)[0]}.{min(TESTED)[1]},<{max(TESTED)[0]}.{max(TESTED)[1] + 1}"


class UntestedTorchError(RuntimeError):
    """A torch version outside the supported range, or a feature that needs a checked one."""


def torch_version(text: Optional[str] = None) -> tuple[int, int]:
    """(major, minor) of ``text`` or of the installed torch (``"2.13.0+cpu"`` -> ``(2, 13)``)."""
    if text is None:
        import torch

        text = torch.__version__
    m = re.match(r"(\d+)\.(\d+)", str(text))
    if m is None:
        raise ValueError(f"cannot read a torch version from {text!r}")
    return int(m.group(1)), int(m.group(2))


def installed_torch() -> Optional[str]:
    """The installed torch's version string, read without importing torch (None: none installed)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _name(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def require_tested_torch(feature: str, version: Optional[str] = None) -> None:
    """Raise :class:`UntestedTorchError` unless the torch version is one whose optimizer update rules
    were checked against SWIFT's inverses (every version of :data:`TESTED`)."""
    v = torch_version(version)
    if v not in TESTED:
        raise UntestedTorchError(
            f"{feature} is checked on torch {RANGE} only, and this is torch {_name(v)}: its exact "
            f"inverses follow those releases' optimizer code, so on another one they could corrupt "
            f"the model instead of undoing a step. Install {PIP_SPEC!r}, or run without it (no --plugin undo)")


def require_supported_torch(version: Optional[str] = None) -> None:
    """Raise :class:`UntestedTorchError` outside :data:`TESTED`."""
    v = torch_version(version)
    if v not in TESTED:
        raise UntestedTorchError(
            f"jitckpt supports torch {RANGE}, and this is torch {_name(v)}: the torch internals it wraps "
            f"(DDP's forward and bucket rebuild, c10d's Work.wait, FSDP2's hooks) are checked on those "
            f"releases only. Install {PIP_SPEC!r} (pip install {PIP_SPEC!r}), or run the script under "
            f"torchrun without jitckpt")
