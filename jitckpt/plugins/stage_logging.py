"""``--plugin logging``: SWIFT logging-based recovery of a dead pipeline stage (``--recovery stage``)."""
from __future__ import annotations

from jitckpt.plugins.base import RecoveryPlugin


class LoggingPlugin(RecoveryPlugin):
    """The survivors keep running; the launcher starts one replacement for the dead rank, which
    loads the global checkpoint and replays its inputs from its neighbours' send logs (the script
    logs with ``jitckpt.swift.SendLogger`` and joins with ``jitckpt.swift.StageMembership``).
    Nothing to do at ``protect()``: the stage runtime drives it."""

    name = "logging"
    recovery = "stage"
    why = ("logging replaces a dead pipeline stage alone while the survivors keep running and save "
           "nothing (--recovery stage)")
