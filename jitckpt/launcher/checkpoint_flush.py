"""Make JIT checkpoints durable after the restart has begun, not before it (one node).

A survivor's JIT save returns once its files are in the page cache (``WorkerSpec.launcher_fsyncs``):
what a JIT checkpoint recovers from (a process killed, a device or link error) leaves the page
cache intact, and the restarted workers read the files from it. The launcher then fsyncs them in
the background. Pruning goes through the same queue, so an older checkpoint is deleted only after
every newer one handed over before it is on disk; after a failed flush nothing more is pruned.
Until a flush is done a power loss could tear the new checkpoint: its CRC32C check then fails
and the next start resumes from the older one, which is still there.

Only with one node: with several, the job's controller prunes for every node and would not
know when another node's flushes are done, so there the workers fsync before they report.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from jitckpt.checkpoint_store import make_durable

log = logging.getLogger("jitckpt.launcher.checkpoint_flush")


class CheckpointFlusher:
    """One background thread that fsyncs checkpoint directories, then runs what must follow them."""

    def __init__(self, *, emit: Callable[..., None]) -> None:
        self._emit = emit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jitckpt-fsync")
        self._pending: list[Future] = []
        self.failed = False  # a flush failed: later prunes are skipped, older checkpoints stay

    def flush(self, path: str) -> None:
        """Make checkpoint directory ``path`` durable (:func:`~jitckpt.checkpoint_store.make_durable`)."""
        self._pending.append(self._pool.submit(self._flush, Path(path)))

    def then(self, fn: Callable[[], None], *, what: str) -> None:
        """Run ``fn`` once every flush queued before is done, unless one of them failed."""
        def run() -> None:
            if self.failed:
                log.warning("not %s: a JIT checkpoint could not be flushed to disk, so older ones are kept",
                            what)
                return
            fn()
        self._pending.append(self._pool.submit(run))

    def _flush(self, path: Path) -> None:
        t0 = time.monotonic()
        try:
            make_durable(path)
        except OSError as e:
            self.failed = True
            log.error("could not flush JIT checkpoint %s to disk: %s; it stays usable from memory, and "
                      "older checkpoints are no longer pruned", path, e)
            self._emit("checkpoint_flush_failed", path=str(path), reason=f"{type(e).__name__}: {e}")
            return
        self._emit("checkpoint_durable", path=str(path), seconds=time.monotonic() - t0)

    def close(self) -> None:
        """Wait for everything queued (the launcher's last act: nothing it was given stays in the page cache)."""
        self._pool.shutdown(wait=True)
        for fut in self._pending:
            exc = fut.exception()
            if exc is not None:
                log.error("checkpoint flush thread failed: %s", exc)
        self._pending.clear()

