"""Bounded runs of benchmark processes, and nothing of theirs left behind.

A launcher's workers run in sessions of their own, and a process killed at a timeout leaves its
children running: `subprocess.run(timeout=...)` kills only the process it started. Here a timeout
kills the whole tree, found by PID (psutil) before anything in it is killed, and ``make bench``
(run_all.py) is the child subreaper of everything it starts, so that what was orphaned on the way
(a launcher SIGKILLed by a test of it, say) is still its descendant, and killed once its benchmark
ends.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import tempfile
from typing import Any

import psutil

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans of this process's descendants are reparented to it, not to init (Linux >= 3.4)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def kill_tree(pid: int, *, timeout: float = 10.0) -> list[int]:
    """SIGKILL ``pid`` and every descendant of it (listed first, so none escapes by being
    reparented meanwhile); wait for them; the PIDs killed."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    return _kill(procs, timeout)


def kill_descendants(*, grace: float = 3.0, timeout: float = 10.0) -> list[int]:
    """SIGKILL every descendant of this process (a subreaper: also the orphans of its children's
    children) still running after ``grace`` seconds, and reap them all; the PIDs of those killed.
    The grace is for what ends by itself just after its parent (multiprocessing's resource
    tracker, once its pipe closes); an orphan that ended is this process's zombie, reaped too."""
    procs = psutil.Process().children(recursive=True)
    running = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                running.append(p)
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(running, timeout=grace) if running else ([], [])
    _kill(procs, timeout)
    return [p.pid for p in still]


def _kill(procs: list, timeout: float) -> list[int]:
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)  # reaps this process's own children among them
    return [p.pid for p in procs]


def run(cmd: list, *, timeout: float, stderr: Any = None, **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **popen)``, except
    that at the timeout the whole tree of ``cmd`` is killed before TimeoutExpired is raised, and
    that it returns when ``cmd`` exits, not when the last holder of its output closes it (a
    worker in a session of its own may outlive it): the output goes to files, not pipes.
    ``stderr=subprocess.STDOUT`` merges the two."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out if stderr == subprocess.STDOUT else err, **popen)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            raise subprocess.TimeoutExpired(cmd, timeout, output=_text(out), stderr=_text(err)) from None
        except BaseException:  # interrupted: nothing of it outlives this process either
            kill_tree(proc.pid)
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, _text(out), _text(err))


def _text(f: Any) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")
