"""Errors raised by update-undo: refused at setup vs. failed at undo time."""
from __future__ import annotations


class NotInvertibleError(ValueError):
    """The optimizer configuration has no exact inverse; raised when ``UpdateUndo`` is built
    (or when a later step would use such a configuration), never after a silent mis-undo."""


class UndoError(RuntimeError):
    """``undo_last_step()`` cannot run: no step was recorded, or what the inverse needs (the
    step's gradient, per-parameter progress marks) is gone."""
