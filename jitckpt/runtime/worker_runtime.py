"""The in-worker side of jitckpt: failure detection, the consistent-state save, the exit barrier.

One :class:`WorkerRuntime` per training process. It learns of a failure in four ways: a wrapped
collective (or backward) raises a transport error; the watchdog sees a blocking region outlive the
hang timeout; the launcher reports that another worker died; or the native interposer (libjit.so)
reports a hung NCCL collective. It then saves a just-in-time checkpoint from a consistent state and
exits with :data:`EXIT_JIT_SAVED`, or, with ``--recovery inprocess``, leaves the user's script and
lets the process run it again (:mod:`jitckpt.runtime.inprocess`).

Consistency rule: parameters and optimizer state change only inside ``optimizer.step()``. The save
runs either on the main thread at a safe point (entering or leaving a collective or backward, the
optimizer pre-step hook, a step boundary, interpreter exit), or on a helper thread while the main
thread is blocked inside a collective or backward (it is then held there: a region that ends after
a failure parks instead of returning). It never runs during the optimizer phase.
"""
from __future__ import annotations

import atexit
import faulthandler
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Callable, Optional

from jitckpt.checkpoint_store import (CheckpointError, find_latest, quarantine, read_meta, resume_path,
                               write_checkpoint)
from jitckpt.runtime.collective_hooks import CollectiveHooks, run_region
from jitckpt.runtime import group_sockets
from jitckpt.runtime.inprocess import InProcessRestart
from jitckpt.runtime.peer_failure import is_collective_failure
from jitckpt.protocol.control_channel import ControlChannel
from jitckpt.protocol.step_board import StepBoard
from jitckpt.protocol.control_messages import (Assign, ExitReady, FailureReport, Hello, PeerExit, RankLost, Restored,
                                               Resumed, Saved, SaveFailed, SaveNow, Unwind, Verdict, WorkerWarning)
from jitckpt.plugins import get as get_plugins
from jitckpt.torch_compat import require_supported_torch
from jitckpt.hang_timeout import HangTimeout
from jitckpt.runtime.save_reserve import SaveReserve
from jitckpt.runtime.shard_parts import PartFill, node_of_rank
from jitckpt.runtime.watchdog import DurationHistory, Watchdog
from jitckpt.console_log import configure as configure_console_log

log = logging.getLogger("jitckpt.worker")

from jitckpt.protocol.worker_spec import WorkerSpec
from jitckpt.protocol.exit_codes import EXIT_JIT_SAVED, EXIT_LAUNCHER_GONE, EXIT_NO_SAVE

