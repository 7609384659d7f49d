"""Per-node keeper of in-memory snapshots: owns the memory so it outlives the training processes.

Run one per node: ``python -m jitckpt.snapshot.keeper --socket PATH --node N``. It prints
``ready <pid>`` once it accepts connections. Local ranks talk to it over a Unix ``SOCK_SEQPACKET``
socket (one typed message per request and reply: :mod:`jitckpt.protocol.keeper_messages`); buffers are anonymous ``memfd`` files whose file
descriptors travel with the reply (SCM_RIGHTS), so ranks write snapshots straight into the
keeper's memory with no copy through the socket. The memory belongs to the keeper: it survives a
crash of the trainers and goes away with the keeper (a lost node loses its snapshots, as it would).

Per object key at most two buffers: while a rank writes version ``t+1`` the previous complete one
stays readable, and it is the one reused by the next ``begin`` (REFT: one completed, one ongoing).
A commit item may ``pin`` its version: a third buffer keeps it until the key's next pinned version
commits (a fallback older than two steps: the partition copies of AOR's log mode).
A buffer only grows (a smaller object leaves its tail unused), so a reader that mapped it once
keeps a valid mapping: a warm standby maps them ahead of a restore (:mod:`jitckpt.snapshot.premap`).
The keeper never hashes data (the writer does, off the training critical path); readers verify.

Requests: ``Begin(key, step, size)`` -> fd; ``Commit(items)``; ``ListObjects``; ``Open(key, step)``
-> fd; ``Reject(step)`` (a restore from it failed: free it, never offer it again);
``DiscardNewer(step)``; ``Ping``. The keeper stops on SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from jitckpt.protocol.keeper_messages import (CHANNEL, MAX_PACKET, TO_KEEPER, Begin, Commit, DiscardNewer,
                                              Done, Freed, Granted, ListObjects, Objects, Open, Ping, Pong,
                                              Refused, Reject)
from jitckpt.protocol.wire import Message, ProtocolError, decode


@dataclass
class _Buffer:
    fd: int
    size: int      # the object's bytes
    capacity: int  # the memfd's: it only grows, so a reader's mapping stays valid for smaller objects
    buf_id: int    # changes when the capacity does
    step: int = -1
    complete: bool = False
    checksum: int = 0
    algo: str = ""
    covers: tuple = ()  # a parity object's checksum of each range it is the XOR of, as its writer read them
    pinned: bool = False  # kept until the key's next pinned version commits (not reused by begin)


class SnapshotKeeper:
    """The keeper's object table and request handling (one instance per keeper process)."""

    def __init__(self, *, node: int) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._objects: dict[str, list[_Buffer]] = {}
        self._next_id = 1

    # Table operations --------------------------------------------------------------------------
    def begin(self, key: str, step: int, size: int) -> _Buffer:
        if size <= 0:
            raise ValueError(f"begin {key}: size must be > 0, got {size}")
        with self._lock:
            bufs = self._objects.setdefault(key, [])
            same = [b for b in bufs if b.complete and b.step == step]
            if same:
                raise ValueError(f"begin {key}: a complete version for step {step} exists; "
                                 "snapshot a newer step (or discard_newer first)")
            free = [b for b in bufs if not b.pinned]
            spare = [b for b in free if not b.complete]
            if spare:
                b = spare[0]
            elif len(free) < 2:
                b = self._new(size)
                bufs.append(b)
            else:  # reuse the older complete version; the newer one stays readable
                b = min(free, key=lambda x: x.step)
            if b.capacity < size:
                os.ftruncate(b.fd, size)
                b.capacity, b.buf_id = size, self._take_id()
            b.size, b.step, b.complete, b.checksum, b.algo, b.covers = size, step, False, 0, "", ()
            return b

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _new(self, size: int) -> _Buffer:
        fd = os.memfd_create("jitckpt-snapshot", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return _Buffer(fd=fd, size=size, capacity=size, buf_id=self._take_id())

    def commit(self, items: list) -> None:
        with self._lock:
            for it in items:
                key, step = it["key"], int(it["step"])
                match = [b for b in self._objects.get(key, []) if not b.complete and b.step == step]
                if not match:
                    raise ValueError(f"commit {key} step {step}: no begin for it (or already committed)")
                b = match[0]
                b.checksum, b.algo, b.complete = int(it["checksum"]), str(it["algo"]), True
                b.covers = tuple(int(c) for c in it.get("covers", ()))
                if it.get("pin"):
                    bufs = self._objects[key]
                    for other in bufs:
                        other.pinned = other is b
                    free = [x for x in bufs if not x.pinned]
                    done = sorted((x for x in free if x.complete), key=lambda x: x.step)
                    for old in done[:max(0, len(free) - 2)]:  # the version unpinned: back to two
                        bufs.remove(old)
                        os.close(old.fd)

    def listing(self) -> list[dict]:
        with self._lock:
            return [{"key": k, "step": b.step, "size": b.size, "checksum": b.checksum, "algo": b.algo,
                     "buf_id": b.buf_id, **({"covers": list(b.covers)} if b.covers else {})}
                    for k, bufs in sorted(self._objects.items()) for b in bufs
                    if b.complete]

    def find(self, key: str, step: int) -> _Buffer:
        with self._lock:
            for b in self._objects.get(key, []):
                if b.complete and b.step == step:
                    return b
        raise KeyError(f"no complete object {key} for step {step} on node {self.node}")

    def reject(self, step: int) -> int:
        """Free every version of ``step`` (a restore from it failed): it is never offered again,
        and a later run that reaches the same step number can snapshot it afresh."""
        n = 0
        with self._lock:
            for bufs in self._objects.values():
                for b in bufs:
                    if b.step == step:
                        b.step, b.complete, b.pinned = -1, False, False
                        n += 1
        return n

    def discard_newer(self, step: int) -> int:
        n = 0
        with self._lock:
            for bufs in self._objects.values():
                for b in bufs:
                    if b.step > step:
                        b.step, b.complete, b.pinned = -1, False, False
                        n += 1
        return n

    # Request dispatch --------------------------------------------------------------------------
    def handle(self, req: Message) -> tuple[Message, Optional[int]]:
        """The reply to one request, and the file descriptor that travels with it."""
        if isinstance(req, Begin):
            b = self.begin(req.key, int(req.step), int(req.size))
            return Granted(buf_id=b.buf_id, size=b.size), b.fd
        if isinstance(req, Commit):
            self.commit(list(req.items))
            return Done(), None
        if isinstance(req, ListObjects):
            return Objects(objects=self.listing(), node=self.node), None
        if isinstance(req, Open):
            b = self.find(req.key, int(req.step))
            return Granted(buf_id=b.buf_id, size=b.size, checksum=b.checksum, algo=b.algo), b.fd
        if isinstance(req, Reject):
            return Freed(count=self.reject(int(req.step))), None
        if isinstance(req, DiscardNewer):
            return Freed(count=self.discard_newer(int(req.step))), None
        if isinstance(req, Ping):
            return Pong(pid=os.getpid(), node=self.node), None
        raise ProtocolError(f"no handler for {type(req).__name__}")


def _serve_connection(keeper: SnapshotKeeper, conn: socket.socket, stop: threading.Event) -> None:
    with conn:
        while not stop.is_set():
            try:
                data = conn.recv(MAX_PACKET)
            except OSError:
                return
            if not data:
                return
            fd = None
            try:
                reply, fd = keeper.handle(decode(data, TO_KEEPER, channel=CHANNEL))
            except (ValueError, KeyError, TypeError) as e:  # ProtocolError is a ValueError
                reply = Refused(error=str(e))
            try:
                if fd is not None:
                    socket.send_fds(conn, [reply.encode()], [fd])
                else:
                    conn.send(reply.encode())
            except OSError:
                return


def serve(socket_path: str, *, node: int, max_lifetime: float, ready_out: Any = sys.stdout) -> None:
    """Accept local ranks until shutdown, SIGTERM, ``max_lifetime`` seconds (0: no limit) or the
    death of the process that started it (a launcher killed with SIGKILL): a keeper serves that
    launcher's ranks only, and an orphan would hold the node's snapshot memory for good."""
    parent = os.getppid()
    keeper = SnapshotKeeper(node=node)
    stop = threading.Event()
    if os.path.exists(socket_path):
        os.unlink(socket_path)  # a stale socket of a dead keeper
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(socket_path)
    srv.listen(64)
    srv.settimeout(0.5)  # lets the accept loop notice stop/lifetime
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # A Ctrl-C at the terminal reaches the launcher's whole process group: the launcher turns it
    # into a JIT save of every rank and stops this keeper afterwards, not before.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    deadline = time.monotonic() + max_lifetime if max_lifetime > 0 else None
    print(f"ready {os.getpid()}", file=ready_out, flush=True)
    try:
        while not stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                print("snapshot keeper: max lifetime reached, exiting", file=sys.stderr, flush=True)
                break
            if os.getppid() != parent:  # re-parented: the starting process is gone
                print(f"snapshot keeper: parent process {parent} is gone, exiting", file=sys.stderr,
                      flush=True)
                break
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            threading.Thread(target=_serve_connection, args=(keeper, conn, stop), daemon=True).start()
    finally:
        srv.close()
        try:
            os.unlink(socket_path)
        except FileNotFoundError:
            pass


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitckpt.snapshot.keeper", description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True, help="Unix socket path the node's ranks connect to")
    p.add_argument("--node", type=int, default=0, help="node index (for messages)")
    p.add_argument("--max-lifetime", type=float, default=0.0,
                   help="exit after this many seconds (0: run until SIGTERM or shutdown)")
    a = p.parse_args(argv)
    if len(a.socket.encode()) > 100:
        p.error(f"--socket path is {len(a.socket.encode())} bytes; Unix socket paths must be under "
                "108 bytes - use a shorter directory")
    serve(a.socket, node=a.node, max_lifetime=a.max_lifetime)
    return 0


if __name__ == "__main__":
    sys.exit(main())
