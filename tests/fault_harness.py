"""Fault injection from outside the training script: run `jitckpt run` jobs, signal their processes
at random times, and check what a recovery must guarantee.

A :class:`Job` is one `jitckpt run` of a config's script (tests/scripts/train_matrix.py) in its own session. While it runs
the harness watches (bounded polls of files, each wait with a deadline) the launcher's
``events.jsonl`` (``worker_start``: rank, pid, gen), the script's steps log (``begin``/``step``
records) and the checkpoint directory, and records every process the launcher started. A
:class:`Fault` waits until its target rank begins a random step of a window, waits a random part of
a step more, and delivers its signal with ``os.kill``. The randomness comes from one seed per case
(printed with every failure, and settable with ``FAULT_SEED``) so a failing case can be rerun as it
was.

:func:`run_case` runs a case and returns the list of problems found (empty: it passed):

* the launcher's exit code is the expected one;
* at most one minibatch is run again (or, for a full disk, no more than since the newest checkpoint
  that could be written);
* rank 0's final parameters and buffers are bitwise equal to a failure-free run of the same config;
* no process the launcher started outlives it;
* no complete checkpoint is lost unless a newer complete one supersedes it.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch

from full_disk import small_fs
from jobs import ROOT, kill_tree

SCRIPT = ROOT / "tests" / "scripts" / "train_matrix.py"
HANG = ["--hang-timeout", "auto:floor=3,mult=10,startup=60,warmup=3"]
STEPS = 16
PHASE_SLEEP = 0.01   # five phases: a step takes ~50 ms plus compute
JOB_TIMEOUT = 240.0  # one launcher run, start to end, on 2 loaded cores
POLL = 0.02
SCAN_EVERY = 0.25
META = "jitckpt-meta.json"
PAGE = 4096
BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")
# protect()'s warning when no saved copy holds the buffers DDP broadcasts from rank 0
RANK_LOCAL_BUFFERS = "with rank-local model buffers"


@dataclass(frozen=True)
class Config:
    """What is trained: a model, its optimizer, the jitckpt API used, and the number of ranks."""

    model: str = "ln"       # ln | bn | dropout
    api: str = "protect"    # protect | init
    nproc: int = 2
    optim: str = ""         # default: adam for ln, sgd for bn, adamw for dropout
    parallel: str = "ddp"   # ddp | hsdp (FSDP2 on a 2 x nproc/2 mesh) | fsdp | tp | fsdp_tp | pp | pp_ddp (train_matrix.py)
    snapshot_every: int = 0  # jitckpt run --snapshot-every (0: off)
    recovery: str = "jit"   # jitckpt run --recovery (inprocess: the survivors must keep their processes)
    compiled: bool = False  # the forward through torch.compile

    @property
    def replicated(self) -> bool:
        """Whether another rank holds each rank's state (DDP's replicas, HSDP's replica groups)."""
        return self.parallel in ("ddp", "hsdp", "pp_ddp")

    @property
    def optimizer(self) -> str:
        return self.optim or {"ln": "adam", "bn": "sgd", "dropout": "adamw"}[self.model]

    @property
    def id(self) -> str:
        return (f"{self.model}-{self.optimizer}-{self.api}-{self.nproc}r" + ("" if self.parallel == "ddp" else f"-{self.parallel}")
                + (f"-snap{self.snapshot_every}" if self.snapshot_every else "")
                + ("" if self.recovery == "jit" else f"-{self.recovery}") + ("-compiled" if self.compiled else ""))

    @property
    def script(self) -> Path:
        """The training script the launcher runs."""
        return SCRIPT

    @property
    def steps(self) -> int:
        """How many minibatches the script trains."""
        return STEPS

    def launcher_args(self) -> list:
        args = ["--snapshot-every", str(self.snapshot_every)] if self.snapshot_every else []
        return args + (["--recovery", self.recovery] if self.recovery != "jit" else [])

    def script_args(self) -> list:
        return ["--model", self.model, "--optim", self.optimizer, "--api", self.api, "--parallel", self.parallel,
                "--steps", str(STEPS), "--phase-sleep", str(PHASE_SLEEP)] + (["--compile"] if self.compiled else [])


