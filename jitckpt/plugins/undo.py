"""``--plugin undo``: SWIFT update-undo inside the JIT recovery."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jitckpt.plugins.base import RecoveryPlugin

if TYPE_CHECKING:
    from jitckpt.runtime.protected_state import Protected
    from jitckpt.runtime.worker_runtime import WorkerRuntime


class UndoPlugin(RecoveryPlugin):
    """A failure that tears ``protect()``'s optimizer step on the survivors (inside ``step()``, or
    before the scheduler's step of that minibatch) is undone before their JIT save, so they still
    save the start of that minibatch. ``protect()`` refuses an optimizer without an exact inverse."""

    name = "undo"
    recovery = "jit"
    why = ("undo lets the survivors JIT-save when a failure tore their optimizer step (--recovery "
           "jit, every rank restarts)")

    def on_protect(self, state: "Protected", runtime: "WorkerRuntime") -> None:
        state.enable_undo()
        runtime.roll_back = state.roll_back
