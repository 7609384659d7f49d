"""Which launcher is the job's controller, through the job's store (:mod:`jitckpt.launcher.job_store`).

The controller closes each generation's gathering: it decides which nodes the generation has
(``--nnodes MIN:MAX``) and where their workers' store is; it also prunes superseded checkpoints
once a recovery resumed and removes the job's keys when it ends.

* etcd: the holder of a key with a time to live, taken with an atomic create (``prevExist=false``)
  and renewed by compare-and-swap on its own value (``prevValue``), etcd's lease pattern, as torch's
  etcd rendezvous uses it. A lost holder's key expires after :data:`LEASE_TTL_S` and a survivor
  takes it: the controller is whichever launcher holds it, node 0 or not.
* c10d: node 0's launcher, always: it serves the store, so the job does not outlive it anyway.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

log = logging.getLogger("jitckpt.launcher.controller_lease")
LEASE_TTL_S = 6  # a lost controller is replaced within this (etcd TTLs are whole seconds)


class ControllerLease:
    """This launcher's claim on the job's controller role. ``store`` is the job's store client
    (torch's EtcdStore keeps its python-etcd client and key prefix); ``node`` this launcher's node.
    :meth:`renew` is called at least every LEASE_TTL_S / 3 (the launcher's heartbeat)."""

    def __init__(self, *, store: Any, etcd: bool, node: int) -> None:
        self._etcd = etcd
        self._node = node
        self._holder = f"node {node} pid {os.getpid()} on {socket.gethostname()}"
        self._held = not etcd and node == 0
        self._lock = threading.Lock()
        if etcd:
            self._client = store.client
            self._key = store.prefix + "controller_lease"  # '_' is not base64: no store key is named so
            self.renew()

    @property
    def held(self) -> bool:
        """This launcher is the controller now (as of the last renewal)."""
        return self._held

    def renew(self) -> bool:
        """Keep the lease if held, take it if free; whether it is held. A store error keeps the
        last answer for now (the heartbeat finds a lost store)."""
        if not self._etcd:
            return self._held
        import etcd  # type: ignore[import-not-found]

        with self._lock:
            was = self._held
            try:
                if was:
                    self._client.write(self._key, self._holder, ttl=LEASE_TTL_S, prevValue=self._holder)
                else:
                    self._client.write(self._key, self._holder, ttl=LEASE_TTL_S, prevExist=False)
                self._held = True
            except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                self._held = False  # another launcher holds it (ours expired, if it was ours)
            except Exception as e:  # noqa: BLE001 - python-etcd raises several unrelated types
                log.debug("controller lease: %s", e)
                return self._held
            if self._held != was:
                log.info("node %d %s the job's controller", self._node, "is now" if self._held else "is no longer")
            return self._held

    def release(self) -> None:
        """Give the lease up (the launcher ends), so a survivor takes it at once, not after the TTL."""
        if not (self._etcd and self._held):
            return
        with self._lock:
            try:
                self._client.delete(self._key, prevValue=self._holder)
            except Exception:  # noqa: BLE001 - it expires anyway
                pass
            self._held = False
