"""Control channel framing: several messages arriving in one socket read are all delivered."""
from __future__ import annotations

import json
import selectors

from jitckpt.control_channel import ControlChannel, channel_pair


def test_messages_read_together_stay_available_after_select_goes_quiet() -> None:
    launcher, child = channel_pair()
    worker = ControlChannel(child)
    try:
        # Two lines in one write, as a worker's last status and exit_ready often arrive.
        child.sendall((json.dumps({"type": "status", "step": 11}) + "\n"
                       + json.dumps({"type": "exit_ready", "rank": 0}) + "\n").encode())
        sel = selectors.DefaultSelector()
        sel.register(launcher.fileno(), selectors.EVENT_READ)
        assert sel.select(1.0)
        assert launcher.recv(timeout=1.0) == {"type": "status", "step": 11}
        # The socket is drained: select reports nothing, yet the second message is buffered.
        assert sel.select(0) == []
        assert launcher.buffered()
        assert launcher.recv(timeout=0) == {"type": "exit_ready", "rank": 0}
        assert not launcher.buffered()
        sel.close()
    finally:
        launcher.close()
        worker.close()


def test_partial_line_is_not_reported_as_buffered() -> None:
    launcher, child = channel_pair()
    try:
        child.sendall(b'{"type": "hello"}\n{"type": "sta')
        assert launcher.recv(timeout=1.0) == {"type": "hello"}
        assert not launcher.buffered()
        child.sendall(b'tus"}\n')
        assert launcher.recv(timeout=1.0) == {"type": "status"}
    finally:
        launcher.close()
        child.close()
