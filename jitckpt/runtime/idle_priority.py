"""Idle CPU and I/O priority for the calling thread, for work a process does while a job trains
(a warm standby importing torch): the kernel runs it only on time no other thread wants, so it
never slows a training step. Per thread on Linux, so it ends with the thread: an unprivileged
process could lower its own priority but not raise it again (RLIMIT_NICE is 0 by default).
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("jitckpt.runtime.idle_priority")

# ioprio_set(2) has no libc wrapper: its system call number, and the idle class (which the CFQ and
# BFQ I/O schedulers honour; others ignore it).
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
IOPRIO_WHO_PROCESS, IOPRIO_CLASS_IDLE, IOPRIO_CLASS_SHIFT = 1, 3, 13


def at_idle_priority() -> None:
    """Put the calling thread at ``SCHED_IDLE`` and the idle I/O class. A system that refuses
    either (no such call here) leaves that priority as it is, said at debug level."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except (AttributeError, OSError) as e:
        log.debug("SCHED_IDLE refused: %s", e)
    number = _SYS_IOPRIO_SET.get(platform.machine())
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    # who 0 with IOPRIO_WHO_PROCESS: the calling thread.
    if libc.syscall(number, IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT) != 0:
        log.debug("idle I/O priority refused: %s", os.strerror(ctypes.get_errno()))


def thread_is_idle(tid: int = 0) -> bool:
    """Whether thread ``tid`` (0: the calling one) runs at ``SCHED_IDLE``."""
    return os.sched_getscheduler(tid) == os.SCHED_IDLE
