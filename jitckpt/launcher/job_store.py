"""The job's cross-node store, for `jitckpt run --nnodes N` (N > 1).

Two backends, chosen with torchrun's ``--rdzv-backend``:

* ``c10d`` / ``static`` (the default): a c10d ``TCPStore`` that node 0's launcher serves at
  ``--rdzv-endpoint``. It lives and dies with node 0's launcher, so losing node 0 ends the job.
* ``etcd`` / ``etcd-v2``: etcd at ``--rdzv-endpoint`` through its v2 API (etcd 3.4 started with
  ``--enable-v2``), with torch's own :class:`~torch.distributed.elastic.rendezvous.etcd_store.EtcdStore`
  on the python-etcd client. No launcher serves it, so it outlives any node, node 0 included, and a
  replacement node (a launcher with the same ``--rdzv-id``, and the lost node's ``--node-rank`` or
  none) can join the running job (:class:`~jitckpt.launcher.node_coordinator.NodeCoordinator`).

Either way the job's keys are under its own prefix (run id and a hash of ``JITCKPT_TOKEN``). A
store's own ``get`` of a key not there waits the store's whole timeout: :func:`read` does not wait.
"""
from __future__ import annotations

import base64
import datetime
from typing import TYPE_CHECKING, Any, Optional

from jitckpt.runtime.generation_store import bind_listener

if TYPE_CHECKING:  # config imports this module's checks
    from jitckpt.launcher.config import LaunchConfig

ETCD_BACKENDS = ("etcd", "etcd-v2")
# A wait that timed out: c10d raises DistStoreError (a RuntimeError), torch's EtcdStore LookupError.
WAIT_TIMED_OUT = (RuntimeError, LookupError)
ETCD_INSTALL = "pip install python-etcd (or: pip install 'jitckpt[etcd]')"


def uses_etcd(cfg: "LaunchConfig") -> bool:
    return cfg.rdzv_backend in ETCD_BACKENDS


def etcd_members(endpoint: str) -> tuple[tuple[str, int], ...]:
    """``HOST:PORT[,HOST:PORT...]``: the etcd members a launcher may talk to (it moves to the next
    when one stops answering). ValueError naming the bad entry."""
    members = []
    for item in filter(None, (e.strip() for e in endpoint.split(","))):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint {endpoint!r}: {item!r} is not HOST:PORT (etcd members are "
                             "HOST:PORT[,HOST:PORT...])")
        members.append((host, int(port)))
    if not members:
        raise ValueError("--rdzv-endpoint: no etcd member given (HOST:PORT[,HOST:PORT...])")
    return tuple(members)


def _etcd_client(cfg: LaunchConfig) -> Any:
    try:
        import etcd  # type: ignore[import-not-found]
    except ImportError:
        raise RuntimeError(f"--rdzv-backend {cfg.rdzv_backend} needs the python-etcd client: {ETCD_INSTALL}") from None
    members = etcd_members(cfg.rdzv_endpoint)
    # Several members: the client goes on with the next one when one is lost (a majority must live).
    client = etcd.Client(host=members if len(members) > 1 else members[0][0], port=members[0][1], protocol="http",
                         read_timeout=10, allow_reconnect=len(members) > 1)
    try:
        client.read("/")
    except etcd.EtcdKeyNotFound:
        pass
    except Exception as e:  # noqa: BLE001 - python-etcd raises several unrelated types here
        raise RuntimeError(f"--rdzv-endpoint {cfg.rdzv_endpoint}: cannot reach etcd's v2 API ({e}); is etcd running "
                           "there, started with --enable-v2?") from None
    return client


def connect(cfg: LaunchConfig, prefix: str, *, serve: bool) -> Any:
    """A client of the job's store, its keys under ``prefix``. ``serve``: node 0 of the c10d
    backend starts the server (on the rendezvous address only, not every interface)."""
    if uses_etcd(cfg):
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        return EtcdStore(_etcd_client(cfg), "/" + prefix, datetime.timedelta(seconds=cfg.rdzv_timeout))
    return _c10d(cfg, prefix, bind_listener(cfg.rdzv_host, cfg.rdzv_port).detach() if serve else None)


