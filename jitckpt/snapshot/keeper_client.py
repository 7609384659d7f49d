"""A rank's connection to its node's snapshot keeper (see :mod:`jitckpt.snapshot.keeper`)."""
from __future__ import annotations

import mmap
import os
import socket
import threading
from typing import Optional

from jitckpt.protocol.keeper_messages import (CHANNEL, MAX_PACKET, TO_RANK, Begin, Commit, DiscardNewer,
                                              Granted, ListObjects, Open, Ping, Pong, Refused, Reject)
from jitckpt.protocol.wire import Message, ProtocolError, decode

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
        self.mappings_made = 0  # new mappings so far (a restore from mapped-ahead buffers makes none)

    def request(self, req: Message) -> tuple[Message, Optional[int]]:
        """Send one request; its reply and the file descriptor that came with it (if any).
        :class:`KeeperError` when the keeper refuses or cannot be reached."""
        return self.requests([req])[0]

    def requests(self, reqs: list) -> list:
        """Several requests in one round trip (all sent, then every reply read: the keeper answers
        in order); a (reply, fd) per request. The first refusal raises, closing every fd."""
        received = []
        with self._lock:
            try:
                for req in reqs:
                    self._sock.send(req.encode())
                for req in reqs:
                    data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_PACKET, 1)
                    received.append((req, data, fds[0] if fds else None))
            except OSError as e:
                for _, _, fd in received:
                    if fd is not None:
                        os.close(fd)
                raise KeeperError(f"snapshot keeper at {self.path}: {', '.join(r.TYPE for r in reqs)} failed: "
                                  f"{e}") from None
        out = []
        try:
            for req, data, fd in received:
                out.append(self._reply(req, data, fd))
        except KeeperError:
            for _, _, fd in received[len(out) + 1:]:
                if fd is not None:
                    os.close(fd)
            for _, fd in out:
                if fd is not None:
                    os.close(fd)
            raise
        return out

    def _reply(self, req: Message, data: bytes, fd: Optional[int]) -> tuple[Message, Optional[int]]:
        try:
            if not data:
                raise KeeperError(f"snapshot keeper at {self.path} closed the connection during {req.TYPE}")
            try:
                reply = decode(data, TO_RANK, channel=CHANNEL)
            except ProtocolError as e:
                raise KeeperError(f"snapshot keeper at {self.path}: {e}") from None
            if isinstance(reply, Refused):
                raise KeeperError(f"snapshot keeper refused {req.TYPE}: {reply.error}")
        except KeeperError:
            if fd is not None:
                os.close(fd)
            raise
        return reply, fd

    def _map(self, key: str, reply: Message, fd: Optional[int], *, ahead: bool = False) -> mmap.mmap:
        try:
            if fd is None or not isinstance(reply, Granted):
                raise KeeperError(f"snapshot keeper sent no buffer for {key}")
            cache_key = (key, reply.buf_id)
            m = self._maps.get(cache_key)
            if m is None or len(m) < reply.size:
                # The whole buffer (it may be larger than the object): later, smaller objects in it
                # need no new mapping.
                size = max(reply.size, os.fstat(fd).st_size)
                if ahead:  # mapped now, its pages faulted in by a helper thread while the caller reads
                    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                    threading.Thread(target=_populate, args=(m,), name="jitckpt-keeper-populate",
                                     daemon=True).start()
                else:
                    # MAP_POPULATE: fault the pages in now, in one go, not one by one during the copy.
                    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
                self._maps[cache_key] = m
                self.mappings_made += 1
            return m
        finally:
            if fd is not None:
                os.close(fd)

    def begin(self, key: str, step: int, size: int) -> mmap.mmap:
        """A writable mapping of the buffer for (key, step): at least ``size`` bytes, of which the
        caller writes the first ``size``."""
        return self.begin_many([(key, size)], step)[0]

    def begin_many(self, objects: list, step: int) -> list:
        """:meth:`begin` of several (key, size) of ``step`` in one round trip."""
        replies = self.requests([Begin(key=k, step=step, size=n) for k, n in objects])
        return self._map_all([k for k, _ in objects], replies, ())

    def commit(self, items: list[dict]) -> None:
        """Mark the begun buffers of ``items`` ({key, step, checksum, algo}) complete."""
        self.request(Commit(items=items))

    def listing(self) -> list[dict]:
        """Every complete object version: {key, step, size, checksum, algo}."""
        return self.request(ListObjects())[0].objects

    def open(self, key: str, step: int, *, sequential: bool = False) -> tuple[mmap.mmap, Granted]:
        """A mapping of the complete object (key, step) and its metadata (checksum, algo, size: the
        mapping may be longer than the object).

        ``sequential``: the caller reads it once from start to end; its pages are faulted in by a
        helper thread running ahead of the reader (the other core), not all before this returns."""
        return self.open_many([key], step, sequential=(key,) if sequential else ())[0]

    def open_many(self, keys: list, step: int, *, sequential: tuple = ()) -> list:
        """:meth:`open` of several objects of ``step`` in one round trip."""
        replies = self.requests([Open(key=k, step=step) for k in keys])
        return list(zip(self._map_all(keys, replies, sequential), (reply for reply, _ in replies)))

    def _map_all(self, keys: list, replies: list, sequential: tuple) -> list:
        maps = []
        for i, (key, (reply, fd)) in enumerate(zip(keys, replies)):
            try:
                maps.append(self._map(key, reply, fd, ahead=key in sequential))
            except KeeperError:
                for _, other in replies[i + 1:]:
                    if other is not None:
                        os.close(other)
                raise
        return maps

    def open_listed(self, entries: list, *, sequential: tuple = ()) -> list:
        """:meth:`open_many` of listed objects (entries of one step from :meth:`listing`), with no
        round trip for those whose buffer this client has mapped already (a warm standby's)."""
        out: list = [None] * len(entries)
        ask = []
        for i, e in enumerate(entries):
            m = self._maps.get((e["key"], e.get("buf_id")))
            if m is not None and len(m) >= e["size"]:
                out[i] = (m, Granted(buf_id=e["buf_id"], size=e["size"], checksum=e["checksum"], algo=e["algo"]))
            else:
                ask.append(i)
        if ask:
            steps = {int(entries[i]["step"]) for i in ask}
            if len(steps) != 1:
                raise ValueError("open_listed: the entries are of several steps")
            opened = self.open_many([entries[i]["key"] for i in ask], steps.pop(), sequential=sequential)
            for i, got in zip(ask, opened):
                out[i] = got
        return out

    def premap(self) -> int:
        """Map every complete object's buffer, its pages faulted in, ahead of a restore (a warm
        standby does this while idle). The keeper reuses its buffers, so once mapped a buffer stays
        mapped and populated however often it is rewritten; only new buffers are mapped. A key's
        mappings beyond the keeper's two newest buffers (it holds two per key; a resize makes a new
        one) are dropped. How many buffers were newly mapped."""
        listing = self.listing()
        before = self.mappings_made
        for step in sorted({int(e["step"]) for e in listing}):
            try:
                self.open_many([e["key"] for e in listing if int(e["step"]) == step], step)
            except KeeperError:
                continue  # reused for a newer step since the listing: mapped on the next call
        # A buffer smaller than a key's newest object will not hold it again (a first step's, before
        # the optimizer's state existed): dropped, so that two buffers mapped means the two in use.
        need: dict[str, int] = {}
        for e in listing:
            need[e["key"]] = max(need.get(e["key"], 0), int(e["size"]))
        by_key: dict[str, list] = {}
        for (key, buf_id), m in list(self._maps.items()):
            if len(m) < need.get(key, 0):
                del self._maps[(key, buf_id)]
            else:
                by_key.setdefault(key, []).append(buf_id)
        for key, ids in by_key.items():
            for old in sorted(ids)[:-2]:  # buffer ids only grow
                del self._maps[(key, old)]  # unmapped once nothing views it
        return self.mappings_made - before

    def mapped_both_buffers(self) -> bool:
        """Whether every object mapped so far has both of its keeper buffers mapped (the keeper
        alternates between two per object, so after that premap() finds nothing new)."""
        count: dict[str, int] = {}
        for key, _ in self._maps:
            count[key] = count.get(key, 0) + 1
        return bool(count) and all(n >= 2 for n in count.values())

    def reject(self, step: int) -> None:
        """A restore from ``step`` failed: the keeper frees it and never offers it again."""
        self.request(Reject(step=step))

    def discard_newer(self, step: int) -> int:
        """Free every version newer than ``step``; how many buffers were freed."""
        return self.request(DiscardNewer(step=step))[0].count

    def ping(self) -> Pong:
        """The keeper's pid and node."""
        return self.request(Ping())[0]

    def close(self) -> None:
        # Mappings are not closed explicitly: a restored tensor may still view one (torch keeps a
        # reference to the mmap object, not a buffer export), and munmap under it would crash.
        # Each unmaps when its last user is gone: dropped on a helper thread, since unmapping tens
        # of MiB takes milliseconds the caller (a restore) need not wait for.
        maps, self._maps = self._maps, {}
        if maps:
            threading.Thread(target=maps.clear, name="jitckpt-keeper-unmap", daemon=True).start()
        self._sock.close()


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.11 lacks the name
_WINDOW = 2 << 20


def _populate(m: mmap.mmap) -> None:
    """Fault ``m``'s pages in from its start, a window at a time (the reader follows behind; a page
    it reaches first it faults itself). Through ctypes, which releases the GIL during the call
    (mmap.madvise holds it). Older kernels refuse the advice: the reader faults the pages then."""
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    view = (ctypes.c_char * len(m)).from_buffer(m)  # an export: the mapping stays while it lives
    try:
        base = ctypes.addressof(view)
        for start in range(0, len(m), _WINDOW):
            if madvise(base + start, min(_WINDOW, len(m) - start), _MADV_POPULATE_READ) != 0:
                return
    finally:
        del view
