"""`jitckpt run`: start and watch the workers of one node, recover the job after a failure.

Per generation (restart attempt) the launcher hands each local rank to a warm standby process,
then watches the workers' control channels. A worker that dies closes its channel, so death is
seen at once; a worker that detects a hang or a collective error reports it. On the first failure
the launcher tells every other worker to save a just-in-time checkpoint, waits (bounded) until at
least one data-parallel replica of every shard has saved one, kills what is left, and starts the
next generation, whose workers resume from that checkpoint.

With several nodes, one launcher runs per node; they coordinate through a c10d TCPStore served
by node 0 at ``--rdzv-endpoint`` (see :mod:`jitckpt.launcher.node_coordinator`).
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from jitckpt.checkpoint_store import prune, prune_finished
from jitckpt.protocol.control_channel import ENV_FD, ControlChannel, channel_pair
from jitckpt.protocol.worker_spec import SnapshotSpec, WorkerSpec
from jitckpt.protocol.control_messages import (Assign, ExitReady, FailureReport, Hello, Message, PeerExit,
                                               Restored, Resumed, Saved, SaveFailed, SaveNow, StageCaughtUp,
                                               Status, Verdict, WorkerWarning)
from jitckpt.observability.events import EventLog
from jitckpt.launcher.keeper_supervisor import KeeperSupervisor
from jitckpt.protocol.exit_codes import EXIT_JIT_SAVED, EXIT_NO_SAVE
from jitckpt.launcher.config import LaunchConfig, check_writable_dir
from jitckpt.launcher.node_coordinator import NodeCoordinator
from jitckpt.launcher.standby_pool import StandbyPool, kill_group
from jitckpt.launcher.stage_generations import StageGenerations
from jitckpt.observability.status_display import StatusDisplay
from jitckpt.hang_timeout import HangTimeout

log = logging.getLogger("jitckpt.launcher.supervisor")
# Exit codes of ranks that ended because of another rank's failure (saved, or gave up saving).
NOT_A_CULPRIT = (0, EXIT_JIT_SAVED, EXIT_NO_SAVE)
# SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C): the workers save, then the job stops.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Longest wait for the workers' JIT saves after a preemption signal (at most --save-timeout):
# Kubernetes' default grace period and SLURM's KillWait are 30 s, and killing the workers and
# reporting must fit in it too.
PREEMPT_SAVE_WAIT = 20.0
# How long a rank may take to exit after every rank finished (the verdict) before it is killed.
EXIT_GRACE = 30.0


class _StopNow(BaseException):
    """A second preemption signal: stop at once, without waiting for the saves."""


def _death(w: "Worker") -> tuple[str, str]:
    """How a worker that exited on its own died: (failure kind, detail)."""
    if (w.exit_code or 0) < 0:
        return "signal", f"killed by {signal.Signals(-w.exit_code).name}"
    return "exit", f"exit code {w.exit_code}"


@dataclass
class Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    channel: ControlChannel
    warm: bool
    started: float = field(default_factory=time.monotonic)
    exit_code: Optional[int] = None
    eof: bool = False
    step: Optional[int] = None
    step_time: Optional[float] = None
    exit_ready: bool = False
    exit_step: Optional[int] = None
    restored: Optional[Restored] = None
    resumed: bool = False
    killed: bool = False  # by this launcher, while still running: not a death of its own

    def kill(self) -> None:
        """SIGKILL the worker's process group, remembering that the launcher did it."""
        if self.proc.poll() is None:
            self.killed = True
            kill_group(self.proc)


@dataclass
class FailureRecord:
    """What the launcher knows about one failure and the recovery from it."""

    gen: int
    kind: str
    rank: Optional[int]
    detail: str
    t_detect: float                      # time.time() when the launcher learned of it
    step_failed: Optional[int] = None    # highest step any rank had reached
    t_covered: Optional[float] = None    # every shard had a saved JIT checkpoint
    t_killed: Optional[float] = None     # old workers gone
    checkpoint_bytes: int = 0
    save_s: Optional[float] = None
    saved_ranks: list = field(default_factory=list)
    failed_ranks: list = field(default_factory=list)
    detect_s: float = 0.0                # failure -> detection, when known (a hang: its timeout)
    reporter: Optional[int] = None       # the healthy rank that detected it (a hang, an error)
    first_kind: Optional[str] = None     # of the failure this one interrupted the recovery from
    during_recovery: int = 0             # how many failures in a row hit the recovery

    @property
    def label(self) -> str:
        """The kind, and for failures during a recovery which one, once (not chained)."""
        n = self.during_recovery
        if n == 0:
            return self.kind
        if n == 1:
            return f"{self.kind} during recovery from {self.first_kind}"
        nth = {2: "2nd", 3: "3rd"}.get(n, f"{n}th")
        return f"{self.kind}, the {nth} failure during recovery from {self.first_kind}"


