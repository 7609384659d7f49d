"""`jitckpt daemon run`: the node daemon's gRPC server (service in ``daemon.proto``).

It listens on a Unix socket by default (its directory 0700, the socket 0600: only this user). TCP
needs an explicit ``--listen HOST:PORT`` and a token, which every request must carry
(``authorization: Bearer <token>``, compared in constant time). Requests over
:data:`~jitckpt.daemon.schema.MAX_MESSAGE_BYTES` are refused before they are parsed; a request with a
bad field gets INVALID_ARGUMENT naming it, and changes nothing (:mod:`jitckpt.daemon.node_state`).
"""
from __future__ import annotations

import hmac
import logging
import os
import signal
import threading
from concurrent import futures
from typing import Any, Callable, Optional

import grpc

from jitckpt.daemon.node_state import BadRequest, Draining, NodeState
from jitckpt.daemon.proxy_broker import ProxyBroker
from jitckpt.daemon.socket_path import broker_socket, default_socket
from jitckpt.daemon.schema import MAX_MESSAGE_BYTES, pb, rpc

log = logging.getLogger("jitckpt.daemon")


class _TokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid token is required (authorization: Bearer <token>)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return continuation(details)
        return self._deny


class _Servicer(rpc.NodeDaemonServicer):
    def __init__(self, state: NodeState, keepers: "DaemonKeepers") -> None:
        self.state = state
        self.keepers = keepers

    def _apply(self, context: grpc.ServicerContext, fn: Callable[[], Any], reply: Any) -> Any:
        try:
            fn()
        except BadRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Draining as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return reply

    def RegisterJob(self, request, context):  # noqa: N802 - gRPC's names
        return self._apply(context, lambda: self.state.register_job(request), pb.RegisterJobReply())

    def ReportFailure(self, request, context):  # noqa: N802
        return self._apply(context, lambda: self.state.report_failure(request), pb.ReportFailureReply())

    def ReportCheckpoint(self, request, context):  # noqa: N802
        return self._apply(context, lambda: self.state.report_checkpoint(request), pb.ReportCheckpointReply())

    def EndJob(self, request, context):  # noqa: N802
        return self._apply(context, lambda: self.state.end_job(request), pb.EndJobReply())

    def Health(self, request, context):  # noqa: N802
        draining, jobs, _ = self.state.snapshot()
        dead = [pb.Process(rank=r, pid=pid, kind=kind) for _, r, pid, kind in self.state.dead_processes()]
        return pb.HealthReply(serving=True, draining=draining, jobs=sum(j.status == "running" for j in jobs),
                              dead=dead)

    def Status(self, request, context):  # noqa: N802
        draining, jobs, failures = self.state.snapshot()
        return pb.StatusReply(
            draining=draining, daemon_pid=os.getpid(), started=self.state.started,
            jobs=[pb.Job(run_id=j.run_id, node_rank=j.node_rank, launcher_pid=j.launcher_pid,
                         world_size=j.world_size, generation=j.generation,
                         processes=[pb.Process(rank=r, pid=pid, kind=k) for r, pid, k in j.processes],
                         last_checkpoint_step=j.last_checkpoint_step, last_checkpoint_path=j.last_checkpoint_path,
                         status=j.status) for j in jobs],
            failures=[pb.Failure(**f) for f in failures])

    def Drain(self, request, context):  # noqa: N802
        self.state.drain(request.drain)
        return pb.DrainReply()

    def EnsureKeeper(self, request, context):  # noqa: N802
        try:
            keeper = self.keepers.ensure(request.run_id, request.node_rank)
        except BadRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (RuntimeError, OSError) as e:
            context.abort(grpc.StatusCode.INTERNAL, f"cannot start the snapshot keeper: {e}")
        started, sup = keeper
        prev = sup.previous_exit
        return pb.EnsureKeeperReply(socket_path=sup.socket_path, pid=sup.pid or 0, started=started,
                                    previous_exit=-1000 if prev is None else prev, starts=sup.starts)

    def StopKeeper(self, request, context):  # noqa: N802
        return self._apply(context, lambda: self.keepers.stop(request.run_id), pb.StopKeeperReply())

    def RequestMigration(self, request, context):  # noqa: N802
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "CRIU migration is not built yet: recover the rank with `jitckpt run`'s JIT recovery")


