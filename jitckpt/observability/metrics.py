"""Prometheus metrics for operators, fed by the launcher's event records (:mod:`jitckpt.observability.events`).

Off by default (``port=None``) and bound to loopback by default. prometheus_client's own
``start_http_server`` has no authentication, so the endpoint is served here by a small WSGI
wrapper around ``prometheus_client.make_wsgi_app``: with a ``token`` every scrape must send
``Authorization: Bearer <token>`` (Prometheus: ``authorization: {credentials: ...}`` in the scrape
config). A non-loopback address is refused without a token. The endpoint is plain HTTP, so the
token crosses the network in clear text: on untrusted networks put it behind a TLS proxy.

Metric names (all prefixed ``jitckpt_``; times in seconds, sizes in bytes):

* ``step`` (gauge) latest training step reported; ``step_time_seconds`` (histogram)
* ``failures_total{kind}`` failure incidents (several ranks reporting one failure count once; the
  kind is the first report's)
* ``recovery_phase_seconds{phase}`` (histogram; detect/save/restart/restore),
  ``recovery_seconds`` (histogram, whole recovery), ``steps_redone_total``
* ``checkpoints_total{kind}``, ``checkpoint_bytes_total{kind}``, ``checkpoint_save_seconds{kind}``,
  ``checkpoint_failures_total``
* ``restarts_total``, ``generation``, ``workers_started_total{warm}``, ``world_size``,
  ``job_running``
* ``transparent_recoveries_total{outcome}`` (recovered, refused), ``transparent_validations_total{result}``
  (matched, mismatch): from the records the workers' libjit.so writes under ``--transparent``

Only ``/metrics`` is served (anything else is 404), and without the ``*_created`` series
prometheus_client adds to counters and histograms by default (every counter here starts at 0 with the
launcher, so they carry nothing a scraper's own start time does not).
"""
from __future__ import annotations

import hmac
import ipaddress
import math
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

try:
    from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                                   generate_latest, make_wsgi_app)
except ImportError as exc:  # an optional dependency: say how to get it, not a traceback of ours
    raise ImportError("--metrics-port needs prometheus-client: pip install 'jitckpt[metrics]' "
                      "(or pip install prometheus-client)") from exc

FAILURE_KINDS = ("exit", "signal", "hang", "error", "exception")
PHASES = ("detect", "save", "restart", "restore")
CHECKPOINT_KINDS = ("jit", "periodic")
MIN_TOKEN_LENGTH = 16

_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, math.inf)
_RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, math.inf)


