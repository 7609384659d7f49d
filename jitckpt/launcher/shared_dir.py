"""Whether every node of a job sees the same ``--checkpoint-dir``.

A JIT checkpoint saved by the survivors on one node is what the restarted ranks of every node
load, so with several nodes the directory must be shared (NFS, Lustre, ...). Node-local
directories of one name let each node find different checkpoints: the ranks then restore
different steps and the restarted job hangs in its first collective. So each launcher leaves a
marker in the directory before it joins a generation (the token it joined with, unique to that
generation), and once the generation's nodes are known checks it can read every member's.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping

MARKERS = ".jitckpt-nodes"  # in the job's checkpoint directory; one small file per node


def leave_marker(checkpoint_dir: str, node: int, token: str) -> None:
    """Write this node's ``token`` where every node of the job should see it."""
    d = Path(checkpoint_dir) / MARKERS
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{node}.{os.getpid()}"
    tmp.write_text(token)
    os.replace(tmp, d / str(node))


def check_shared(checkpoint_dir: str, tokens: Mapping[int, str], *, this_node: int,
                 wait_s: float = 10.0) -> None:
    """Raise RuntimeError unless the marker of every node in ``tokens`` holds its token here.
    Waits up to ``wait_s`` for files another node wrote to show (a network filesystem's caches)."""
    deadline = time.monotonic() + wait_s
    while True:
        missing = [n for n, token in sorted(tokens.items()) if _read(checkpoint_dir, n) != token]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"--checkpoint-dir {checkpoint_dir} is not shared between the job's nodes: node {this_node} "
                f"does not see what node(s) {missing} wrote there. A JIT checkpoint one node saves is "
                "what every node's restarted ranks load; put the directory on a filesystem every node "
                "mounts at the same path (NFS, Lustre, ...)")
        time.sleep(0.2)  # polling a file another host writes


def _read(checkpoint_dir: str, node: int) -> str:
    try:
        return (Path(checkpoint_dir) / MARKERS / str(node)).read_text()
    except OSError:
        return ""
