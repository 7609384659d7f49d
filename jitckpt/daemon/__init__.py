"""The node daemon (issue 17): ``jitckpt daemon run`` once per node; :class:`Client` to talk to it."""
from __future__ import annotations

from typing import Any

__all__ = ["Client", "DaemonRefused", "DaemonUnavailable"]


def __getattr__(name: str) -> Any:  # gRPC is imported only when the daemon is used
    if name in __all__:
        from jitckpt.daemon import client

        return getattr(client, name)
    raise AttributeError(name)
