"""The sockets of this process's torch.distributed groups, to cut them after a peer's failure.

Neither ``destroy_process_group()`` nor gloo's ``abort()`` closes a gloo group's connections (they
close when the group's C++ object is freed, which DDP's reducer and the script's objects delay):
a survivor leaving its script in an in-process recovery would leave its peers blocked in a receive
from it until gloo's timeout. So every socket a group's creation opens (gloo's listener and its
pair connections) is noted, and :func:`cut` shuts the connections down (not the listener): each peer's
pending receive from this process fails at once, and so does this process's own receive from a
peer that hangs. The descriptors stay open (gloo still owns them) until the group is freed.
"""
from __future__ import annotations

import functools
import os
import socket
import threading
from typing import Any

_lock = threading.Lock()
_noted: dict[int, str] = {}  # fd -> "socket:[inode]" when noted


def _sockets() -> dict[int, str]:
    """This process's socket descriptors now (fd -> its link, which names the socket's inode)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor, too)
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def install() -> None:
    """Note the sockets each new group opens (``init_process_group``, ``new_group``, DeviceMesh's
    groups: all are made by c10d's ``_new_process_group_helper``). Once per process."""
    from torch.distributed import distributed_c10d as c10d

    helper = c10d._new_process_group_helper
    if getattr(helper, "__jitckpt_wrapped__", False):
        return

    @functools.wraps(helper)
    def noting(*args: Any, **kwargs: Any) -> Any:
        before = _sockets()
        try:
            return helper(*args, **kwargs)
        finally:
            opened = {fd: link for fd, link in _sockets().items() if before.get(fd) != link}
            with _lock:
                _noted.update(opened)

    noting.__jitckpt_wrapped__ = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = noting


def cut() -> int:
    """Shut down every noted socket still open as it was (the same inode behind the fd); the number
    cut. The groups that own them are unusable from here on."""
    with _lock:
        noted = dict(_noted)
        _noted.clear()
    n = 0
    for fd, link in noted.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed, and the number reused for something else
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            # Not gloo's listener: its accept() thread aborts the process on an error.
            if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:  # not connected: nothing to cut
            pass
        finally:
            s.close()  # the duplicate only; gloo keeps its own
    return n
