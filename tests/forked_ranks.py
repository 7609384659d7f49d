"""Run gloo ranks as processes forked from the test, around a store in its own process."""
from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Callable

from jitckpt.swift.pipeline.store import StoreServer


def run_ranks(target: Callable[..., None], *extra: object, world: int = 2, timeout: float = 60.0) -> list:
    """Call ``target(rank, store_port, *extra)`` in ``world`` forked processes; return their exit codes.

    Every process is killed by PID if it outlives ``timeout``.
    """
    server = StoreServer()  # no c10d server thread in this process while forking
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=(r, server.port, *extra), daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        server.stop()
