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

import gc
import logging
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING, Optional

from jitckpt.protocol.control_messages import Assign
from jitckpt.protocol.exit_codes import EXIT_JIT_SAVED
from jitckpt.runtime.idle_priority import at_idle_priority

log = logging.getLogger("jitckpt.worker")

if TYPE_CHECKING:
    from jitckpt.protocol.control_channel import ControlChannel
    from jitckpt.protocol.step_board import StepBoard
    from jitckpt.runtime.inprocess import ScriptRunner


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
    from jitckpt.process_title import set_title
    from jitckpt.protocol.control_channel import ENV_FD, ControlChannel
    from jitckpt.protocol.control_messages import TO_WORKER, Ready
    from jitckpt.protocol.step_board import StepBoard
    from jitckpt.snapshot.premap import ENV_PREMAP

    channel = ControlChannel(socket.socket(fileno=int(os.environ[ENV_FD])), incoming=TO_WORKER)
    board = StepBoard.from_env()
    # torch's objects are here for good: garbage collections (one after an in-process recovery)
    # need not walk them again, and a forked process does not touch their pages to count them.
    gc.freeze()
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
    premap_socket = premapper.socket_path if premapper is not None else None
    from jitckpt.runtime.inprocess import ScriptRunner

    runner = ScriptRunner(list(msg.argv), module=bool(msg.module))
    while msg is not None:  # one pass per generation: more than one only after an in-process recovery
        msg = _run_rank(msg, channel, board, runner, premapped, premap_socket)
        premapped = None


def _run_rank(msg: "Assign", channel: "ControlChannel", board: "Optional[StepBoard]", runner: "ScriptRunner",
              premapped: object, premap_socket: Optional[str]) -> "Optional[Assign]":
    """Be the rank ``msg`` assigns and run its script; None once it finished, else (after an
    in-process recovery) the launcher's next Assign: the same process runs the script again.
    ``premapped``: the keeper's buffers this standby mapped ahead from ``premap_socket`` (first run only)."""
    import time

    from jitckpt.process_title import set_title, worker_title
    from jitckpt.protocol.control_messages import Unwound
    from jitckpt.protocol.worker_spec import WorkerSpec
    from jitckpt.runtime.current import install_runtime
    from jitckpt.runtime.generation_store import host_if_rank0
    from jitckpt.runtime.inprocess import release_process_groups
    from jitckpt.runtime.worker_runtime import WorkerRuntime

    redirect_output(msg.stdout, msg.stderr)
    os.environ.update(msg.env)
    os.chdir(msg.cwd)
    spec = WorkerSpec.from_dict(msg.spec)
    set_title(worker_title(spec.rank, spec.world_size, spec.gen))
    store = host_if_rank0(spec)  # serves the process group's store while this rank lives
    rt = WorkerRuntime.from_spec(spec, channel, board)
    rt.start()
    if premapped is not None:
        if rt.snapshots is not None and rt.snapshots.socket_path == premap_socket:
            rt.snapshots.premapped = premapped
        else:
            premapped.close()  # type: ignore[attr-defined]
    install_runtime(rt)
    # After an in-process recovery: the ended run's runtime (no longer the installed one), model,
    # optimizer and DDP hold each other in reference cycles; freed before this run allocates its own,
    # whose tensors then reuse their memory, already faulted in (a millisecond: torch's objects are frozen).
    gc.collect()
    try:
        runner.run()
        if not spec.in_process:
            return None  # the interpreter exits: the exit barrier runs at exit
        rt.finish_script()  # its exit barrier: a peer's failure in the last step still unwinds
        return None
    except SystemExit as e:
        if _unwinding(e):
            pass
        else:
            if e.code not in (0, None):
                # sys.exit(2) (a bad flag) is a failed rank, as under torchrun: not a rank that finished.
                rt.skip_exit_barrier()
            raise
    except BaseException as e:
        if not _unwinding(e):
            raise
    t0 = time.monotonic()
    rt.retire()
    why = release_process_groups()
    if why is not None:
        log.warning("%s; this rank restarts from its checkpoint (the others keep their processes)", why)
        sys.stderr.flush()
        os._exit(EXIT_JIT_SAVED)
    del store
    runner.forget()  # the script's globals: its model and optimizer go with the runtime (see serve())
    channel.send(Unwound(rank=spec.rank, pid=os.getpid(), seconds=time.monotonic() - t0))
    nxt = rt.next_message()
    if not isinstance(nxt, Assign):
        os._exit(0)  # the launcher is gone, or ended the job while this rank waited
    return nxt


def _unwinding(exc: BaseException) -> bool:
    """``exc`` is the in-process recovery's InProcessRestart, or an error the script's own cleanup
    raised while it propagated (a ``finally:`` doing a collective on the broken group)."""
    from jitckpt.runtime.inprocess import InProcessRestart

    seen: set = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, InProcessRestart):
            return True
        seen.add(id(exc))
        exc = exc.__context__  # type: ignore[assignment]
    return False


if __name__ == "__main__":
    main()
