"""The standby template: one process that imports torch once and forks every warm standby of a
plain Python job, so that a standby costs a fork (milliseconds, no CPU taken from training)
instead of an interpreter start and ``import torch`` (seconds of CPU, taken from the training
ranks on a node with few cores, and not ready when a failure comes early).

Started by the launcher's :class:`~jitckpt.launcher.standby_pool.StandbyPool` with the pool's
environment and one end of a ``SOCK_SEQPACKET`` pair (``JITCKPT_TEMPLATE_FD``). It imports torch at
normal priority (the job's first workers come from it), says ``{"ready": true}``, then serves
requests in order: ``{"env": {...}}`` with the standby's control channel and step board as two
descriptors, answered ``{"pid": N}`` (or ``{"error": "..."}``). Each standby is forked twice (its
intermediate parent exits at once), so that it is reparented to the launcher, its child subreaper:
the launcher waits for it and reads its exit status as for a process it started.

What a fresh process would have that a fork shares is made its own in the child: its session, its
environment, numpy's global random state (Python's ``random`` reseeds itself at a fork). The
string hash seed stays the template's, the same in every standby. Jobs with ``--preload``
(libjit.so) do not use a template: libjit.so treats a forked child as a process it does not track.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import traceback
import warnings
from typing import Optional

ENV_TEMPLATE_FD = "JITCKPT_TEMPLATE_FD"
MAX_REQUEST = 1 << 20  # an environment, as JSON


def fork_standby() -> Optional[int]:
    """Fork a standby that is reparented to the launcher: its PID here, None in the standby."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # 3.12 warns of any thread: numpy's BLAS server is fork-aware
        warnings.simplefilter("ignore", DeprecationWarning)
        middle = os.fork()
        if middle == 0:  # the intermediate parent: fork, report, exit (its child is reparented)
            os.close(r)
            try:
                pid = os.fork()
            except OSError:
                os._exit(1)
            if pid == 0:
                os.close(w)
                return None
            os.write(w, str(pid).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(middle, 0)  # reaped: the standby's parent is the launcher now
    if not data:
        raise OSError("the standby's intermediate parent could not fork")
    return int(data)


def become_standby(env: dict, channel_fd: int, board_fd: int) -> None:
    """In the forked standby: a session, an environment and a random state of its own, then the
    standby's life (:func:`jitckpt.runtime.standby.serve`)."""
    from jitckpt.process_title import set_title
    from jitckpt.protocol.control_channel import ENV_FD
    from jitckpt.protocol.step_board import ENV_FD as BOARD_FD
    from jitckpt.runtime import standby

    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.environ[ENV_FD], os.environ[BOARD_FD] = str(channel_fd), str(board_fd)
    if "numpy" in sys.modules:  # seeded from the OS at its import, as in a fresh process
        sys.modules["numpy"].random.seed()
    set_title("jitckpt standby")
    standby.serve()


def serve_forks(sock: socket.socket) -> Optional[tuple[dict, int, int]]:
    """Answer the launcher's requests until it closes its end (None); in a forked standby, what it
    is to become (environment, control channel, step board)."""
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 2)
        if not msg:
            return None
        try:
            env = json.loads(msg)["env"]
            if len(fds) != 2:
                raise ValueError(f"a request carries 2 descriptors, got {len(fds)}")
            pid = fork_standby()
        except (OSError, ValueError, KeyError) as e:
            sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            pid = -1
        if pid is None:
            sock.close()
            return env, fds[0], fds[1]
        for fd in fds:  # the standby has its own copies
            os.close(fd)
        if pid >= 0:
            sock.send(json.dumps({"pid": pid}).encode())


def main() -> None:
    from jitckpt.process_title import set_title

    sock = socket.socket(fileno=int(os.environ.pop(ENV_TEMPLATE_FD)))
    set_title("jitckpt template (torch imported)")
    try:
        from jitckpt.runtime.standby import import_torch

        import_torch()
        import torch

        # A CUDA context does not survive a fork ("cannot re-initialize CUDA in forked
        # subprocess"): were an import to make one, the standbys must be processes of their own.
        if torch.cuda.is_initialized():
            raise RuntimeError("importing torch initialized CUDA: a fork of this process could not use the GPU")
    except BaseException:  # noqa: BLE001 - the launcher falls back to standbys of their own
        sock.send(json.dumps({"error": traceback.format_exc()[-2000:]}).encode())
        raise
    sock.send(json.dumps({"ready": True}).encode())
    job = serve_forks(sock)
    if job is None:
        return
    # The standby, at the top of the stack: its end is an interpreter's end (atexit and all).
    become_standby(*job)


if __name__ == "__main__":
    main()
