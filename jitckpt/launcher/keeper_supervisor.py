"""The launcher's handle on its node's snapshot keeper: start it, replace it if it died, stop it.

The keeper (:mod:`jitckpt.snapshot.keeper`) holds the node's in-memory snapshots, so it must outlive the
trainers: one keeper per node for the whole job, kept across restarts. A keeper found dead at the
start of a generation (its node was lost, or it crashed) is replaced by a fresh, empty one; the
lost snapshot data is then rebuilt from the other nodes' replicas or parity.
"""
from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("jitckpt.launcher.supervisor")

MAX_SOCKET_PATH = 100  # Unix socket paths must fit in 108 bytes (sun_path)


class KeeperSupervisor:
    """Runs ``python -m jitckpt.snapshot.keeper`` for node ``node`` with its socket under ``run_dir``."""

    def __init__(self, *, run_dir: str, node: int, python: str, env: dict,
                 start_timeout: float = 60.0, stop_timeout: float = 5.0) -> None:
        if start_timeout <= 0 or stop_timeout <= 0:
            raise ValueError("start_timeout and stop_timeout must be > 0")
        self.node, self.python, self.env = node, python, env
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self._tmpdir: Optional[str] = None
        # Named per node: launchers of several nodes may share a run dir (a shared file system).
        path = str(Path(run_dir).resolve() / f"snapshot-keeper-node{node}.sock")
        if len(path.encode()) > MAX_SOCKET_PATH:
            # A deep run dir: the socket goes to a short private directory instead.
            self._tmpdir = tempfile.mkdtemp(prefix="jitckpt-keeper-")
            path = os.path.join(self._tmpdir, f"node{node}.sock")
        self.socket_path = path
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0
        self.previous_exit: Optional[int] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def ensure_running(self) -> bool:
        """Start the keeper if none runs (a dead one's exit code goes to ``previous_exit``).

        Returns True if a keeper was started. Raises RuntimeError if it does not report ready
        within ``start_timeout``.
        """
        if self.proc is not None and self.proc.poll() is None:
            return False
        if self.proc is not None:
            self.previous_exit = self.proc.returncode
            log.warning("snapshot keeper of node %d (pid %d) is gone (exit %s); starting an empty one",
                        self.node, self.proc.pid, self.previous_exit)
        self._start()
        return True

    def _start(self) -> None:
        # Same process group as the launcher (no new session): a SIGTERM to the group reaches it too,
        # and stop() ends it on every exit path of the launcher. It ignores SIGINT (see serve()).
        proc = subprocess.Popen([self.python, "-m", "jitckpt.snapshot.keeper", "--socket", self.socket_path,
                                 "--node", str(self.node)], env=self.env, stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
        self.proc = proc
        self.starts += 1
        line = b""
        deadline = time.monotonic() + self.start_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n") and time.monotonic() < deadline:
                if sel.select(max(0.0, deadline - time.monotonic())):
                    chunk = os.read(proc.stdout.fileno(), 256)
                    if not chunk:
                        break  # EOF: the keeper died
                    line += chunk
        if not line.startswith(b"ready"):
            self.stop()
            raise RuntimeError(f"snapshot keeper for node {self.node} did not start (socket "
                               f"{self.socket_path}; output {line!r}); see its error above")

    def stop(self) -> None:
        """SIGTERM, wait up to ``stop_timeout``, then SIGKILL by PID; remove the socket directory."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=self.stop_timeout)
                except subprocess.TimeoutExpired:
                    log.warning("snapshot keeper pid %d ignored SIGTERM; killing it", proc.pid)
                    proc.kill()
                    proc.wait(timeout=self.stop_timeout)
            if proc.stdout is not None:
                proc.stdout.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
