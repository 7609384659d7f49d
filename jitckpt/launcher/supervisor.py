"""`jitckpt run`: start and watch the workers of one node; hand a failure to a recovery strategy.

Per generation (restart attempt) the launcher hands each local rank to a warm standby process,
then watches the workers' control channels. A worker that dies closes its channel, so death is
seen at once; a worker that detects a hang or a collective error reports it. What follows is a
strategy's: :mod:`jitckpt.launcher.jit_recovery` (every survivor saves a just-in-time
checkpoint, the whole job restarts from it) or, with ``--recovery stage``,
:mod:`jitckpt.launcher.stage_replacement` (one dead pipeline stage is replaced alone, falling
back to the JIT recovery when it cannot be). This module owns the processes, the control
messages, preemption (SIGTERM/SIGINT) and the end of the job.

With several nodes, one launcher runs per node; they coordinate through a c10d TCPStore served
by node 0 at ``--rdzv-endpoint`` (see :mod:`jitckpt.launcher.node_coordinator`).
"""
from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from jitckpt.checkpoint_store import prune_finished
from jitckpt.launcher.checkpoint_flush import CheckpointFlusher
from jitckpt.protocol.control_channel import ENV_FD, ENV_NATIVE_HELLO, channel_pair
from jitckpt.protocol.worker_spec import SnapshotSpec, WorkerSpec
from jitckpt.protocol.control_messages import (Assign, ExitReady, FailureReport, Hello, Message, PeerExit,
                                               RankLost, Restored, Resumed, Saved, SaveFailed, SaveNow, StageCaughtUp,
                                               Unwound, Verdict, WorkerWarning)
from jitckpt.observability.events import EVENTS_FILE, EventLog
from jitckpt.launcher.keeper_supervisor import KeeperSupervisor
from jitckpt.snapshot.premap import ENV_PREMAP
from jitckpt.protocol.exit_codes import EXIT_JIT_SAVED
from jitckpt.launcher.config import LaunchConfig, check_writable_dir
from jitckpt.launcher.node_coordinator import SCALE_UP, NodeCoordinator
from jitckpt.launcher.store_relay import StoreRelay, local_store_factory
from jitckpt.launcher.standby_pool import StandbyPool
from jitckpt.launcher.daemon_link import DaemonKeeper, DaemonLink, NodeDraining
from jitckpt.launcher.job_tally import JobTally
from jitckpt.launcher.worker_logs import WorkerLogs, WorkerStreams
from jitckpt.launcher.inprocess_recovery import InProcessRecovery
from jitckpt.launcher.jit_recovery import NOT_A_CULPRIT, FailureRecord, JitRecovery
from jitckpt.launcher.stage_replacement import StageReplacement
from jitckpt.launcher.worker_handle import Worker
from jitckpt.launcher.stage_generations import StageGenerations
from jitckpt.observability.status_display import StatusDisplay
from jitckpt.observability.worker_records import WorkerRecords, console_line
from jitckpt.hang_timeout import HangTimeout

log = logging.getLogger("jitckpt.launcher.supervisor")
# SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C): the workers save, then the job stops.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Longest wait for the workers' JIT saves after a preemption signal (at most --save-timeout):
# Kubernetes' default grace period and SLURM's KillWait are 30 s, and killing the workers and
# reporting must fit in it too.
PREEMPT_SAVE_WAIT = 20.0
# How long a rank may take to exit after every rank finished (the verdict) before it is killed.
EXIT_GRACE = 30.0



def with_malloc_hugepages(tunables: str) -> str:
    """``GLIBC_TUNABLES`` with glibc's malloc asking for transparent huge pages (glibc >= 2.35; an
    older one ignores it), unless the user's value sets ``glibc.malloc.hugetlb`` itself.

    A restarted worker's time goes mostly to faulting in fresh memory: its model, the checkpoint it
    loads, and the dying rank's teardown too. On the bench VM a fresh 100 MB tensor cost 45 ms of
    4 KiB page faults and 12 ms in huge pages, and failure -> resumed went from 0.37 to 0.21 s."""
    if "glibc.malloc.hugetlb" in tunables:
        return tunables
    return ":".join(filter(None, [tunables, "glibc.malloc.hugetlb=1"]))


def transparent_env(cfg: LaunchConfig) -> dict[str, str]:
    """What libjit.so reads at load time in proxy mode: the mode (it starts the worker's proxy on
    its first CUDA call) and the plugins that run in it (undo: update-undo in the recovery)."""
    return {"JITCKPT_MODE": "proxy", "JITCKPT_PLUGINS": ",".join(cfg.plugins)}

class _StopNow(BaseException):
    """A second preemption signal: stop at once, without waiting for the saves."""


