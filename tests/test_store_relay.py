"""The launcher's store relay (jitckpt/launcher/store_relay.py), spoken to as libjit.so does
(interposer/src/rendezvous_store.h): a real torch HashStore behind a real Unix socket."""
from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time

import pytest

from jitckpt.launcher.store_relay import StoreRelay, local_store_factory


def request(path: str, op: bytes, key: str, tail: bytes) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(path)
        k = key.encode()
        s.sendall(op + struct.pack("<I", len(k)) + k + tail)
        head = b""
        while len(head) < 5:
            chunk = s.recv(5 - len(head))
            assert chunk, "the relay closed the connection without a reply"
            head += chunk
        status, size = struct.unpack("<BI", head)
        body = b""
        while len(body) < size:
            body += s.recv(size - len(body))
        return status, body


def set_key(path: str, key: str, value: bytes) -> tuple[int, bytes]:
    return request(path, b"S", key, struct.pack("<I", len(value)) + value)


def get_key(path: str, key: str, wait_ms: int) -> tuple[int, bytes]:
    return request(path, b"G", key, struct.pack("<I", wait_ms))


@pytest.fixture
def relay():
    r = StoreRelay(store_factory=local_store_factory(), prefix="test")
    yield r
    r.close()


def test_a_key_set_by_one_rank_is_got_by_another_waiting_for_it(relay: StoreRelay) -> None:
    uid = bytes(range(128))
    got: dict[str, tuple[int, bytes]] = {}
    waiter = threading.Thread(target=lambda: got.update(r=get_key(relay.socket_path, "comm/ab/0", 10_000)))
    waiter.start()
    assert set_key(relay.socket_path, "comm/ab/0", uid) == (0, b"")
    waiter.join(timeout=20)
    assert not waiter.is_alive() and got["r"] == (0, uid)
    assert get_key(relay.socket_path, "comm/ab/0", 0) == (0, uid)  # already there: no wait


def test_a_key_nobody_sets_times_out_within_its_wait(relay: StoreRelay) -> None:
    t0 = time.monotonic()
    status, _ = get_key(relay.socket_path, "vote/never/0/1", 300)
    assert status == 1 and 0.25 < time.monotonic() - t0 < 10
    t0 = time.monotonic()  # a wait of 0: only whether it is there (the watchdog's question)
    assert get_key(relay.socket_path, "vote/never/0/found", 0)[0] == 1 and time.monotonic() - t0 < 5
    set_key(relay.socket_path, "vote/x/0/found", b"1")
    assert get_key(relay.socket_path, "vote/x/0/found", 0) == (0, b"1")


def test_bad_requests_get_an_error_and_the_relay_goes_on(relay: StoreRelay) -> None:
    status, body = request(relay.socket_path, b"X", "k", b"")
    assert status == 2 and b"unknown request" in body
    status, body = request(relay.socket_path, b"S", "k", struct.pack("<I", 1 << 30))
    assert status == 2 and b"not a store request" in body
    assert set_key(relay.socket_path, "k", b"v") == (0, b"")


def test_the_socket_is_private_and_gone_after_close() -> None:
    r = StoreRelay(store_factory=local_store_factory())
    directory = os.path.dirname(r.socket_path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    r.close()
    assert not os.path.exists(directory)
    with pytest.raises(ValueError, match="prefix"):
        StoreRelay(store_factory=local_store_factory(), prefix="")