# ---- reading what a job writes -----------------------------------------------------------------
class JsonlTail:
    """The complete lines of a growing JSONL file, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.records, self._pos, self._rest = path, [], 0, b""

    def poll(self) -> list:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return self.records
        self._pos += len(data)
        data = self._rest + data
        lines = data.split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return self.records


def complete_checkpoints(root: Path) -> dict:
    """name -> step of the checkpoint directories under ``root`` that were committed (renamed into
    place with their metadata; the store renames only complete ones)."""
    out = {}
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return out
    for e in entries:
        if e.name.startswith(".") or not e.is_dir() or "-s" not in e.name:
            continue
        if os.path.exists(os.path.join(e.path, META)):
            with contextlib.suppress(ValueError):
                out[e.name] = int(e.name.rsplit("-s", 1)[1])
    return out


def verified(path: Path) -> bool:
    from jitckpt.checkpoint_store import CheckpointError, verify_checkpoint

    try:
        verify_checkpoint(path)
        return True
    except (CheckpointError, OSError):
        return False


def fs_bytes(directory: Path) -> int:
    """What ``directory``'s files take on a tmpfs (whole pages)."""
    total = 0
    for p in directory.rglob("*"):
        if p.is_file():
            total += -(-p.stat().st_size // PAGE) * PAGE
    return total


# ---- one launcher run ----------------------------------------------------------------------------
class Job:
    """One ``jitckpt run`` of the matrix script, watched from outside."""

    def __init__(self, workdir: Path, cfg: Config, *, ckpt: Path, name: str = "job",
                 launcher_args: tuple = (), script_args: tuple = (),
                 timeout: float = JOB_TIMEOUT) -> None:
        self.workdir, self.cfg, self.ckpt, self.name = workdir, cfg, ckpt, name
        workdir.mkdir(parents=True, exist_ok=True)
        self.run_dir = workdir / f"{name}-run"
        self.steps_path = workdir / f"{name}-steps.jsonl"
        self.out_path = workdir / f"{name}-out.txt"
        self.final_path = workdir / f"{name}-final.pt"
        self.events_tail = JsonlTail(self.run_dir / "events.jsonl")
        self.steps_tail = JsonlTail(self.steps_path)
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.seen_ckpts: dict = {}       # name -> step, every complete checkpoint ever seen
        self.lost: list = []             # complete checkpoints gone with no newer one, mid-training
        self.procs: dict = {}            # pid -> (start time in ticks, how we know it)
        self._n_events, self._last_scan = 0, 0.0
        self.ckpts_at_fault: dict = {}   # the complete checkpoints when the fault was delivered
        cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", str(cfg.nproc),
               "--checkpoint-dir", str(ckpt), "--run-dir", str(self.run_dir), "--status-interval", "0",
               *HANG, *cfg.launcher_args(), *launcher_args, str(cfg.script), *cfg.script_args(),
               "--out", str(self.final_path), "--steps-log", str(self.steps_path), *script_args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self._out = open(self.out_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.rc: Optional[int] = None

    # observation
    def poll(self, full: bool = False) -> None:
        self.events_tail.poll()
        self.steps_tail.poll()
        for e in self.events_tail.records[self._n_events:]:
            if e.get("event") == "worker_start" and e["pid"] not in self.procs:
                self._remember(e["pid"], f"rank {e['rank']} gen {e['gen']}")
        self._n_events = len(self.events_tail.records)
        # Scanning /proc and the checkpoint directory costs CPU the job needs: a few times a second.
        if not full and time.monotonic() - self._last_scan < SCAN_EVERY:
            return
        self._last_scan = time.monotonic()
        now = complete_checkpoints(self.ckpt)
        if not self._training_done():  # once every rank is done, the job may drop its JIT copies
            for name, step in self.seen_ckpts.items():
                if name not in now and not any(s >= step for s in now.values()) and name not in self.lost:
                    self.lost.append(name)
        self.seen_ckpts.update(now)
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                if c.pid not in self.procs:
                    self._remember(c.pid, "launcher child")

    def _training_done(self) -> bool:
        last = {r["rank"] for r in self.steps_tail.records if r.get("step") == self.cfg.steps - 1}
        return len(last) == self.cfg.nproc

    def _remember(self, pid: int, what: str) -> None:
        self.procs[pid] = (_start_ticks(pid), what)  # None: already gone

    @property
    def events(self) -> list:
        return self.events_tail.records

    @property
    def steps(self) -> list:
        return self.steps_tail.records

    def ev(self, name: str) -> list:
        return [e for e in self.events if e.get("event") == name]

    def wait_for(self, what: str, pred: Callable[[], object]) -> object:
        """Poll until ``pred()`` is true (returned); AssertionError if the launcher ends first or
        the job's deadline passes."""
        while True:
            self.poll()
            got = pred()
            if got:
                return got
            if self.proc.poll() is not None:
                self.poll(full=True)
                got = pred()
                if got:
                    return got
                raise AssertionError(f"{self.name}: launcher exited (rc {self.proc.returncode}) "
                                     f"before {what}")
            if time.monotonic() > self.deadline:
                raise AssertionError(f"{self.name}: no {what} within {self.timeout:.0f}s")
            time.sleep(POLL)

    def worker(self, gen: int, rank: int) -> Optional[int]:
        for e in self.events:
            if e.get("event") == "worker_start" and e["gen"] == gen and e["rank"] == rank:
                return e["pid"]
        return None

    def began(self, gen: int, rank: int, step: int) -> bool:
        return any(r.get("begin") == step and r["gen"] == gen and r["rank"] == rank for r in self.steps)

    def step_time(self, gen: int, rank: int) -> float:
        ts = [r["t"] for r in self.steps if "step" in r and r["gen"] == gen and r["rank"] == rank]
        if len(ts) < 2:
            return 5 * PHASE_SLEEP
        return (ts[-1] - ts[0]) / (len(ts) - 1)

    def finish(self) -> list:
        """Wait (bounded) for the launcher to exit; return the problems: a timeout, or processes
        it started still alive. Every process is killed afterwards either way."""
        problems = []
        try:
            while self.proc.poll() is None:
                self.poll()
                if time.monotonic() > self.deadline:
                    problems.append(f"{self.name}: launcher still running after {self.timeout:.0f}s")
                    kill_tree(self.proc.pid)
                    break
                time.sleep(POLL * 5)
            self.rc = self.proc.wait(timeout=30)
            self.poll(full=True)
            problems += self._leftovers()
        finally:
            kill_tree(self.proc.pid)
            for pid in self.procs:
                _kill_if_same(pid, self.procs[pid][0])
            self._out.close()
        return problems

    def _leftovers(self) -> list:
        """Processes the launcher started that are alive once it exited. SIGKILLed ones need a
        moment to be gone: poll up to 10 s."""
        deadline = time.monotonic() + 10.0
        while True:
            alive = [(pid, what) for pid, (ct, what) in self.procs.items() if _alive(pid, ct)]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out = []
        for pid, what in alive:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                out.append(f"{self.name}: leftover process pid {pid} ({what}, status {p.status()}, "
                           f"{' '.join(p.cmdline())[:120]}) alive 10s after the launcher exited")
        return out

    def output(self, tail: Optional[int] = 5000) -> str:
        try:
            text = self.out_path.read_text(errors="replace")
            return text if tail is None else text[-tail:]
        except FileNotFoundError:
            return ""


def _start_ticks(pid: int) -> Optional[int]:
    """When ``pid`` started, in clock ticks since boot (/proc/<pid>/stat): with the pid, it names
    one process. (psutil's create_time adds the boot time, which moves when a VM's clock is
    adjusted, so the same process can seem to have two start times.)"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _alive(pid: int, start: Optional[int]) -> bool:
    if start is None or _start_ticks(pid) != start:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_if_same(pid: int, start: Optional[int]) -> None:
    if _alive(pid, start):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


# ---- faults --------------------------------------------------------------------------------------
@dataclass
class Fault:
    """A failure and what a correct recovery from it looks like.

    ``sig`` goes to the target rank's worker (``to_launcher``: to the launcher) when that rank has
    begun a random step of ``window`` (inclusive; end relative to the last step if negative) plus
    a random fraction of a step. ``usr1`` arms the script (``--on-usr1``): the signal is SIGUSR1.
    """

    name: str
    sig: Optional[int] = signal.SIGKILL
    window: tuple = (3, -4)
    usr1: str = ""
    to_launcher: bool = False
    exit_fault: str = ""             # --exit-fault mode: dies after the exit barrier (no signal)
    second: bool = False             # also SIGKILL a gen-1 worker as soon as it starts
    disk_full: bool = False
    expect_rc: int = 0
    preempt: bool = False            # the job stops (rc 128+sig) and is run again to finish
    restarts: Optional[int] = 1      # launcher restarts expected (None: not checked)

    def script_args(self, victim: int) -> list:
        args = []
        if self.usr1:
            args += ["--on-usr1", self.usr1]
        if self.exit_fault:
            args += ["--exit-fault", f"0:{victim}:{self.exit_fault}"]
        return args


FAULTS = {f.name: f for f in [
    Fault("sigkill"),
    Fault("sigterm", sig=signal.SIGTERM, preempt=True, expect_rc=128 + signal.SIGTERM, restarts=0),
    Fault("sigsegv", sig=signal.SIGSEGV),
    Fault("abort", sig=signal.SIGABRT),
    Fault("sigstop", sig=signal.SIGSTOP),
    Fault("gil", usr1="gil", sig=signal.SIGUSR1),
    Fault("exception", usr1="raise", sig=signal.SIGUSR1),
    Fault("optim", usr1="optim", sig=signal.SIGUSR1),
    Fault("backward", usr1="backward", sig=signal.SIGUSR1),
    Fault("reduce_scatter", usr1="reduce_scatter", sig=signal.SIGUSR1),
    Fault("recovery", second=True, restarts=2),
    Fault("step1", window=(0, 0)),
    Fault("after_barrier_abort", sig=None, exit_fault="abort", restarts=0),
    Fault("after_barrier_kill", sig=None, exit_fault="kill", restarts=0),
    Fault("launcher_sigterm", sig=signal.SIGTERM, to_launcher=True, preempt=True,
          expect_rc=128 + signal.SIGTERM, restarts=0),
    Fault("launcher_sigint", sig=signal.SIGINT, to_launcher=True, preempt=True,
          expect_rc=128 + signal.SIGINT, restarts=0),
    Fault("disk_full", window=(10, 12), disk_full=True),
]}

PERIODIC = 4  # disk-full case: periodic checkpoints every 4 steps; only the first one fits


# ---- a case ----------------------------------------------------------------------------------------
@dataclass
class Reference:
    cfg: Config
    final: dict
    periodic_bytes: int   # what one periodic checkpoint takes on a tmpfs


def run_reference(workdir: Path, cfg: Config) -> Reference:
    """A failure-free run of ``cfg`` (with periodic checkpoints, to size the disk-full case)."""
    job = Job(workdir, cfg, ckpt=workdir / "ckpt", name="ref", launcher_args=("--periodic-every", str(PERIODIC), "--warm-standby", "0"))
    problems = job.finish()
    assert job.rc == 0 and not problems, (problems, job.output())
    assert not job.ev("failure_detected"), job.output()
    periodic = sorted((workdir / "ckpt").glob("periodic-*"))
    assert periodic, f"reference run of {cfg.id} wrote no periodic checkpoint:\n{job.output()}"
    return Reference(cfg, torch.load(job.final_path, weights_only=True), max(fs_bytes(p) for p in periodic))


def case_seed(case_id: str) -> int:
    env = os.environ.get("FAULT_SEED")
    return int(env) if env else zlib.crc32(case_id.encode())


@dataclass
class Outcome:
    case: str
    seed: int
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    bound: list = field(default_factory=list)   # passed within a documented bound, not exactly
    jobs: list = field(default_factory=list)

    def report(self) -> str:
        head = f"case {self.case} (seed {self.seed}; rerun with FAULT_SEED={self.seed}): "
        body = "\n".join(f"  - {p}" for p in self.problems)
        tail = "\n".join(f"--- {j.name} output ({j.out_path}) ---\n{j.output(3000)}" for j in self.jobs)
        return head + "\n" + body + "\n  notes: " + "; ".join(self.notes) + "\n" + tail


def run_case(workdir: Path, ref: Reference, fault: Fault) -> Outcome:
    cfg = ref.cfg
    case = f"{fault.name}-{cfg.id}"
    out = Outcome(case, case_seed(case))
    rnd = random.Random(out.seed)
    victim = rnd.randrange(1, cfg.nproc) if fault.disk_full else rnd.randrange(cfg.nproc)
    lo, hi = fault.window
    hi = hi if hi >= 0 else cfg.steps + hi
    target = rnd.randint(lo, hi)
    frac = rnd.random()
    ckpt = workdir / "ckpt"
    with contextlib.ExitStack() as stack:
        if fault.disk_full:
            # Room for one periodic checkpoint and half of another: the second periodic save and
            # the JIT save after the fault find the disk full.
            size = ref.periodic_bytes * 3 // 2 // PAGE * PAGE + 4 * PAGE
            stack.enter_context(small_fs(ckpt, size))
            out.notes.append(f"tmpfs {size} B, a checkpoint takes {ref.periodic_bytes} B")
        launcher_args = ("--periodic-every", str(PERIODIC)) if fault.disk_full else ()
        job = Job(workdir, cfg, ckpt=ckpt, name="run1", launcher_args=launcher_args,
                  script_args=tuple(fault.script_args(victim)))
        out.jobs.append(job)
        try:
            _inject(job, fault, victim, target, frac, rnd, out)
        except AssertionError as e:
            out.problems.append(str(e))
        finally:  # also on any other error: every process of the job is ended here
            out.problems += job.finish()
        jobs = [job]
        if fault.preempt and job.rc == fault.expect_rc:
            job2 = Job(workdir, cfg, ckpt=ckpt, name="run2")
            out.jobs.append(job2)
            out.problems += job2.finish()
            jobs.append(job2)
            if job2.rc != 0:
                out.problems.append(f"run2 (resume after preemption): launcher rc {job2.rc}, expected 0")
        _check(out, ref, fault, jobs, ckpt, target)
    return out


def _inject(job: Job, fault: Fault, victim: int, target: int, frac: float, rnd: random.Random,
            out: Outcome) -> None:
    if fault.sig is not None:
        pid = job.wait_for(f"rank {victim} gen 0 start", lambda: job.worker(0, victim))
        job.wait_for(f"rank {victim} to begin step {target}", lambda: job.began(0, victim, target))
        delay = frac * job.step_time(0, victim)
        time.sleep(delay)  # a random point inside the step (what is tested, not synchronisation)
        to = job.proc.pid if fault.to_launcher else pid
        job.poll(full=True)
        job.ckpts_at_fault = dict(job.seen_ckpts)
        signal_pid(to, fault.sig)
        out.notes.append(f"{signal.Signals(fault.sig).name} to {'launcher' if fault.to_launcher else f'rank {victim}'} "
                         f"pid {to} at step {target} + {delay * 1000:.0f} ms")
    else:
        out.notes.append(f"rank {victim} dies after the exit barrier ({fault.exit_fault})")
    if fault.second:
        rank2 = rnd.randrange(job.cfg.nproc)
        pid2 = job.wait_for(f"rank {rank2} gen 1 start", lambda: job.worker(1, rank2))
        signal_pid(pid2, signal.SIGKILL)
        out.notes.append(f"SIGKILL to gen-1 rank {rank2} pid {pid2} at its start")


def completed(steps: list, gen: int) -> list:
    return sorted({r["step"] for r in steps if r["gen"] == gen and "step" in r})


def _check(out: Outcome, ref: Reference, fault: Fault, jobs: list, ckpt: Path, target: int) -> None:
    p = out.problems
    first = jobs[0]
    if first.rc != fault.expect_rc:
        p.append(f"launcher rc {first.rc}, expected {fault.expect_rc}")
    restarts = len(first.ev("restart"))
    if fault.restarts is not None and restarts != fault.restarts:
        p.append(f"{restarts} restarts, expected {fault.restarts} "
                 f"(failures: {[(e.get('kind'), e.get('rank'), e.get('detail')) for e in first.ev('failure_detected')]})")
    # Steps: every (job, gen) in order; each launch must start right after the last step completed
    # by any earlier one (at most the interrupted minibatch is run again). Without replicas (full
    # sharding, TP) a rank lost in its optimizer step takes its updated shard along while the others
    # complete theirs: that minibatch, the one the lost rank did not complete, is done again.
    launches = [(j, g) for j in jobs for g in sorted({r["gen"] for r in j.steps})]
    done_max = done_all = -1
    newest_before_fault = max(first.ckpts_at_fault.values(), default=0)
    for j, g in launches:
        steps = completed(j.steps, g)
        begun = sorted({r["begin"] for r in j.steps if r["gen"] == g and "begin" in r})
        if not begun:
            continue
        if (j, g) != launches[0]:
            if fault.disk_full and j is first and g == 1:
                # Bound: the JIT save cannot be written, so the job resumes from the newest
                # checkpoint that was complete when the fault came.
                if begun[0] != newest_before_fault:
                    p.append(f"disk full: gen 1 resumed at step {begun[0]}, expected the newest "
                             f"complete checkpoint's step {newest_before_fault}")
            elif begun[0] != done_max + 1 and (ref.cfg.replicated or begun[0] != done_all + 1):
                p.append(f"{j.name} gen {g} resumed at step {begun[0]}, but step {done_max} was the "
                         f"last completed before it: {done_max + 1 - begun[0]} minibatch(es) redone "
                         f"(at most 1, i.e. resume at {done_max + 1}"
                         + ("" if ref.cfg.replicated else f", or at {done_all + 1}: every rank's last") + ")")
        if steps:
            done_max = max(done_max, steps[-1])
            by_rank = [max((r["step"] for r in j.steps if r["gen"] == g and r.get("rank") == k and "step" in r),
                           default=-1) for k in range(ref.cfg.nproc)]
            done_all = max(done_all, min(by_rank))
    last_job = jobs[-1]
    if done_max != ref.cfg.steps - 1 and last_job.rc == 0:
        p.append(f"the job ended at rc 0 but the last completed step is {done_max}, not {ref.cfg.steps - 1}")
    for j in jobs:
        for s in j.ev("recovery_summary"):
            if not fault.disk_full and (s.get("steps_redone") is None or s["steps_redone"] > 1):
                p.append(f"{j.name}: recovery_summary steps_redone={s.get('steps_redone')}")
    # Bitwise equality with the failure-free run.
    final = None
    if last_job.final_path.exists():
        final = torch.load(last_job.final_path, weights_only=True)
    elif last_job.rc == 0:
        p.append("the job ended at rc 0 without rank 0's final state")
    if final is not None:
        if final.keys() != ref.final.keys():
            p.append(f"final state keys differ: {sorted(final.keys() ^ ref.final.keys())}")
        diff = [k for k in ref.final if k in final and not torch.equal(final[k], ref.final[k])]
        declared = [j.name for j in jobs if RANK_LOCAL_BUFFERS in j.output(None)]
        if diff and declared and all(k.endswith(BUFFER_NAMES) for k in diff):
            # The documented bound: rank 0 died before its buffer broadcast reached the others,
            # so no saved copy holds the broadcast buffers; the job said so when it resumed.
            out.bound.append(f"buffers {diff} differ; {declared[0]} logged 'resuming ... {RANK_LOCAL_BUFFERS}'")
        elif diff:
            p.append(f"final state differs from the failure-free run in {diff}")
    # No good checkpoint lost: each one ever complete is still there and verifies, or a newer
    # complete one is.
    now = complete_checkpoints(ckpt)
    good_now = {n: s for n, s in now.items() if verified(ckpt / n)}
    seen = {}
    for j in jobs:
        seen.update(j.seen_ckpts)
    for j in jobs:
        for name in j.lost:
            p.append(f"{j.name}: checkpoint {name} disappeared during training with no newer complete one")
    for name, step in sorted(seen.items(), key=lambda kv: kv[1]):
        if name in good_now or (last_job.rc == 0 and name.startswith("jit-")):
            continue  # a finished job drops its JIT checkpoints (mid-run states)
        if not any(s >= step for s in good_now.values()):
            p.append(f"checkpoint {name} (step {step}) was complete and is gone or corrupt, with no "
                     f"newer complete one left (left: {sorted(now)})")
    tmp = [e.name for e in os.scandir(ckpt) if e.name.startswith(".tmp-")] if ckpt.is_dir() else []
    if tmp and last_job.rc == 0:
        p.append(f"temporary save directories left behind: {tmp}")
    if fault.disk_full:
        failed = [e for e in first.ev("checkpoint_failed")]
        if not failed:
            p.append("disk full: no checkpoint_failed event")
        out.notes.append(f"checkpoint_failed: {[(e.get('kind'), e.get('rank'), (e.get('reason') or '')[:80]) for e in failed]}")
    if ref.cfg.recovery == "inprocess" and fault.expect_rc == 0:
        p += kept_survivors(first)
    out.notes.append(f"failures: {[(e.get('kind'), e.get('rank')) for e in first.ev('failure_detected')]}")
    out.notes.append(f"launches: {[(j.name, g, completed(j.steps, g)[:1], completed(j.steps, g)[-1:]) for j, g in launches]}")


def kept_survivors(job: Job) -> list:
    """--recovery inprocess: after each recovery every rank that did not fail and had begun
    training in the generation that ended (a rank killed before its script's first step has saved
    nothing: it may restart) runs on in the process it had, the same pid, named a survivor; and the
    summary names them. The problems found."""
    problems = []
    starts = {(e["gen"], e["rank"]): e for e in job.ev("worker_start")}
    for gen in sorted({g for g, _ in starts if g > 0}):
        summary = next((s for s in job.ev("recovery_summary") if s["gen"] == gen), None)
        # A hang's culprit is named only once it is found (in the summary, not the detection).
        failed = {e["rank"] for e in job.ev("failure_detected") if e["gen"] == gen - 1 and e.get("rank") is not None}
        failed |= set(summary["failed_ranks"]) if summary is not None else set()
        trained = {r["rank"] for r in job.steps if r.get("gen") == gen - 1 and "begin" in r}
        for rank in sorted(trained - failed):
            before, after = starts.get((gen - 1, rank)), starts.get((gen, rank))
            if before is None or after is None:
                continue
            if after["pid"] != before["pid"] or after.get("role") != "survivor":
                problems.append(f"gen {gen}: surviving rank {rank} was pid {before['pid']}, now pid {after['pid']} "
                                f"(role {after.get('role')}): it did not keep its process")
        kept = sorted(r for (g, r), e in starts.items() if g == gen and e.get("role") == "survivor")
        if summary is not None and summary.get("kept_ranks", []) != kept:
            problems.append(f"gen {gen}: recovery_summary kept_ranks {summary.get('kept_ranks')}, survivors {kept}")
    return problems


def check_case(references: Callable[[Config], Reference], workdir: Path, fault: str, cfg: Config) -> None:
    """Run ``fault`` on ``cfg`` against its failure-free run (``references``: the conftest fixture
    ``fault_references``), record the outcome, and fail with its report if it found problems."""
    outcome = run_case(workdir, references(cfg), FAULTS[fault])
    record(outcome)
    assert not outcome.problems, outcome.report()


def record(outcome: Outcome) -> None:
    """Append the outcome to ``$FAULT_MATRIX_RESULTS`` (JSONL), if set: a log of matrix runs."""
    path = os.environ.get("FAULT_MATRIX_RESULTS")
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"case": outcome.case, "seed": outcome.seed, "ok": not outcome.problems,
                            "problems": outcome.problems, "notes": outcome.notes, "bound": outcome.bound,
                            "t": time.time()}) + "\n")
