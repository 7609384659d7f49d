"""`jitckpt daemon run|status|drain`: the node daemon's commands."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("daemon", help="the node daemon: run it, ask its status, drain the node")
    dsub = p.add_subparsers(dest="daemon_command", required=True)
    run = dsub.add_parser("run", help="serve this node's daemon until SIGTERM/SIGINT")
    run.add_argument("--socket", default=None, help="Unix socket (default $JITCKPT_DAEMON_SOCKET, else "
                     "$XDG_RUNTIME_DIR/jitckpt/daemon.sock or /tmp/jitckpt-<uid>/daemon.sock)")
    run.add_argument("--listen", default="", metavar="HOST:PORT",
                     help="serve over TCP too (needs a token: --token-file or $JITCKPT_DAEMON_TOKEN)")
    run.add_argument("--token-file", default="", help="file holding the token every request must carry")
    run.set_defaults(func=_needs_grpc(_run))
    for name, fn, text in (("status", _status, "the node's jobs, ranks, processes and last failures"),
                           ("drain", _drain, "take no new jobs on this node (--undo: take them again)")):
        q = dsub.add_parser(name, help=text)
        q.add_argument("--socket", default=None, help="the daemon's Unix socket (default: as `daemon run`)")
        q.add_argument("--address", default="", metavar="HOST:PORT", help="a daemon served over TCP")
        q.add_argument("--token-file", default="", help="the token for --address (or $JITCKPT_DAEMON_TOKEN)")
        if name == "status":
            q.add_argument("--json", action="store_true", help="machine-readable output")
        else:
            q.add_argument("--undo", action="store_true", help="take new jobs again")
        q.set_defaults(func=_needs_grpc(fn))


def _needs_grpc(fn: Any) -> Any:
    """A daemon command without gRPC installed says what to install instead of a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            import jitckpt.daemon.schema  # noqa: F401
        except ImportError as e:
            print(f"jitckpt daemon: {e}", file=sys.stderr)
            return 2
        return fn(args)

    return run


def _token(path: str) -> str:
    from jitckpt.daemon.client import token_from_env

    if not path:
        return token_from_env()
    with open(path) as f:
        return f.read().strip()


def _run(args: argparse.Namespace) -> int:
    from jitckpt.console_log import configure
    from jitckpt.daemon.server import DaemonServer
    from jitckpt.process_title import set_title

    configure()
    set_title("jitckpt daemon")
    try:
        server = DaemonServer(socket_path=args.socket, listen=args.listen, token=_token(args.token_file))
        return server.serve_until_signal()
    except (ValueError, RuntimeError, OSError) as e:
        print(f"jitckpt daemon: error: {e}", file=sys.stderr)
        return 2


def _client(args: argparse.Namespace) -> Any:
    from jitckpt.daemon.client import Client

    return Client(socket_path=args.socket, address=args.address, token=_token(args.token_file))


def _status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict
    from rich.console import Console
    from rich.table import Table

    from jitckpt.daemon.client import DaemonRefused, DaemonUnavailable

    try:
        with _client(args) as c:
            st = c.status()
    except (DaemonUnavailable, DaemonRefused) as e:
        print(f"jitckpt daemon status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
                         indent=2))
        return 0
    con = Console()
    con.print(f"jitckpt daemon pid {st.daemon_pid}, up {time.time() - st.started:.0f} s"
              + (", [bold yellow]draining[/]: no new jobs" if st.draining else ""))
    jobs = Table(title="jobs on this node")
    for col in ("job", "node", "generation", "status", "processes", "last checkpoint"):
        jobs.add_column(col)
    for j in st.jobs:
        procs = ", ".join(f"{p.kind} {'rank ' + str(p.rank) + ' ' if p.rank >= 0 else ''}pid {p.pid}" for p in j.processes)
        ckpt = f"step {j.last_checkpoint_step}" if j.last_checkpoint_step >= 0 else "none"
        jobs.add_row(j.run_id, str(j.node_rank), str(j.generation), j.status,
                     f"launcher pid {j.launcher_pid}; {procs}" if procs else f"launcher pid {j.launcher_pid}", ckpt)
    con.print(jobs)
    fails = Table(title="last failures")
    for col in ("time", "job", "generation", "kind", "rank", "detail"):
        fails.add_column(col)
    for f in st.failures[-10:]:
        fails.add_row(time.strftime("%H:%M:%S", time.localtime(f.time)), f.run_id, str(f.generation), f.kind,
                      str(f.rank) if f.rank >= 0 else "?", f.detail[:120])
    con.print(fails)
    return 0


def _drain(args: argparse.Namespace) -> int:
    from jitckpt.daemon.client import DaemonRefused, DaemonUnavailable

    try:
        with _client(args) as c:
            c.drain(not args.undo)
    except (DaemonUnavailable, DaemonRefused) as e:
        print(f"jitckpt daemon drain: {e}", file=sys.stderr)
        return 1
    print("this node takes new jobs again" if args.undo else "this node is draining: it takes no new jobs")
    return 0
