"""A rendezvous TCPStore hosted in its own process, so the supervisor can fork stages safely.

A TCPStore master runs a server thread; forking stage processes from a process with that
thread alive can deadlock the child (observed: a forked child hung forever creating its own
TCPStore client). Hosting the master in a dedicated child keeps the supervisor free of c10d
threads (clients have none).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from datetime import timedelta

import torch.distributed as dist


def _serve(conn) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300))
    conn.send(store.port)
    try:
        conn.recv()  # returns (EOFError) when the owner closes the pipe or dies
    except EOFError:
        pass
    os._exit(0)


class StoreServer:
    """Forks a process hosting a TCPStore master on a free port; ``with`` stops it (by PID)."""

    def __init__(self, *, start_timeout: float = 30.0) -> None:
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self.stop()
            raise TimeoutError(f"TCPStore server did not start within {start_timeout}s")
        self.port: int = self._conn.recv()

    def client(self, *, timeout: float) -> dist.TCPStore:
        """A client connection to the hosted store."""
        return dist.TCPStore("127.0.0.1", self.port, is_master=False,
                             timeout=timedelta(seconds=timeout))

    def stop(self) -> None:
        """Stop the server process."""
        self._conn.close()
        if self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join(5)

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
