"""The process's one :class:`~jitckpt.runtime.worker_runtime.WorkerRuntime`, created on first use.

The user API (``jitckpt.init``, ``protect``, ...) and the library's own worker-side modules reach
the runtime through here, so none of them imports the ``jitckpt`` package root.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from jitckpt.runtime.worker_runtime import WorkerRuntime

_runtime: Optional["WorkerRuntime"] = None
_lock = threading.Lock()


def runtime_or_none() -> Optional["WorkerRuntime"]:
    """The runtime if one was started in this process, else None (never starts one)."""
    return _runtime


def get_runtime() -> "WorkerRuntime":
    """The runtime, started from the environment the launcher set on first use."""
    global _runtime
    with _lock:
        if _runtime is None:
            from jitckpt.runtime.worker_runtime import WorkerRuntime

            rt = WorkerRuntime.from_env()
            rt.start()
            _runtime = rt
        return _runtime


def install_runtime(rt: "WorkerRuntime") -> None:
    """Used by the warm standby process, which starts the runtime before the user's script."""
    global _runtime
    with _lock:
        _runtime = rt
