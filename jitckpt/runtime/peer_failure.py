"""Which exceptions mean a peer or the transport failed (a JIT checkpoint's cue), not a user bug."""
from __future__ import annotations

import torch.distributed as dist


def is_collective_failure(exc: BaseException) -> bool:
    """True for errors raised because a peer or the transport failed (not user bugs)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(s in text for s in (
            "gloo", "connection reset", "connection closed", "connection refused", "broken pipe",
            "nccl", "timed out", "peer", "socket"))
    return False
