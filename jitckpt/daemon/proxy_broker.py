"""The daemon's proxy broker: starts device proxies (``jitckpt-proxy``) for the node's processes,
so a proxy is the daemon's child, not the application's (``proxy_server/src/proxy_broker.h`` is
the client, in libjit.so).

A Unix ``SOCK_SEQPACKET`` socket (mode 0600, in the daemon's 0700 directory), one request per
connection: ``jitckpt-proxy-spawn/1\\0<binary>\\0<NAME=value>\\0...``. Only a process of this
user is served (``SO_PEERCRED``): it could run the binary itself, so starting it for it grants
nothing. The reply is ``ok <pid>`` with the client's end of a new socket pair attached (the proxy
has the other end as fd 3), or ``error <why>``. The daemon reaps each proxy and records it, with
the rank and job its environment names, for ``jitckpt daemon status``.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Callable, Optional

log = logging.getLogger("jitckpt.daemon.proxy_broker")
MAGIC = b"jitckpt-proxy-spawn/1"
MAX_REQUEST = 1 << 20
MAX_ENV = 4096  # variables


class BadSpawn(ValueError):
    """A request the broker refuses; its text says why."""


def parse_request(data: bytes) -> tuple[str, dict[str, str]]:
    """(binary, environment) of a spawn request; BadSpawn naming what is wrong."""
    parts = data.split(b"\0")
    if len(parts) < 3 or parts[0] != MAGIC or parts[-1] != b"":
        raise BadSpawn(f"not a {MAGIC.decode()} request")
    try:
        binary = parts[1].decode()
        items = [p.decode() for p in parts[2:-1]]
    except UnicodeDecodeError:
        raise BadSpawn("the binary and the environment must be UTF-8") from None
    if not os.path.isabs(binary) or not os.path.isfile(binary) or not os.access(binary, os.X_OK):
        raise BadSpawn(f"{binary[:200]!r} is not an executable file's absolute path")
    if len(items) > MAX_ENV:
        raise BadSpawn(f"{len(items)} environment variables, at most {MAX_ENV}")
    env = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise BadSpawn(f"environment entry {item[:80]!r} is not NAME=value")
        env[name] = value
    return binary, env


class ProxyBroker:
    """Serves the broker socket on a thread of its own until :meth:`stop`.

    ``on_start(pid, run_id, rank)`` and ``on_exit(pid, status)`` tell the daemon's state.
    """

    def __init__(self, socket_path: str, *, on_start: Callable[[int, str, int], None],
                 on_exit: Callable[[int, int], None]) -> None:
        self.socket_path = socket_path
        self._on_start, self._on_exit = on_start, on_exit
        self._sock: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    def start(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # the daemon's own, from a run that died (it checked no daemon serves)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)  # created 0600: no window where another user could connect
        try:
            sock.bind(self.socket_path)
        finally:
            os.umask(old)
        sock.listen(16)
        sock.settimeout(0.5)  # so stop() is seen
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="jitckpt-proxy-broker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop taking requests. Running proxies are left alone: each exits when its process does."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5.0)
                try:
                    self._handle(conn)
                except OSError as e:  # the client went away: nothing to answer
                    log.debug("proxy broker: %s", e)

    def _handle(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            conn.send(b"error only the daemon's user may start proxies through it")
            return
        data, _, flags, _ = conn.recvmsg(MAX_REQUEST + 1)
        try:
            if len(data) > MAX_REQUEST or flags & socket.MSG_TRUNC:
                raise BadSpawn(f"a request over {MAX_REQUEST} bytes")
            binary, env = parse_request(data)
            pid, client_end = self._spawn(binary, env)
        except (BadSpawn, OSError) as e:
            conn.send(b"error " + str(e).encode()[:3000])
            return
        try:
            socket.send_fds(conn, [f"ok {pid}".encode()], [client_end.fileno()])
        finally:
            client_end.close()
        try:
            rank = int(env.get("RANK", "-1"))
        except ValueError:
            rank = -1
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        log.info("proxy broker: started %s pid %d for job %s rank %d", os.path.basename(binary), pid, run_id or "?", rank)
        self._on_start(pid, run_id, rank)

    def _spawn(self, binary: str, env: dict[str, str]) -> tuple[int, socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.posix_spawn(binary, [binary], env,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3)], setsid=True)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        threading.Thread(target=self._reap, args=(pid,), name=f"jitckpt-proxy-reaper-{pid}", daemon=True).start()
        return pid, ours

    def _reap(self, pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        log.info("proxy broker: pid %d ended (%s)", pid, f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                 else f"exit code {os.waitstatus_to_exitcode(status)}")
        self._on_exit(pid, status)
