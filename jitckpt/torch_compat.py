"""Which torch versions jitckpt is tested on, and what it does on the others: one table, one check.

jitckpt reaches into torch in two version-sensitive ways:

* SWIFT update-undo (``jitckpt.swift.undo``) inverts optimizer steps transcribed from the update
  rules of one torch release. An inverse of the wrong update rule silently corrupts the model, so
  on a torch whose minor version was not tested, :func:`require_tested_torch` refuses with a clear
  error rather than undoing approximately.
* The worker runtime wraps DDP internals (``_pre_forward``, the reducer's bucket rebuild) and
  c10d's ``Work.wait``. On an untested version these are checked for presence where they are used;
  :func:`warn_if_untested` says once that the combination is untested.

CI tests the pinned version (Makefile ``TORCH_SPEC``); add a version to :data:`TESTED` only after
the whole suite (``make test`` and ``make test-slow``) passed on it, and widen pyproject.toml's
``torch`` bound with it (a user who forces another version past pip gets the checks below).
"""
from __future__ import annotations

import logging
import re
from typing import Optional

log = logging.getLogger("jitckpt.torch_compat")

# torch minor versions the whole suite passed on (SWIFT's inverses were transcribed from 2.13).
TESTED: tuple[tuple[int, int], ...] = ((2, 13),)
# The oldest torch whose APIs jitckpt uses at all (pyproject.toml declares only TESTED).
MINIMUM = (2, 4)

_warned = False


class UntestedTorchError(RuntimeError):
    """A feature whose correctness depends on torch's exact internals met an untested version."""


def torch_version(text: Optional[str] = None) -> tuple[int, int]:
    """(major, minor) of ``text`` or of the installed torch (``"2.13.0+cpu"`` -> ``(2, 13)``)."""
    if text is None:
        import torch

        text = torch.__version__
    m = re.match(r"(\d+)\.(\d+)", str(text))
    if m is None:
        raise ValueError(f"cannot read a torch version from {text!r}")
    return int(m.group(1)), int(m.group(2))


def _name(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def require_tested_torch(feature: str, version: Optional[str] = None) -> None:
    """Raise :class:`UntestedTorchError` unless the torch version is in :data:`TESTED`."""
    v = torch_version(version)
    if v not in TESTED:
        tested = ", ".join(_name(t) for t in TESTED)
        raise UntestedTorchError(
            f"{feature} is tested on torch {tested} only, and this is torch {_name(v)}: its exact "
            f"inverses follow that release's optimizer code, so on another one they could corrupt "
            f"the model instead of undoing a step. Install torch=={_name(TESTED[-1])}.*, or run "
            f"without it (no --plugin undo)")


def warn_if_untested(version: Optional[str] = None) -> None:
    """Log once if the installed torch is not one the suite passed on (below MINIMUM: refuse)."""
    global _warned
    v = torch_version(version)
    if v < MINIMUM:
        raise UntestedTorchError(f"jitckpt needs torch >= {_name(MINIMUM)}, this is torch {_name(v)}")
    if v not in TESTED and not _warned:
        _warned = True
        log.warning("torch %s is not among the versions jitckpt is tested on (%s); recovery may "
                    "misbehave where torch's internals changed", _name(v),
                    ", ".join(_name(t) for t in TESTED))
