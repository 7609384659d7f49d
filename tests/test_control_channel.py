"""The control channel: typed messages (issue 14), framing of several messages per socket read,
and lines that are no message of the protocol refused by name."""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

import pytest

from jitckpt.protocol.control_channel import ControlChannel, channel_pair
from jitckpt.protocol.control_messages import (TO_LAUNCHER, TO_WORKER, ExitReady, ProtocolError, Saved,
                                               Resumed, SaveNow, Verdict, decode)


def test_messages_read_together_stay_available_after_select_goes_quiet() -> None:
    launcher, child = channel_pair()
    worker = ControlChannel(child, incoming=TO_WORKER)
    try:
        # Two lines in one write, as a worker's resumed and exit_ready can arrive.
        child.sendall(Resumed(rank=0, step=11).encode() + ExitReady(rank=0, step=12).encode())
        sel = selectors.DefaultSelector()
        sel.register(launcher.fileno(), selectors.EVENT_READ)
        assert sel.select(1.0)
        assert launcher.recv(timeout=1.0) == Resumed(rank=0, step=11)
        # The socket is drained: select reports nothing, yet the second message is buffered.
        assert sel.select(0) == []
        assert launcher.buffered()
        assert launcher.recv(timeout=0) == ExitReady(rank=0, step=12)
        assert not launcher.buffered()
        sel.close()
    finally:
        launcher.close()
        worker.close()


def test_partial_line_is_not_reported_as_buffered() -> None:
    launcher, child = channel_pair()
    try:
        child.sendall(b'{"type": "hello", "rank": 1, "pid": 7, "gen": 0}\n{"type": "res')
        assert launcher.recv(timeout=1.0).pid == 7
        assert not launcher.buffered()
        child.sendall(b'umed", "rank": 1, "step": 3}\n')
        assert launcher.recv(timeout=1.0) == Resumed(rank=1, step=3)
    finally:
        launcher.close()
        child.close()


def test_each_end_decodes_its_own_direction() -> None:
    """'failure' is a report to the launcher and an order to save to a worker: one type name, two
    classes, chosen by the end that reads it."""
    a, b = socket.socketpair()
    worker = ControlChannel(b, incoming=TO_WORKER)
    try:
        a.sendall(SaveNow(kind="signal", rank=2, detail="killed").encode() + Verdict(ok=True).encode())
        assert worker.recv(timeout=1.0) == SaveNow(kind="signal", rank=2, detail="killed")
        assert worker.recv(timeout=1.0) == Verdict(ok=True)
    finally:
        a.close()
        worker.close()


@pytest.mark.parametrize("line,message", [
    (b"not json", "not a JSON object with a type"),
    (b'{"step": 1}', "not a JSON object with a type"),
    (b'{"type": "stauts", "rank": 0}', "unknown control message type 'stauts'"),
    (b'{"type": "resumed", "rank": 0, "step": 1, "stpe": 2}', r"unknown field\(s\) \['stpe'\]"),
    (b'{"type": "saved", "rank": 0}', "'saved'.*missing"),
])
def test_lines_outside_the_protocol_are_named(line, message) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(line, TO_LAUNCHER)


def test_a_message_round_trips_with_its_defaults() -> None:
    msg = Saved(rank=1, path="/c", step=5, bytes=10, seconds=0.5)
    assert json.loads(msg.encode())["type"] == "saved"
    assert decode(msg.encode(), TO_LAUNCHER) == msg


def test_a_hello_says_whether_the_worker_can_save() -> None:
    """libjit.so's registration of a --no-python program (interposer/src/launcher_hello.cc writes
    this line) says it cannot save; the Python runtime's Hello, without the field, can."""
    native = decode(b'{"type":"hello","rank":1,"pid":7,"gen":0,"can_save":false}', TO_LAUNCHER)
    assert (native.rank, native.pid, native.gen, native.can_save) == (1, 7, 0, False)
    assert decode(b'{"type": "hello", "rank": 1, "pid": 7, "gen": 0}', TO_LAUNCHER).can_save is True


def test_a_worker_that_exited_leaves_its_last_messages_to_read_without_waiting() -> None:
    """A survivor that saved its JIT checkpoint and exited before the launcher's select() returned
    its channel: the launcher sees the exit first and must still count the save (once every
    worker has an exit code it goes on). A process it forked still holds the socket, so no EOF
    comes: reading what is there must not wait for more."""
    launcher, child = channel_pair()
    saved = Saved(rank=0, path="/ck/jit-s5", step=5, bytes=10, seconds=0.1)
    code = ("import os, socket, sys, time\n"
            f"s = socket.socket(fileno={child.fileno()})\n"
            "if os.fork() == 0:\n"
            "    time.sleep(30); os._exit(0)\n"  # holds the socket open after its parent exits
            "s.sendall(sys.argv[1].encode() + sys.argv[2].encode()[:9])\n")  # and a partial line
    proc = subprocess.Popen([sys.executable, "-c", code, saved.encode().decode(),
                             Resumed(rank=0, step=6).encode().decode()],
                            pass_fds=(child.fileno(),), start_new_session=True)
    child.close()
    try:
        assert proc.wait(timeout=30) == 0
        t0 = time.monotonic()
        assert launcher.pending() == [saved]
        assert launcher.pending() == []  # the partial line stays for later
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(TimeoutError):
            launcher.recv(timeout=0.05)  # no EOF: the grandchild holds the socket
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the grandchild, by its session's group
        launcher.close()


def test_pending_stops_at_eof_and_leaves_it_to_recv() -> None:
    launcher, child = channel_pair()
    child.sendall(Resumed(rank=1, step=3).encode())
    child.close()
    try:
        assert launcher.pending() == [Resumed(rank=1, step=3)]
        assert launcher.recv(timeout=1.0) is None
    finally:
        launcher.close()
