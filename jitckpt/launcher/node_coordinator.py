"""Cross-node coordination for `jitckpt run` through the job's store (:mod:`jitckpt.launcher.job_store`).

Single node: everything is local and no store is created. Several nodes: every launcher is a client
of the job's store: a c10d TCPStore that node 0 serves at ``--rdzv-endpoint``, or etcd there.
Keys, per generation ``g``: ``g/joined/<node>`` (that node's launcher is in, with the address its
workers' store would take), ``g/members`` (the generation's nodes and its workers' store, decided by
the controller), ``g/failed`` (a failure: the first, unless two nodes write it at once),
``g/saved/<shard>`` (a replica of that shard saved a JIT checkpoint), ``g/exit_ready/<rank>`` (that
rank is at the exit barrier), ``g/done/<node>`` (that node's workers are gone); ``latest``: the
newest generation begun; ``alive/<node>``: heartbeats; ``slot/<node>``: the launcher holding that
slot, without --node-rank (a once-key: :func:`jitckpt.launcher.job_store.set_once`). No read waits
for a key that may never come: one the protocol wrote before is read at once, and a wait for one
still to come is bounded, ending in a RuntimeError that names it and the job.

The job's controller (:mod:`jitckpt.launcher.controller_lease`: an etcd lease, or node 0 with c10d)
closes each generation's gathering: once every node joined, or, with ``--nnodes MIN:MAX``, once MIN
did and ``last_call_timeout`` passed. The generation's ranks follow its nodes in slot order; its
lowest node's address is the workers' store. With c10d, if node 0's launcher dies the job ends.
With etcd the store outlives it, and a launcher started with a lost node's ``--node-rank`` (node 0's
too; with c10d any other node's), or without one (it takes the slot of a launcher that is gone:
:meth:`NodeCoordinator._claim_slot`), joins the generation after the one that lost it
(:meth:`NodeCoordinator.first_launch`); with a range, a launcher whose slot the running generation does not have asks the job to grow (a
``scale_up`` "failure": every rank saves, and the next generation has the new node).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

from jitckpt.launcher import job_store
from jitckpt.launcher.config import LaunchConfig
from jitckpt.launcher.controller_lease import ControllerLease
from jitckpt.launcher.shared_dir import check_shared, leave_marker

log = logging.getLogger("jitckpt.launcher.node_coordinator")
HEARTBEAT_S = 2.0  # how often a launcher writes to the job's store, to find it lost
STORE_GRACE_S = 15.0  # how long the store may refuse writes before it is lost (an etcd election: ~1 s)
SCALE_UP = "scale_up"  # the failure kind of a node asking a running job to grow (--nnodes MIN:MAX)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the next generation's master port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

def _local_addr(cfg: LaunchConfig, claimed: bool) -> str:
    """The address this node's workers' store takes if the node has a generation's lowest rank:
    --local-addr; node 0: --master-addr (c10d: the store's host), unless etcd gave it its slot (any
    machine may take slot 0 there); else this host's name, or loopback when --master-addr is
    loopback (every node on one machine)."""
    if cfg.local_addr:
        return cfg.local_addr
    if cfg.node_rank == 0 and not (claimed and job_store.uses_etcd(cfg)):
        return cfg.master_addr if job_store.uses_etcd(cfg) else cfg.rdzv_host
    if cfg.master_addr in ("127.0.0.1", "localhost", "::1"):
        return cfg.master_addr
    return socket.getfqdn()


@dataclass(frozen=True)
class Generation:
    """One generation of the job as this node sees it: its number, its workers' store, its nodes
    (slots, ascending) and this node's place among them (the group rank)."""

    gen: int
    master: tuple[str, int]
    nodes: tuple[int, ...]
    group_rank: int