# Failures that leave every rank alive: the minibatch under way can still finish, and every replica
# then saves the same step at its next safe point rather than the minibatch's start.
MINIBATCH_CAN_FINISH = ("preempted", "snapshot")
# A rank blocked this long in a collective after a peer reached its exit barrier waits for it in
# vain (see WorkerRuntime._on_peer_exit).
PEER_EXIT_GRACE = 5.0
SAVER_TOKEN = -1  # region_enter's token for a wait inside a checkpoint write
# In-process recovery: how long a helper thread that saved waits for the training thread to leave
# the collective it is stuck in (the failed rank is killed, so gloo raises there within moments).
UNWIND_GRACE = 10.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class WorkerRuntime:
    """Failure handling for one worker process (created by ``jitckpt.init`` or the standby)."""

    def __init__(self, *, rank: int, world_size: int, gen: int, checkpoint_dir: str,
                 hang_timeout: HangTimeout, channel: Optional[ControlChannel],
                 board: Optional[StepBoard] = None, periodic_every: int = 0,
                 save_timeout: float = 120.0, plugins: tuple[str, ...] = ()) -> None:
        if periodic_every < 0:
            raise ValueError(f"periodic_every must be >= 0, got {periodic_every}")
        self.rank, self.world_size, self.gen = rank, world_size, gen
        self.checkpoint_dir = checkpoint_dir
        self.channel = channel
        self.board = board  # the step this rank began, for the launcher: no message per step
        self.periodic_every = periodic_every
        self.save_timeout = save_timeout
        self.plugins = get_plugins(plugins)  # jitckpt run --plugin: their hooks run at protect()
        # A region blocked this long after a failure is taken as stuck: save while it is held.
        self.blocked_grace = 2.0
        self.save_fn: Optional[Callable[[str], Optional[str]]] = None
        # Why this job's failures take no JIT save (a preemption's still does, with a save function).
        self.no_save_reason: Optional[str] = None
        self._saver_ident: Optional[int] = None  # the thread writing a checkpoint now
        # A DTensor job's replicas (protect()): part_fn(replica id) chooses what the next write holds,
        # that replica's part of this rank's shard, and returns its (shard id, shard count).
        self.part_fn: Optional[Callable[[int], tuple[int, int]]] = None
        self.replica_ranks: tuple = ()  # the global rank of each replica of this rank's shard
        self._lost: set = set()  # ranks known lost since the failure (a survivor need not wait for them)
        # The minibatch goes on after optimizer.step() (a DTensor job's shard snapshot and its
        # agreement come after the scheduler's step): the board shows the next one once it is over.
        self.minibatch_open = False
        # A DTensor job (protect()): a preemption is saved at a minibatch boundary only, never in a
        # collective the main thread waits in, so that every rank's shard is of the same step.
        self.preempt_at_boundary = False
        # Shards that do not wait on each other within a minibatch (pipeline stages, DDP per stage):
        # a collective of every rank before each optimizer step, so that no shard's state moves to
        # the next minibatch while another's may still be held in this one (protect()).
        self.step_sync: Optional[Callable[[], None]] = None
        # Such a job's save to memory after a failure (protect(), --snapshot-zero log): what it did.
        self.save_to_memory: Optional[Callable[[], str]] = None
        self._memory_save_lock = threading.Lock()  # the saver and the training thread may both give up
        self._memory_saved: Optional[str] = None
        self.step_fn: Optional[Callable[[], int]] = None
        self.consistency_check: Optional[Callable[[], bool]] = None
        # protect(): True while the training thread computes a minibatch without touching the
        # saved state (forward/backward): a failure's save need not wait for it to block.
        self.saveable_while_running: Optional[Callable[[], bool]] = None
        self.save_reserve = SaveReserve(checkpoint_dir)  # page-cache pages for the JIT save
        self._jit_saving = False
        self._reserve_used = False
        # A JIT save begun while the main thread still computes its minibatch: set once written.
        self._speculation: Optional[threading.Event] = None
        # The main thread's minibatch can finish: its backward (DDP's all-reduce) completed, or
        # it reached optimizer.step(). A speculative save then yields to the minibatch's end.
        self._moved_on = False
        # --plugin undo: puts a torn state (interrupted optimizer step, or its minibatch unfinished)
        # back to the start of the minibatch; returns the number of parameters undone.
        self.roll_back: Optional[Callable[[], int]] = None
        self.shard_id, self.num_shards, self.replica_id = 0, 1, rank

        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._regions: dict[int, tuple[str, float, bool]] = {}  # kind, start, on the main thread
        self._in_optimizer = False
        self._failure: Optional[dict] = None
        self._failure_evt = threading.Event()
        self._verdict_evt = threading.Event()
        self._save_claimed = False
        self._history = DurationHistory(hang_timeout)
        self._hooks = CollectiveHooks(self, resuming=self._resuming_from_disk)
        self.ddp_init_sync = self._hooks.init_sync  # protect()'s restore settles what DDP deferred
        self.ddp_layouts = self._hooks.layouts  # saved with every checkpoint this rank writes
        self.ddp_buffers = self._hooks.buffers  # what a JIT save records of DDP buffers and RNG
        self._watchdog = Watchdog(oldest=self._oldest_region, history=self._history,
                                  on_hang=self._on_hang)
        self._restored_step: Optional[int] = None
        self._selected_path: Optional[str] = None  # what get_checkpoint_path() returned
        self._opt_steps = 0
        self._last_step: Optional[int] = None
        self._last_step_t = 0.0
        self._resumed_reported = False
        self._last_opt_t: Optional[float] = None
        self._warned = False
        self._peers_left: list[tuple[int, Optional[int], float]] = []  # (rank, step, monotonic t)
        self._exiting = False  # this rank reached its exit barrier
        self._latest: dict = {}
        self._native = None  # jitckpt._native when libjit.so is preloaded
        self._native_step: Optional[int] = None  # the minibatch libjit.so was last told began
        self.snapshots = None  # SnapshotTier when jitckpt run --snapshot-every is on
        self.spec: Optional[WorkerSpec] = None  # what the launcher (or the environment) said
        # --recovery inprocess: after its JIT save a survivor leaves the script instead of exiting
        # (jitckpt.runtime.inprocess); the training thread raises once _unwind is set.
        self.in_process = False
        self._unwind = threading.Event()
        self._unwind_ok = threading.Event()  # the launcher's Unwind: every survivor saved
        self._unwound = threading.Event()  # the training thread raised InProcessRestart
        self._retired = False  # the script ended for an in-process recovery: the next Assign is handed off
        self._handoff: Optional[queue.Queue] = None  # what the launcher sends then (its next Assign)
        self._previous_excepthook = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: WorkerSpec, channel: Optional[ControlChannel],
                  board: Optional[StepBoard] = None) -> "WorkerRuntime":
        """The runtime ``jitckpt run`` configured (the spec came with the rank's assignment)."""
        rt = cls(rank=spec.rank, world_size=spec.world_size, gen=spec.gen,
                 checkpoint_dir=spec.checkpoint_dir, hang_timeout=HangTimeout.parse(spec.hang_timeout),
                 channel=channel, board=board, periodic_every=spec.periodic_every,
                 save_timeout=spec.save_timeout, plugins=spec.plugins)
        rt.spec = spec
        rt.in_process = spec.in_process
        return rt

    @classmethod
    def from_env(cls) -> "WorkerRuntime":
        """A process the launcher did not start (torchrun, plain python): settings from the
        environment (:data:`jitckpt.protocol.worker_spec.ENVIRONMENT`)."""
        return cls.from_spec(WorkerSpec.from_env(os.environ), ControlChannel.from_env(), StepBoard.from_env())

    def start(self) -> None:
        configure_console_log(rank=self.rank, level=logging.WARNING)
        # A fatal signal (a segfault, or SIGABRT from a C++ std::terminate in a library) then
        # prints every thread's Python stack into the launcher's output: where it died.
        faulthandler.enable()
        require_supported_torch()
        self._hooks.install()
        if self.in_process:
            group_sockets.install()
        from jitckpt.runtime import ddp_layout
        from jitckpt.snapshot.tier import SnapshotTier

        snapshot = self.spec.snapshot if self.spec is not None else None
        self.snapshots = SnapshotTier.from_spec(snapshot, checkpoint_dir=self.checkpoint_dir, gen=self.gen)
        if self.snapshots is not None:
            # The resume point may be an in-memory snapshot: DDP's layout comes from it.
            ddp_layout.install_pinning(self.snapshots.ddp_layout)
        else:
            ddp_layout.install_pinning(lambda: ddp_layout.load(self.latest_checkpoint()))
        self._watchdog.start()
        if self.channel is not None:
            self.channel.send(Hello(rank=self.rank, pid=os.getpid(), gen=self.gen))
            threading.Thread(target=self._listen, name="jitckpt-control", daemon=True).start()
            atexit.register(self._exit_barrier)
            self._chain_excepthook()
        self._attach_native()
        from jitckpt.runtime import preemption_signals

        preemption_signals.catch(self._on_preemption_signal)

    def _on_preemption_signal(self, sig: signal.Signals) -> None:
        """SIGTERM/SIGINT (a scheduler's preemption, torchrun stopping its workers, Ctrl-C):
        save a JIT checkpoint and exit with EXIT_JIT_SAVED, as after a failure. Runs on a helper
        thread; the save itself happens where any failure's does (a safe point, or while the
        main thread is held in a blocking region). Once the job is done there is nothing to save."""
        if self._failure is not None or getattr(self, "_verdict_ok", False):
            return
        self.report_failure("preempted", f"received {sig.name}")

    def _chain_excepthook(self) -> None:
        """An uncaught exception in this rank is itself the failure: report it, skip the barrier."""
        previous = self._previous_excepthook = sys.excepthook
        # Every thread started from now on keeps the sys.excepthook of its start (threading does): a
        # weak reference, so that such a thread does not keep this runtime, and through its hooks the
        # script's model, alive after an in-process recovery.
        me = weakref.ref(self)

        def hook(etype, value, tb):  # type: ignore[no-untyped-def]
            rt = me()
            if rt is not None:
                rt._crashed = True
                rt._quarantine_if_unloadable(value, tb)
                if rt.channel is not None and rt._failure is None:
                    rt.channel.send(FailureReport(rank=rt.rank, kind="exception",
                                    detail=f"{etype.__name__}: {value}", step=rt.current_step()))
            previous(etype, value, tb)

        sys.excepthook = hook

    def _quarantine_if_unloadable(self, exc: BaseException, tb) -> None:  # type: ignore[no-untyped-def]
        """``jitckpt.init()`` users load the checkpoint themselves: if torch.load raised on the path
        get_checkpoint_path() returned, before any step ran, the checkpoint (not the job) is bad.
        Move it aside so the restart resumes from the next older complete one."""
        path = self._selected_path
        if path is None or self._last_step is not None or self._opt_steps or isinstance(exc, OSError):
            return
        frames = traceback.extract_tb(tb)
        if not any(f.filename.replace(os.sep, "/").endswith("torch/serialization.py") for f in frames):
            return
        try:
            quarantine(path, f"{type(exc).__name__}: {_first_line(exc)}")
        except (OSError, CheckpointError) as e:
            log.error("could not quarantine %s: %s", path, e)

    def _attach_native(self) -> None:
        """With libjit.so preloaded, NCCL hangs it detects come here too."""
        try:
            from jitckpt import _native  # type: ignore[attr-defined]
        except ImportError:
            return
        if not _native.preloaded():
            return
        try:
            _native.set_failure_callback(lambda kind, detail: self.report_failure(kind, detail))
        except RuntimeError as e:  # the signal libjit uses to take the GIL is already in use
            log.warning("libjit.so hang detection not attached: %s", e)
            return
        self._native = _native
        # The same policy; libjit.so adapts it to the NCCL collectives it sees, as the watchdog
        # here does to the regions it sees.
        _native.configure(hang_timeout=self._history.policy.to_text())

    def _native_phase(self, phase: str) -> None:
        if self._native is not None:
            self._native.set_phase(phase)

    # ---- the user-facing pieces -------------------------------------------------------------
    def set_save_fn(self, save_fn: Callable[[str], Optional[str]], *, step_fn=None, shard_id: int = 0,
                    num_shards: int = 1, replica_id: Optional[int] = None) -> None:
        if not callable(save_fn):
            raise TypeError("jitckpt.init(save_fn): save_fn must be callable as save_fn(path: str)")
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} must be in [0, num_shards={num_shards})")
        self.save_fn, self.step_fn = save_fn, step_fn
        self.shard_id, self.num_shards = shard_id, num_shards
        self.replica_id = self.rank // num_shards if replica_id is None else replica_id

    def watch_functional_collectives(self) -> None:
        """A DTensor job: its functional collectives' waits are regions too (see CollectiveHooks)."""
        self._hooks.install_functional_waits()

    def _resuming_from_disk(self) -> bool:
        """A checkpoint on disk will be resumed from (the in-memory tier decides collectively)."""
        return self.snapshots is None and self.latest_checkpoint() is not None

    def latest_checkpoint(self) -> Optional[str]:
        """The newest complete checkpoint, chosen once per process so every caller agrees."""
        key = (self.shard_id, self.num_shards)
        if key not in self._latest:
            found = find_latest(self.checkpoint_dir, shard_id=self.shard_id,
                                num_shards=self.num_shards)
            self._latest[key] = None if found is None else (str(found[0]), found[1].step)
        if self._latest[key] is None:
            return None
        path, step = self._latest[key]
        self._restored_step = step
        return path

    @property
    def selected_step(self) -> Optional[int]:
        """The step of latest_checkpoint()'s current choice (None: nothing to resume from)."""
        found = self._latest.get((self.shard_id, self.num_shards))
        return None if found is None else found[1]

    def reject_checkpoint(self, path: str, reason: str) -> Optional[str]:
        """``path`` verified but cannot be loaded: quarantine it and choose again.

        Returns the next choice: another replica's copy of the same step, or an older step.
        """
        quarantine(path, reason)  # None: another rank of this job moved it already
        self._latest.pop((self.shard_id, self.num_shards), None)
        self._restored_step = None
        return self.latest_checkpoint()

    def select_checkpoint(self) -> Optional[str]:
        """``jitckpt.get_checkpoint_path()``: the newest checkpoint, reported as the restore point."""
        path = self.latest_checkpoint()
        self._selected_path = path
        if path is None:
            return None
        if self._restored_step is not None:
            self.report_restored(path, self._restored_step, None)
        try:
            return resume_path(path)  # a framework's entry inside it (Trainer's checkpoint-<step>/)
        except CheckpointError:
            return path  # verified by latest_checkpoint(); a race with a quarantine reads as before

    def report_restored(self, path: str, step: int, seconds: Optional[float], *,
                        source: str = "disk", decoded: Optional[list] = None,
                        fetched: Optional[list] = None) -> None:
        self._restored_step = step
        if self.rank == 0:
            log.warning("%s", self._resume_line(path, step, source))
        if self.channel is not None:
            self.channel.send(Restored(rank=self.rank, step=step, path=path, seconds=seconds,
                              source=source, decoded=list(decoded or []), fetched=list(fetched or [])))

    def _resume_line(self, path: str, step: int, source: str) -> str:
        """One loud line: the step resumed, what it comes from, and which job wrote it."""
        try:
            meta = read_meta(path)
        except CheckpointError:
            return f"resuming from step {step}: {source} state {path}"
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta.created))
        what = {"jit": "JIT checkpoint", "periodic": "periodic checkpoint",
                "snapshot": "flushed snapshot"}.get(meta.kind, meta.kind)
        line = (f"resuming from step {step}: {what} of run {meta.run_id or '(unknown)'} "
                f"written {written} ({path})")
        current = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if current and meta.run_id != current:
            line += (f"; it is from an earlier job, not this run {current}: to start from scratch "
                     "use another --checkpoint-dir or --rdzv-id")
        return line

    def run_snapshot_op(self, fn: Callable[[], object], *, blocking: bool) -> object:
        """Run a snapshot call; its failure (keeper gone, a peer gone) is a failure of the job.

        Called at points where the protected state is consistent (start of a minibatch, before
        optimizer.step()): on an error this rank reports it, JIT-saves and exits. ``blocking``
        calls may wait on other ranks, so they run as a region (hang detection, save while held).
        """
        tok = self.region_enter("collective") if blocking else None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - reported as this job's failure
            if tok is not None:
                self.region_exit(tok, e)
            self.report_failure("snapshot", f"snapshot failed: {type(e).__name__}: {e}")
            self._save_and_exit(on_main=True)
        if tok is not None:
            self.region_exit(tok, None)
        return result

    def current_step(self) -> int:
        if self.step_fn is not None:
            return int(self.step_fn())
        if self._last_step is not None:
            return self._last_step
        return (self._restored_step or 0) + self._opt_steps

    def mark_step(self, step: int) -> None:
        """A minibatch boundary: a safe point, the status heartbeat and the periodic tier."""
        if self._failure_evt.is_set():
            self._save_and_exit(on_main=True)
        with self._lock:
            self._moved_on = False  # a new minibatch: its collectives are still ahead
        if self._native is not None:
            self.begin_minibatch(step)  # a no-op when protect() began it already, before its input copies
            self._native.set_phase("forward")
        now = time.monotonic()
        prev_t, prev = self._last_step_t, self._last_step
        self._last_step, self._last_step_t = step, now
        if self.channel is not None and not self._resumed_reported and prev is not None:
            self._resumed_reported = True
            self.channel.send(Resumed(rank=self.rank, step=step))
        self._heartbeat(step, (now - prev_t) if prev is not None else None)
        if (self.periodic_every and step > 0 and step % self.periodic_every == 0
                and step != self._restored_step and (self.replica_id == 0 or self.part_fn is not None)):
            if self.save_fn is not None:
                self._periodic_save(step)
            else:
                self._warn_once(f"--periodic-every {self.periodic_every}: no periodic checkpoint is "
                                "taken: no save function is registered (call jitckpt.init(save_fn) "
                                "or jitckpt.protect())")

    def begin_minibatch(self, step: int) -> None:
        """Minibatch ``step``'s device work starts here: libjit.so's minibatch mark (proxy mode's
        replay journal keeps what comes after it, ``jitckpt/marks.h``), once per minibatch.

        It must come before the batch's host-to-device copies: a replay of the minibatch starts from
        the buffers as they are at the failure, and the forward may have rewritten its input buffer
        in place since. ``protect()`` calls this when the previous ``optimizer.step()`` returns and
        when it restores; ``mark_step`` calls it for a ``jitckpt.init()`` job (at the top of the
        iteration), where it is a no-op if ``protect()`` began the minibatch already."""
        if self._native is None or self._native_step == step:
            return
        self._native.mark_minibatch(step)
        self._native_step = step

    def close_minibatch(self, step: int) -> None:
        """The minibatch left open after its optimizer step is over: the next one, ``step``, is
        what a failure from here on hits (see ``minibatch_open``)."""
        self.minibatch_open = False
        self._heartbeat(step, None)

    def _heartbeat(self, step: int, step_time: Optional[float]) -> None:
        """Tell the launcher every step begun: it needs the step a failure hit even when the ranks
        die with it. On the step board: two memory writes, no message, no launcher wake-up."""
        if self.board is not None:
            self.board.post(step, step_time)

    def _warn_once(self, reason: str) -> None:
        """A flag this job cannot honour: said once, on the console and in the event log."""
        if self._warned:
            return
        self._warned = True
        self._warn(reason)

    def _warn(self, reason: str) -> None:
        """Said by the launcher (console and event log) when there is one: the worker's own output
        may be redirected to a file."""
        if self.channel is not None:
            self.channel.send(WorkerWarning(rank=self.rank, reason=reason))
        else:
            log.warning("%s", reason)

    def report_fresh_start(self, step: int, why: str) -> None:
        """Checkpoints were found but none could be used: training starts again at ``step``."""
        if self.rank == 0:  # every rank chose alike; one line is enough
            self._warn(f"no usable checkpoint is left ({why}): training starts again from step {step}")

    # ---- region tracking (called by CollectiveHooks on the calling thread) --------------------
    def _torn(self) -> bool:
        """Whether the state is mid-update now (``protect`` knows; else only inside a step: the
        optimizer's hooks, or a failure libjit.so found in the optimizer phase: a native program's
        ``jitckpt_mark_optimizer_step()`` to its next minibatch mark)."""
        return (self._in_optimizer or self._native_failure_in_optimizer()
                or (self.consistency_check is not None and not self.consistency_check()))

    def _native_failure_in_optimizer(self) -> bool:
        """libjit.so's failure was in work posted in the optimizer phase (a hung collective's own
        phase, not the phase its host thread has moved on to: an optimizer step queued behind a
        collective posted before it has not run)."""
        if self._native is None:
            return False
        failure = self._native.status().get("last_error")
        return isinstance(failure, dict) and failure.get("phase") == "optimizer"

    def _consistent(self) -> bool:
        """Whether this thread may save now: the state is not torn, or --plugin undo will roll it
        back first and this is the main thread (the one that mutates it, so it is not mid-update)."""
        if not self._torn():
            return True
        return self.roll_back is not None and threading.current_thread() is threading.main_thread()

    def region_enter(self, kind: str) -> int:
        if threading.get_ident() == self._saver_ident:
            return SAVER_TOKEN  # the save's own waits (DCP's write futures): it must not park itself
        if self._failure_evt.is_set() and self._consistent() and not self._waits_for_boundary():
            self._save_and_exit(on_main=True)
        tok = next(self._ids)
        with self._lock:
            self._regions[tok] = (kind, time.monotonic(), threading.current_thread() is threading.main_thread())
        self._native_phase("backward" if kind == "backward" else "allreduce")
        return tok

    def region_exit(self, token: int, exc: Optional[BaseException]) -> None:
        if token == SAVER_TOKEN:
            return
        with self._lock:
            kind, start, on_main = self._regions.pop(token, ("?", time.monotonic(), False))
            held = self._save_claimed  # another thread is saving: stay inside, params untouched
            if exc is None and kind == "backward" and on_main:
                self._moved_on = True  # DDP's gradient all-reduce is done: this minibatch can finish
        if held:
            self._park()
        if exc is not None and is_collective_failure(exc):
            # Between optimizer.step() and the end of the minibatch (e.g. a scheduler step still
            # pending) the state is torn: report, but let the error reach the user's code.
            self.report_failure("error", f"{kind} raised {type(exc).__name__}: {exc}",
                                on_main=self._consistent())
        if exc is None:
            # A collective that completed had every rank's input: its result is valid, so after
            # a failure elsewhere the main thread may still finish this minibatch and save at the
            # next safe point, losing less work.
            self._history.add(kind, time.monotonic() - start)

    def optimizer_pre_step(self) -> None:
        if self.step_sync is not None:  # before the optimizer phase: a failure in it saves this minibatch's start
            run_region(self, "collective", self.step_sync)
        self._native_step = None  # the next minibatch gets its own mark, whatever step it is given
        with self._lock:  # atomic with a saver's claim: it either sees this step begun or wins
            speculation, held = self._speculation, self._save_claimed
            self._moved_on = self._moved_on or not held  # its collectives completed: it can finish
            self._in_optimizer = speculation is None and not held
        if speculation is not None:
            speculation.wait()  # the speculative save reads the state this step updates
            with self._lock:
                held = self._save_claimed
                self._in_optimizer = not held
        if held:
            self._park()
        self._native_phase("optimizer")

    def optimizer_post_step(self) -> None:
        self._in_optimizer = False
        self._native_phase("idle")
        self._opt_steps += 1
        marked = self._last_step is not None  # mark_step() samples step times, takes periodic saves
        # Completed steps, the index of the minibatch that comes next: what the launcher needs
        # if this rank dies before it begins. (A user's step_fn counter is often bumped only
        # after optimizer.step() returns.)
        step = self.current_step()
        if not marked:
            step = max(step, (self._restored_step or 0) + self._opt_steps)
        now = time.monotonic()
        prev_t, self._last_opt_t = self._last_opt_t, now
        if self.channel is not None and not self._resumed_reported:  # the first step done after a restart
            self._resumed_reported = True
            self.channel.send(Resumed(rank=self.rank, step=step))
        if not self.minibatch_open:
            self._heartbeat(step, None if marked or prev_t is None else now - prev_t)
        if (not marked and self.periodic_every and self._opt_steps >= self.periodic_every
                and self.save_fn is not None and self.replica_id == 0):
            # No safe point is known: after optimizer.step() the user's step counter, scheduler and
            # data position may not be updated yet, and a save would mix two minibatches.
            self._warn_once(f"--periodic-every {self.periodic_every}: no periodic checkpoint is taken: "
                            "this job never calls jitckpt.mark_step(step), so jitckpt knows no point "
                            "where its state is consistent. Call jitckpt.mark_step(step) at the top "
                            "of each iteration (or use jitckpt.protect()); JIT checkpoints after a "
                            "failure are not affected")

    def _oldest_region(self) -> Optional[tuple[str, float]]:
        with self._lock:
            if not self._regions:
                return None
            kind, start, _ = min(self._regions.values(), key=lambda r: r[1])
        return kind, time.monotonic() - start

    # ---- failure handling ---------------------------------------------------------------
    def _on_hang(self, kind: str, age: float, limit: float) -> bool:
        if self._native_takes_hang(limit):
            return False
        self.report_failure("hang", f"{kind} blocked for {age:.1f}s (timeout {limit:.1f}s)",
                            detect_s=age)
        return True

    def _native_takes_hang(self, limit: float) -> bool:
        """Whether libjit.so in proxy mode recovers this region's hang transparently: a recovery is
        under way or just ended, or one of its collectives is about to reach its own hang timeout
        (its watchdog then rebuilds the device state, or reports the failure here itself)."""
        if self._native is None:
            return False
        st = self._native.status()
        t = st.get("transparent") or {}
        if st.get("mode") != "proxy" or not t:
            return False
        if t.get("recovering"):
            return True
        since = t.get("since_last_s")
        if since is not None and since < limit:
            return True
        return bool(t.get("recoverable")) and any(c.get("age_s", 0) > limit / 2 for c in st.get("in_flight", []))

    def report_failure(self, kind: str, detail: str, *, on_main: bool = False,
                       from_launcher: bool = False, detect_s: Optional[float] = None,
                       culprit: Optional[int] = None, peer_step: Optional[int] = None) -> None:
        """Record a failure (first one wins), tell the launcher, and save when it is safe.

        ``culprit``: the failed rank, when this (healthy) rank knows which one it waits for;
        ``peer_step``: the minibatch the failed rank was in (not known: the furthest any rank began),
        from the launcher."""
        with self._lock:
            if culprit is not None:
                self._lost.add(culprit)
            first = self._failure is None
            if first:
                self._failure = {"kind": kind, "detail": detail, "rank": self.rank,
                                 "t": time.time(), "step": self.current_step(), "peer_step": peer_step}
        if first:
            self._failure_evt.set()
            log.warning("failure detected (%s): %s", kind, detail)
            if self.channel is not None and not from_launcher:
                self.channel.send(FailureReport(rank=self.rank, kind=kind, detail=detail,
                                  step=self._failure["step"], detect_s=detect_s, culprit=culprit))
        if on_main:
            self._save_and_exit(on_main=True)
        threading.Thread(target=self._save_when_blocked, name="jitckpt-saver", daemon=True).start()

    def _save_when_blocked(self) -> None:
        """Save from this thread once the main thread is stuck in a blocking region. Otherwise
        the main thread reaches a safe point and saves itself.

        While the main thread computes a minibatch without touching the saved state
        (``protect()``: its forward and backward) this thread saves at once, speculatively: a
        lost peer usually makes that minibatch futile, and the save is then ready when its
        collective fails. Should the minibatch's collectives complete instead (the peer had
        contributed before it failed), the main thread finishes the minibatch and saves its end,
        losing nothing. Not after a preemption, whose minibatch always can finish.
        Without a save function there is nothing to wait for: give up at once.
        """
        self._give_up_if_no_save()
        deadline = time.monotonic() + self.save_timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._save_claimed:
                    return
                running = (self._failure is not None and self._minibatch_futile(self._failure)
                           and self.saveable_while_running is not None and self.saveable_while_running())
                blocked = [on_main for _, start, on_main in self._regions.values()
                           if time.monotonic() - start > self.blocked_grace]
                # A torn state is rolled back only while the main thread, which mutates it, waits.
                claim = (bool(blocked) and not self._waits_for_boundary()
                         and (not self._torn() or (self.roll_back is not None and any(blocked))))
                speculate = (not claim and running and not self._torn() and self._speculation is None
                             and not self._moved_on)
                if claim:
                    self._save_claimed = True
                if speculate:
                    self._speculation = threading.Event()
            if claim:
                self._do_save_and_exit()
            if speculate:
                self._speculate()
            time.sleep(0.02)
        self._give_up(f"main thread reached no safe point within {self.save_timeout}s")

    def _waits_for_boundary(self) -> bool:
        """A preemption of a job that saves it at the next minibatch boundary only (see
        ``preempt_at_boundary``): the peers are alive, so every rank gets there."""
        return self.preempt_at_boundary and (self._failure or {}).get("kind") == "preempted"

    def _minibatch_futile(self, failure: dict) -> bool:
        """Whether this failure may keep the minibatch under way from finishing: not a
        preemption (no rank is lost), nor a rank that failed in a later minibatch (it took part
        in every collective of this one)."""
        peer = failure.get("peer_step")
        return failure["kind"] not in MINIBATCH_CAN_FINISH and (peer is None or peer <= self.current_step())

    def _speculate(self) -> None:
        """The speculative save (see :meth:`_save_when_blocked`): kept and reported if the main
        thread is still in its minibatch once it is written, else left as an older checkpoint.
        No buffer rewind: the main thread may be in its forward (``protect()`` records the start)."""
        assert self._speculation is not None
        step, t0 = self.current_step(), time.monotonic()
        try:
            written = self._write_jit(step)
            error: Optional[BaseException] = None
        except BaseException as e:  # noqa: BLE001 - reported below if the save is kept
            error = e
        with self._lock:
            keep = not self._moved_on
            self._save_claimed = self._save_claimed or keep
        self._speculation.set()
        if not keep:
            log.info("the minibatch went on after the failure: its JIT save waits for its end")
            return
        if error is not None:
            self._give_up(self._save_error(error))
        self._report_saved_and_exit(written, step, t0, undone=None)

    def _save_and_exit(self, *, on_main: bool) -> None:
        with self._lock:  # one decision with the saver thread's: a speculative save, or this one
            speculation = self._speculation
            claim = speculation is None and not self._save_claimed
            self._save_claimed = self._save_claimed or claim
        if speculation is not None:
            speculation.wait()  # it keeps the state it read, or yields to this one
            with self._lock:
                claim = not self._save_claimed
                self._save_claimed = True
        if claim:
            self._do_save_and_exit()
        self._park()

    def _park(self) -> None:
        """Hold this thread while another one saves; that one ends the process or, in an in-process
        recovery, has the training thread leave the script from here."""
        if threading.current_thread() is threading.main_thread():
            self._unwind.wait()
            self._unwound.set()
            raise InProcessRestart(f"rank {self.rank}: a peer failed; the script runs again in this process")
        while True:
            time.sleep(3600)

    def _give_up_if_no_save(self) -> None:
        """No save function, or a failure this job saves nothing for: stop without a checkpoint."""
        if self.save_fn is None:
            self._give_up(self.no_save_reason or "no save function registered (call jitckpt.init(save_fn))")
        if self.no_save_reason is not None and self._failure is not None and self._failure["kind"] != "preempted":
            done = ""
            if self.save_to_memory is not None:
                with self._memory_save_lock:  # once: the second thread waits for it, then exits too
                    if self._memory_saved is None:
                        try:
                            self._memory_saved = f"; {self.save_to_memory()}"
                        except Exception as e:  # noqa: BLE001 - the restart goes on without it
                            self._memory_saved = f"; no partition saved: {type(e).__name__}: {e}"
                    done = self._memory_saved
            self._give_up(self.no_save_reason + done)

    def _do_save_and_exit(self) -> None:
        self._give_up_if_no_save()
        undone = self._roll_back_if_torn()
        step = self.current_step()
        t0 = time.monotonic()
        try:
            # DDP buffers and RNG as of the start of the minibatch recorded (the process exits next).
            self.ddp_buffers.rewind_for_save()
            written = self._write_jit(step)
        except BaseException as e:  # noqa: BLE001 - any save error must end in a clean report
            self._give_up(self._save_error(e))
        self._report_saved_and_exit(written, step, t0, undone=undone)

    def _write_jit(self, step: int) -> list:
        """The JIT save: [(path, metadata)] of each checkpoint written, this rank's own first."""
        if self._native is not None:  # this thread's device copies go to libjit.so's save stream
            self._native.set_save_thread(True)
        # The process exits next: a launcher that fsyncs for it lets the restart start first.
        self._jit_saving = True
        fsync = not (self.spec is not None and self.spec.launcher_fsyncs)
        preempted = (self._failure or {}).get("kind") == "preempted"  # every replica writes its own part
        if self.part_fn is None or len(self.replica_ranks) < 2 or preempted:
            return [self._write("jit", step, fsync=fsync)]
        # After a failure: also the parts of this shard that no other survivor writes.
        fill = PartFill(root=self.checkpoint_dir, gen=self.gen, step=step, replica=self.replica_id,
                        replica_ranks=self.replica_ranks, on_this_node=node_of_rank(),
                        lost=lambda: set(self._lost))
        return fill.write(lambda replica: self._write("jit", step, fsync=fsync, replica=replica))

    @staticmethod
    def _save_error(e: BaseException) -> str:
        if isinstance(e, CheckpointError):  # e.g. "no space left on <dir>: N bytes needed"
            return f"JIT save failed: {e}"
        return f"JIT save failed: {type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))}"

    def _report_saved_and_exit(self, written: list, step: int, t0: float, *, undone: Optional[int]) -> None:
        seconds = time.monotonic() - t0
        parts = f", and {len(written) - 1} other replica's part(s) of its shard" if len(written) > 1 else ""
        log.warning("JIT checkpoint of step %d saved to %s (%.3fs%s%s)", step, written[0][0], seconds,
                    ", over its reserve's pages" if self._reserve_used else "", parts)
        if self.channel is not None:
            for path, meta in written:  # one report per checkpoint: the launcher counts shards covered
                self.channel.send(Saved(rank=self.rank, path=str(path), step=step,
                                  bytes=meta.total_bytes, seconds=seconds, shard_id=meta.shard_id,
                                  num_shards=meta.num_shards, kind="jit", undone=undone))
        if self.in_process and (self._failure or {}).get("kind") != "preempted":
            self._leave_script()
        self._exit(EXIT_JIT_SAVED)

    def _leave_script(self) -> None:
        """In-process recovery, after the JIT save: the training thread leaves the user's script
        (this thread, or the one held while this one saved). A helper waits for it, bounded; a
        training thread that stays stuck ends the process as in the JIT recovery (its checkpoint is
        written, a standby takes its rank)."""
        if not self._unwind_ok.wait(self.save_timeout):
            log.warning("no word from the launcher that every survivor saved within %.0fs: this rank restarts "
                        "from its checkpoint", self.save_timeout)
            return
        self._unwind.set()
        group_sockets.cut()  # peers (and this rank's own receive) blocked in a collective fail now
        if threading.current_thread() is threading.main_thread():
            self._unwound.set()
            raise InProcessRestart(f"rank {self.rank}: a peer failed; the script runs again in this process")
        if self._unwound.wait(UNWIND_GRACE):
            raise SystemExit  # ends this helper thread quietly; the process lives on
        log.warning("the training thread did not leave its collective within %.0fs after the JIT save: this "
                    "rank restarts from its checkpoint (the others keep their processes); where it is stuck:",
                    UNWIND_GRACE)
        faulthandler.dump_traceback(all_threads=True)

    def finish_script(self) -> None:
        """In-process recovery: the script returned; the exit barrier now, not at interpreter exit,
        so that a peer's failure in its last step still unwinds this rank (InProcessRestart)."""
        atexit.unregister(self._exit_barrier)
        if self.channel is not None:
            self._exit_barrier()

    def retire(self) -> None:
        """In-process recovery: this generation is over but the process lives on. Stop the threads
        and hooks a new runtime installs again; what the launcher sends next (the next Assign) is
        handed to :meth:`next_message`."""
        self._handoff = queue.Queue()
        self._retired = True
        self._watchdog.stop()
        if self._watchdog.is_alive():  # (it polls every 0.1 s) a live thread would keep this runtime alive
            self._watchdog.join(timeout=1.0)
        self._hooks.remove()
        if self.snapshots is not None:  # its taker's thread and side group: the next runtime makes its own
            self.snapshots.close()
        atexit.unregister(self._exit_barrier)
        if self._previous_excepthook is not None:
            sys.excepthook = self._previous_excepthook

    def next_message(self) -> Optional[object]:
        """After :meth:`retire`: the launcher's next Assign (None: the launcher is gone)."""
        assert self._handoff is not None
        return self._handoff.get()

    def take_save_reserve(self) -> Optional[Path]:
        """For the save function: a file of ready page-cache pages to rename into the checkpoint
        and overwrite (:mod:`jitckpt.runtime.save_reserve`), during a JIT save only; else None."""
        reserve = self.save_reserve.take() if self._jit_saving else None
        self._reserve_used = self._reserve_used or reserve is not None
        return reserve

    def _roll_back_if_torn(self) -> Optional[int]:
        """--plugin undo: undo the torn step before saving; the number of parameters undone."""
        if self.roll_back is None or not self._torn():
            return None
        try:
            undone = self.roll_back()
        except Exception as e:  # noqa: BLE001 - e.g. UndoError: zero_grad() ran after the step
            self._give_up(f"--plugin undo could not undo the interrupted optimizer step, so this rank "
                          f"has no consistent state to save: {type(e).__name__}: {e}")
        self._in_optimizer = False
        log.warning("--plugin undo rolled back the torn optimizer step (%d parameters) "
                    "before the JIT save", undone)
        return undone

    def _give_up(self, reason: str) -> None:
        log.error("%s", reason)
        if self.channel is not None:
            self.channel.send(SaveFailed(rank=self.rank, reason=reason))
        self._exit(EXIT_NO_SAVE)

    @staticmethod
    def _exit(code: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)

    def _write(self, kind: str, step: int, *, fsync: bool = True,  # type: ignore[no-untyped-def]
               replica: Optional[int] = None):
        """One checkpoint; with replicas of a DTensor job's shard (``part_fn``), the part of
        replica ``replica`` (another replica's, written for it), else this rank's own part."""
        assert self.save_fn is not None
        # DDP's bucket layout goes into every checkpoint, before its files are checksummed.
        save_fn = self.ddp_layouts.saving(self.save_fn)
        shard_id, num_shards = self.shard_id, self.num_shards
        if self.part_fn is not None:
            shard_id, num_shards = self.part_fn(self.replica_id if replica is None else replica)
        self._saver_ident = threading.get_ident()
        try:
            return write_checkpoint(self.checkpoint_dir, save_fn, kind=kind, step=step,
                                    rank=self.rank, world_size=self.world_size, gen=self.gen,
                                    shard_id=shard_id, num_shards=num_shards, fsync=fsync,
                                    part=None if replica is None else shard_id)
        finally:
            self._saver_ident = None

    # ---- periodic tier ------------------------------------------------------------------
    def _periodic_save(self, step: int) -> None:
        """Synchronous periodic checkpoint (fallback tier), same format as JIT.

        A failed save (a full disk, an error in the save function) costs only this save: it is
        logged and reported, the older checkpoints stay, and training goes on.
        """
        t0 = time.monotonic()
        try:
            path, meta = self._write("periodic", step)
        except Exception as e:  # noqa: BLE001 - see the docstring
            reason = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            log.error("periodic checkpoint at step %d failed: %s; training goes on", step, reason)
            if self.channel is not None:
                self.channel.send(SaveFailed(rank=self.rank, reason=reason, kind="periodic",
                                  step=step))
            return
        if self.channel is not None:
            self.channel.send(Saved(rank=self.rank, path=str(path), step=step,
                              bytes=meta.total_bytes, seconds=time.monotonic() - t0,
                              shard_id=meta.shard_id, num_shards=meta.num_shards, kind="periodic"))

    # ---- launcher messages and the exit barrier -----------------------------------------
    def _listen(self) -> None:
        assert self.channel is not None
        while True:
            msg = self.channel.recv()
            if self._retired:  # the process waits for its next assignment (or the launcher's end)
                if msg is None or isinstance(msg, Assign):
                    self._handoff.put(msg)
                    return
                continue  # about the ended generation (a RankLost, a SaveNow sent as it ended)
            if msg is None:
                log.error("launcher is gone; exiting")
                self._exit(EXIT_LAUNCHER_GONE)
            if isinstance(msg, SaveNow) and getattr(self, "_verdict_ok", False):
                continue  # every rank finished: nothing to recover, the job is complete
            if isinstance(msg, RankLost):
                self._lost.add(msg.rank)
            elif isinstance(msg, SaveNow):
                self.report_failure(msg.kind, msg.detail, from_launcher=True, culprit=msg.rank,
                                    peer_step=msg.step)
            elif isinstance(msg, Verdict):
                self._verdict_ok = bool(msg.ok)
                self._verdict_evt.set()
            elif isinstance(msg, PeerExit):
                self._on_peer_exit(msg.rank, msg.step)
            elif isinstance(msg, Unwind):
                self._unwind_ok.set()

    def _on_peer_exit(self, rank: Optional[int], step: Optional[int]) -> None:
        """Another rank reached its exit barrier: it finished, or left early (``sys.exit(0)``).

        If this rank then stays blocked in a collective for :data:`PEER_EXIT_GRACE` seconds, it
        waits for a rank that will not come: that rank's exit is the failure, reported now rather
        than after the hang timeout. A collective the leaver took part in ends within moments.
        """
        self._peers_left.append((rank, step, time.monotonic()))
        if len(self._peers_left) > 1:
            return  # the watcher runs

        def watch() -> None:
            while self._failure is None and not self._exiting:
                with self._lock:
                    starts = [start for _, start, _ in self._regions.values()]
                left_rank, left_step, t_left = self._peers_left[0]
                if starts and time.monotonic() - max(min(starts), t_left) > PEER_EXIT_GRACE:
                    ranks = ", ".join(str(r) for r, _, _ in self._peers_left)
                    self.report_failure(
                        "exit", f"rank {ranks} left the job (exited with code 0 at step "
                        f"{left_step}) while rank {self.rank} waits for it in a collective",
                        culprit=left_rank, detect_s=time.monotonic() - t_left)
                    return
                time.sleep(0.1)

        threading.Thread(target=watch, name="jitckpt-peer-exit", daemon=True).start()

    def skip_exit_barrier(self) -> None:
        """This rank is ending with a failure the launcher sees in its exit code (``sys.exit(2)``):
        it did not finish, so it does not tell the launcher it did."""
        self._crashed = True

    def _exit_barrier(self) -> None:
        """At normal exit, wait until every rank finished or a failure is known.

        A failure in another rank's last optimizer step leaves no later collective to hang in;
        without this barrier the healthy ranks would exit and their state would be lost.
        """
        assert self.channel is not None
        if getattr(self, "_crashed", False):
            return
        self._exiting = True
        self.channel.send(ExitReady(rank=self.rank, step=self.current_step()))
        deadline = time.monotonic() + self.save_timeout
        while time.monotonic() < deadline:
            if self._failure_evt.is_set():
                self._save_and_exit(on_main=True)
            if self._verdict_evt.wait(0.05):
                if getattr(self, "_verdict_ok", False):
                    return
                self._failure_evt.wait(5.0)
                self._save_and_exit(on_main=True)
        log.error("no verdict from the launcher at exit")
