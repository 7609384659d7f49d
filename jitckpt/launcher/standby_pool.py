"""Warm standbys: processes that have imported torch and wait for a rank assignment.

A restart then costs rendezvous and checkpoint load, not interpreter start and ``import torch``
(seconds on a loaded node). A plain Python job's standbys are forked by the standby template
(:mod:`jitckpt.runtime.standby_template`), which imports torch once at the job's start: a standby
is then ready a few milliseconds after it is asked for, and takes no CPU from the training. With
``--preload`` (libjit.so does not track a forked child), or if the template is lost, each
standby is a process of its own (:mod:`jitckpt.runtime.standby`) that imports torch at idle CPU
and I/O priority. Either way each standby is in its own session, so :func:`kill_group` takes
whatever it started with it.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections import deque
from typing import NamedTuple, Optional, Union

from jitckpt.protocol.control_channel import ENV_FD, ControlChannel, channel_pair
from jitckpt.protocol.control_messages import Ready
from jitckpt.protocol.step_board import ENV_FD as BOARD_FD, StepBoard
from jitckpt.runtime.standby_template import ENV_TEMPLATE_FD

log = logging.getLogger("jitckpt.launcher.standby_pool")
TEMPLATE_START_S = 300.0  # how long the template may take to import torch (a loaded node, a cold disk)
PR_SET_CHILD_SUBREAPER = 36


def kill_group(proc: "Process") -> None:
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


class ForkedProcess:
    """A standby the template forked, reparented to this process (its child subreaper): the part
    of :class:`subprocess.Popen` the launcher uses (``pid``, ``poll``, ``wait``, ``kill``,
    ``returncode``). Its PID is known once the template answered the request."""

    def __init__(self, template: "StandbyTemplate") -> None:
        self._template = template
        self._pid: Optional[int] = None
        self.returncode: Optional[int] = None

    @property
    def pid(self) -> int:
        while self._pid is None:
            self._template.read_answer()
        return self._pid

    def _forked(self, pid: int) -> None:
        self._pid = pid

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 0
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    @property
    def known(self) -> bool:
        """The template said its PID (else it may never: the template lost)."""
        return self._pid is not None

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"standby pid {self.pid}", timeout or 0.0)
            try:
                fd = os.pidfd_open(self.pid)  # readable once it exited
            except OSError:  # a kernel before 5.3: look again shortly
                time.sleep(0.01 if left is None else min(0.01, left))
                continue
            try:
                select.select([fd], [], [], left)
            finally:
                os.close(fd)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


Process = Union[subprocess.Popen, ForkedProcess]


class StandbyTemplate:
    """The launcher's end of the standby template process: fork requests and their answers, in
    order. ``failed`` says why it can fork no more (then the pool starts standbys of their own)."""

    def __init__(self, *, env: dict, python: str) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # the forked standbys become ours
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.set_inheritable(True)
        self.proc = subprocess.Popen([python, "-m", "jitckpt.runtime.standby_template"],
                                     env={**env, ENV_TEMPLATE_FD: str(theirs.fileno())},
                                     pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.sock = ours
        self.ready = False
        self.failed: Optional[str] = None
        self._t_start = time.monotonic()
        self._waiting: deque = deque()  # ForkedProcess handles whose PID is still to come

    def fork(self, env: dict, fds: tuple[int, int]) -> ForkedProcess:
        """Ask for a standby with environment ``env`` and (control channel, step board)."""
        handle = ForkedProcess(self)
        socket.send_fds(self.sock, [json.dumps({"env": env}).encode()], list(fds))
        self._waiting.append(handle)
        return handle

    def read_answer(self, timeout: Optional[float] = None) -> bool:
        """Read the template's next answer, waiting up to ``timeout`` (None: as long as its start
        may take, TEMPLATE_START_S, or a fork, 30 s); False if none came within ``timeout``.
        OSError once it cannot fork; the handles waiting get nothing more."""
        if self.failed is not None:
            raise OSError(self.failed)
        limit = TEMPLATE_START_S - (time.monotonic() - self._t_start) if not self.ready else 30.0
        ready, _, _ = select.select([self.sock], [], [], max(0.0, limit if timeout is None else timeout))
        if not ready and timeout is not None:
            return False
        msg = self.sock.recv(1 << 16) if ready else b""
        answer = json.loads(msg) if msg else {"error": "no answer" if not ready else "it exited"}
        if "error" in answer:
            what = "did not import torch within %.0f s" % TEMPLATE_START_S if not ready else answer["error"]
            self.failed = f"the standby template (pid {self.proc.pid}) {what}"
            raise OSError(self.failed)
        if answer.get("ready"):
            self.ready = True
        else:
            self._waiting.popleft()._forked(int(answer["pid"]))
        return True

    def close(self) -> None:
        """Stop it, once the PIDs it already sent are read (those standbys exist)."""
        try:
            while self.read_answer(timeout=0):
                pass
        except OSError:
            pass
        self.failed = self.failed or "closed"
        self.sock.close()  # EOF: it exits by itself
        kill_group(self.proc)
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.error("standby template pid %d did not die after SIGKILL", self.proc.pid)


class Standby(NamedTuple):
    """A standby process and the launcher's ends of its control channel and step board."""
    proc: Process
    channel: ControlChannel
    board: StepBoard
    t_start: float  # time.monotonic() when it was asked for

    def close(self) -> None:
        self.channel.close()
        self.board.close()


