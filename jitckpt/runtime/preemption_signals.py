"""SIGTERM/SIGINT in a worker: a preemption to save for, even while the main thread is blocked.

Python runs a signal handler only on the main thread, between bytecodes: never while that thread
waits in a collective or a long C call, which is exactly when a save is most needed. So the Python
handler installed here does nothing; Python's C-level handler also writes the signal number to a
wakeup fd (:func:`signal.set_wakeup_fd`), which a helper thread reads and passes on.

Left alone: a signal the script already handles or ignores, and both signals if a wakeup fd is
already set (e.g. by an asyncio event loop). A handler the script installs later takes over that
signal: the helper thread no longer passes it on. Forked children (e.g. DataLoader workers) get the
default dispositions back, so a signal to them is not taken for one to this process.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable, Optional

log = logging.getLogger("jitckpt.worker")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


# Who gets the signals: the process's current worker runtime (replaced after an in-process recovery).
_target: Optional[Callable[[signal.Signals], None]] = None


def _wake_only(signum: int, frame: object) -> None:
    """The Python-level handler: the wakeup fd carries the signal to the helper thread."""


def catch(on_signal: Callable[[signal.Signals], None]) -> bool:
    """Call ``on_signal(sig)`` on a helper thread for every SIGTERM/SIGINT this process receives.

    Must be called on the main thread. Returns False (nothing installed) when a handler or wakeup
    fd is already there, or off the main thread.
    """
    global _target
    if threading.current_thread() is not threading.main_thread():
        log.warning("jitckpt started off the main thread: SIGTERM/SIGINT will not trigger a JIT save")
        return False
    if _target is not None and all(signal.getsignal(s) is _wake_only for s in SIGNALS):
        _target = on_signal  # a new runtime in the same process (in-process recovery): it gets them now
        return True
    mine = [s for s in SIGNALS if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler)]
    if not mine:
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)  # the C handler must never block
    previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        log.warning("a signal wakeup fd is already set (an asyncio loop?): SIGTERM/SIGINT will not "
                    "trigger a JIT save")
        return False
    _target = on_signal
    restore = {s: signal.signal(s, _wake_only) for s in mine}
    os.register_at_fork(after_in_child=lambda: _reset_in_child(restore))
    threading.Thread(target=_watch, args=(r, frozenset(mine)), name="jitckpt-signals",
                     daemon=True).start()
    return True


def _reset_in_child(restore: dict) -> None:
    try:
        signal.set_wakeup_fd(-1)
        for s, previous in restore.items():
            if signal.getsignal(s) is _wake_only:
                signal.signal(s, previous)
    except ValueError:  # not the main thread of the child: leave it
        pass


def _watch(fd: int, mine: frozenset) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in mine and signal.getsignal(signum) is _wake_only and _target is not None:
                _target(signal.Signals(signum))
