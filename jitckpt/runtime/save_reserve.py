"""A file of page-cache pages kept ready for this worker's JIT save to overwrite.

Writing a checkpoint into new pages costs the kernel an allocation and a zeroing per 4 KiB page,
and on a virtual machine often a fault into the host too: on the bench VM a 100 MB JIT save took
0.2-0.3 s into fresh pages and 25 ms over pages the file already had. So, once the size of the
state is known, a background thread writes a *reserve* file of that size in the checkpoint
directory (``.reserve-<host>-<pid>``, hidden from checkpoint listings); a JIT save renames it into
its temporary directory and overwrites it in place. The reserve costs one checkpoint's worth of disk
and page cache per rank. A reserve whose writer died (the failed rank's, for one) is adopted by the
next worker on the same host instead of being written again; at a successful job end
:func:`jitckpt.checkpoint_store.prune_finished` deletes them all. Should the kernel drop the pages
meanwhile, the save is only as fast as before.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Optional

from jitckpt.checkpoint_store import RESERVE_PREFIX, pid_alive

log = logging.getLogger("jitckpt.save_reserve")

_CHUNK = 8 << 20


class SaveReserve:
    """This process's reserve in ``directory``; :meth:`prepare` once, :meth:`take` for the JIT save."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._host = socket.gethostname().replace("-", "_")
        self.path = self.directory / f"{RESERVE_PREFIX}{self._host}-{os.getpid()}"
        self._ready = threading.Event()
        self._started = False
        self._lock = threading.Lock()

    def prepare(self, nbytes: int) -> None:
        """Have a reserve of at least ``nbytes`` written, on a background thread (first call only)."""
        with self._lock:
            if self._started or nbytes <= 0:
                return
            self._started = True
        threading.Thread(target=self._fill, args=(nbytes,), name="jitckpt-save-reserve", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """Whether a reserve is ready, waiting up to ``timeout`` seconds for the writer."""
        return self._ready.wait(timeout)

    def take(self) -> Optional[Path]:
        """The reserve, now the caller's to rename and overwrite; None if none is ready."""
        with self._lock:
            if not self._ready.is_set():
                return None
            self._ready.clear()
        return self.path if self.path.is_file() else None

    def _fill(self, nbytes: int) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            have = self._adopt()
            if have < nbytes and shutil.disk_usage(self.directory).free < 3 * (nbytes - have):
                # Room for a checkpoint comes first: a reserve only speeds one up.
                raise OSError(errno.ENOSPC, "less free space than three times the state")
            if have < nbytes:
                zeros = bytes(_CHUNK)
                with open(self.path, "r+b" if have else "wb") as f:
                    f.seek(have)
                    for off in range(have, nbytes, _CHUNK):
                        f.write(zeros[:min(_CHUNK, nbytes - off)])
            self._ready.set()
        except OSError as e:  # e.g. a full disk: the JIT save writes new pages, as without it
            log.info("no save reserve in %s (%s); a JIT save writes into new pages", self.directory, e)
            try:
                self.path.unlink()
            except OSError:
                pass

    def _adopt(self) -> int:
        """Rename a dead writer's reserve on this host to ours; its size (0: none adopted)."""
        for p in sorted(self.directory.glob(f"{RESERVE_PREFIX}{self._host}-*")):
            pid = p.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            try:
                os.rename(p, self.path)
            except FileNotFoundError:
                continue  # another new worker adopted it first
            return self.path.stat().st_size
        return 0
