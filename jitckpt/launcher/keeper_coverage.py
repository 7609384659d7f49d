"""Whether a node's keeper already holds what a restart resumes from (a DTensor job's shard snapshots).

Under ``--snapshot-every`` a DTensor job's ranks each commit their own shard (keeper object
``dt.r<rank>``) before any rank begins the minibatch it is the start of (see
:mod:`jitckpt.snapshot.shard_snapshots`). So once the keeper holds every rank's shard of the newest
minibatch any rank began, no JIT save can give a newer complete state: the launcher restarts at once
instead of waiting for saves, which a rank that hangs holding the GIL, or whose shard has no replica,
never finishes (it waited the whole --save-timeout).
"""
from __future__ import annotations

import logging
from typing import Optional

from jitckpt.snapshot.keeper_client import KeeperClient, KeeperError
from jitckpt.snapshot.shard_keys import PREFIX, shard_key

log = logging.getLogger("jitckpt.launcher")


def newest_common_shard_step(socket_path: str, ranks: list[int]) -> Optional[int]:
    """The newest step of which the keeper at ``socket_path`` holds a committed shard snapshot of
    every rank in ``ranks``; None if there is none (or the keeper cannot be asked)."""
    try:
        keeper = KeeperClient(socket_path, timeout=2.0)
    except (KeeperError, ValueError):
        return None
    try:
        listing = keeper.listing()
    except KeeperError as e:
        log.debug("keeper listing failed: %s", e)
        return None
    finally:
        keeper.close()
    steps: dict = {}
    for e in listing:
        if e["key"].startswith(PREFIX):
            steps.setdefault(e["key"], set()).add(int(e["step"]))
    common = None
    for r in ranks:
        have = steps.get(shard_key(r), set())
        common = have if common is None else common & have
    return max(common) if common else None
