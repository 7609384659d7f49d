"""A rank's connection to its node's snapshot keeper (see :mod:`jitckpt.snapshot.keeper`)."""
from __future__ import annotations

import json
import mmap
import os
import socket
import threading
from typing import Any, Optional

from jitckpt.snapshot.keeper import MAX_MSG

ENV_SOCKET = "JITCKPT_SNAPSHOT_SOCKET"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class KeeperError(RuntimeError):
    """The keeper refused a request or cannot be reached."""


class KeeperClient:
    """Thread-safe request/reply client; maps keeper buffers into this process (cached per buffer)."""

    def __init__(self, socket_path: Optional[str] = None, *, timeout: float = 30.0) -> None:
        path = socket_path or os.environ.get(ENV_SOCKET)
        if not path:
            raise ValueError(f"no snapshot keeper socket: pass socket_path or set ${ENV_SOCKET} "
                             "(start one with python -m jitckpt.snapshot.keeper --socket PATH)")
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as e:
            self._sock.close()
            raise KeeperError(f"cannot connect to the snapshot keeper at {path}: {e} (is it running?)") from None
        self._lock = threading.Lock()
        self._maps: dict[tuple[str, int], mmap.mmap] = {}

    def request(self, op: str, **fields: Any) -> tuple[dict, Optional[int]]:
        with self._lock:
            try:
                self._sock.send(json.dumps({"op": op, **fields}).encode())
                data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MSG, 1)
            except OSError as e:
                raise KeeperError(f"snapshot keeper at {self.path}: {op} failed: {e}") from None
        if not data:
            raise KeeperError(f"snapshot keeper at {self.path} closed the connection during {op}")
        reply = json.loads(data)
        fd = fds[0] if fds else None
        if not reply.get("ok"):
            if fd is not None:
                os.close(fd)
            raise KeeperError(f"snapshot keeper refused {op}: {reply.get('error')}")
        return reply, fd

    def _map(self, key: str, reply: dict, fd: Optional[int]) -> mmap.mmap:
        if fd is None:
            raise KeeperError(f"snapshot keeper sent no buffer for {key}")
        try:
            cache_key = (key, int(reply["buf_id"]))
            m = self._maps.get(cache_key)
            if m is None or len(m) != reply["size"]:
                # MAP_POPULATE: fault the pages in now, in one go, not one by one during the copy.
                m = mmap.mmap(fd, int(reply["size"]), flags=mmap.MAP_SHARED | _POPULATE)
                self._maps[cache_key] = m
            return m
        finally:
            os.close(fd)

    def begin(self, key: str, step: int, size: int) -> mmap.mmap:
        """A writable mapping of the buffer for (key, step)."""
        reply, fd = self.request("begin", key=key, step=step, size=size)
        return self._map(key, reply, fd)

    def commit(self, items: list[dict]) -> None:
        self.request("commit", items=items)

    def listing(self) -> list[dict]:
        return self.request("list")[0]["objects"]

    def open(self, key: str, step: int) -> tuple[mmap.mmap, dict]:
        """A mapping of the complete object (key, step) and its metadata (checksum, algo)."""
        reply, fd = self.request("open", key=key, step=step)
        return self._map(key, reply, fd), reply

    def reject(self, step: int) -> None:
        self.request("reject", step=step)

    def discard_newer(self, step: int) -> int:
        return int(self.request("discard_newer", step=step)[0]["discarded"])

    def ping(self) -> dict:
        return self.request("ping")[0]

    def close(self) -> None:
        # Mappings are not closed explicitly: a restored tensor may still view one (torch keeps a
        # reference to the mmap object, not a buffer export), and munmap under it would crash.
        # Each unmaps when its last user is gone.
        self._maps.clear()
        self._sock.close()
