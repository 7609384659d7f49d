"""What the launcher knows of one worker process: its rank, process, channel and progress."""
from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

from jitckpt.launcher.standby_pool import kill_group
from jitckpt.protocol.control_channel import ControlChannel
from jitckpt.protocol.control_messages import Restored
from jitckpt.protocol.step_board import StepBoard


@dataclass
class Worker:
    """One rank's process as the launcher sees it; updated from its control messages, its step
    read from its step board."""

    rank: int
    local_rank: int
    proc: subprocess.Popen
    channel: ControlChannel
    warm: bool
    started: float = field(default_factory=time.monotonic)
    exit_code: Optional[int] = None
    eof: bool = False
    board: Optional[StepBoard] = None  # None: a --no-python worker, which posts no step
    hello: bool = False  # its runtime started
    can_save: Optional[bool] = None  # what its Hellos said (None: none yet); any True wins
    noted_step: Optional[int] = None  # the step the launcher last noted (events, failure record)
    noted_t: float = 0.0
    exit_ready: bool = False
    exit_step: Optional[int] = None
    restored: Optional[Restored] = None
    resumed: bool = False
    killed: bool = False  # by this launcher, while still running: not a death of its own

    @property
    def step(self) -> Optional[int]:
        """The minibatch it began last; -1: its runtime started, no minibatch yet; None: not
        started. Read from the board: current, also just after the worker died."""
        posted = self.board.step() if self.board is not None else None
        if posted is not None:
            return posted
        return -1 if self.hello else None

    @property
    def minibatch_done(self) -> bool:
        """It finished a minibatch in this process (after a restore: the one it resumed at, the
        failed one done again): told by its Resumed, else read from its board."""
        if self.resumed:
            return True
        first = self.restored.step if self.restored is not None else 0
        return self.step is not None and self.step > first

    @property
    def step_time(self) -> Optional[float]:
        """Its last step's seconds, when it posted one."""
        return self.board.step_time() if self.board is not None else None

    @property
    def no_save_path(self) -> bool:
        """It registered and nothing in it can save (a native program): after a failure, no JIT
        checkpoint is to be waited for from it."""
        return self.can_save is False

    def registered(self, can_save: bool) -> None:
        """Its Hello came: a save path once registered stays (a Python runtime started after
        libjit.so registered the process)."""
        self.hello = True
        self.can_save = bool(self.can_save) or can_save

    @property
    def stopped(self) -> bool:
        """Its process is stopped (SIGSTOP, a debugger): it runs nothing, a save included, until
        someone continues it."""
        import psutil

        try:
            return psutil.Process(self.proc.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            return False

    @property
    def live(self) -> bool:
        """Not known to have exited and its channel still open: it can be told things."""
        return self.exit_code is None and not self.eof

    def kill(self) -> None:
        """SIGKILL the worker's process group (what it started too), remembering whether the
        launcher killed the worker itself."""
        if self.proc.poll() is None:
            self.killed = True
        kill_group(self.proc)

    def death(self) -> tuple[str, str]:
        """How a worker that exited on its own died: (failure kind, detail)."""
        if (self.exit_code or 0) < 0:
            return "signal", f"killed by {signal.Signals(-self.exit_code).name}"
        return "exit", f"exit code {self.exit_code}"


def pid_of(workers: list[Worker], rank: Optional[int]) -> Optional[int]:
    """The process id of ``rank`` among ``workers`` (None if not one of them)."""
    return next((w.proc.pid for w in workers if w.rank == rank), None)
