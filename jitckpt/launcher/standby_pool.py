"""Warm standbys: processes that have imported torch and wait for a rank assignment.

A restart then costs rendezvous and checkpoint load, not interpreter start and ``import torch``
(seconds on a loaded node). Each standby runs :mod:`jitckpt.runtime.standby` in its own session,
so :func:`kill_group` takes whatever it started with it.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import time
from typing import NamedTuple, Optional

from jitckpt.protocol.control_channel import ENV_FD, ControlChannel, channel_pair
from jitckpt.protocol.control_messages import Ready
from jitckpt.protocol.step_board import ENV_FD as BOARD_FD, StepBoard

log = logging.getLogger("jitckpt.launcher.standby_pool")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (its own session), also once ``proc`` exited: the
    group lives on while a process it started does (a data loader worker it forked)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:  # it moved itself to another group
            try:
                proc.kill()
            except ProcessLookupError:
                pass


class Standby(NamedTuple):
    """A standby process and the launcher's ends of its control channel and step board."""
    proc: subprocess.Popen
    channel: ControlChannel
    board: StepBoard

    def close(self) -> None:
        self.channel.close()
        self.board.close()


class StandbyPool:
    """Processes that have imported torch and wait for a rank assignment."""

    def __init__(self, *, size: int, env: dict, python: str) -> None:
        self.size, self.env, self.python = size, env, python
        self._idle: list[Standby] = []
        self._ready: set = set()
        self._t_fill = time.monotonic()

    def _spawn(self) -> Standby:
        parent, child = channel_pair()
        board = StepBoard.create()
        env = {**self.env, ENV_FD: str(child.fileno()), BOARD_FD: str(board.fileno())}
        proc = subprocess.Popen([self.python, "-m", "jitckpt.runtime.standby"], env=env,
                                pass_fds=(child.fileno(), board.fileno()), start_new_session=True)
        child.close()
        board.close_fd()
        return Standby(proc, parent, board)

    def fill(self, count: Optional[int] = None) -> None:
        """Start standbys until ``count`` are idle (default ``size``)."""
        while len(self._idle) < (self.size if count is None else count):
            self._idle.append(self._spawn())
        self._ready: set = set()
        self._t_fill = time.monotonic()

    def ready_after(self) -> Optional[float]:
        """Seconds from the last fill until every idle standby finished importing, once it has."""
        pending = [(s.proc, s.channel) for s in self._idle if s.proc.pid not in self._ready]
        if pending:
            readable, _, _ = select.select([ch.fileno() for _, ch in pending], [], [], 0)
            for p, ch in pending:
                if ch.fileno() in readable:
                    msg = ch.recv(timeout=1.0)
                    if isinstance(msg, Ready):
                        self._ready.add(p.pid)
        if len(self._ready) < len(self._idle):
            return None
        return time.monotonic() - self._t_fill

    def take(self) -> tuple[Standby, bool]:
        """An idle standby (True), or a process started now (False) when none is left."""
        while self._idle:
            s = self._idle.pop(0)
            if s.proc.poll() is None:
                return s, True
            s.close()
        return self._spawn(), False

    def close(self) -> None:
        for s in self._idle:
            s.close()  # EOF: the standby exits by itself
            kill_group(s.proc)
        for proc, _, _ in self._idle:  # reaped: none outlives the launcher
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.error("standby pid %d did not die after SIGKILL", proc.pid)
        self._idle.clear()
