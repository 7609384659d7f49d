"""Launcher <-> worker control channel over a Unix socketpair (JSON lines).

The launcher creates one socketpair per worker and hands the child end to the worker process
(fd number in ``JITCKPT_CONTROL_FD``). Nothing listens on a network port and nothing polls: the
worker's listener thread blocks in ``recv`` and wakes only when the launcher writes. The messages
are the classes of :mod:`jitckpt.protocol.control_messages`; each end decodes what it may receive.
"""
from __future__ import annotations

import os
import select
import socket
import threading
from typing import Any, Optional

from jitckpt.protocol.control_messages import TO_LAUNCHER, TO_WORKER, Message, decode

ENV_FD = "JITCKPT_CONTROL_FD"
# Set for a --no-python worker: libjit.so, if preloaded, registers the program (a Hello saying it
# cannot save), as no Python runtime is there to do it (interposer/src/launcher_hello.cc).
ENV_NATIVE_HELLO = "JITCKPT_NATIVE_HELLO"


class ControlChannel:
    """One end of a launcher/worker socketpair; thread-safe sends, blocking line reads."""

    def __init__(self, sock: socket.socket, *, incoming: dict) -> None:
        self._sock = sock
        self._incoming = incoming  # TO_WORKER or TO_LAUNCHER: what this end may receive
        self._send_lock = threading.Lock()
        self._buf = b""

    @classmethod
    def from_env(cls) -> Optional["ControlChannel"]:
        fd = os.environ.get(ENV_FD)
        if not fd:
            return None
        try:
            sock = socket.socket(fileno=int(fd))
        except (OSError, ValueError) as e:
            raise RuntimeError(
                f"{ENV_FD}={fd!r} is not an open socket ({e}); run the script under `jitckpt run` "
                f"or unset {ENV_FD}") from None
        return cls(sock, incoming=TO_WORKER)

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, msg: Message) -> bool:
        """Send one message; returns False if the peer is gone."""
        data = msg.encode()
        with self._send_lock:
            try:
                self._sock.sendall(data)
                return True
            except OSError:
                return False

    def recv(self, timeout: Optional[float] = None) -> Optional[Any]:
        """Next message (a control_messages class), or None on EOF. Raises TimeoutError if
        ``timeout`` passes first, ProtocolError for a line that is no message of the protocol."""
        self._sock.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                try:
                    chunk = self._sock.recv(65536)
                except socket.timeout:
                    raise TimeoutError("no control message within timeout") from None
                except OSError:
                    return None
                if not chunk:
                    return None
                self._buf += chunk
        finally:
            if not self._sock._closed:  # type: ignore[attr-defined]
                self._sock.settimeout(None)
        return self._take_line()

    def _take_line(self) -> Any:
        line, self._buf = self._buf.split(b"\n", 1)
        return decode(line, self._incoming)

    def pending(self) -> list:
        """Every message already sent and not yet read, without waiting for more: what a peer that
        has exited wrote before it did (its EOF is left for :meth:`recv` to report)."""
        out = []
        readable = select.poll()  # not select(): a launcher of many ranks may hold fds past 1024
        readable.register(self._sock, select.POLLIN)
        while True:
            if b"\n" in self._buf:
                out.append(self._take_line())
                continue
            if not readable.poll(0):
                return out
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                return out
            if not chunk:
                return out
            self._buf += chunk

    def buffered(self) -> bool:
        """True if a complete message was already read from the socket (select() will not report it)."""
        return b"\n" in self._buf

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def channel_pair() -> tuple[ControlChannel, socket.socket]:
    """(launcher-side channel, worker-side socket to pass to the child with pass_fds)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child.set_inheritable(True)
    return ControlChannel(parent, incoming=TO_LAUNCHER), child
