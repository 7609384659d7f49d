"""`jitckpt daemon run` as a real process for tests: in its own session, on a socket in the test's
directory; stopped with SIGTERM, killed by PID if it does not stop."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jobs import ROOT, kill_tree


class Daemon:
    """`jitckpt daemon run` in its own session, on a socket in the test's directory."""

    def __init__(self, tmp: Path, *extra: str, env: dict | None = None) -> None:
        self.socket = tmp / "d" / "daemon.sock"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "JITCKPT_DAEMON_SOCKET": str(self.socket), **(env or {})}
        self.log = tmp / "daemon.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "jitckpt", "daemon", "run", *extra], env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.serving() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # polling for the line a started server writes (after every listener is up)
        if not self.serving():
            self.close()
            raise AssertionError(f"the daemon did not start:\n{self.log.read_text()}")

    def serving(self) -> bool:
        return self.log.exists() and "serving" in self.log.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid)

    def client(self):  # type: ignore[no-untyped-def]
        from jitckpt.daemon import Client

        return Client(socket_path=str(self.socket))