def is_loopback(addr: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scraper must not keep the launcher alive


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few s would flood stderr
        pass


def _bearer_auth(app: Callable, token: str) -> Callable:
    """WSGI middleware: 401 unless the request carries ``Authorization: Bearer <token>``."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        got = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(got, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                ("WWW-Authenticate", 'Bearer realm="jitckpt"')])
            return [b"missing or wrong bearer token\n"]
        return app(environ, start_response)

    return guarded


def _only_metrics_path(app: Callable) -> Callable:
    """WSGI middleware: 404 for any path but ``/metrics`` (prometheus_client serves every path)."""

    def routed(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the metrics are at /metrics\n"]
        return app(environ, start_response)

    return routed


def _num(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class JobMetrics:
    """One job's Prometheus metrics, in its own registry, optionally served over HTTP."""

    def __init__(self, *, port: int | None = None, addr: str = "127.0.0.1", token: str | None = None) -> None:
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ValueError(f"metrics port must be an integer 0-65535 (0 = any free port) or None to disable, got {port!r}")
        if not isinstance(addr, str) or not addr:
            raise ValueError(f"metrics addr must be an IP address or 'localhost', got {addr!r}")
        if token is not None and (not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH or token != token.strip()):
            raise ValueError(f"metrics token must be a string of at least {MIN_TOKEN_LENGTH} characters "
                             "without surrounding whitespace, e.g. from `python -c 'import secrets; print(secrets.token_urlsafe())'`")
        if not is_loopback(addr) and token is None:
            raise ValueError(
                f"refusing to serve metrics on non-loopback address {addr!r} without authentication: "
                "bind to 127.0.0.1 (default) and scrape locally, or pass a bearer token "
                "(scrapes must then send 'Authorization: Bearer <token>'; the endpoint is plain HTTP)"
            )
        disable_created_metrics()  # process-wide in prometheus_client: the launcher's own process
        self.registry = CollectorRegistry(auto_describe=True)
        self._build_metrics()
        self._lock = threading.Lock()
        self._failure_open = False
        self._max_step: float | None = None
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        if port is not None:
            app = _only_metrics_path(make_wsgi_app(self.registry))
            if token is not None:
                app = _bearer_auth(app, token)
            cls = _ThreadingServer6 if ":" in addr else _ThreadingServer
            try:
                self._server = make_server(addr, port, app, server_class=cls, handler_class=_QuietHandler)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror}; "
                              "pick another --metrics-port (0 = any free port)") from exc
            self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                            name="jitckpt-metrics", daemon=True)
            self._thread.start()

    def _build_metrics(self) -> None:
        r = self.registry
        self.step = Gauge("jitckpt_step", "Latest training step reported by any rank", registry=r)
        self.step_time = Histogram("jitckpt_step_time_seconds", "Sampled training step time (s)",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.failures = Counter("jitckpt_failures", "Failure incidents, by kind of the first report",
                                ["kind"], registry=r)
        self.recovery_phase = Histogram("jitckpt_recovery_phase_seconds", "Time per recovery phase (s)",
                                        ["phase"], buckets=_RECOVERY_BUCKETS, registry=r)
        self.recovery = Histogram("jitckpt_recovery_seconds", "Total time of one recovery (s)",
                                  buckets=_RECOVERY_BUCKETS, registry=r)
        self.steps_redone = Counter("jitckpt_steps_redone", "Training steps redone after failures", registry=r)
        self.checkpoints = Counter("jitckpt_checkpoints", "Checkpoint shards saved (one per rank)", ["kind"], registry=r)
        self.checkpoint_bytes = Counter("jitckpt_checkpoint_bytes", "Checkpoint bytes written", ["kind"], registry=r)
        self.checkpoint_seconds = Histogram("jitckpt_checkpoint_save_seconds", "Time to save one rank's checkpoint (s)",
                                            ["kind"], buckets=_RECOVERY_BUCKETS, registry=r)
        self.checkpoint_failures = Counter("jitckpt_checkpoint_failures", "Checkpoints that failed", registry=r)
        self.restarts = Counter("jitckpt_restarts", "Job restarts and single-rank replacements",
                                registry=r)
        self.generation = Gauge("jitckpt_generation", "Restart generation (0 = first launch)", registry=r)
        self.workers_started = Counter("jitckpt_workers_started", "Worker processes started", ["warm"], registry=r)
        self.world_size = Gauge("jitckpt_world_size", "Ranks in the job", registry=r)
        self.job_running = Gauge("jitckpt_job_running", "1 while the job runs, 0 after job_end", registry=r)
        self.transparent_recoveries = Counter(
            "jitckpt_transparent_recoveries", "Device proxies replaced in place (--transparent), by outcome "
            "(recovered, or refused: user-level recovery took over)", ["outcome"], registry=r)
        self.transparent_validations = Counter(
            "jitckpt_transparent_validations", "Replay validations (--transparent), by result (a mismatch "
            "turns transparent recovery off for that rank)", ["result"], registry=r)
        for k in FAILURE_KINDS + ("other",):  # export zeros so rate() works before the first failure
            self.failures.labels(k)
        for p in PHASES:
            self.recovery_phase.labels(p)
        for k in CHECKPOINT_KINDS:
            self.checkpoints.labels(k)
            self.checkpoint_bytes.labels(k)
        for outcome in ("recovered", "refused"):
            self.transparent_recoveries.labels(outcome)
        for result in ("matched", "mismatch"):
            self.transparent_validations.labels(result)

    @property
    def port(self) -> int | None:
        """The bound TCP port (useful with ``port=0``), or None when serving is disabled."""
        return self._server.server_address[1] if self._server else None

    def render(self) -> bytes:
        """The current metrics in Prometheus text format (works with serving disabled too)."""
        return generate_latest(self.registry)

    def record_event(self, record: dict) -> None:
        """Update the metrics from one event record as emitted by :class:`jitckpt.observability.events.EventLog`.

        Unknown event types and missing or non-numeric fields are ignored: metrics must never
        take the launcher down.
        """
        if not isinstance(record, dict):
            raise TypeError(f"record_event takes an event dict from EventLog.emit, got {type(record).__name__}")
        ev = record.get("event")
        gen = _num(record.get("gen"))
        if gen is not None:
            self.generation.set(gen)
        if ev == "step":
            step, st = _num(record.get("step")), _num(record.get("step_time"))
            if step is not None:
                with self._lock:  # max over ranks: read-modify-write
                    if self._max_step is None or step > self._max_step:
                        self._max_step = step
                        self.step.set(step)
            if st is not None and st >= 0:
                self.step_time.observe(st)
        elif ev == "failure_detected":
            kind = record.get("kind") if record.get("kind") in FAILURE_KINDS else "other"
            with self._lock:
                first, self._failure_open = not self._failure_open, True
            if first:
                self.failures.labels(kind).inc()
        elif ev == "transparent_recovery":
            self.transparent_recoveries.labels("recovered" if record.get("recovered") else "refused").inc()
        elif ev == "transparent_validation":
            self.transparent_validations.labels("matched" if record.get("matched") else "mismatch").inc()
        elif ev == "stage_replaced":
            self.restarts.inc()  # counts against --max-restarts like a whole-job restart
        elif ev == "recovery_summary":
            with self._lock:
                was_open, self._failure_open = self._failure_open, False
            if not was_open:  # a recovery whose failure was never reported separately
                kind = record.get("failure_kind") if record.get("failure_kind") in FAILURE_KINDS else "other"
                self.failures.labels(kind).inc()
            for p in PHASES:
                v = _num(record.get(f"{p}_s"))
                if v is not None and v >= 0:
                    self.recovery_phase.labels(p).observe(v)
            total = _num(record.get("total_s"))
            if total is not None and total >= 0:
                self.recovery.observe(total)
            redone = _num(record.get("steps_redone"))
            if redone is not None and redone > 0:
                self.steps_redone.inc(redone)
        elif ev == "checkpoint_saved":
            kind = record.get("kind") if record.get("kind") in CHECKPOINT_KINDS else "other"
            self.checkpoints.labels(kind).inc()
            nbytes, sec = _num(record.get("bytes")), _num(record.get("seconds"))
            if nbytes is not None and nbytes > 0:
                self.checkpoint_bytes.labels(kind).inc(nbytes)
            if sec is not None and sec >= 0:
                self.checkpoint_seconds.labels(kind).observe(sec)
        elif ev == "checkpoint_failed":
            self.checkpoint_failures.inc()
        elif ev == "restart":
            self.restarts.inc()
        elif ev == "worker_start":
            self.workers_started.labels("true" if record.get("warm") else "false").inc()
        elif ev == "job_start":
            ws = _num(record.get("world_size"))
            if ws is not None:
                self.world_size.set(ws)
            self.job_running.set(1)
        elif ev == "job_end":
            self.job_running.set(0)

    def close(self) -> None:
        """Stop serving (idempotent); bounded wait for the server thread."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "JobMetrics":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
