"""The launcher's store, reachable from the workers' libjit.so (issue 16, transparent recovery case 1).

When a collective fails, every rank of the communicator rebuilds it in a new device proxy, and they
need one new NCCL unique id: the communicator's rank 0 makes it and the others wait for it. That
goes through the job's torch.distributed store (a ``HashStore`` in the launcher on one node, the
cross-node coordinator's TCPStore on several). Native code cannot be a c10d client without
libtorch, so the launcher relays: a Unix socket in a private (0700) directory, named to the workers
in ``JITCKPT_STORE_SOCKET``, taking one request per connection (the format is in
``interposer/src/rendezvous_store.h``): set a key, or wait for one up to a deadline (0: not at all)
and get it.
"""
from __future__ import annotations

import datetime
import os
import shutil
import socketserver
import struct
import tempfile
import threading
from typing import Any, Callable, Optional

OK, TIMED_OUT, ERROR = 0, 1, 2
MAX_FIELD = 1 << 20  # a unique id is 128 bytes; anything near this is not a request of libjit.so


class StoreRelay:
    """Serves the launcher's store to this node's workers on a Unix socket.

    Args:
        store_factory: returns a torch.distributed ``Store`` for one request at a time (each
            connection gets its own: a TCPStore client serves one blocking wait at a time).
        prefix: every key is put under it (the job's, so two jobs on one store do not meet).

    ``socket_path`` is what the workers get as ``JITCKPT_STORE_SOCKET``, ``buffers_dir`` as
    ``JITCKPT_REPLICA_DIR`` on one node; ``close()`` stops the server and removes both.
    """

    def __init__(self, *, store_factory: Callable[[], Any], prefix: str = "transparent") -> None:
        if not prefix:
            raise ValueError("StoreRelay needs a non-empty key prefix")
        self._factory = store_factory
        self._prefix = prefix
        self._dir = tempfile.mkdtemp(prefix="jitckpt-store-")  # 0700: only this user's processes
        self.socket_path = os.path.join(self._dir, "store.sock")
        # Where a rank that kept its device buffers leaves them for a rank of this node that lost
        # its own (JITCKPT_REPLICA_DIR; several nodes need a shared directory instead).
        self.buffers_dir = os.path.join(self._dir, "buffers")
        os.mkdir(self.buffers_dir, 0o700)
        relay = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:  # noqa: D401 - socketserver's hook
                relay._serve(self.request)

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

        self._server = Server(self.socket_path, Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="jitckpt-store-relay",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- one request -------------------------------------------------------------------------
    def _serve(self, conn: Any) -> None:
        conn.settimeout(30)
        try:
            op = _read(conn, 1)
            key = self._prefix + "/" + _read(conn, _u32(conn)).decode("utf-8", "replace")
            if op == b"S":
                value = _read(conn, _u32(conn))
                self._factory().set(key, value)
                _reply(conn, OK, b"")
            elif op == b"G":
                wait_ms = _u32(conn)
                store = self._factory()
                if wait_ms == 0:  # whether it is there now (c10d's wait takes 0 as "no timeout")
                    if store.check([key]):
                        _reply(conn, OK, store.get(key))
                    else:
                        _reply(conn, TIMED_OUT, b"")
                    return
                try:
                    store.wait([key], datetime.timedelta(milliseconds=wait_ms))
                except Exception as e:  # c10d raises a plain error (DistStoreError) on timeout
                    if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                        _reply(conn, TIMED_OUT, b"")
                        return
                    raise
                _reply(conn, OK, store.get(key))
            else:
                _reply(conn, ERROR, f"unknown request {op!r}".encode())
        except _Malformed as e:
            _reply(conn, ERROR, str(e).encode(), quiet=True)
        except Exception as e:  # the worker gets the store's error as text, the launcher goes on
            _reply(conn, ERROR, f"{type(e).__name__}: {e}".encode(), quiet=True)


class _Malformed(Exception):
    pass


def _read(conn: Any, n: int) -> bytes:
    if n > MAX_FIELD:
        raise _Malformed(f"a field of {n} bytes is not a store request")
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise _Malformed("the request ended early")
        data += chunk
    return data


def _u32(conn: Any) -> int:
    return struct.unpack("<I", _read(conn, 4))[0]


def _reply(conn: Any, status: int, body: bytes, quiet: bool = False) -> None:
    try:
        conn.sendall(struct.pack("<BI", status, len(body)) + body)
    except OSError:
        if not quiet:
            raise


def local_store_factory() -> Callable[[], Any]:
    """One node: an in-process ``HashStore`` that every relay connection shares (it is thread-safe)."""
    import torch.distributed as dist

    store: Optional[Any] = dist.HashStore()
    return lambda: store
