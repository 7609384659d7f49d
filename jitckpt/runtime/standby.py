"""Warm standby worker: a Python process that has already imported torch, waiting for a rank.

The launcher keeps a pool of these so a restart costs rendezvous and checkpoint load, not
interpreter start-up and ``import torch`` (seconds). A plain Python job's standbys are forked by
the standby template (:mod:`jitckpt.runtime.standby_template`), which imported torch once; with
``--preload`` (libjit.so) each one is a process of its own that imports torch itself, on a thread
at idle CPU and I/O priority so that it never slows a training step. On ``assign`` it takes the
rank's environment and argv and the worker spec, starts the jitckpt worker runtime from the spec,
and runs the user's script as ``__main__``.
"""
from __future__ import annotations

import os
import runpy
import socket
import sys
import threading

from jitckpt.runtime.idle_priority import at_idle_priority


def import_torch() -> None:
    """The expensive part, done while idle: torch itself, and torch._dynamo, which DDP's
    constructor imports lazily (seconds on its own), and the runtime a worker starts."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.optim  # noqa: F401

    import jitckpt.runtime.worker_runtime  # noqa: F401


def import_torch_at_idle_priority() -> None:
    """:func:`import_torch` on a thread of its own at idle CPU and I/O priority, the caller waiting:
    an unprivileged process can lower its priority but not raise it again, and this thread's
    priority ends with it (the worker-to-be keeps its own)."""
    error: list = []

    def run() -> None:
        try:
            at_idle_priority()
            import_torch()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            error.append(e)

    t = threading.Thread(target=run, name="jitckpt-standby-import")
    t.start()
    t.join()
    if error:
        raise error[0]


def redirect_output(stdout: str, stderr: str) -> None:
    """Point fds 1 and 2 (Python's and native code's output alike) at the launcher's files."""
    for path, fd, stream in ((stdout, 1, sys.stdout), (stderr, 2, sys.stderr)):
        if path:
            stream.flush()
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)


def main() -> None:
    """A standby started as a process of its own (``python -m jitckpt.runtime.standby [--idle]``;
    ``--idle``: started ahead of its use, while the job trains: it imports at idle priority)."""
    from jitckpt.process_title import set_title

    set_title("jitckpt standby")
    if sys.argv[1:] == ["--idle"]:
        import_torch_at_idle_priority()
    else:
        import_torch()
    serve()


def serve() -> None:
    """Say ready, wait for the launcher's assignment and run the rank's script (torch imported;
    the control channel and the step board in the environment)."""
    from jitckpt.process_title import set_title, worker_title
    from jitckpt.protocol.control_channel import ENV_FD, ControlChannel
    from jitckpt.protocol.control_messages import TO_WORKER, Assign, Ready
    from jitckpt.protocol.step_board import StepBoard
    from jitckpt.snapshot.premap import ENV_PREMAP

    channel = ControlChannel(socket.socket(fileno=int(os.environ[ENV_FD])), incoming=TO_WORKER)
    board = StepBoard.from_env()
    from jitckpt.runtime.current import install_runtime
    from jitckpt.runtime.worker_runtime import WorkerRuntime

    channel.send(Ready())
    premapper = None
    if os.environ.get(ENV_PREMAP):  # a one-node job's snapshots: their restore then maps nothing
        from jitckpt.snapshot.premap import Premapper

        # The title tells `ps` (and the tests) when a restore from this standby would map nothing.
        premapper = Premapper(os.environ.pop(ENV_PREMAP),
                              on_settled=lambda: set_title("jitckpt standby (snapshots mapped ahead)"))
    msg = channel.recv()
    if not isinstance(msg, Assign):
        os._exit(0)  # launcher shut the pool down
    premapped = premapper.stop() if premapper is not None else None
    redirect_output(msg.stdout, msg.stderr)
    os.environ.update(msg.env)
    os.chdir(msg.cwd)
    argv = list(msg.argv)
    from jitckpt.protocol.worker_spec import WorkerSpec
    from jitckpt.runtime.generation_store import host_if_rank0

    spec = WorkerSpec.from_dict(msg.spec)
    set_title(worker_title(spec.rank, spec.world_size, spec.gen))
    store = host_if_rank0(spec)  # noqa: F841 - serves the process group's store while this rank lives
    rt = WorkerRuntime.from_spec(spec, channel, board)
    rt.start()
    if premapped is not None:
        if rt.snapshots is not None and rt.snapshots.socket_path == premapper.socket_path:
            rt.snapshots.premapped = premapped
        else:
            premapped.close()
    install_runtime(rt)
    try:
        if msg.module:
            sys.argv = argv
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            # sys.exit(2) (a bad flag) is a failed rank, as under torchrun: not a rank that finished.
            rt.skip_exit_barrier()
        raise


if __name__ == "__main__":
    main()