class DaemonKeepers:
    """The snapshot keepers this daemon started, one per job (its children: they outlive launchers)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self._lock = threading.Lock()
        self._keepers: dict[str, Any] = {}

    def ensure(self, run_id: str, node_rank: int) -> tuple[bool, Any]:
        import sys

        from jitckpt.daemon.node_state import _int, _run_id
        from jitckpt.launcher.keeper_supervisor import KeeperSupervisor

        run_id, node_rank = _run_id(run_id), _int("node_rank", node_rank, 0)
        with self._lock:  # one start at a time; a start waits for the keeper's "ready" line
            sup = self._keepers.get(run_id)
            if sup is None:
                run_dir = os.path.join(self.base, run_id)
                os.makedirs(run_dir, mode=0o700, exist_ok=True)
                sup = KeeperSupervisor(run_dir=run_dir, node=node_rank, python=sys.executable, env=dict(os.environ))
                self._keepers[run_id] = sup
            return sup.ensure_running(), sup

    def stop(self, run_id: str) -> None:
        from jitckpt.daemon.node_state import _run_id

        with self._lock:
            sup = self._keepers.pop(_run_id(run_id), None)
        if sup is not None:
            sup.stop()

    def stop_all(self) -> None:
        with self._lock:
            sups, self._keepers = list(self._keepers.values()), {}
        for sup in sups:
            sup.stop()


class DaemonServer:
    """The node daemon, serving until :meth:`stop`.

    Args:
        socket_path: the Unix socket (default :func:`default_socket`); "" with ``listen`` only.
        listen: ``HOST:PORT`` for TCP as well (needs ``token``).
        token: required on every request when set (always with ``listen``).
    """

    def __init__(self, *, socket_path: Optional[str] = None, listen: str = "", token: str = "") -> None:
        if listen and not token:
            raise ValueError("--listen serves the daemon over TCP: give a token too (--token-file or "
                             "JITCKPT_DAEMON_TOKEN); without one only the Unix socket is served")
        if token and len(token) < 16:
            raise ValueError("the daemon's token must be at least 16 characters")
        self.socket_path = default_socket() if socket_path is None else socket_path
        self.listen = listen
        self.state = NodeState()
        interceptors = [_TokenCheck(token)] if token else []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors,
                                   options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                            ("grpc.max_send_message_length", 16 * MAX_MESSAGE_BYTES)])
        self.keepers = DaemonKeepers(os.path.join(os.path.dirname(self.socket_path or default_socket()), "keepers"))
        # Device proxies of the node's processes, started as this daemon's children (Unix socket only).
        self.broker = ProxyBroker(broker_socket(self.socket_path), on_start=self.state.proxy_started,
                                  on_exit=self.state.proxy_ended) if self.socket_path else None
        rpc.add_NodeDaemonServicer_to_server(_Servicer(self.state, self.keepers), self._server)
        self.port: Optional[int] = None
        self._stopped = threading.Event()

    def start(self) -> None:
        if self.socket_path:
            d = os.path.dirname(self.socket_path)
            os.makedirs(d, mode=0o700, exist_ok=True)
            if os.stat(d).st_uid != os.getuid():  # e.g. planted in /tmp by another user
                raise RuntimeError(f"{d} belongs to another user: choose a socket elsewhere (--socket)")
            os.chmod(d, 0o700)
            if os.path.exists(self.socket_path):
                from jitckpt.daemon.client import Client, DaemonUnavailable  # one way: client imports no server

                try:
                    Client(socket_path=self.socket_path, timeout=2).health()
                    raise RuntimeError(f"a jitckpt daemon already serves {self.socket_path}")
                except DaemonUnavailable:
                    os.unlink(self.socket_path)  # a dead daemon's socket
            self._server.add_insecure_port(f"unix:{self.socket_path}")
        if self.listen:
            self.port = self._server.add_insecure_port(self.listen)
            if not self.port:
                raise RuntimeError(f"--listen {self.listen}: cannot bind")
        self._server.start()
        if self.socket_path:
            os.chmod(self.socket_path, 0o600)
        if self.broker is not None:
            try:
                self.broker.start()
            except OSError as e:  # e.g. a path over the socket limit: proxies stay the applications' children
                log.warning("the proxy broker cannot serve %s (%s); device proxies are started by their "
                            "applications instead", self.broker.socket_path, e)
                self.broker = None
        log.info("jitckpt daemon (pid %d) serving %s", os.getpid(),
                 ", ".join(filter(None, [self.socket_path and f"unix:{self.socket_path}",
                                         self.listen and f"tcp:{self.listen} (token)"])))

    def stop(self) -> None:
        if self.broker is not None:
            self.broker.stop()
        self._server.stop(grace=1).wait()
        self.keepers.stop_all()
        log.info("jitckpt daemon (pid %d) stopped", os.getpid())
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self._stopped.set()

    def serve_until_signal(self) -> int:
        """Serve until SIGTERM or SIGINT."""
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda *_: self._stopped.set())
        self.start()
        self._stopped.wait()
        self.stop()
        return 0
