"""Where a node's daemon listens by default (the daemon and its clients agree on it here)."""
from __future__ import annotations

import os


def default_socket() -> str:
    """``$JITCKPT_DAEMON_SOCKET``, else ``$XDG_RUNTIME_DIR/jitckpt/daemon.sock``, else
    ``/tmp/jitckpt-<uid>/daemon.sock``."""
    if os.environ.get("JITCKPT_DAEMON_SOCKET"):
        return os.environ["JITCKPT_DAEMON_SOCKET"]
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/jitckpt-{os.getuid()}"
    if base.startswith("/tmp/jitckpt-"):
        return os.path.join(base, "daemon.sock")
    return os.path.join(base, "jitckpt", "daemon.sock")


def broker_socket(daemon_socket: str) -> str:
    """The daemon's proxy broker (:mod:`jitckpt.daemon.proxy_broker`), beside its socket (a name no
    longer than the daemon's, so it fits wherever the daemon's socket path does)."""
    return os.path.join(os.path.dirname(daemon_socket), "proxy.sock")
