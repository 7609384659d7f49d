"""The c10d store of one generation, hosted by rank 0 on the rendezvous address only.

``init_process_group("gloo")`` under torchrun's environment makes rank 0 start a TCPStore server
that listens on every interface, with no authentication. Under ``jitckpt run`` the workers are
told to use an "agent store" instead (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank, rank 0
too, is a client), and rank 0's worker process serves that store itself before the user's script
runs, from a socket bound to ``MASTER_ADDR`` (loopback on one node; node 0's rendezvous address
with several). The server lives as long as rank 0's process, as torch's own would.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from jitckpt.protocol.worker_spec import WorkerSpec


def host_if_rank0(spec: "WorkerSpec") -> Optional[Any]:
    """Start the generation's store server when this process is rank 0 of a ``jitckpt run``
    worker set that asked for it (``spec.host_store``); return it (keep it alive), or None."""
    if not spec.host_store or spec.rank != 0:
        return None
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # The server listens on this very descriptor for the rest of the process: hand it over.
    return dist.TCPStore(host, port, world_size=None, is_master=True,
                         timeout=datetime.timedelta(seconds=300), wait_for_workers=False,
                         master_listen_fd=bind_listener(host, port).detach())


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` alone, for a TCPStore server (``master_listen_fd``)."""
    try:
        return socket.create_server((host, port), family=_family(host), backlog=128)
    except OSError as e:
        raise RuntimeError(f"cannot serve a c10d store on {host}:{port}: {e} (is the address this "
                           "machine's, and the port free?)") from None


def _family(host: str) -> socket.AddressFamily:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return socket.AF_INET
    return infos[0][0] if infos else socket.AF_INET