class Launcher:
    """Runs one node's share of a job until it finishes or runs out of restarts."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        check_writable_dir(cfg.checkpoint_dir, "--checkpoint-dir")
        self.run_dir = Path(cfg.run_dir)
        # Creates run_dir; a full disk there costs the event log (kept in memory), not the job.
        self.events = EventLog(self.run_dir / "events.jsonl")
        self._tally = JobTally()
        # --transparent: what the workers' libjit.so writes into the same log (metrics, console).
        self.worker_records = WorkerRecords(self.run_dir / "events.jsonl") if cfg.transparent else None
        self.metrics = None
        if cfg.metrics_port is not None:
            from jitckpt.observability.metrics import JobMetrics
            self.metrics = JobMetrics(port=cfg.metrics_port, addr=cfg.metrics_addr,
                                      token=os.environ.get("JITCKPT_METRICS_TOKEN") or None)
        self.coord = NodeCoordinator(cfg)  # without --node-rank, this gives cfg.node_rank
        self.logs = WorkerLogs(cfg, self.run_dir)
        self.daemon = DaemonLink(run_id=cfg.run_id, node_rank=cfg.node_rank, world_size=cfg.world_size)
        self.display = StatusDisplay(enabled=cfg.status_interval > 0, interval=cfg.status_interval,
                                     hang_timeout=HangTimeout.parse(cfg.hang_timeout))
        self.pool: Optional[StandbyPool] = None
        self.workers: list[Worker] = []
        # One node: a survivor's JIT save returns at the page cache, this launcher fsyncs it.
        self.flusher = CheckpointFlusher(emit=self.emit) if cfg.nnodes == 1 else None
        self.jit = JitRecovery(cfg=cfg, coord=self.coord, emit=self.emit, display=self.display,
                               flusher=self.flusher, keeper_socket=self._local_keeper_socket)
        self.restart_count = 0
        self.keeper: Optional[KeeperSupervisor | DaemonKeeper] = None
        self.gen = 0  # process-group generation; --recovery stage advances it per replacement
        self.stage: Optional[StageGenerations] = None
        self.replacement: Optional[StageReplacement] = None  # --recovery stage
        self.preempt_signal: Optional[int] = None  # the first SIGTERM/SIGINT (see run())
        self.store_lost: Optional[str] = None  # why the job's cross-node store stopped answering
        self._stopping = False  # a second one arrived: stop at once
        self._omp_warned = False
        # --recovery inprocess: the survivors keep their processes (jitckpt.launcher.inprocess_recovery).
        self.inprocess = InProcessRecovery(emit=self.emit) if cfg.recovery == "inprocess" else None
        if cfg.recovery == "stage":
            self.stage = StageGenerations(cfg, self.coord)
            self.replacement = StageReplacement(generations=self.stage, node_rank=cfg.node_rank,
                                                emit=self.emit,
                                                show_summary=self.display.show_summary)
        # --transparent: the workers' libjit.so rebuild a failed communicator together through
        # the job's store (transparent recovery), which this relays to them.
        self.store_relay: Optional[StoreRelay] = None
        self.replica_dir: Optional[str] = None  # where ranks leave device buffers for a replica
        if cfg.transparent:
            factory = self.coord.new_store_client if cfg.nnodes > 1 else local_store_factory()
            self.store_relay = StoreRelay(store_factory=factory, prefix=f"transparent/{cfg.run_id}")
            self.replica_dir = self.store_relay.buffers_dir
            if cfg.nnodes > 1:  # shared by every node, as the JIT checkpoints are
                self.replica_dir = os.path.join(cfg.checkpoint_dir, f".jitckpt-replicas-{cfg.run_id}")
                os.makedirs(self.replica_dir, mode=0o700, exist_ok=True)
        # Each rank's state at its minibatch start (RNG, loader position), for a lost rank's survivors
        # on this node (jitckpt.runtime.rank_state): tmpfs where there is one, removed at the end.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.rank_state_dir = tempfile.mkdtemp(prefix=f"jitckpt-ranks-{cfg.run_id}-", dir=shm)
        if cfg.snapshot_every:
            # The node's daemon runs it when there is one, so it outlives this launcher.
            self.keeper = self.daemon.keeper(cfg.node_rank) or KeeperSupervisor(
                run_dir=str(self.run_dir), node=cfg.node_rank, python=sys.executable, env=self._base_env())

    def _local_keeper_socket(self) -> Optional[str]:
        """This node's snapshot keeper's socket when it is the job's only node (else None)."""
        if self.keeper is None or self.cfg.nnodes != 1:
            return None
        return self.keeper.socket_path

    # ---- events ---------------------------------------------------------------------------
    def emit(self, event: str, **fields) -> None:
        rec = self.events.emit(event, **fields)
        if self.metrics is not None:
            self.metrics.record_event(rec)
        self.daemon.on_event(event, rec)
        if event == "job_start":
            self.display.say(f"job {self.cfg.run_id}: run directory {self.run_dir}, checkpoints in "
                             f"{self.cfg.checkpoint_dir}")
        elif event in ("failure_detected", "recovery_summary"):
            self._tally.add(rec)
        elif event == "job_end":
            self.display.say(self._tally.verdict(rec, self.workers, self.run_dir))

    def _take_worker_records(self, launch: Optional[int] = None) -> None:
        """Count the records the workers' libjit.so appended (transparent recoveries, replay
        validations, a native replacement stage caught up) and say on the console what the user
        must know of them."""
        if self.worker_records is None:
            return
        for rec in self.worker_records.poll():
            if self.metrics is not None:
                self.metrics.record_event(rec)
            if rec["event"] == "stage_caught_up" and launch is not None and self.replacement is not None:
                # A --no-python program has no control channel: its libjit.so says it in the log.
                for w in self.workers:
                    if w.rank == rec.get("rank") and w.proc.pid == rec.get("pid"):
                        self.replacement.caught_up(launch, w, StageCaughtUp(
                            rank=w.rank, generation=int(rec.get("gen", self.gen)),
                            checkpoint=int(rec.get("checkpoint", 0)), replayed=int(rec.get("replayed", 0))))
            line = console_line(rec)
            if line is not None:
                self.display.say(line)

    # ---- main loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job; its exit code.

        SIGTERM or SIGINT is a preemption: every live worker is told to save a JIT checkpoint of
        its current minibatch, the launcher waits for the saves (at most --save-timeout and
        :data:`PREEMPT_SAVE_WAIT`), kills every process it started, and returns 128 + the signal
        number (the shell's code for "terminated by that signal"; job_end status "preempted").
        Running the job again resumes from those checkpoints. A second signal stops at once.
        """
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, self._on_signal) for s in PREEMPTION_SIGNALS}
        try:
            return self._run_job()
        except _StopNow:
            for s in handlers:  # the shutdown below is quick and must not be cut short
                signal.signal(s, signal.SIG_IGN)
            self._stop_processes()
            log.warning("second %s: stopped without waiting for the JIT checkpoints",
                        signal.Signals(self.preempt_signal).name)
            return self._end_preempted()
        finally:
            for s, previous in handlers.items():
                signal.signal(s, previous)

    def _on_signal(self, signum: int, frame: object) -> None:
        """The first signal only sets a flag: the generation loop acts on it between polls."""
        if self.preempt_signal is None:
            self.preempt_signal = signum
        elif not self._stopping:
            self._stopping = True
            raise _StopNow()

    def _end_preempted(self) -> int:
        if self.store_lost is not None:
            log.error("job stopped: %s. Its ranks saved JIT checkpoints of their current step; run the job again "
                      "once the store is back (etcd: a majority of its members), and it resumes from them",
                      self.store_lost)
            self.emit("job_end", status="failed", exit_code=1, restarts=self._restarts_used(), reason=self.store_lost)
            return 1
        code = 128 + int(self.preempt_signal or signal.SIGTERM)
        name = signal.Signals(self.preempt_signal or signal.SIGTERM).name
        log.warning("job preempted (%s), exit code %d; run it again to resume from its newest "
                    "checkpoint", name, code)
        self.emit("job_end", status="preempted", exit_code=code, restarts=self._restarts_used(),
                  signal=name)
        return code

    def _run_job(self) -> int:
        cfg = self.cfg
        self.emit("job_start", nproc=cfg.nproc_per_node, nnodes=cfg.nnodes,
                  world_size=cfg.world_size, script=cfg.script, checkpoint_dir=cfg.checkpoint_dir,
                  hang_timeout=cfg.hang_timeout, node_rank=cfg.node_rank, run_id=cfg.run_id)
        if not cfg.no_python:
            env = self._base_env()
            if cfg.preload:  # must be in the environment when the standby process starts
                env["LD_PRELOAD"] = cfg.preload
            if cfg.transparent:
                env.update(transparent_env(cfg))
            # --preload (libjit.so does not track a forked child): no template.
            self.pool = StandbyPool(size=cfg.nproc_per_node * cfg.warm_standby, env=env,
                                    python=sys.executable, forks=not cfg.preload)
            # The first generation's workers (the standby template's import is the job's start);
            # the standbys for a restart once they train: forks of the template, ready at once
            # (standbys of their own, with --preload: imported at idle priority meanwhile).
            self.pool.fill(count=cfg.nproc_per_node, ahead=False)
        try:
            try:
                self.daemon.start(os.getpid())
            except NodeDraining as e:
                log.error("%s; start the job on another node", e)
                self.emit("job_end", status="failed", exit_code=1, restarts=0, reason=str(e))
                return 1
            try:
                gen = self.coord.first_launch()  # whole-job launches (the coordinator's generations)
            except RuntimeError as e:  # e.g. a replacement for a node whose launcher runs: a bounded wait
                log.error("%s", e)
                self.emit("job_end", status="failed", exit_code=1, restarts=0, reason=str(e))
                return 1
            self.restart_count = self.coord.restarts_before(gen)  # a replacement: the job's restarts so far
            while True:
                self.gen = self.stage.for_launch(gen) if self.stage is not None else gen
                self.events.gen = self.gen
                if self.preempt_signal is not None:  # arrived between two generations
                    return self._end_preempted()
                if not self._ensure_keeper():
                    self.emit("job_end", status="failed", exit_code=1, restarts=self._restarts_used())
                    return 1
                try:
                    joined = self.coord.begin_generation(gen, restarts=self.restart_count)
                except RuntimeError as e:  # no rendezvous, or a --checkpoint-dir the nodes do not share
                    log.error("%s", e)
                    self.emit("job_end", status="failed", exit_code=1, restarts=self._restarts_used(), reason=str(e))
                    return 1
                if joined.gen != gen:  # --nnodes MIN:MAX: it closed without this node, which joins a later one
                    gen = self.gen = self.events.gen = joined.gen
                if cfg.nnodes > 1:
                    self.emit("generation_nodes", nodes=list(joined.nodes), group_rank=joined.group_rank,
                              world_size=len(joined.nodes) * cfg.nproc_per_node, controller=self.coord.leads)
                ok = self._run_generation(gen, joined.master)
                if ok:
                    self._prune_finished()
                    self.emit("job_end", status="ok", exit_code=0, restarts=self._restarts_used())
                    return 0
                if self.preempt_signal is not None:
                    return self._end_preempted()
                # A change of the job's nodes (a node joined: --nnodes MIN:MAX) is no failure: as
                # with torchrun, it does not use up a restart.
                scale_up = self.jit.pending_kind() == SCALE_UP
                if self._restarts_used() >= cfg.max_restarts and not scale_up:
                    log.error("job failed and --max-restarts=%d is used up", cfg.max_restarts)
                    self.emit("job_end", status="failed", exit_code=1, restarts=self._restarts_used())
                    return 1
                if not scale_up:
                    self.restart_count += 1
                gen += 1
                if self.replacement is not None:  # killed with the rest; launch ``gen`` counts afresh
                    self.replacement.reset()
                self.emit("restart", reason="failure", restart_count=self._restarts_used())
        finally:
            self._stop_processes()
            self._take_worker_records()  # the last ones, written as the workers ended
            shutil.rmtree(self.rank_state_dir, ignore_errors=True)
            if self.store_relay is not None:
                self.store_relay.close()
                if self.replica_dir and cfg.nnodes > 1 and cfg.node_rank == 0:
                    shutil.rmtree(self.replica_dir, ignore_errors=True)
            self.coord.close()
            if self.flusher is not None:  # the last JIT checkpoints reach the disk before the launcher ends
                self.flusher.close()
            if self.metrics is not None:
                self.metrics.close()
            self.events.close()

    def _stop_processes(self) -> None:
        """Kill the workers and standbys, stop the keeper: nothing this launcher started outlives it."""
        for w in self.workers:
            w.kill()
        if self.pool is not None:
            self.pool.close()
        if self.keeper is not None:
            self.keeper.stop()

    def _prune_finished(self) -> None:
        """The job finished: its JIT checkpoints (mid-run states, often several replicas' copies)
        and dead writers' temporary directories go; periodic checkpoints and flushed snapshots,
        which the user asked for, stay."""
        if self.flusher is not None:
            self.flusher.close()  # no fsync left running in a directory removed here
        try:
            removed = prune_finished(self.cfg.checkpoint_dir)
        except OSError as e:
            log.warning("could not remove the finished job's JIT checkpoints: %s", e)
            return
        if removed:
            log.info("job finished: removed %d superseded JIT checkpoint/temporary directories from %s",
                     len(removed), self.cfg.checkpoint_dir)

    def _restarts_used(self) -> int:
        """Whole-job restarts plus --recovery stage replacements on any node."""
        return self.restart_count + (self.stage.replacements() if self.stage is not None else 0)

    def _ensure_keeper(self) -> bool:
        """This node's snapshot keeper runs (kept across generations; replaced, empty, if it died)."""
        if self.keeper is None:
            return True
        try:
            started = self.keeper.ensure_running()
        except (RuntimeError, OSError) as e:
            log.error("%s", e)
            return False
        if started:
            self.emit("snapshot_keeper_start", node=self.cfg.node_rank, pid=self.keeper.pid,
                      socket=self.keeper.socket_path, replaced=self.keeper.starts > 1,
                      previous_exit=self.keeper.previous_exit)
        if self.pool is not None and self.cfg.nnodes == 1:
            # One node's ranks restore from its keeper alone, straight into their tensors: the
            # standbys map the keeper's buffers while idle (with more nodes objects travel over
            # the process group, and a standby would map buffers its restore may not read).
            self.pool.env[ENV_PREMAP] = self.keeper.socket_path
        return True

    def _base_env(self) -> dict:
        env = dict(os.environ)
        pkg_parent = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
        # Restarted gloo workers must not read a previous generation's peer addresses.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(self.cfg.omp_num_threads)
            if self.cfg.nproc_per_node > 1 and not self._omp_warned:  # torchrun's warning, once
                self._omp_warned = True
                log.warning("Setting OMP_NUM_THREADS environment variable for each process to be %s in default, "
                            "to avoid your system being overloaded, please further tune the variable for optimal "
                            "performance in your application as needed.", env["OMP_NUM_THREADS"])
        if self.cfg.nnodes == 1:  # one node: gloo's own sockets on loopback too, as the store's
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["GLIBC_TUNABLES"] = with_malloc_hugepages(env.get("GLIBC_TUNABLES", ""))
        return env

    def _rank_env(self, spec: WorkerSpec, local_rank: int, master: tuple[str, int], streams: WorkerStreams) -> dict:
        """torchrun's variables for the rank, as torchrun sets them (scripts and
        ``init_process_group`` read them); jitckpt's own settings are in ``spec``."""
        cfg = self.cfg
        rank, gen = spec.rank, spec.gen
        nodes = self.coord.current
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node), "GROUP_RANK": str(nodes.group_rank),
            "GROUP_WORLD_SIZE": str(len(nodes.nodes)),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(spec.world_size), "ROLE_NAME": cfg.role,
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
            "TORCHELASTIC_RESTART_COUNT": str(gen), "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
            "TORCHELASTIC_RUN_ID": cfg.run_id,
            # Python workers: rank 0's process serves the store on MASTER_ADDR only (every rank a
            # client), not torch's server on every interface (jitckpt.runtime.generation_store).
            "TORCHELASTIC_USE_AGENT_STORE": str(not cfg.no_python),
        }
        # torchrun's error file: a script's @record (torch.distributed.elastic.multiprocessing.errors)
        # writes its exception there.
        env["TORCHELASTIC_ERROR_FILE"] = streams.error_file
        if cfg.preload:
            env["LD_PRELOAD"] = cfg.preload
        if cfg.transparent:
            env.update(transparent_env(cfg))
            if self.daemon.proxy_broker:  # the node's daemon starts (and owns) the device proxies
                env["JITCKPT_PROXY_BROKER"] = self.daemon.proxy_broker
            # libjit.so records a lost proxy it replaced (and replayed) in the job's event log.
            env["JITCKPT_EVENT_LOG"] = str(Path(spec.run_dir) / EVENTS_FILE)
            env["JITCKPT_EVENT_GEN"] = str(gen)
            if self.store_relay is not None:
                env["JITCKPT_STORE_SOCKET"] = self.store_relay.socket_path
                env["JITCKPT_REPLICA_DIR"] = str(self.replica_dir)
        return env

    def _worker_spec(self, gen: int, local_rank: int, role: str) -> WorkerSpec:
        """What this launcher tells the rank, once, validated."""
        cfg = self.cfg
        snapshot = stage = None
        if self.keeper is not None:
            snapshot = SnapshotSpec(socket=self.keeper.socket_path, every=cfg.snapshot_every,
                                    protection=str(cfg.snapshot_protection),
                                    flush_every=cfg.snapshot_flush_every,
                                    ranks_per_node=cfg.nproc_per_node, zero=cfg.snapshot_zero,
                                    zero_copy_every=cfg.snapshot_zero_copy_every)
        if self.stage is not None:
            stage = self.stage.worker_spec(role)
        nodes = self.coord.current  # the generation's nodes: with --nnodes MIN:MAX maybe fewer than MAX
        return WorkerSpec(rank=nodes.group_rank * cfg.nproc_per_node + local_rank,
                          world_size=len(nodes.nodes) * cfg.nproc_per_node, gen=gen, checkpoint_dir=cfg.checkpoint_dir,
                          run_dir=str(self.run_dir), hang_timeout=cfg.hang_timeout,
                          periodic_every=cfg.periodic_every, save_timeout=cfg.save_timeout,
                          plugins=cfg.plugins, host_store=not cfg.no_python, snapshot=snapshot,
                          stage=stage, launcher_fsyncs=self.flusher is not None,
                          rank_state_dir=self.rank_state_dir, in_process=self.inprocess is not None)

    def _start_workers(self, launch: int, master: tuple[str, int]) -> None:
        role = "initial" if launch == 0 else "restart"
        streams = self.logs.attempt(self.gen, list(range(self.cfg.nproc_per_node)))
        self.not_ready: list[str] = []  # why a rank of this launch did not get a ready standby
        self.workers = [self._start_worker(self.gen, lr, master, role, streams[lr])
                        for lr in range(self.cfg.nproc_per_node)]

    def _start_worker(self, gen: int, local_rank: int, master: tuple[str, int],
                      role: str, streams: WorkerStreams) -> Worker:
        cfg = self.cfg
        spec = self._worker_spec(gen, local_rank, role)
        env = self._rank_env(spec, local_rank, master, streams)
        rank = spec.rank
        if cfg.no_python:  # no Python to send the spec to: libjit.so reads the environment
            parent, child = channel_pair()
            # ENV_NATIVE_HELLO: libjit.so registers the program, saying it cannot save.
            full_env = {**self._base_env(), **env, **spec.to_env(), ENV_FD: str(child.fileno()),
                        ENV_NATIVE_HELLO: "1", **self._native_logging_env(rank, role)}
            with ExitStack() as files:
                out, err = (files.enter_context(open(p, "ab")) if p else None for p in (streams.stdout, streams.stderr))
                proc = subprocess.Popen([cfg.script, *cfg.script_args], env=full_env, stdout=out, stderr=err,
                                        pass_fds=(child.fileno(),), start_new_session=True)
            child.close()
            w = Worker(rank, local_rank, proc, parent, warm=False)
            why = "--no-python (no standby: the program starts anew)"
        else:
            assert self.pool is not None
            kept = self.inprocess.take(rank) if self.inprocess is not None else None
            if kept is not None:  # a survivor of an in-process recovery: the same process, the same rank
                channel, board, proc, why, role = kept.channel, kept.board, kept.proc, None, "survivor"
                self.jit.note_kept(rank)
                if board is not None:
                    board.clear()
            else:
                standby, why = self.pool.take()
                channel, board, proc = standby.channel, standby.board, standby.proc
            argv = [cfg.script, *cfg.script_args]
            channel.send(Assign(env=env, argv=argv, cwd=os.getcwd(), module=cfg.module, spec=spec.to_dict(),
                                stdout=streams.stdout or "", stderr=streams.stderr or ""))
            w = Worker(rank, local_rank, proc, channel, warm=why is None, board=board)
        if why is not None:
            self.not_ready.append(f"rank {rank}: {why}")
        self.emit("worker_start", rank=rank, pid=proc.pid, warm=w.warm, role=role,
                  **({"not_ready": why} if why is not None else {}))
        return w

    def _native_logging_env(self, rank: int, role: str) -> dict:
        """--no-python --plugin logging: libjit.so logs every rank's sends under the run directory,
        and a replacement of a dead stage replays its receives from the other ranks' logs, joining
        the survivors in the device proxy (interposer/src/stage_join.h)."""
        if self.replacement is None:
            return {}
        logs = Path(self.run_dir) / "send_logs"
        (logs / f"rank{rank}").mkdir(parents=True, exist_ok=True)
        env = {"JITCKPT_SEND_LOG_DIR": str(logs / f"rank{rank}")}
        if role == "replacement":
            others = [str(logs / f"rank{r}") for r in range(self.cfg.world_size) if r != rank]
            env.update(JITCKPT_STAGE_JOIN="1", JITCKPT_RECV_REPLAY_DIRS=":".join(others))
        return env

    def _replace_worker(self, launch: int, old: Worker, master: tuple[str, int],
                        sel: selectors.BaseSelector) -> bool:
        """--recovery stage: start a replacement for the dead ``old`` and keep the survivors;
        False when :meth:`StageReplacement.begin` refuses (the caller recovers the whole job)."""
        if self.replacement is None:
            return False
        gen = self.replacement.begin(launch, old, self.workers,
                                     restarts_left=self._restarts_used() < self.cfg.max_restarts)
        if gen is None:
            return False
        self.gen = gen
        self.events.gen = self.gen
        streams = self.logs.attempt(self.gen, [old.local_rank])
        new = self._start_worker(self.gen, old.local_rank, master, "replacement", streams[old.local_rank])
        self.replacement.started(self.gen, old.rank, restart_count=self._restarts_used())
        old.channel.close()
        self.workers[self.workers.index(old)] = new
        sel.register(new.channel.fileno(), selectors.EVENT_READ, new)
        if self.pool is not None:
            self.pool.fill()  # the next replacement starts warm too
        return True

    def _worker_gone(self, gen: int, w: Worker, master: tuple[str, int], sel: selectors.BaseSelector,
                     failure: Optional[FailureRecord], verdict_sent: bool) -> Optional[FailureRecord]:
        """``w`` exited (its channel's EOF, or poll()): reap it and, if it died before the
        verdict, recover (replace it alone, or the whole job)."""
        sel.unregister(w.channel.fileno())
        w.eof = True
        self._reap(w)
        if failure is not None and w.exit_code not in NOT_A_CULPRIT and w.rank not in failure.failed_ranks:
            failure.failed_ranks.append(w.rank)  # the culprit, seen after a peer's report
            for x in self.workers:  # a survivor writing its shard's parts stops waiting for its part
                if x.live and x is not w:
                    x.channel.send(RankLost(rank=w.rank))
        if w.exit_code in (0, EXIT_JIT_SAVED) or failure is not None or verdict_sent:
            return failure  # after the verdict: see _warn_deaths_after_verdict
        if self._replace_worker(gen, w, master, sel):
            return None
        kind, detail = w.death()
        failure = self.jit.on_failure(gen, self.workers, kind, w.rank, detail)
        if self.replacement is not None:  # --recovery stage fell back
            self.replacement.fold_into(failure)
        return failure

    # ---- one generation ---------------------------------------------------------------------
    def _run_generation(self, gen: int, master: tuple[str, int]) -> bool:
        t_start = time.time()
        self._start_workers(gen, master)
        self.jit.generation_started(t_start, self.not_ready)
        sel = selectors.DefaultSelector()
        for w in self.workers:
            sel.register(w.channel.fileno(), selectors.EVENT_READ, w)
        remote_fd = self.coord.failure_fd()
        if remote_fd is not None:
            sel.register(remote_fd, selectors.EVENT_READ, None)
        failure: Optional[FailureRecord] = None
        refilled = False
        pool_ready = False
        verdict_sent = False
        exit_deadline = 0.0  # after the verdict: ranks still alive then are stuck exiting
        preempt_deadline: Optional[float] = None  # set once a preemption signal is acted on
        try:
            while True:
                timeout = self.cfg.monitor_interval
                for key, _ in sel.select(timeout):
                    w = key.data
                    if w is None:
                        info = self.coord.read_remote_failure(gen)
                        if info is not None and info["kind"] == "store_lost":
                            self._store_gone(info["detail"])
                        elif info is not None and info["kind"] == "preempted":
                            self.preempt_signal = self.preempt_signal or signal.SIGTERM
                        elif info is not None and failure is None:
                            failure = self.jit.on_failure(gen, self.workers, info["kind"],
                                                          info.get("rank"), info.get("detail", ""),
                                                          remote=True, reporter=info.get("reporter"))
                        continue
                    msg = w.channel.recv(timeout=5.0)
                    if msg is None:
                        failure = self._worker_gone(gen, w, master, sel, failure, verdict_sent)
                        continue
                    failure = self._on_message(gen, w, msg, failure)
                    while w.channel.buffered():  # one socket read can carry several messages
                        failure = self._on_message(gen, w, w.channel.recv(), failure)
                # Periodic checks.
                self._note_progress(failure)
                if self.coord.lost is not None:  # found by a request of this loop, before its pipe is read
                    self._store_gone(self.coord.lost)
                self._take_worker_records(gen)
                for w in self.workers:
                    if not w.eof and w.exit_code is None and w.proc.poll() is not None:
                        # Exited before select() returned its channel's EOF, which may never come
                        # (a data loader or compile worker it forked holds the channel open): what
                        # it sent first counts (a JIT checkpoint it saved, its report), then the
                        # exit is its death.
                        for msg in w.channel.pending():
                            failure = self._on_message(gen, w, msg, failure)
                        failure = self._worker_gone(gen, w, master, sel, failure, verdict_sent)
                self.display.maybe_show(gen, self.workers, failure)
                if not refilled and self.pool is not None and all(w.minibatch_done for w in self.workers):
                    # Once a minibatch is done, after a restart the failed one done again: the new
                    # standbys' imports would slow the workers' start and that minibatch.
                    self.pool.fill()
                    refilled = True
                if refilled and not pool_ready and self.pool is not None:
                    seconds = self.pool.ready_after()
                    if seconds is not None:
                        pool_ready = True
                        self.emit("standby_ready", count=self.pool.size, seconds=seconds)
                if self.preempt_signal is not None:
                    if preempt_deadline is None:
                        preempt_deadline = time.monotonic() + min(self.cfg.save_timeout,
                                                                  PREEMPT_SAVE_WAIT)
                        if not verdict_sent:  # after it, the workers are merely exiting
                            failure = self._preempt_workers(gen, failure)
                    # A worker with no save path is not waited for: nothing more will come from it.
                    if (all(w.exit_code is not None or w.no_save_path for w in self.workers)
                            or time.monotonic() > preempt_deadline):
                        break
                    continue
                if failure is None:
                    if not verdict_sent and self._all_exit_ready(gen):
                        for w in self.workers:
                            w.channel.send(Verdict(ok=True))
                        verdict_sent = True
                        exit_deadline = time.monotonic() + EXIT_GRACE
                    if verdict_sent and time.monotonic() > exit_deadline:
                        self._kill_stuck_after_verdict()
                    if all(w.exit_code is not None for w in self.workers):
                        codes = [w.exit_code for w in self.workers]
                        if verdict_sent or all(c == 0 for c in codes):
                            self._warn_deaths_after_verdict()
                            self.coord.node_done(gen, ok=True)
                            return True
                        failure = self.jit.on_failure(gen, self.workers, "exit", None,
                                                      f"exit codes {codes}")
                    continue
                if self.inprocess is not None:
                    self.inprocess.failed(failure, self.workers)
                    decision = self.inprocess.decide(self.workers, failure,
                                                     self.jit.covered(gen, self.workers, failure))
                    if decision == "go":
                        break
                    if decision == "wait":
                        continue
                if self.jit.can_proceed(gen, self.workers, failure):
                    break
        finally:
            sel.close()
            self.logs.stop()  # what the tee'd files hold is on the console before the verdict
        self._kill_all()
        if preempt_deadline is not None:
            self._report_preemption(failure)
            return verdict_sent  # every rank had finished: the job is done
        failure.t_killed = time.time()
        # Said before run() decides, so that nothing announces a restart that does not come.
        restarting = (self.preempt_signal is None
                      and (self._restarts_used() < self.cfg.max_restarts or failure.kind == SCALE_UP))
        self.jit.finish(self.workers, failure, restarting=restarting)
        return False

    def _store_gone(self, detail: str) -> None:
        """No recovery can be coordinated any more: every rank saves, as for a preemption."""
        if self.store_lost is None:
            self.store_lost = detail
            log.error("%s: every worker saves a JIT checkpoint, then the job stops", detail)
            self.preempt_signal = self.preempt_signal or signal.SIGTERM

    def _preempt_workers(self, gen: int,
                         failure: Optional[FailureRecord]) -> FailureRecord:
        """Tell every live worker (and the other nodes) to save a JIT checkpoint now."""
        name = signal.Signals(self.preempt_signal).name
        if self.store_lost is None:
            log.warning("%s: every worker saves a JIT checkpoint, then the job stops (send it "
                        "again to stop at once)", name)
        if failure is not None:
            return failure  # a recovery is under way: its workers are saving already
        detail = self.store_lost or f"received {name}"
        for w in self.workers:
            if w.live:
                w.channel.send(SaveNow(kind="preempted", rank=None, detail=detail))
        self.coord.announce_failure(gen, {"kind": "preempted", "rank": None, "detail": detail})
        return FailureRecord(gen=gen, kind="preempted", rank=None, detail=detail,
                             t_detect=time.time())

    def _report_preemption(self, failure: Optional[FailureRecord]) -> None:
        saved = set(failure.saved_ranks) if failure is not None else set()
        unsaved = sorted(w.rank for w in self.workers if w.rank not in saved)
        if failure is not None and unsaved:
            why = {failure.save_failed.get(r) for r in unsaved}
            # One reason every unsaved rank gave (e.g. a layout protect() cannot save), else the usual causes.
            log.warning("preempted: rank(s) %s saved no JIT checkpoint (%s); the next run resumes from the "
                        "newest complete checkpoint", unsaved,
                        why.pop() if len(why) == 1 and None not in why else "stopped, hung, or too slow")
            if isinstance(self.keeper, KeeperSupervisor):
                # Found from outside: a preempted ZeRO job, told to run again to resume, started at step 0.
                log.warning("preempted: the in-memory snapshots are in this launcher's keeper and stop with it, so "
                            "a ZeroRedundancyOptimizer job, whose shards of this step are incomplete, resumes from an "
                            "older complete set or starts again from step 0 next run; `jitckpt daemon run` on each "
                            "node keeps the snapshots across runs")

    def _kill_stuck_after_verdict(self) -> None:
        """Ranks still alive EXIT_GRACE after the verdict are stuck in their interpreter's teardown
        (e.g. torch's ProcessGroupGloo destructor joining a thread that waits for the GIL the
        destructor holds): their work is done, so they are killed rather than waited for."""
        for w in self.workers:
            if w.exit_code is None and w.proc.poll() is None:
                log.warning("rank %d still running %.0f s after every rank finished (stuck exiting); "
                            "killing it", w.rank, EXIT_GRACE)
                w.kill()
                try:
                    w.exit_code = w.proc.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    log.error("worker pid %d did not die after SIGKILL", w.proc.pid)

    def _warn_deaths_after_verdict(self) -> None:
        """Every rank passed the exit barrier, so the job is done: a later death loses nothing."""
        for w in self.workers:
            if w.exit_code not in (0, None):
                kind, detail = w.death()
                log.warning("rank %d %s after every rank finished; the job is complete", w.rank,
                            "was " + detail if kind == "signal" else "exited with " + detail)
                self.emit("death_after_verdict", rank=w.rank, pid=w.proc.pid, detail=detail)

    def _all_exit_ready(self, gen: int) -> bool:
        local = all(w.exit_ready for w in self.workers)
        return local and self.coord.all_exit_ready(gen)

    # ---- messages ---------------------------------------------------------------------------
    def _note_progress(self, failure: Optional[FailureRecord]) -> None:
        """The steps the workers posted on their boards since the last look: a worker's first
        (its start-up ended), rank 0's every ~0.5 s (a sample for the event log), and, after a
        failure, the minibatches begun until they stopped."""
        now = time.monotonic()
        for w in self.workers:
            step = w.step
            if step is None or step < 0 or step == w.noted_step:
                continue
            first, w.noted_step = w.noted_step is None, step
            if first or (w.rank == 0 and now - w.noted_t > 0.5):
                w.noted_t = now
                self.emit("step", rank=w.rank, step=step, step_time=None if first else w.step_time)
            if failure is not None:
                failure.saw_step(step)

    def _on_message(self, gen: int, w: Worker, msg: Message,
                    failure: Optional[FailureRecord]) -> Optional[FailureRecord]:
        if isinstance(msg, Hello):
            w.registered(msg.can_save)
        elif isinstance(msg, FailureReport) and msg.kind == "preempted":
            # The worker itself got SIGTERM/SIGINT (e.g. SLURM signals every process of a job
            # step): the whole job is being preempted, not a failure to recover from.
            self.preempt_signal = self.preempt_signal or signal.SIGTERM
        elif isinstance(msg, FailureReport):
            if failure is None:
                # A rank's own exception names itself; a hang or collective error is reported
                # by a healthy rank that waited on the failed one, which it names when it knows.
                culprit = msg.rank if msg.kind == "exception" else msg.culprit
                failure = self.jit.on_failure(gen, self.workers, msg.kind, culprit, msg.detail,
                                              reporter=w.rank)
            failure.saw_step(_began(w, msg.step))
            if msg.detect_s is not None:
                failure.detect_s = max(failure.detect_s, float(msg.detect_s))
        elif isinstance(msg, Saved):
            self.emit("checkpoint_saved", rank=w.rank, step=msg.step, bytes=msg.bytes,
                      seconds=msg.seconds, path=msg.path, kind=msg.kind, undone=msg.undone)
            if msg.kind == "jit" and self.flusher is not None:  # its workers leave the fsync to it
                self.flusher.flush(msg.path)
            if msg.kind == "jit":
                self.coord.report_saved(gen, msg.shard_id, msg.num_shards, w.rank)
                if failure is not None:
                    failure.saved_ranks.append(w.rank)
                    failure.checkpoint_bytes = max(failure.checkpoint_bytes, msg.bytes)
                    failure.save_s = max(failure.save_s or 0.0, msg.seconds)
            if failure is not None:
                failure.saw_step(_began(w, msg.step))
        elif isinstance(msg, SaveFailed):
            self.emit("checkpoint_failed", rank=w.rank, reason=msg.reason, kind=msg.kind, step=msg.step)
            if failure is not None and msg.kind == "jit":
                failure.saw_step(_began(w, msg.step))
                failure.save_failed[w.rank] = msg.reason
        elif isinstance(msg, WorkerWarning):
            self.emit("warning", rank=w.rank, reason=msg.reason)
            self.display.say(f"warning from rank {w.rank}: {msg.reason}")
        elif isinstance(msg, Restored):
            w.restored = msg
            self.emit("restore", rank=w.rank, step=msg.step, path=msg.path, seconds=msg.seconds,
                      source=msg.source, decoded=msg.decoded, fetched=msg.fetched)
        elif isinstance(msg, Resumed):
            w.resumed = True
            self.jit.maybe_summarize(self.workers)
        elif isinstance(msg, Unwound):
            if self.inprocess is not None:
                self.inprocess.unwound(w, msg)
        elif isinstance(msg, StageCaughtUp):
            if self.replacement is not None:
                self.replacement.caught_up(gen, w, msg)
        elif isinstance(msg, ExitReady):
            w.exit_ready = True
            w.exit_step = msg.step
            self.coord.report_exit_ready(gen, w.rank)
            if failure is None and not all(x.exit_ready for x in self.workers):
                # Peers that then wait for this rank in a collective report its early exit.
                for x in self.workers:
                    if not x.exit_ready and x.live:
                        x.channel.send(PeerExit(rank=w.rank, step=w.exit_step))
        return failure

    def _reap(self, w: Worker) -> None:
        try:
            w.exit_code = w.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            w.kill()
            w.exit_code = w.proc.wait(timeout=5.0)

    def _kill_all(self) -> None:
        """Kill the generation's workers, but the survivors an in-process recovery keeps."""
        kept = {id(w) for w in self.workers if self.inprocess is not None and self.inprocess.keeps(w)}
        for w in self.workers:
            if id(w) not in kept:
                w.kill()
        for w in self.workers:
            if id(w) in kept:
                continue
            try:
                w.exit_code = w.proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not die after SIGKILL", w.proc.pid)
            w.channel.close()


def run(cfg: LaunchConfig) -> int:
    from jitckpt.console_log import configure

    configure()
    from jitckpt.process_title import set_title

    set_title(f"jitckpt launcher {cfg.run_id}")
    try:
        launcher = Launcher(cfg)
    except (ValueError, OSError, RuntimeError) as e:  # e.g. a metrics address that needs a token, a busy port
        print(f"jitckpt run: error: {e}", file=sys.stderr)
        return 2
    set_title(f"jitckpt launcher {cfg.run_id} node {cfg.node_rank}")
    return launcher.run()


def _began(w: Worker, state_step: Optional[int]) -> Optional[int]:
    """The minibatch worker ``w`` was in when it reported the state at the start of ``state_step``
    (a save, a failure report): its step board's, which shows the minibatch begun. A rank held
    between minibatches (a DTensor job's snapshot agreement after its optimizer step) reports the
    next one's state without having begun it. Without a board step (a job that never marks its
    steps) the state's step is the minibatch in progress."""
    board = w.step
    return board if board is not None and board >= 0 else state_step
