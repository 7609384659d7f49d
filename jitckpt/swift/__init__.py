"""SWIFT (Zhong et al.) failure-recovery mechanisms: update-undo of the optimizer step.

``UpdateUndo`` inverts the last (possibly interrupted) optimizer step so data-parallel
survivors return to one consistent state without snapshots; ``Lamb`` is a LAMB optimizer that
keeps the per-tensor trust ratios its inverse needs.
"""
from .errors import NotInvertibleError, UndoError
from .lamb import Lamb
from .undo import UpdateUndo

__all__ = ["UpdateUndo", "Lamb", "NotInvertibleError", "UndoError"]