def connect_or_serve(cfg: LaunchConfig, prefix: str) -> tuple[Any, bool]:
    """c10d, as torchrun's rendezvous does it: serve the store when --rdzv-endpoint's address is
    this machine's and its port is free, else be its client; (store, whether this one serves)."""
    try:
        listener = bind_listener(cfg.rdzv_host, cfg.rdzv_port)
    except RuntimeError:
        return _c10d(cfg, prefix, None), False
    return _c10d(cfg, prefix, listener.detach()), True


def _c10d(cfg: LaunchConfig, prefix: str, listen_fd: Optional[int]) -> Any:
    """A client of the c10d store at --rdzv-endpoint; its server too, on ``listen_fd``."""
    import torch.distributed as dist

    store = dist.TCPStore(cfg.rdzv_host, cfg.rdzv_port, world_size=None, is_master=listen_fd is not None,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=cfg.rdzv_timeout),
                          master_listen_fd=listen_fd)
    return dist.PrefixStore(prefix, store)


def read(store: Any, key: str) -> Optional[bytes]:
    """``key``'s value now, None while it has none: one request, never a wait. (A store's own
    ``get`` of a missing key waits its whole timeout, --rdzv-conf timeout, printing nothing; a
    ``check`` then ``get`` waits so too if the key goes in between: the job's keys deleted.)"""
    client = getattr(store, "client", None)  # torch's EtcdStore keeps its python-etcd client
    if client is None:
        return store.get(key) if store.check([key]) else None
    import etcd  # type: ignore[import-not-found]

    try:  # the path EtcdStore gives the key: its prefix, then the key in base64
        return base64.b64decode(client.read(store.prefix + base64.b64encode(key.encode()).decode()).value)
    except etcd.EtcdKeyNotFound:
        return None


# Once-keys: a value written once (set_once) and then only swapped from a known one (compare_set),
# as a launcher's claim on its node slot. One spelling of the key for all three on either backend
# (the slot reclaim once read a key that etcd never had, and waited the store's whole timeout).
def _once_path(store: Any, key: str) -> str:
    """Where once-key ``key`` lives on etcd: under the store's prefix, beside its keys ('_' is not
    base64, so no store key is named so)."""
    return store.prefix + "once_" + key.replace("/", "_")


def read_once(store: Any, key: str) -> Optional[str]:
    """Once-key ``key``'s value, None while it has none (never a wait)."""
    client = getattr(store, "client", None)
    if client is None:
        value = read(store, key)
        return None if value is None else value.decode()
    import etcd  # type: ignore[import-not-found]

    try:
        return client.read(_once_path(store, key)).value
    except etcd.EtcdKeyNotFound:
        return None


def set_once(store: Any, key: str, value: str) -> str:
    """Write once-key ``key`` = ``value`` unless some client wrote it first; the value it holds
    after (this one, or the first writer's). An atomic create: c10d's compare-and-set from nothing,
    etcd's ``prevExist=false``."""
    client = getattr(store, "client", None)
    if client is None:
        return store.compare_set(key, "", value).decode()
    import etcd  # type: ignore[import-not-found]

    try:
        client.write(_once_path(store, key), value, prevExist=False)
    except etcd.EtcdAlreadyExist:
        pass
    return client.read(_once_path(store, key)).value


def compare_set(store: Any, key: str, expected: str, value: str) -> Optional[str]:
    """Write once-key ``key`` = ``value`` if it holds ``expected``; the value it holds after (this
    one if swapped; None: it has none). Atomic: c10d's compare-and-set, etcd's compare-and-swap
    (``prevValue``)."""
    client = getattr(store, "client", None)
    if client is None:
        return read_once(store, key) if not store.check([key]) else store.compare_set(key, expected, value).decode()
    import etcd  # type: ignore[import-not-found]

    try:
        return client.write(_once_path(store, key), value, prevValue=expected).value
    except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
        return read_once(store, key)


def forget(cfg: LaunchConfig, prefix: str) -> None:
    """Delete the job's keys once it ended well (etcd keeps them otherwise; a c10d store ends with
    node 0's launcher). A launcher of the same ``--rdzv-id`` started later then starts a new job
    instead of joining this one as a replacement."""
    if not uses_etcd(cfg):
        return
    import etcd  # type: ignore[import-not-found]

    try:
        _etcd_client(cfg).delete("/" + prefix, recursive=True, dir=True)
    except (etcd.EtcdKeyNotFound, RuntimeError):
        pass
