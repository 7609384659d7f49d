"""What a recovery plugin is: its name, the recovery it serves, and the hooks the core calls."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from jitckpt.runtime.protected_state import Protected
    from jitckpt.runtime.worker_runtime import WorkerRuntime


class RecoveryPlugin:
    """Base class. Subclasses set :attr:`name`, :attr:`recovery` and :attr:`why`, and override hooks.

    ``recovery`` is the ``--recovery`` mode the plugin belongs to: two plugins of different modes
    cannot run in one job, and naming the plugin selects its mode.
    """

    name: ClassVar[str] = ""
    recovery: ClassVar[str] = "jit"
    why: ClassVar[str] = ""  # what it does, for error messages that must say why two conflict

    def on_protect(self, state: "Protected", runtime: "WorkerRuntime") -> None:
        """Worker side: ``jitckpt.protect()`` built ``state`` (before the user's ``restore()``)."""

    def __repr__(self) -> str:
        return f"<plugin {self.name}>"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, RecoveryPlugin) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)