class StandbyPool:
    """Processes that have imported torch and wait for a rank assignment."""

    def __init__(self, *, size: int, env: dict, python: str, forks: bool = True) -> None:
        """``size`` standbys kept idle once filled; ``forks``: from a standby template (False:
        each a process of its own, e.g. with a library preloaded that a fork would not suit)."""
        if size < 0:
            raise ValueError(f"StandbyPool: size must be >= 0, got {size}")
        self.size, self.env, self.python = size, env, python
        self._idle: list[Standby] = []
        self._ready: set = set()  # the idle standbys that said Ready
        self._t_fill = time.monotonic()
        self._template: Optional[StandbyTemplate] = None
        # --warm-standby 0 (size 0) is torchrun's way: every worker a fresh process.
        self._forks = forks and size > 0

    def _spawn(self, *, ahead: bool) -> Standby:
        """A standby: forked by the template, else a process of its own, which imports torch at
        idle priority when it is started ``ahead`` of its use (while the job trains)."""
        parent, child = channel_pair()
        board = StepBoard.create()
        env = {**self.env, ENV_FD: str(child.fileno()), BOARD_FD: str(board.fileno())}
        try:
            proc: Process = self._fork(env, (child.fileno(), board.fileno()))
        except OSError as e:
            if self._template is not None:
                log.warning("%s; standbys start as processes of their own (each imports torch)", e)
            self._forks = False
            proc = subprocess.Popen([self.python, "-m", "jitckpt.runtime.standby", *(["--idle"] if ahead else [])],
                                    env=env, pass_fds=(child.fileno(), board.fileno()), start_new_session=True)
        child.close()
        board.close_fd()
        return Standby(proc, parent, board, time.monotonic())

    def _fork(self, env: dict, fds: tuple[int, int]) -> ForkedProcess:
        """A standby from the template (started at the first one); OSError once it cannot fork."""
        if not self._forks:
            raise OSError("no template")
        if self._template is None:
            self._template = StandbyTemplate(env=self.env, python=self.python)
        return self._template.fork(env, fds)

    def fill(self, count: Optional[int] = None, *, ahead: bool = True) -> None:
        """Start standbys until ``count`` are idle (default ``size``). ``ahead``: for a later
        restart, started while the job trains (False: for workers needed now)."""
        while len(self._idle) < (self.size if count is None else count):
            self._idle.append(self._spawn(ahead=ahead))
        self._t_fill = time.monotonic()

    def _read_ready(self, standbys: list[Standby]) -> None:
        """Note the standbys among ``standbys`` that said Ready (without waiting)."""
        pending = [s for s in standbys if s not in self._ready]
        if not pending:
            return
        readable, _, _ = select.select([s.channel.fileno() for s in pending], [], [], 0)
        for s in pending:
            if s.channel.fileno() in readable:
                msg = s.channel.recv(timeout=1.0)
                if isinstance(msg, Ready):
                    self._ready.add(s)

    def ready_after(self) -> Optional[float]:
        """Seconds from the last fill until every idle standby finished importing, once it has."""
        self._read_ready(self._idle)
        if any(s not in self._ready for s in self._idle):
            return None
        return time.monotonic() - self._t_fill

    def take(self) -> tuple[Standby, Optional[str]]:
        """An idle standby, and None if it was ready (torch imported), else why it was not; a
        process started now when none is left."""
        self._read_ready(self._idle)
        while self._idle:
            s = self._idle.pop(0)
            try:
                alive = s.proc.poll() is None
            except OSError as e:  # a fork the template never made
                log.warning("a standby was lost: %s", e)
                alive = False
            ready = s in self._ready
            self._ready.discard(s)
            if alive:
                if ready:
                    return s, None
                return s, f"its standby was still starting ({time.monotonic() - s.t_start:.1f} s after it was asked for)"
            s.close()
        why = ("--warm-standby 0" if self.size == 0 else
               "no standby was left (the pool is filled once every rank trains)")
        return self._spawn(ahead=False), why

    def close(self) -> None:
        if self._template is not None:  # first: no fork after this, and every PID it made known
            self._template.close()
        idle = [s for s in self._idle if not isinstance(s.proc, ForkedProcess) or s.proc.known]
        for s in self._idle:
            s.close()  # EOF: the standby exits by itself
        for s in idle:
            kill_group(s.proc)
        for s in idle:  # reaped: none outlives the launcher
            try:
                s.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.error("standby pid %d did not die after SIGKILL", s.proc.pid)
        self._idle.clear()
