"""`jitckpt run`'s link to its node's daemon (`jitckpt daemon run`), when one serves this node.

The launcher registers its job and processes, reports failures, checkpoints and how the job ended,
from its own event records. Without a daemon (no socket) nothing happens, as before the daemon
existed. A daemon that stops answering is said once and left alone: it never takes the job down.
A draining node refuses the job at its start (:class:`NodeDraining`).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

log = logging.getLogger("jitckpt.launcher.daemon_link")


class NodeDraining(RuntimeError):
    """The node's daemon takes no new jobs."""


class DaemonKeeper:
    """The node's snapshot keeper for this job, as the daemon runs it (the launcher's
    KeeperSupervisor's interface). The daemon's child outlives this launcher: a job run again
    after its launcher died finds its snapshots. It is stopped only when the job ended well."""

    def __init__(self, client: Any, run_id: str, node: int) -> None:
        self._client, self.run_id, self.node = client, run_id, node
        self.socket_path = ""
        self.pid: Optional[int] = None
        self.starts = 0
        self.previous_exit: Optional[int] = None
        self.job_ok = False

    def ensure_running(self) -> bool:
        from jitckpt.daemon.client import DaemonRefused, DaemonUnavailable

        try:
            r = self._client.ensure_keeper(run_id=self.run_id, node_rank=self.node)
        except (DaemonRefused, DaemonUnavailable) as e:
            raise RuntimeError(f"the node's daemon cannot run the snapshot keeper: {e}") from None
        self.socket_path, self.pid, self.starts = r.socket_path, r.pid, r.starts
        self.previous_exit = None if r.previous_exit == -1000 else r.previous_exit
        return r.started

    def stop(self) -> None:
        if not self.job_ok:
            return  # kept for a run of the job again
        from jitckpt.daemon.client import DaemonRefused, DaemonUnavailable

        try:
            self._client.stop_keeper(run_id=self.run_id)
        except (DaemonRefused, DaemonUnavailable) as e:
            log.warning("could not stop the job's snapshot keeper in the node's daemon: %s", e)


class DaemonLink:
    def __init__(self, *, run_id: str, node_rank: int, world_size: int) -> None:
        self.run_id, self.node_rank, self.world_size = run_id, node_rank, world_size
        self._client: Any = None
        self._processes: dict[int, tuple[int, int, str]] = {}  # rank -> (rank, pid, kind)
        self._keeper: Optional[int] = None
        self._gen = 0
        self._registered = False
        self._keeper_handle: Optional[DaemonKeeper] = None
        from jitckpt.daemon.socket_path import default_socket

        path = default_socket()
        if not os.path.exists(path):
            return
        try:
            from jitckpt.daemon.client import Client
        except ImportError as e:
            log.warning("a jitckpt daemon socket is at %s, but this installation cannot talk to it: %s", path, e)
            return
        self._client = Client(socket_path=path, timeout=5.0)

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def proxy_broker(self) -> Optional[str]:
        """The daemon's proxy broker socket (device proxies start as the daemon's children), or None."""
        if self._client is None:
            return None
        from jitckpt.daemon.socket_path import broker_socket, default_socket

        path = broker_socket(default_socket())
        return path if os.path.exists(path) else None

    def keeper(self, node: int) -> Optional[DaemonKeeper]:
        """The daemon's keeper for this job (None without a daemon)."""
        if self._client is None:
            return None
        self._keeper_handle = DaemonKeeper(self._client, self.run_id, node)
        return self._keeper_handle

    def on_event(self, event: str, rec: dict) -> None:
        """One of the launcher's event records."""
        if self._client is None:
            return
        if event == "worker_start":
            self._processes[int(rec["rank"])] = (int(rec["rank"]), int(rec["pid"]), "worker")
            self._register()
        elif event == "snapshot_keeper_start":
            self._keeper = int(rec["pid"])
            self._register()
        elif event == "restart":
            self._gen = int(rec.get("restart_count", self._gen + 1))
        elif event == "failure_detected":
            self._call("report_failure", run_id=self.run_id, generation=self._gen, kind=str(rec.get("kind", "")),
                       rank=int(rec["rank"]) if isinstance(rec.get("rank"), int) else -1,
                       detail=str(rec.get("detail", ""))[:4000])
        elif event == "checkpoint_saved":
            self._call("report_checkpoint", run_id=self.run_id, rank=int(rec["rank"]), step=int(rec["step"]),
                       kind=str(rec.get("kind") or "jit"), path=str(rec.get("path") or "")[:4000],
                       nbytes=int(rec.get("bytes") or 0))
        elif event == "job_end" and self._registered:
            if self._keeper_handle is not None:
                self._keeper_handle.job_ok = rec.get("status") == "ok"
            self._call("end_job", run_id=self.run_id, status=str(rec.get("status", "failed")))

    def start(self, launcher_pid: int) -> None:
        """The job starts on this node: registered, or NodeDraining."""
        self._launcher_pid = launcher_pid
        if self._client is None:
            return
        from jitckpt.daemon.client import DaemonRefused

        try:
            self._register(raise_draining=True)
        except DaemonRefused as e:
            raise NodeDraining(str(e)) from None

    def _register(self, raise_draining: bool = False) -> None:
        procs = list(self._processes.values()) + ([(-1, self._keeper, "keeper")] if self._keeper else [])
        self._registered |= self._call("register_job", raise_draining=raise_draining, run_id=self.run_id,
                                       node_rank=self.node_rank, launcher_pid=self._launcher_pid,
                                       world_size=self.world_size, generation=self._gen, processes=procs)

    def _call(self, method: str, raise_draining: bool = False, **kwargs: Any) -> bool:
        import grpc

        from jitckpt.daemon.client import DaemonRefused, DaemonUnavailable

        if self._client is None:
            return False
        try:
            getattr(self._client, method)(**kwargs)
            return True
        except DaemonRefused as e:
            if raise_draining and e.code == grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("the node's jitckpt daemon refused %s: %s", method, e)
        except DaemonUnavailable as e:
            log.warning("%s; going on without it", e)
            self._client.close()
            self._client = None
        return False