class Launcher:
    """Runs one node's share of a job until it finishes or runs out of restarts."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        check_writable_dir(cfg.checkpoint_dir, "--checkpoint-dir")
        self.run_dir = Path(cfg.run_dir)
        # Creates run_dir; a full disk there costs the event log (kept in memory), not the job.
        self.events = EventLog(self.run_dir / "events.jsonl")
        self.metrics = None
        if cfg.metrics_port is not None:
            from jitckpt.observability.metrics import JobMetrics
            self.metrics = JobMetrics(port=cfg.metrics_port, addr=cfg.metrics_addr,
                                      token=os.environ.get("JITCKPT_METRICS_TOKEN") or None)
        self.coord = NodeCoordinator(cfg)
        self.display = StatusDisplay(enabled=cfg.status_interval > 0, interval=cfg.status_interval,
                                     hang_timeout=HangTimeout.parse(cfg.hang_timeout))
        self.pool: Optional[StandbyPool] = None
        self.workers: list[Worker] = []
        self.pending_summary: Optional[FailureRecord] = None
        self.restart_count = 0
        self.keeper: Optional[KeeperSupervisor] = None
        self.gen = 0  # process-group generation; --recovery stage advances it per replacement
        self.stage: Optional[StageGenerations] = None
        self._replacing: dict[int, tuple[str, float, float]] = {}  # rank -> (kind, t_detect, t_start)
        self.preempt_signal: Optional[int] = None  # the first SIGTERM/SIGINT (see run())
        self._stopping = False  # a second one arrived: stop at once
        if cfg.recovery == "stage":
            self.stage = StageGenerations(cfg, self.coord)
        if cfg.snapshot_every:
            self.keeper = KeeperSupervisor(run_dir=str(self.run_dir), node=cfg.node_rank,
                                           python=sys.executable, env=self._base_env())

    # ---- events ---------------------------------------------------------------------------
    def emit(self, event: str, **fields) -> None:
        rec = self.events.emit(event, **fields)
        if self.metrics is not None:
            self.metrics.record_event(rec)

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
            self.pool = StandbyPool(size=cfg.nproc_per_node * cfg.warm_standby, env=env,
                                    python=sys.executable)
            # The first generation's workers and the standbys for the first restart import torch
            # together, before training starts: a failure early in the job still restarts warm.
            self.pool.fill(extra=cfg.nproc_per_node)
        try:
            gen = 0  # whole-job launches (the coordinator's generations)
            while True:
                self.gen = self.stage.for_launch(gen) if self.stage is not None else gen
                self.events.gen = self.gen
                if self.preempt_signal is not None:  # arrived between two generations
                    return self._end_preempted()
                if not self._ensure_keeper():
                    self.emit("job_end", status="failed", exit_code=1, restarts=self._restarts_used())
                    return 1
                ok = self._run_generation(gen)
                if ok:
                    self._prune_finished()
                    self.emit("job_end", status="ok", exit_code=0, restarts=self._restarts_used())
                    return 0
                if self.preempt_signal is not None:
                    return self._end_preempted()
                if self._restarts_used() >= cfg.max_restarts:
                    log.error("job failed and --max-restarts=%d is used up", cfg.max_restarts)
                    self.emit("job_end", status="failed", exit_code=1, restarts=self._restarts_used())
                    return 1
                self.restart_count += 1
                gen += 1
                self._replacing.clear()  # killed with the rest; launch ``gen`` counts afresh
                self.emit("restart", reason="failure", restart_count=self._restarts_used())
        finally:
            self._stop_processes()
            self.coord.close()
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
        return True

    def _base_env(self) -> dict:
        env = dict(os.environ)
        pkg_parent = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
        # Restarted gloo workers must not read a previous generation's peer addresses.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(self.cfg.omp_num_threads))
        if self.cfg.nnodes == 1:  # one node: gloo's own sockets on loopback too, as the store's
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return env

    def _rank_env(self, spec: WorkerSpec, local_rank: int, master: tuple[str, int]) -> dict:
        """torchrun's variables for the rank, as torchrun sets them (scripts and
        ``init_process_group`` read them); jitckpt's own settings are in ``spec``."""
        cfg = self.cfg
        rank, gen = spec.rank, spec.gen
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(cfg.world_size),
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node), "GROUP_RANK": str(cfg.node_rank),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(cfg.world_size), "ROLE_NAME": "default",
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
            "TORCHELASTIC_RESTART_COUNT": str(gen), "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
            "TORCHELASTIC_RUN_ID": cfg.run_id,
            # Python workers: rank 0's process serves the store on MASTER_ADDR only (every rank a
            # client), not torch's server on every interface (jitckpt.runtime.generation_store).
            "TORCHELASTIC_USE_AGENT_STORE": str(not cfg.no_python),
        }
        if cfg.preload:
            env["LD_PRELOAD"] = cfg.preload
        return env

    def _worker_spec(self, gen: int, local_rank: int, role: str) -> WorkerSpec:
        """What this launcher tells the rank, once, validated."""
        cfg = self.cfg
        snapshot = stage = None
        if self.keeper is not None:
            snapshot = SnapshotSpec(socket=self.keeper.socket_path, every=cfg.snapshot_every,
                                    protection=str(cfg.snapshot_protection),
                                    flush_every=cfg.snapshot_flush_every,
                                    ranks_per_node=cfg.nproc_per_node)
        if self.stage is not None:
            stage = self.stage.worker_spec(role)
        return WorkerSpec(rank=cfg.node_rank * cfg.nproc_per_node + local_rank,
                          world_size=cfg.world_size, gen=gen, checkpoint_dir=cfg.checkpoint_dir,
                          run_dir=str(self.run_dir), hang_timeout=cfg.hang_timeout,
                          periodic_every=cfg.periodic_every, save_timeout=cfg.save_timeout,
                          plugins=cfg.plugins, host_store=not cfg.no_python, snapshot=snapshot,
                          stage=stage)

    def _start_workers(self, launch: int, master: tuple[str, int]) -> None:
        role = "initial" if launch == 0 else "restart"
        self.workers = [self._start_worker(self.gen, lr, master, role)
                        for lr in range(self.cfg.nproc_per_node)]

    def _start_worker(self, gen: int, local_rank: int, master: tuple[str, int],
                      role: str) -> Worker:
        cfg = self.cfg
        spec = self._worker_spec(gen, local_rank, role)
        env = self._rank_env(spec, local_rank, master)
        rank = spec.rank
        if cfg.no_python:  # no Python to send the spec to: libjit.so reads the environment
            parent, child = channel_pair()
            full_env = {**self._base_env(), **env, **spec.to_env(), ENV_FD: str(child.fileno())}
            proc = subprocess.Popen([cfg.script, *cfg.script_args], env=full_env,
                                    pass_fds=(child.fileno(),), start_new_session=True)
            child.close()
            w = Worker(rank, local_rank, proc, parent, warm=False)
        else:
            assert self.pool is not None
            proc, ch, warm = self.pool.take()
            argv = [cfg.script, *cfg.script_args]
            ch.send(Assign(env=env, argv=argv, cwd=os.getcwd(), module=cfg.module,
                           spec=spec.to_dict()))
            w = Worker(rank, local_rank, proc, ch, warm=warm)
        self.emit("worker_start", rank=rank, pid=proc.pid, warm=w.warm, role=role)
        return w

    def _replace_worker(self, launch: int, old: Worker, master: tuple[str, int],
                        sel: selectors.BaseSelector) -> bool:
        """--recovery stage: start a replacement for the dead ``old`` and keep the survivors.

        Refused (the caller falls back to the whole-job recovery) when restarts are used up, a
        rank already stands at the exit barrier (it no longer takes part in a recovery), or
        a replacement (another stage's, or ``old`` itself) is still catching up: the survivors
        wait for it in a process group that cannot form (see :class:`StageGenerations`).
        """
        if (self.stage is None or self._restarts_used() >= self.cfg.max_restarts
                or any(w.exit_ready for w in self.workers)):
            return False
        kind, detail = _death(old)
        gen = self.stage.replace(old.rank, launch)
        if gen is None:
            log.warning("rank %d died (%s) while another stage's replacement is still catching up "
                        "from the logs; restarting every rank from the global checkpoint",
                        old.rank, detail)
            return False
        log.warning("rank %d died (%s); replacing it alone (--recovery stage)", old.rank, detail)
        t_detect = time.time()
        self.emit("failure_detected", kind=kind, rank=old.rank, node=self.cfg.node_rank,
                  pid=old.proc.pid, detail=detail, reporter=None)
        self.gen = gen
        self.events.gen = self.gen
        new = self._start_worker(self.gen, old.local_rank, master, "replacement")
        self.stage.announce(self.gen, old.rank)
        self.emit("stage_replaced", rank=old.rank, generation=self.gen,
                  restart_count=self._restarts_used())
        self._replacing[old.rank] = (kind, t_detect, time.time())
        old.channel.close()
        self.workers[self.workers.index(old)] = new
        sel.register(new.channel.fileno(), selectors.EVENT_READ, new)
        if self.pool is not None:
            self.pool.fill()  # the next replacement starts warm too
        return True

    # ---- one generation ---------------------------------------------------------------------
    def _run_generation(self, gen: int) -> bool:
        master = self.coord.begin_generation(gen)
        t_start = time.time()
        self._start_workers(gen, master)
        if self.pending_summary is not None:
            self.pending_summary.t_killed = self.pending_summary.t_killed or t_start
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
                timeout = 0.2
                for key, _ in sel.select(timeout):
                    w = key.data
                    if w is None:
                        info = self.coord.read_remote_failure(gen)
                        if info is not None and info["kind"] == "preempted":
                            self.preempt_signal = self.preempt_signal or signal.SIGTERM
                        elif info is not None and failure is None:
                            failure = self._on_failure(gen, info["kind"], info.get("rank"),
                                                       info.get("detail", ""), remote=True,
                                                       reporter=info.get("reporter"))
                        continue
                    msg = w.channel.recv(timeout=5.0)
                    if msg is None:
                        sel.unregister(key.fd)
                        w.eof = True
                        self._reap(w)
                        if (failure is not None and w.exit_code not in NOT_A_CULPRIT
                                and w.rank not in failure.failed_ranks):
                            failure.failed_ranks.append(w.rank)  # the culprit, seen after a peer's report
                        if (w.exit_code not in (0, EXIT_JIT_SAVED) and failure is None
                                and not verdict_sent):  # after the verdict: see below
                            if self._replace_worker(gen, w, master, sel):
                                continue
                            kind, detail = _death(w)
                            failure = self._on_failure(gen, kind, w.rank, detail)
                            for rank, (_, t_detect, _) in self._replacing.items():
                                # --recovery stage fell back: a death still being replaced is
                                # part of this failure (and was detected first).
                                if rank not in failure.failed_ranks:
                                    failure.failed_ranks.append(rank)
                                failure.t_detect = min(failure.t_detect, t_detect)
                        continue
                    failure = self._on_message(gen, w, msg, failure)
                    while w.channel.buffered():  # one socket read can carry several messages
                        failure = self._on_message(gen, w, w.channel.recv(), failure)
                # Periodic checks.
                for w in self.workers:
                    if not w.eof and w.exit_code is None and w.proc.poll() is not None:
                        w.exit_code = w.proc.returncode
                self.display.maybe_show(gen, self.workers, failure)
                if (not refilled and self.pool is not None and gen > 0
                        and all(w.step is not None and w.step >= 0 for w in self.workers)):
                    self.pool.fill()  # once training runs, not competing with the workers' start
                    refilled = True
                if (refilled or gen == 0) and not pool_ready and self.pool is not None:
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
                    if (all(w.exit_code is not None for w in self.workers)
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
                        failure = self._on_failure(gen, "exit", None, f"exit codes {codes}")
                    continue
                if self._recovery_can_proceed(gen, failure):
                    break
        finally:
            sel.close()
        self._kill_all()
        if preempt_deadline is not None:
            self._report_preemption(failure)
            return verdict_sent  # every rank had finished: the job is done
        failure.t_killed = time.time()
        self._finish_failure(gen, failure)
        return False

    def _preempt_workers(self, gen: int,
                         failure: Optional[FailureRecord]) -> FailureRecord:
        """Tell every live worker (and the other nodes) to save a JIT checkpoint now."""
        name = signal.Signals(self.preempt_signal).name
        log.warning("%s: every worker saves a JIT checkpoint, then the job stops (send it "
                    "again to stop at once)", name)
        if failure is not None:
            return failure  # a recovery is under way: its workers are saving already
        detail = f"received {name}"
        for w in self.workers:
            if w.exit_code is None and not w.eof:
                w.channel.send(SaveNow(kind="preempted", rank=None, detail=detail))
        self.coord.announce_failure(gen, {"kind": "preempted", "rank": None, "detail": detail})
        return FailureRecord(gen=gen, kind="preempted", rank=None, detail=detail,
                             t_detect=time.time())

    def _report_preemption(self, failure: Optional[FailureRecord]) -> None:
        saved = set(failure.saved_ranks) if failure is not None else set()
        unsaved = sorted(w.rank for w in self.workers if w.rank not in saved)
        if failure is not None and unsaved:
            log.warning("preempted: rank(s) %s saved no JIT checkpoint (stopped, hung, or too "
                        "slow); the next run resumes from the newest complete checkpoint", unsaved)

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
                kind, detail = _death(w)
                log.warning("rank %d %s after every rank finished; the job is complete", w.rank,
                            "was " + detail if kind == "signal" else "exited with " + detail)
                self.emit("death_after_verdict", rank=w.rank, pid=w.proc.pid, detail=detail)

    def _all_exit_ready(self, gen: int) -> bool:
        local = all(w.exit_ready for w in self.workers)
        return local and self.coord.all_exit_ready(gen)

    # ---- messages ---------------------------------------------------------------------------
    def _on_message(self, gen: int, w: Worker, msg: Message,
                    failure: Optional[FailureRecord]) -> Optional[FailureRecord]:
        if isinstance(msg, Status):  # every step; step_time only in a sample every ~0.5 s
            w.step = msg.step
            if msg.step_time is not None:
                w.step_time = msg.step_time
                if w.rank == 0:
                    self.emit("step", rank=w.rank, step=w.step, step_time=w.step_time)
            if failure is not None and w.step is not None:  # minibatches begun until stopped
                failure.step_failed = max(failure.step_failed or 0, w.step)
        elif isinstance(msg, Hello):
            if w.step is None:
                w.step = -1
        elif isinstance(msg, FailureReport) and msg.kind == "preempted":
            # The worker itself got SIGTERM/SIGINT (e.g. SLURM signals every process of a job
            # step): the whole job is being preempted, not a failure to recover from.
            self.preempt_signal = self.preempt_signal or signal.SIGTERM
        elif isinstance(msg, FailureReport):
            if failure is None:
                # A rank's own exception names itself; a hang or collective error is reported
                # by a healthy rank that waited on the failed one, which it names when it knows.
                culprit = msg.rank if msg.kind == "exception" else msg.culprit
                failure = self._on_failure(gen, msg.kind, culprit, msg.detail, reporter=w.rank)
            if msg.step is not None:
                failure.step_failed = max(failure.step_failed or 0, msg.step)
            if msg.detect_s is not None:
                failure.detect_s = max(failure.detect_s, float(msg.detect_s))
        elif isinstance(msg, Saved):
            self.emit("checkpoint_saved", rank=w.rank, step=msg.step, bytes=msg.bytes,
                      seconds=msg.seconds, path=msg.path, kind=msg.kind, undone=msg.undone)
            if msg.kind == "jit":
                self.coord.report_saved(gen, msg.shard_id, msg.num_shards, w.rank)
                if failure is not None:
                    failure.saved_ranks.append(w.rank)
                    failure.checkpoint_bytes = max(failure.checkpoint_bytes, msg.bytes)
                    failure.save_s = max(failure.save_s or 0.0, msg.seconds)
            if failure is not None:  # the state saved is at least as far as the failed step
                failure.step_failed = max(failure.step_failed or 0, msg.step)
        elif isinstance(msg, SaveFailed):
            self.emit("checkpoint_failed", rank=w.rank, reason=msg.reason, kind=msg.kind, step=msg.step)
            if failure is not None and msg.kind == "jit" and msg.step is not None:
                failure.step_failed = max(failure.step_failed or 0, msg.step)
        elif isinstance(msg, WorkerWarning):
            self.emit("warning", rank=w.rank, reason=msg.reason)
        elif isinstance(msg, Restored):
            w.restored = msg
            self.emit("restore", rank=w.rank, step=msg.step, path=msg.path, seconds=msg.seconds,
                      source=msg.source, decoded=msg.decoded, fetched=msg.fetched)
        elif isinstance(msg, Resumed):
            w.resumed = True
            self._maybe_emit_summary(gen)
        elif isinstance(msg, StageCaughtUp):
            self._stage_summary(gen, w, msg)
        elif isinstance(msg, ExitReady):
            w.exit_ready = True
            w.exit_step = msg.step
            self.coord.report_exit_ready(gen, w.rank)
            if failure is None and not all(x.exit_ready for x in self.workers):
                # Peers that then wait for this rank in a collective report its early exit.
                for x in self.workers:
                    if not x.exit_ready and x.exit_code is None and not x.eof:
                        x.channel.send(PeerExit(rank=w.rank, step=w.exit_step))
        return failure

    def _on_failure(self, gen: int, kind: str, rank: Optional[int], detail: str, *,
                    reporter: Optional[int] = None, remote: bool = False) -> FailureRecord:
        """Record a failure of ``rank`` (None: not known yet) and tell every other worker.

        ``reporter`` is the healthy rank that detected it (a hang or a collective error); it is
        never taken for the failed rank."""
        now = time.time()
        steps = [w.step for w in self.workers if w.step is not None and w.step >= 0]
        rec = FailureRecord(gen=gen, kind=kind, rank=rank, detail=detail, t_detect=now,
                            step_failed=max(steps) if steps else None, reporter=reporter)
        if rank is None and reporter is not None and not all(w.exit_ready for w in self.workers):
            # Ranks that already left (exit barrier) while the others hang waiting for them.
            rec.failed_ranks.extend(w.rank for w in self.workers if w.exit_ready)
        elif rank is not None:
            rec.failed_ranks.append(rank)
        if rank is not None:
            by = f" (detected by rank {reporter})" if reporter not in (None, rank) else ""
            log.warning("failure detected (%s) on rank %d%s: %s", kind, rank, by, detail)
        elif rec.failed_ranks:
            log.warning("failure detected (%s) by rank %d: %s; rank(s) %s left the job before it "
                        "finished", kind, reporter, detail, rec.failed_ranks)
        elif reporter is not None:
            log.warning("failure detected (%s) by rank %d, failed rank not known yet: %s", kind,
                        reporter, detail)
        else:
            log.warning("failure detected (%s) on unknown rank: %s", kind, detail)
        self.emit("failure_detected", kind=kind, rank=rank, node=self.cfg.node_rank,
                  pid=self._pid_of(rank), detail=detail, reporter=reporter)
        for w in self.workers:
            if w.exit_code is None and not w.eof and w.rank not in rec.failed_ranks:
                w.channel.send(SaveNow(kind=kind, rank=rank, detail=detail))
        if not remote:
            self.coord.announce_failure(gen, {"kind": kind, "rank": rank, "detail": detail,
                                              "reporter": reporter})
        return rec

    def _stage_summary(self, launch: int, w: Worker, msg: dict) -> None:
        """A replacement replayed up to the survivors: log its recovery (one rank redid steps)."""
        pending = self._replacing.pop(w.rank, None)
        if pending is None:
            return
        self.stage.caught_up(launch)
        kind, t_detect, t_start = pending
        now = time.time()
        summary = dict(failure_kind=kind, failed_ranks=[w.rank], detect_s=0.0, save_s=0.0,
                       restart_s=t_start - t_detect, restore_s=now - t_start,
                       total_s=now - t_detect, checkpoint_bytes=0, step_failed=None,
                       step_resumed=msg.checkpoint, steps_redone=msg.replayed,
                       scope="stage")
        self.emit("recovery_summary", **summary)
        self.display.show_summary(summary)

    def _pid_of(self, rank: Optional[int]) -> Optional[int]:
        for w in self.workers:
            if w.rank == rank:
                return w.proc.pid
        return None

    def _recovery_can_proceed(self, gen: int, failure: FailureRecord) -> bool:
        """All local workers gone, or every shard covered plus a short grace for more replicas."""
        now = time.time()
        if all(w.exit_code is not None for w in self.workers):
            if failure.t_covered is None and self.coord.shards_covered(gen):
                failure.t_covered = now
            return self.coord.node_done(gen, ok=False, wait=True)
        if failure.t_covered is None and self.coord.shards_covered(gen):
            failure.t_covered = now
        if failure.t_covered is not None:
            grace = max(1.0, failure.save_s or 0.0)
            if now - failure.t_covered > grace:
                return True
        if now - failure.t_detect > self.cfg.save_timeout:
            log.error("no complete JIT checkpoint from every shard within %.0fs; restarting from "
                      "the newest complete checkpoint", self.cfg.save_timeout)
            return True
        return False

    def _reap(self, w: Worker) -> None:
        try:
            w.exit_code = w.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            w.kill()
            w.exit_code = w.proc.wait(timeout=5.0)

    def _kill_all(self) -> None:
        for w in self.workers:
            w.kill()
        for w in self.workers:
            try:
                w.exit_code = w.proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not die after SIGKILL", w.proc.pid)
            w.channel.close()

    # ---- recovery summary -----------------------------------------------------------------
    def _finish_failure(self, gen: int, failure: FailureRecord) -> None:
        prev = self.pending_summary
        if prev is not None:
            # A failure during the recovery from an earlier one: report them as one recovery,
            # from the first detection, counting the steps lost since the first failure.
            failure.t_detect = prev.t_detect
            failure.detect_s = max(failure.detect_s, prev.detect_s)
            failure.first_kind = prev.first_kind or prev.kind
            failure.during_recovery = prev.during_recovery + 1
            steps = [s for s in (failure.step_failed, prev.step_failed) if s is not None]
            failure.step_failed = max(steps) if steps else None
            failure.failed_ranks = sorted(set(prev.failed_ranks) | set(failure.failed_ranks))
        self.pending_summary = failure
        for w in self.workers:
            if w.exit_code not in (*NOT_A_CULPRIT, None) and w.rank not in failure.failed_ranks:
                if w.rank not in failure.saved_ranks and (not w.killed or failure.kind == "hang"):
                    # Died on its own, or (after a hang) was still silent when killed: a culprit.
                    failure.failed_ranks.append(w.rank)
        # Said before run() decides, so that nothing announces a restart that does not come.
        restarting = (self.preempt_signal is None
                      and self._restarts_used() < self.cfg.max_restarts)
        self.display.show_failure(failure, restarting=restarting)

    def _maybe_emit_summary(self, gen: int) -> None:
        f = self.pending_summary
        if f is None or not all(w.resumed for w in self.workers):
            return
        now = time.time()
        restored = [w.restored for w in self.workers if w.restored is not None]
        # A worker that restored nothing (no checkpoint was left) starts from step 0.
        step_resumed = min(w.restored.step if w.restored is not None else 0 for w in self.workers)
        restore_s = max((r.seconds or 0.0 for r in restored), default=0.0)
        detect_s = f.detect_s
        save_s = (f.t_covered - f.t_detect) if f.t_covered else None
        restart_s = now - (f.t_killed or now)
        redone = None
        if f.step_failed is not None:  # the failed minibatch and every one since the restore point
            redone = max(0, f.step_failed - step_resumed) + 1
        summary = dict(failure_kind=f.label, failed_ranks=sorted(f.failed_ranks), detect_s=detect_s,
                       save_s=save_s, restart_s=restart_s, restore_s=restore_s,
                       total_s=now - f.t_detect, checkpoint_bytes=f.checkpoint_bytes,
                       step_failed=f.step_failed, step_resumed=step_resumed, steps_redone=redone)
        self.emit("resumed", step=step_resumed, steps_redone=redone)
        self.emit("recovery_summary", **summary)
        self.display.show_summary(summary)
        self.pending_summary = None
        if self.cfg.node_rank != 0:
            return
        try:
            prune(self.cfg.checkpoint_dir, older_than_step=step_resumed)
        except OSError as e:
            log.warning("could not prune old checkpoints: %s", e)


def run(cfg: LaunchConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="[jitckpt] %(message)s")
    try:
        launcher = Launcher(cfg)
    except (ValueError, OSError) as e:  # e.g. a metrics address that needs a token, a busy port
        print(f"jitckpt run: error: {e}", file=sys.stderr)
        return 2
    return launcher.run()
