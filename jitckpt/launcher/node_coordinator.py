"""Cross-node coordination for `jitckpt run` through torch.distributed's c10d TCPStore.

Single node: everything is local and no store is created. Several nodes: node 0 serves a TCPStore
at ``--rdzv-endpoint`` and every node's launcher is a client. Keys, per generation ``g``:
``g/master`` (MASTER_ADDR:PORT chosen by node 0), ``g/joined`` (counter; the last to join sets
``g/all_joined``), ``g/failed`` (first failure, set with compare_set so the first one wins),
``g/saved/<shard>`` (a replica of that shard saved a JIT checkpoint), ``g/exit_ready`` (counter of
ranks at the exit barrier), ``g/done/<node>`` (that node's workers are gone). Node 0 is a fixed
leader: no election, as with torchrun's static rendezvous; if node 0's launcher dies the job ends.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import threading
from typing import Optional

from jitckpt.runtime.generation_store import bind_listener
from jitckpt.launcher.config import LaunchConfig



def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the next generation's master port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

class NodeCoordinator:
    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self._saved: dict[int, set] = {}
        self._num_shards: dict[int, int] = {}
        self._exit_ready: dict[int, set] = {}
        self.store = None
        self._pipe_r: Optional[int] = None
        self._pipe_w: Optional[int] = None
        self._remote: list[tuple[int, dict]] = []   # (generation, failure info)
        self._lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None
        self._closing = threading.Event()
        if cfg.nnodes > 1:
            self._connect()

    # ---- store ------------------------------------------------------------------------------
    def _client(self, *, server: bool = False):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        listen_fd = None
        if server:  # on the rendezvous address only, not torch's default of every interface
            listen_fd = bind_listener(self.cfg.rdzv_host, self.cfg.rdzv_port).detach()
        store = dist.TCPStore(self.cfg.rdzv_host, self.cfg.rdzv_port, world_size=None,
                              is_master=server, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.cfg.rdzv_timeout),
                              master_listen_fd=listen_fd)
        return dist.PrefixStore(self.prefix, store)

    def new_store_client(self):  # type: ignore[no-untyped-def]
        """A client of the job's store of its own (several nodes only): one blocking wait at a time."""
        if self.cfg.nnodes <= 1:
            raise RuntimeError("a single-node job has no cross-node store")
        return self._client()

    @property
    def prefix(self) -> str:
        """This job's key prefix in the rendezvous store."""
        token = os.environ.get("JITCKPT_TOKEN", "")
        return f"jitckpt/{self.cfg.run_id}/{hashlib.sha256(token.encode()).hexdigest()[:16]}"

    def _connect(self) -> None:
        self.store = self._client(server=self.cfg.node_rank == 0)
        # A store client serves one request at a time: the blocking wait for a failure gets its own.
        self._watch_store = self._client()
        self._pipe_r, self._pipe_w = os.pipe()

    def _k(self, gen: int, key: str) -> str:
        return f"g{gen}/{key}"

    def begin_generation(self, gen: int) -> tuple[str, int]:
        if self.store is None:  # one node: torchrun's --master-addr/--master-port; a restart's port is fresh
            port = self.cfg.master_port if gen == 0 and self.cfg.master_port else free_port(self.cfg.master_addr)
            return self.cfg.master_addr, port
        s = self.store
        if self.cfg.node_rank == 0:
            port = free_port(self.cfg.rdzv_host if self.cfg.rdzv_host != "localhost" else "127.0.0.1")
            s.set(self._k(gen, "master"), f"{self.cfg.rdzv_host}:{port}")
        if s.add(self._k(gen, "joined"), 1) == self.cfg.nnodes:
            s.set(self._k(gen, "all_joined"), "1")
        s.wait([self._k(gen, "master"), self._k(gen, "all_joined")])
        host, _, port = s.get(self._k(gen, "master")).decode().rpartition(":")
        if self._watcher is not None:
            self._watcher.join()
        self._drop_stale_failures()
        self._watcher = threading.Thread(target=self._watch_failure, args=(gen,), daemon=True)
        self._watcher.start()
        return host, int(port)

    def _watch_failure(self, gen: int) -> None:
        key = self._k(gen, "failed")
        while not self._closing.is_set():
            try:
                # Short waits, so close() can stop this thread before the store goes away.
                self._watch_store.wait([key], datetime.timedelta(seconds=1))
                break
            except RuntimeError:
                continue
        if self._closing.is_set():
            return
        info = json.loads(self._watch_store.get(key))
        with self._lock:
            self._remote.append((gen, info))
        os.write(self._pipe_w, b"x")

    def _drop_stale_failures(self) -> None:
        """Forget failures of earlier generations that this launcher never read: when all ranks
        die at once, each launcher handles its own rank's death, and the store's report of that
        same failure must not count as a new failure of the next generation."""
        with self._lock:
            stale, self._remote = len(self._remote), []
        for _ in range(stale):  # one pipe byte per report; the previous watcher has exited
            os.read(self._pipe_r, 1)

    def failure_fd(self) -> Optional[int]:
        return self._pipe_r

    def read_remote_failure(self, gen: int) -> Optional[dict]:
        """The next failure announced by another node for generation ``gen`` (None: none, or
        one of an earlier generation)."""
        os.read(self._pipe_r, 1)
        with self._lock:
            while self._remote:
                g, info = self._remote.pop(0)
                if g == gen:
                    return info
            return None

    # ---- failure and coverage ---------------------------------------------------------------
    def announce_failure(self, gen: int, info: dict) -> None:
        if self.store is not None:
            self.store.compare_set(self._k(gen, "failed"), "", json.dumps(info))

    def report_saved(self, gen: int, shard_id: int, num_shards: int, rank: int) -> None:
        self._saved.setdefault(gen, set()).add(shard_id)
        self._num_shards[gen] = num_shards
        if self.store is not None:
            self.store.set(self._k(gen, f"saved/{shard_id}"), str(rank))
            self.store.set(self._k(gen, "num_shards"), str(num_shards))

    def shards_covered(self, gen: int) -> bool:
        if self.store is None:
            n = self._num_shards.get(gen)
            return n is not None and len(self._saved.get(gen, ())) >= n
        if not self.store.check([self._k(gen, "num_shards")]):
            return False
        n = int(self.store.get(self._k(gen, "num_shards")))
        return self.store.check([self._k(gen, f"saved/{i}") for i in range(n)])

    # ---- exit barrier and generation end ------------------------------------------------------
    def report_exit_ready(self, gen: int, rank: int) -> None:
        self._exit_ready.setdefault(gen, set()).add(rank)
        if self.store is not None:
            self.store.add(self._k(gen, "exit_ready"), 1)

    def all_exit_ready(self, gen: int) -> bool:
        if self.store is None:
            return True  # the launcher checks its local workers itself
        return self.store.add(self._k(gen, "exit_ready"), 0) >= self.cfg.world_size

    def node_done(self, gen: int, *, ok: bool, wait: bool = False) -> bool:
        """Mark this node's workers as gone; True when every node's are (or at once, if ok)."""
        if self.store is None:
            return True
        self.store.set(self._k(gen, f"done/{self.cfg.node_rank}"), "ok" if ok else "failed")
        keys = [self._k(gen, f"done/{n}") for n in range(self.cfg.nnodes)]
        if ok:
            if self.cfg.node_rank == 0:  # node 0 serves the store: stay until everyone is done
                try:
                    self.store.wait(keys, datetime.timedelta(seconds=self.cfg.rdzv_timeout))
                except RuntimeError:
                    pass
            return True
        return self.store.check(keys)

    def close(self) -> None:
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        for fd in (self._pipe_r, self._pipe_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