class HeartbeatWatch:
    """When each launcher's heartbeat (``alive/<node>``, rewritten every HEARTBEAT_S) last changed,
    on this launcher's clock: no wall clocks of two machines are compared. Three periods without a
    change mean that launcher is gone."""

    def __init__(self) -> None:
        self._seen: dict = {}  # node -> (its heartbeat, when this launcher saw it change)

    def saw(self, node: int, beat: Optional[str]) -> bool:
        """Record a read of ``node``'s heartbeat; True if it changed since the previous read."""
        prev = self._seen.get(node)
        if prev is None or prev[0] != beat:
            self._seen[node] = (beat, time.monotonic())
        return prev is not None and prev[0] != beat

    def silent(self, node: int) -> bool:
        """Unchanged for three periods since this launcher first read it."""
        seen = self._seen.get(node)
        return seen is not None and time.monotonic() - seen[1] > 3 * HEARTBEAT_S


class NodeCoordinator:
    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.current = Generation(0, (cfg.master_addr, 0), (0,), 0)  # one node's; set per generation
        self.lease: Optional[ControllerLease] = None
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
        self.lost: Optional[str] = None  # why the job's store stopped answering (then nothing waits on it)
        self._beats = 0
        self._heartbeats = HeartbeatWatch()  # the other nodes' launchers, for _silent
        self._beat_gen = -1  # the generation this launcher is in, for its heartbeat (-1: none yet)
        self._heart: Optional[threading.Thread] = None
        self._dir_checked = False  # --checkpoint-dir seen shared by every node (checked once)
        self._claimed = False  # this launcher took its slot in the rendezvous (no --node-rank)
        self._slot_claim: Optional[str] = None  # its claim there (``slot/<node>``'s value)
        if cfg.nnodes > 1:
            self._connect()

    # ---- store ------------------------------------------------------------------------------
    def _client(self, *, server: bool = False):  # type: ignore[no-untyped-def]
        return job_store.connect(self.cfg, self.prefix, serve=server)

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
        if self.cfg.node_rank is None:  # torchrun's way: the slot comes from the rendezvous
            self.cfg.node_rank, self._claimed = self._claim_slot(), True
        else:
            self.store = self._client(server=self.cfg.node_rank == 0)
        self.lease = ControllerLease(store=self.store, etcd=job_store.uses_etcd(self.cfg), node=self.cfg.node_rank)
        # A store client serves one request at a time: the blocking wait for a failure gets its own.
        self._watch_store = self._client()
        self._pipe_r, self._pipe_w = os.pipe()
        self._heart = threading.Thread(target=self._heartbeat, name="jitckpt-store-heartbeat", daemon=True)
        self._heart.start()

    def _claim_slot(self) -> int:
        """The node rank of a launcher without --node-rank (it connects ``self.store``). With c10d
        the one that serves the store is node 0 (its workers' store takes the same host, as with
        --node-rank 0); with etcd no launcher is special. Every other one takes the lowest free
        slot, else that of a launcher which is gone (its heartbeat unchanged for three periods): a
        replacement started after a node loss needs no flag either."""
        if job_store.uses_etcd(self.cfg):
            self.store, served = self._client(), False
            slots = list(range(self.cfg.nnodes))
        else:
            self.store, served = job_store.connect_or_serve(self.cfg, self.prefix)
            slots = [0] if served else list(range(1, self.cfg.nnodes))
        token = self._slot_claim = f"{socket.gethostname()} pid {os.getpid()} {os.urandom(4).hex()}"
        holders = {}  # slot -> its launcher's claim, as read before its heartbeat was watched
        for k in slots:
            holders[k] = job_store.set_once(self.store, f"slot/{k}", token)
            if holders[k] == token:
                return k
        self._watch_heartbeats(slots)
        for k in slots:
            # Swapped from the holder read before the watch: of two replacements, one takes the slot.
            if self._heartbeats.silent(k) and job_store.compare_set(self.store, f"slot/{k}", holders[k],
                                                                    token) == token:
                log.warning("job %s: node %d's launcher is gone; this launcher takes its slot", self.cfg.run_id, k)
                return k
        served_by = "" if job_store.uses_etcd(self.cfg) else f": the one serving the store at {self.cfg.rdzv_endpoint} is node 0"
        raise RuntimeError(f"job {self.cfg.run_id}: every node slot of --nnodes {self.cfg.nnodes} is held by a running "
                           f"launcher ({', '.join(str(k) for k in slots)} here{served_by}); is this launcher one too many, "
                           "or is --rdzv-id another job's?")

    def _watch_heartbeats(self, slots: list) -> None:
        """Read the heartbeats of ``slots``' launchers for three periods and a bit (for ``_silent``)."""
        end = time.monotonic() + 3 * HEARTBEAT_S + 1.0
        while True:
            for k in slots:
                self._heartbeats.saw(k, self._read_heartbeat(k))
            if time.monotonic() > end:
                return
            self._closing.wait(HEARTBEAT_S / 2)  # heartbeats are written every HEARTBEAT_S

    def _get(self, key: str, what: str) -> bytes:
        """``key``'s value, which the job's protocol has written before this read: a RuntimeError
        naming ``what`` if it has none (the job's keys deleted meanwhile: it ended, or another run
        of its --rdzv-id cleared them), not a wait of the store's whole timeout."""
        value = job_store.read(self.store, key)
        if value is None:
            raise RuntimeError(f"job {self.cfg.run_id}: the job's store ({self.cfg.rdzv_backend} at "
                               f"{self.cfg.rdzv_endpoint}) has no {what} (key {key!r}): were its keys deleted, the job "
                               "ended or run again by another launcher with this --rdzv-id? Check the other "
                               "launchers and --rdzv-id")
        return value

    def _k(self, gen: int, key: str) -> str:
        return f"g{gen}/{key}"

    @property
    def leads(self) -> bool:
        """This launcher is the job's controller (one node: always)."""
        return self.lease is None or self.lease.held

    def restarts_before(self, gen: int) -> int:
        """The restarts the job used before generation ``gen`` (a launcher joining a running job:
        the store keeps the count; a scale-up is no restart)."""
        if gen == 0 or self.store is None:
            return gen
        def read() -> int:
            prev = job_store.read(self.store, self._k(gen - 1, "restarts"))
            if prev is None:
                return gen
            failed = job_store.read(self.store, self._k(gen - 1, "failed"))
            grew = failed is not None and json.loads(failed).get("kind") == SCALE_UP
            return int(prev) + (0 if grew else 1)

        return self._guarded(read, gen)

    def begin_generation(self, gen: int, *, restarts: int = 0) -> Generation:
        """Join generation ``gen`` and wait until its nodes are decided; the generation this node
        is in: ``gen``, or with --nnodes MIN:MAX a later one when ``gen`` closed without it.
        ``restarts``: those the job used before it (kept in the store for a replacement node)."""
        if self.store is None:  # one node: torchrun's --master-addr/--master-port; a restart's port is fresh
            port = self.cfg.master_port if gen == 0 and self.cfg.master_port else free_port(self.cfg.master_addr)
            self.current = Generation(gen, (self.cfg.master_addr, port), (0,), 0)
            return self.current
        while True:
            self.store.set(self._k(gen, "restarts"), str(restarts))
            members = self._gather(gen)
            if self.cfg.node_rank in members["nodes"]:
                break
            log.warning("generation %d of job %s began with nodes %s, without this one (it joined after the last "
                        "call); asking the job to grow", gen, self.cfg.run_id, members["nodes"])
            gen = self._ask_to_grow(gen)
        host, _, port = members["master"].rpartition(":")
        nodes = tuple(members["nodes"])
        if not self._dir_checked:
            tokens = {n: self._marker_token(gen, self._get(self._k(gen, f"joined/{n}"), f"address of node {n} in "
                                                           f"generation {gen}").decode()) for n in nodes}
            check_shared(self.cfg.checkpoint_dir, tokens, this_node=self.cfg.node_rank)
            self._dir_checked = True
        self.current = Generation(gen, (host, int(port)), nodes, nodes.index(self.cfg.node_rank))
        if self._watcher is not None:
            self._watcher.join()
        self._drop_stale_failures()
        self._watcher = threading.Thread(target=self._watch_failure, args=(gen,), daemon=True)
        self._watcher.start()
        return self.current

    def _gather(self, gen: int) -> dict:
        """Say this node is in generation ``gen`` and wait for its nodes, closing the gathering when
        this launcher is the controller; {"nodes": [...], "master": "host:port"}."""
        s = self.store
        host = _local_addr(self.cfg, self._claimed)
        try:
            port = free_port(host if host != "localhost" else "127.0.0.1")
        except OSError:  # a name this host does not bind by: any interface's free port
            port = free_port("")
        # Before joining: once the generation's nodes are known, every member's marker is there.
        leave_marker(self.cfg.checkpoint_dir, self.cfg.node_rank, self._marker_token(gen, f"{host}:{port}"))
        s.set(self._k(gen, f"joined/{self.cfg.node_rank}"), f"{host}:{port}")
        s.set("latest", str(gen))
        self._beat_gen = gen
        key = self._k(gen, "members")
        deadline = time.monotonic() + self.cfg.rdzv_timeout
        enough_since: Optional[float] = None  # when MIN nodes had joined (the last call's start)
        while not s.check([key]):
            if self.leads:
                joined = [n for n in range(self.cfg.nnodes) if s.check([self._k(gen, f"joined/{n}")])]
                if len(joined) >= self.cfg.min_nodes:
                    enough_since = enough_since or time.monotonic()
                if len(joined) == self.cfg.nnodes or (
                        enough_since is not None and time.monotonic() - enough_since >= self.cfg.last_call_timeout):
                    master = self._get(self._k(gen, f"joined/{joined[0]}"), f"address of node {joined[0]}").decode()
                    decided = json.dumps({"nodes": joined, "master": master})
                    s.set(key, job_store.set_once(s, key, decided))  # one decision, were there two controllers
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {self.cfg.run_id}: generation {gen} did not get its nodes within the rendezvous "
                                   f"timeout ({self.cfg.rdzv_timeout:.0f}s; --rdzv-conf join_timeout): "
                                   f"--nnodes {self.cfg.min_nodes}:{self.cfg.nnodes} needs at least "
                                   f"{self.cfg.min_nodes} launchers with the same --rdzv-id")
            try:
                s.wait([key], datetime.timedelta(seconds=0.5))
            except job_store.WAIT_TIMED_OUT:
                pass  # the controller (maybe this launcher, once the lease is ours) decides
        return json.loads(self._get(key, f"nodes of generation {gen}"))

    def _marker_token(self, gen: int, joined: str) -> str:
        """What a node writes in its --checkpoint-dir marker: unique to this job, generation and node."""
        return f"{self.prefix} g{gen} {joined}"

    def _ask_to_grow(self, gen: int) -> int:
        """This node is not in running generation ``gen``: announce a scale-up (every rank saves a
        JIT checkpoint, as for a failure) and return the next generation, which it joins."""
        info = {"kind": SCALE_UP, "rank": None, "reporter": None,
                "detail": f"node {self.cfg.node_rank} joins the job (--nnodes {self.cfg.min_nodes}:{self.cfg.nnodes})"}
        if not self.store.check([self._k(gen, "failed")]):
            self.store.set(self._k(gen, "failed"), json.dumps(info))
        return gen + 1

    def first_launch(self) -> int:
        """The generation this launcher's workers start in: 0, or, when the job already runs (its
        store outlived a lost node), the one after the generation that lost this node. This
        launcher then replaces the lost one: it says that node's workers are gone (the survivors
        stop waiting for it) and joins the next generation with the survivors."""
        if self.store is None:
            return 0
        latest = self._latest()
        if latest is not None and not self._gathering(latest) and not self._peers_alive():
            # The keys of a run whose launchers are all gone (it stopped when the store did): a
            # new run of the job. Node 0 clears them; the others wait for its new run.
            if self.cfg.node_rank == 0:
                log.warning("job %s: the store holds a run whose launchers are all gone; starting anew "
                            "(its checkpoints are kept)", self.cfg.run_id)
                job_store.forget(self.cfg, self.prefix)
                self._hold_slot_again()
                return 0
            deadline = time.monotonic() + self.cfg.rdzv_timeout
            while latest is not None and not self._gathering(latest):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"job {self.cfg.run_id}: the store holds a run whose launchers are gone, and "
                                       "node 0 did not start a new one within the rendezvous timeout")
                time.sleep(0.5)  # polling the store for node 0's new run
                latest = self._latest()
            self._hold_slot_again()
        if latest is None:
            return 0
        if self._gathering(latest):
            if latest > 0:  # generation 0 gathering is every job's start
                log.warning("job %s is gathering for generation %d: this launcher joins it in place of node %d",
                            self.cfg.run_id, latest, self.cfg.node_rank)
            return latest
        members = json.loads(self._get(self._k(latest, "members"), f"nodes of generation {latest}"))
        if self.cfg.node_rank not in members["nodes"]:
            log.warning("job %s runs generation %d without node %d: this launcher asks it to grow", self.cfg.run_id,
                        latest, self.cfg.node_rank)
            return self._ask_to_grow(latest)
        log.warning("job %s is running (generation %d): this launcher replaces node %d, whose launcher is "
                    "gone; waiting for the survivors to find the failure", self.cfg.run_id, latest, self.cfg.node_rank)
        self._wait_for_failure(latest)
        self.store.set(self._k(latest, f"done/{self.cfg.node_rank}"), "lost")
        return latest + 1

    def _hold_slot_again(self) -> None:
        """Node 0 cleared a dead run's keys, this launcher's slot claim with them: write it again
        (else a launcher started later takes the slot as free, its launcher alive)."""
        if self._slot_claim is None:
            return
        holder = job_store.set_once(self.store, f"slot/{self.cfg.node_rank}", self._slot_claim)
        if holder != self._slot_claim:
            raise RuntimeError(f"job {self.cfg.run_id}: node slot {self.cfg.node_rank} was taken by another launcher "
                               f"({holder}) while the job's keys were cleared for a new run; is that launcher one "
                               "too many, or is --rdzv-id another job's?")

    def _wait_for_failure(self, gen: int) -> None:
        """Wait (up to the rendezvous timeout) until the survivors of generation ``gen`` found the
        failure that this launcher, replacing one of its nodes, comes after."""
        try:
            self.store.wait([self._k(gen, "failed")], datetime.timedelta(seconds=self.cfg.rdzv_timeout))
        except job_store.WAIT_TIMED_OUT:
            raise RuntimeError(
                f"job {self.cfg.run_id}: this launcher came to replace node {self.cfg.node_rank} of the running "
                f"generation {gen}, but no node reported a failure within the rendezvous timeout "
                f"({self.cfg.rdzv_timeout:.0f}s; --rdzv-conf timeout): is node {self.cfg.node_rank}'s launcher still "
                "running (then this one is one too many), or is --rdzv-id another job's?") from None

    def _latest(self) -> Optional[int]:
        """The newest generation begun (None: none, a new job)."""
        latest = job_store.read(self.store, "latest")
        return None if latest is None else int(latest)

    def _gathering(self, latest: int) -> bool:
        """Generation ``latest`` is still gathering its nodes."""
        return job_store.read(self.store, self._k(latest, "members")) is None

    def _peers_alive(self) -> bool:
        """Another node's launcher, in a generation, writes its heartbeat: one changes within three
        periods (a launcher starting as this one does says -1, and does not count)."""
        nodes = [n for n in range(self.cfg.nnodes) if n != self.cfg.node_rank]
        watch = HeartbeatWatch()

        def changed() -> bool:
            found = False
            for n in nodes:
                beat = self._read_heartbeat(n)
                in_generation = beat is not None and not beat.startswith("-1 ")
                if watch.saw(n, beat if in_generation else None) and in_generation:
                    found = True
            return found

        changed()
        deadline = time.monotonic() + 3 * HEARTBEAT_S
        while time.monotonic() < deadline:
            time.sleep(0.5)  # polling the peers' heartbeats
            if changed():
                return True
        return False

    def _watch_failure(self, gen: int) -> None:
        key = self._k(gen, "failed")
        while not self._closing.is_set():
            try:
                # Short waits, so close() can stop this thread before the store goes away.
                self._watch_store.wait([key], datetime.timedelta(seconds=1))
                info = json.loads(self._watch_store.get(key))
                break
            except job_store.WAIT_TIMED_OUT:
                continue
            except Exception:  # noqa: BLE001 - a store in trouble: the heartbeat tells when it is lost
                self._closing.wait(1.0)
        if self._closing.is_set():
            return
        self._post(gen, info)

    def _post(self, gen: Optional[int], info: dict) -> None:
        """A failure for the launcher's loop (``gen`` None: whatever generation runs)."""
        with self._lock:
            self._remote.append((gen, info))
        os.write(self._pipe_w, b"x")

    def _guarded(self, op, default):  # type: ignore[no-untyped-def]
        """``op()`` (idempotent: it may be tried again). A store that refuses it for STORE_GRACE_S
        (longer than an etcd leader election) is lost: the launcher hears it (its loop stops the
        job, every rank saving), and this returns ``default``."""
        deadline = time.monotonic() + STORE_GRACE_S
        said = False
        while self.lost is None:  # once lost, every request fails at once: 15 s each added up
            try:
                return op()
            except Exception as e:  # noqa: BLE001 - the store's client raises its own types (etcd, c10d)
                if time.monotonic() > deadline or self._closing.is_set():
                    self._store_lost(e)
                    return default
                if not said:  # one line per request, not one per try
                    log.warning("the job's store refused a request (%s); trying again for up to %.0f s",
                                e, STORE_GRACE_S)
                    said = True
                time.sleep(1.0)  # an etcd leader election takes about a second
        return default

    def _store_lost(self, e: Exception) -> None:
        detail = (f"the job's store ({self.cfg.rdzv_backend} at {self.cfg.rdzv_endpoint}) does not take writes: "
                  f"{type(e).__name__}: {e}")
        with self._lock:
            if self.lost is not None:
                return
            self.lost = detail
        self._post(None, {"kind": "store_lost", "rank": None, "detail": detail})

    def _heartbeat(self) -> None:
        """A write every HEARTBEAT_S for the launcher's life: a store that lost its quorum (etcd) or
        its server (node 0's c10d store) still lets a wait time out, but refuses a write; and a
        replacement launcher tells a running job from a dead run's keys by it (first_launch)."""
        store = self._client()
        failing_since: Optional[float] = None
        while not self._closing.wait(0 if not self._beats else HEARTBEAT_S):
            try:
                store.set(f"alive/{self.cfg.node_rank}", f"{self._beat_gen} {time.time()}")
                self._beats += 1
                if self.lease is not None:
                    self.lease.renew()
                failing_since = None
            except Exception as e:  # noqa: BLE001 - the store's client raises its own types (etcd, c10d)
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > STORE_GRACE_S and not self._closing.is_set():
                    self._store_lost(e)
                    return

    def _drop_stale_failures(self) -> None:
        """Forget failures of earlier generations that this launcher never read: when all ranks
        die at once, each launcher handles its own rank's death, and the store's report of that
        same failure must not count as a new failure of the next generation."""
        with self._lock:  # a lost store (generation None) stays lost
            kept = [(g, info) for g, info in self._remote if g is None]
            stale, self._remote = len(self._remote) - len(kept), kept
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
                if g == gen or g is None:
                    return info
            return None

    # ---- failure and coverage ---------------------------------------------------------------
    def announce_failure(self, gen: int, info: dict) -> None:
        if self.store is None:
            return
        def announce() -> None:
            if not self.store.check([self._k(gen, "failed")]):  # the first one, mostly
                self.store.set(self._k(gen, "failed"), json.dumps(info))

        self._guarded(announce, None)  # a lost store: this node's own recovery goes on

    def report_saved(self, gen: int, shard_id: int, num_shards: int, rank: int) -> None:
        self._saved.setdefault(gen, set()).add(shard_id)
        self._num_shards[gen] = num_shards
        if self.store is not None:
            self._guarded(lambda: (self.store.set(self._k(gen, f"saved/{shard_id}"), str(rank)),
                                   self.store.set(self._k(gen, "num_shards"), str(num_shards))), None)

    def shards_covered(self, gen: int) -> bool:
        if self.store is None:
            n = self._num_shards.get(gen)
            return n is not None and len(self._saved.get(gen, ())) >= n
        def covered() -> bool:
            n = job_store.read(self.store, self._k(gen, "num_shards"))
            return n is not None and self.store.check([self._k(gen, f"saved/{i}") for i in range(int(n))])

        return self._guarded(covered, False)

    def decide_restart(self, gen: int) -> None:
        """The controller's decision: generation ``gen``'s survivors saved enough (or waited long
        enough); every launcher now ends it."""
        if self.store is not None:
            self._guarded(lambda: self.store.set(self._k(gen, "restart"), "1"), None)

    def restart_decided(self, gen: int) -> bool:
        if self.store is None:
            return False
        return self._guarded(lambda: self.store.check([self._k(gen, "restart")]), False)

    # ---- exit barrier and generation end ------------------------------------------------------
    def report_exit_ready(self, gen: int, rank: int) -> None:
        self._exit_ready.setdefault(gen, set()).add(rank)
        if self.store is not None:
            self._guarded(lambda: self.store.set(self._k(gen, f"exit_ready/{rank}"), "1"), None)

    def all_exit_ready(self, gen: int) -> bool:
        if self.store is None:
            return True  # the launcher checks its local workers itself
        world = len(self.current.nodes) * self.cfg.nproc_per_node
        keys = [self._k(gen, f"exit_ready/{r}") for r in range(world)]
        return self._guarded(lambda: self.store.check(keys), False)

    def node_done(self, gen: int, *, ok: bool, wait: bool = False) -> bool:
        """Mark this node's workers as gone; True when every node's are (or at once, if ok)."""
        if self.store is None:
            return True
        keys = [self._k(gen, f"done/{n}") for n in self.current.nodes]

        def mark() -> bool:
            self.store.set(self._k(gen, f"done/{self.cfg.node_rank}"), "ok" if ok else "failed")
            if ok:
                # The controller (c10d: node 0, which serves the store) stays until everyone is done.
                if self.leads:
                    try:
                        self.store.wait(keys, datetime.timedelta(seconds=self.cfg.rdzv_timeout))
                        job_store.forget(self.cfg, self.prefix)  # etcd: the job's keys go with it
                    except job_store.WAIT_TIMED_OUT:
                        pass
                return True
            return all(self.store.check([k]) or self._silent(n) for n, k in zip(self.current.nodes, keys))

        return self._guarded(mark, True)  # a lost store: nobody else to wait for

    def _silent(self, node: int) -> bool:
        """Node ``node``'s heartbeat has not changed for three periods: its launcher is gone (a lost
        node never says its workers are). Only this launcher's clock is read."""
        self._heartbeats.saw(node, self._read_heartbeat(node))
        return self._heartbeats.silent(node)

    def _read_heartbeat(self, node: int) -> Optional[str]:
        """Node ``node``'s launcher's last heartbeat in the store (None: none yet)."""
        beat = job_store.read(self.store, f"alive/{node}")
        return None if beat is None else beat.decode()

    def close(self) -> None:
        self._closing.set()
        for t in (self._watcher, self._heart):
            if t is not None:
                t.join(timeout=5)
        if self.lease is not None:
            self.lease.release()
        fds, self._pipe_r, self._pipe_w = (self._pipe_r, self._pipe_w), None, None  # once: a closed number is reused
        for fd in fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
