"""The daemon's protobuf messages and gRPC service, generated from ``daemon.proto`` at import by
grpc's own tooling (``grpc.protos_and_services``, from grpcio-tools): nothing generated is
committed. ``pb`` holds the messages, ``rpc`` the stub, servicer and ``add_NodeDaemonServicer_to_server``."""
from __future__ import annotations

import os
import sys

INSTALL = "pip install grpcio grpcio-tools protobuf (or: pip install 'jitckpt[daemon]')"

try:
    import grpc
except ImportError:  # pragma: no cover - named at the flag
    raise ImportError(f"the jitckpt daemon needs gRPC: {INSTALL}") from None

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # protos_and_services finds the .proto on sys.path, by its package path
    sys.path.append(_ROOT)
try:
    pb, rpc = grpc.protos_and_services("jitckpt/daemon/daemon.proto")
except (ImportError, NotImplementedError) as e:  # grpcio-tools missing
    raise ImportError(f"the jitckpt daemon generates its gRPC code with grpcio-tools ({e}): {INSTALL}") from None

SERVICE = "jitckpt.daemon.v1.NodeDaemon"
MAX_MESSAGE_BYTES = 64 * 1024  # requests are small; anything larger is refused before it is parsed
