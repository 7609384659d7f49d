"""Keep a node keeper's snapshot buffers mapped in a warm standby, so a restore maps nothing.

Mapping another process's memory costs a page-table entry per 4 KiB page (shared memory gets no
huge pages by default): for a 48 MiB state that is longer than copying it. The standbys of a
one-node job (whose restore reads every object from the node's keeper straight into the trainer's
tensors) pay it while idle instead.
:class:`Premapper` maps every complete object every ``interval`` seconds; only new buffers cost
anything, as the keeper rewrites the same ones. Until both buffers of every object are mapped it
looks every ``fast`` seconds: a restore soon after the standby starts needs the one written last.
On its assignment the standby hands the :class:`~jitckpt.snapshot.keeper_client.KeeperClient` to
the restore.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from jitckpt.snapshot.keeper_client import KeeperClient, KeeperError

log = logging.getLogger("jitckpt.snapshot")

ENV_PREMAP = "JITCKPT_STANDBY_PREMAP"  # the keeper socket a standby maps ahead from


class Premapper:
    """A daemon thread that keeps ``socket_path``'s complete objects mapped until :meth:`stop`.

    A keeper that is not up yet, or replaced, is connected to again on the next round.
    ``on_settled`` is called (on that thread) the first time both buffers of every object are
    mapped."""

    def __init__(self, socket_path: str, *, interval: float = 1.0, fast: float = 0.05,
                 on_settled: Optional[Callable[[], None]] = None) -> None:
        if not socket_path:
            raise ValueError("Premapper: socket_path is empty")
        if not 0 < fast <= interval:
            raise ValueError(f"Premapper: need 0 < fast ({fast}) <= interval ({interval})")
        self.socket_path, self.interval, self.fast = socket_path, interval, fast
        self._on_settled = on_settled
        self.rounds = 0  # rounds that reached the keeper
        self._client: Optional[KeeperClient] = None
        self._stop = threading.Event()
        self._done = threading.Lock()  # held by a round: stop() waits for it
        self._thread = threading.Thread(target=self._run, name="jitckpt-premap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            settled = False
            with self._done:
                if self._stop.is_set():
                    return
                try:
                    if self._client is None:
                        self._client = KeeperClient(self.socket_path, timeout=5.0)
                    self._client.premap()
                    settled = self._client.mapped_both_buffers()
                    self.rounds += 1
                    if settled and self._on_settled is not None:
                        on_settled, self._on_settled = self._on_settled, None
                        on_settled()
                except (KeeperError, ValueError, OSError) as e:
                    log.debug("premap of %s: %s", self.socket_path, e)
                    if self._client is not None:
                        self._client.close()
                        self._client = None
            self._stop.wait(self.interval if settled else self.fast)

    def stop(self) -> Optional[KeeperClient]:
        """Stop mapping; the connected client, its mappings in place (None if the keeper was never
        reached). The caller owns it."""
        self._stop.set()
        with self._done:
            client, self._client = self._client, None
        return client
