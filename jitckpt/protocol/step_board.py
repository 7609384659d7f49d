"""One worker's progress in a page of shared memory: the minibatch it began last, and a step time.

The launcher must know the minibatch a failure hit, also when the rank dies with it. A control
message every step woke the launcher every step: about 1 ms of its CPU per step on the bench's
2-core VM, twice the rest of jitckpt's steady-state cost there. On this board the worker writes two
8-byte words per step (no system call); the launcher reads them when it looks anyway (every
``--monitor-interval``) and before it handles a failure. The launcher keeps its own mapping, so
the last step a dead worker wrote is still there.

Each word is written and read whole (an aligned 8-byte store or load, which x86-64 and AArch64 do
not tear); the two words need not agree with each other: the time is a sample.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Optional

ENV_FD = "JITCKPT_STEP_BOARD_FD"
_SIZE = 16
_NONE = -(2 ** 63)  # no step written yet


class StepBoard:
    """A shared page with one worker's step: the launcher :meth:`create`\\ s it and passes
    :meth:`fileno` to the worker, which maps it with :meth:`from_env` and :meth:`post`\\ s."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._fd: Optional[int] = fd
        # ctypes fields over the page: each read or write is one aligned 8-byte access.
        self._step = ctypes.c_int64.from_buffer(self._map, 0)
        self._time = ctypes.c_double.from_buffer(self._map, 8)

    @classmethod
    def create(cls) -> "StepBoard":
        """A new board, no step on it (the launcher's end; its fd goes to the child in pass_fds)."""
        fd = os.memfd_create("jitckpt-step-board", os.MFD_CLOEXEC)
        os.ftruncate(fd, _SIZE)
        board = cls(fd)
        board._step.value, board._time.value = _NONE, float("nan")
        return board

    @classmethod
    def from_env(cls) -> Optional["StepBoard"]:
        """The worker's end, from the descriptor the launcher passed (None: not under the
        launcher). The variable and the descriptor are consumed: the worker's own children do
        not inherit them."""
        fd = os.environ.pop(ENV_FD, None)
        if not fd:
            return None
        try:
            board = cls(int(fd))
        except (OSError, ValueError) as e:
            raise RuntimeError(f"{ENV_FD}={fd!r} is not a step board ({e}); run the script under "
                               f"`jitckpt run` or unset {ENV_FD}") from None
        board.close_fd()
        return board

    def fileno(self) -> int:
        assert self._fd is not None, "the descriptor was closed"
        return self._fd

    def close_fd(self) -> None:
        """Close the descriptor; the mapping stays."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def post(self, step: int, step_time: Optional[float] = None) -> None:
        """The worker began minibatch ``step``; ``step_time``: the last one's seconds, if known."""
        if step_time is not None:
            self._time.value = step_time
        self._step.value = step

    def clear(self) -> None:
        """No step on it again (a survivor of an in-process recovery runs its script anew)."""
        self._step.value, self._time.value = _NONE, float("nan")

    def step(self) -> Optional[int]:
        """The step posted last (None: none yet)."""
        step = self._step.value
        return None if step == _NONE else step

    def step_time(self) -> Optional[float]:
        """The step time posted last (None: none yet)."""
        t = self._time.value
        return None if t != t else t

    def close(self) -> None:
        if self._map.closed:
            return
        self.close_fd()
        del self._step, self._time  # the mapping cannot close while they export it
        self._map.close()
