"""``jitckpt.daemon.Client``: talk to a node's daemon (``jitckpt daemon run``).

    from jitckpt.daemon import Client
    c = Client()                      # this node's daemon, on its default Unix socket
    c.status()                        # jobs, their processes, last checkpoints, last failures
    Client(address="host:7070", token="...")   # a daemon served over TCP

Calls raise :class:`DaemonUnavailable` when no daemon answers, :class:`DaemonRefused` (with the
daemon's reason) when it refuses a request.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Optional

import grpc

from jitckpt.daemon.schema import MAX_MESSAGE_BYTES, pb, rpc


class DaemonUnavailable(RuntimeError):
    """No daemon answers there."""


class DaemonRefused(RuntimeError):
    """The daemon refused the request; ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, text: str) -> None:
        super().__init__(text)
        self.code = code


class Client:
    """A node daemon's client. Keyword-only: ``socket_path`` (default: the daemon's default socket)
    or ``address`` (``HOST:PORT``, with ``token``); ``timeout`` in seconds per call."""

    def __init__(self, *, socket_path: Optional[str] = None, address: str = "", token: str = "",
                 timeout: float = 5.0) -> None:
        from jitckpt.daemon.socket_path import default_socket

        if timeout <= 0:
            raise ValueError("timeout must be > 0 seconds")
        self.target = address or f"unix:{socket_path or default_socket()}"
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout
        self._channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", 16 * MAX_MESSAGE_BYTES)])
        self._stub = rpc.NodeDaemonStub(self._channel)

    def _call(self, method: str, request: Any, timeout: Optional[float] = None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise DaemonUnavailable(f"no jitckpt daemon answers at {self.target} ({e.details()}); start one "
                                        "with `jitckpt daemon run`") from None
            raise DaemonRefused(code, f"the jitckpt daemon at {self.target} refused {method}: {e.details()}") from None

    def register_job(self, *, run_id: str, node_rank: int, launcher_pid: int, world_size: int, generation: int,
                     processes: Iterable[tuple[int, int, str]] = ()) -> None:
        """Register (or update) a job's processes on this node: (rank, pid, kind) with kind worker,
        proxy or keeper."""
        self._call("RegisterJob", pb.RegisterJobRequest(
            run_id=run_id, node_rank=node_rank, launcher_pid=launcher_pid, world_size=world_size,
            generation=generation, processes=[pb.Process(rank=r, pid=p, kind=k) for r, p, k in processes]))

    def report_failure(self, *, run_id: str, generation: int, kind: str, rank: int = -1, detail: str = "") -> None:
        self._call("ReportFailure", pb.ReportFailureRequest(run_id=run_id, generation=generation, kind=kind,
                                                            rank=rank, detail=detail))

    def report_checkpoint(self, *, run_id: str, rank: int, step: int, kind: str, path: str = "",
                          nbytes: int = 0) -> None:
        self._call("ReportCheckpoint", pb.ReportCheckpointRequest(run_id=run_id, rank=rank, step=step, kind=kind,
                                                                  path=path, bytes=nbytes))

    def end_job(self, *, run_id: str, status: str) -> None:
        self._call("EndJob", pb.EndJobRequest(run_id=run_id, status=status))

    def health(self) -> Any:
        return self._call("Health", pb.HealthRequest())

    def status(self) -> Any:
        return self._call("Status", pb.StatusRequest())

    def drain(self, on: bool = True) -> None:
        self._call("Drain", pb.DrainRequest(drain=on))

    def ensure_keeper(self, *, run_id: str, node_rank: int) -> Any:
        """The job's snapshot keeper on this node, started by the daemon if none runs (may take
        as long as a Python start)."""
        return self._call("EnsureKeeper", pb.EnsureKeeperRequest(run_id=run_id, node_rank=node_rank), timeout=90)

    def stop_keeper(self, *, run_id: str) -> None:
        self._call("StopKeeper", pb.StopKeeperRequest(run_id=run_id))

    def request_migration(self, *, run_id: str, rank: int, target: str) -> None:
        self._call("RequestMigration", pb.MigrationRequest(run_id=run_id, rank=rank, target=target))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def token_from_env() -> str:
    return os.environ.get("JITCKPT_DAEMON_TOKEN", "")
