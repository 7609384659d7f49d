"""Recovery plugins (`jitckpt run --plugin NAME`): objects with hooks the core calls.

A plugin names the recovery it serves and what it is incompatible with (checked once, by the
launcher's config), and gets a hook on the worker side when ``jitckpt.protect()`` has built the
protected state. The core never tests plugin names: it asks :func:`get` for the objects and calls
their hooks. The device proxy's plugins (JIT paper §4) will be added here as more hooks.

* :class:`~.undo.UndoPlugin` (``undo``): SWIFT update-undo of a torn optimizer step before the
  survivors' JIT save (recovery ``jit``).
* :class:`~.stage_logging.LoggingPlugin` (``logging``): SWIFT logging-based replacement of a dead pipeline
  stage (recovery ``stage``); the script logs with ``jitckpt.swift.SendLogger``.
"""
from __future__ import annotations

from jitckpt.plugins.base import RecoveryPlugin
from jitckpt.plugins.stage_logging import LoggingPlugin
from jitckpt.plugins.undo import UndoPlugin

PLUGINS: dict[str, type[RecoveryPlugin]] = {p.name: p for p in (UndoPlugin, LoggingPlugin)}


def get(names: tuple[str, ...] | list[str]) -> tuple[RecoveryPlugin, ...]:
    """The plugin objects for ``names`` (``--plugin a,b``), or ValueError naming the unknown ones."""
    unknown = sorted(set(names) - set(PLUGINS))
    if unknown:
        raise ValueError(f"--plugin: unknown plugin(s) {unknown}; known: {', '.join(PLUGINS)}")
    return tuple(PLUGINS[n]() for n in dict.fromkeys(names))


__all__ = ["PLUGINS", "RecoveryPlugin", "get", "LoggingPlugin", "UndoPlugin"]
