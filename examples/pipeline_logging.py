"""4-stage pipeline (1F1B, gloo, one process per stage) with SWIFT logging-based recovery.

``run_pipeline(PipelineRun(...))`` starts the stages as forked processes around a TCPStore and
supervises them. One stage can SIGKILL itself at (iteration, op). Recovery modes:

* ``"logging"``: the dead stage gets a replacement that loads the last global checkpoint and
  replays its lost iterations alone from its neighbours' logs; survivors keep their state in
  memory (no roll back), flush their logs, wait (bounded) for the replacement and re-form a
  gloo group of all stages under a new store prefix; stages one iteration behind re-run it.
* ``"restart"``: the baseline; every stage is killed and restarted from the checkpoint.

Run directly for a demo: ``python examples/pipeline_logging.py --fail-stage 2 --fail-iter 7``.
Or under the launcher, which then does the supervising (one stage per worker)::

    jitckpt run --nproc-per-node 4 --plugin logging examples/pipeline_logging.py \
        --run-dir /tmp/pl --fail-stage 2 --fail-iter 7
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Imported before the stage processes are forked, so they start at once (jitckpt.swift pulls in
# heavy torch modules).
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (use_deterministic_algorithms imports it: ~4 s per process)
import torch.distributed as dist  # noqa: E402

from jitckpt.swift.pipeline.logging_determinism import (apply_determinism, check_determinism,  # noqa: E402
                                               read_manifest, write_manifest)
from jitckpt.swift.pipeline.logging_replay import LogIndex  # noqa: E402
from jitckpt.swift.pipeline.logging_sender import SendLogger  # noqa: E402
from jitckpt.swift.pipeline.channel import PeerFailure, PipelineChannel, WorkWaiter  # noqa: E402
from jitckpt.swift.pipeline.failure_flag import FailureFlag, announce_key, failure_key  # noqa: E402
from jitckpt.swift.pipeline.recovery import (catch_up_peers, checkpoint_path,  # noqa: E402
                                             latest_global_checkpoint, recovery_targets,
                                             save_stage_checkpoint)
from jitckpt.swift.pipeline.stage import PipelineStage  # noqa: E402
from jitckpt.swift.pipeline.store import StoreServer  # noqa: E402
from jitckpt.swift.pipeline.stage_membership import StageMembership  # noqa: E402

FAILED = "failure_time"


@dataclass(frozen=True)
class PipelineRun:
    """Configuration of one supervised run (keyword-only, validated in __post_init__)."""

    run_dir: str
    iterations: int = 12
    checkpoint_every: int = 5
    num_stages: int = 4
    micro_batches: int = 4
    micro_batch_size: int = 8
    hidden: int = 32
    layers_per_stage: int = 2
    schedule: str = "1f1b"
    logging: bool = True
    recovery: str = "logging"  # or "restart"
    fail_stage: Optional[int] = None
    fail_iteration: int = 0
    fail_op: int = 0
    fail_after: tuple[int, ...] = ()  # die only once these stages completed fail_iteration
    # Under `jitckpt run --recovery stage` only: stages that die together with fail_stage, at
    # the same iteration and op (overlapping failures: the launcher restarts the whole job).
    also_fail: tuple[int, ...] = ()
    # Under `jitckpt run --recovery stage` only: (stage, iteration, op) of the k-th further
    # failure, injected in process-group generation k (after k earlier replacements).
    later_failures: tuple[tuple[int, int, int], ...] = ()
    timeout: float = 60.0
    group_timeout: float = 45.0
    tamper_replay: bool = False  # test hook: replacement perturbs a weight -> must diverge
    log_root: Optional[str] = None  # shared log store (default run_dir/logs), e.g. on tmpfs
    # Selective logging (SWIFT §5.3): machines (stages) grouped; only inter-group messages are
    # logged and a failure rolls back the failed stage's whole group. Default: one per stage.
    groups: Optional[tuple[tuple[int, ...], ...]] = None

    def __post_init__(self) -> None:
        if self.num_stages < 2:
            raise ValueError("num_stages must be >= 2")
        if self.groups is not None:
            flat = [m for g in self.groups for m in g]
            if flat != list(range(self.num_stages)):
                raise ValueError(f"groups {self.groups} must be contiguous runs covering stages "
                                 f"0..{self.num_stages - 1} in order, e.g. ((0,), (1, 2), (3,))")
        if self.recovery not in ("logging", "restart"):
            raise ValueError(f"recovery must be 'logging' or 'restart', got {self.recovery!r}")
        if self.recovery == "logging" and self.fail_stage is not None and not self.logging:
            raise ValueError("recovery='logging' needs logging=True")
        if self.fail_stage is not None:
            if not 0 <= self.fail_stage < self.num_stages:
                raise ValueError(f"fail_stage {self.fail_stage} outside 0..{self.num_stages-1}")
            if not 1 <= self.fail_iteration <= self.iterations:
                raise ValueError(f"fail_iteration must be in 1..{self.iterations}")
        if (self.later_failures or self.also_fail) and self.fail_stage is None:
            raise ValueError("later_failures and also_fail need a first failure (fail_stage)")
        for stage in self.also_fail:
            if not 0 <= stage < self.num_stages or stage == self.fail_stage:
                raise ValueError(f"also_fail stage {stage}: outside 0..{self.num_stages - 1} "
                                 "or the same as fail_stage")
        for stage, it, _ in self.later_failures:
            if not (0 <= stage < self.num_stages and 1 <= it <= self.iterations):
                raise ValueError(f"later failure of stage {stage} at iteration {it}: outside "
                                 f"stages 0..{self.num_stages - 1} or iterations 1..{self.iterations}")

    def group_of(self, stage: int) -> tuple[int, ...]:
        """The selective-logging group holding ``stage``."""
        for g in self.groups or tuple((m,) for m in range(self.num_stages)):
            if stage in g:
                return tuple(g)
        raise ValueError(f"stage {stage} is in no group")


# ------------------------------------------------------------------ stage side -------------
def _build_stage(cfg: PipelineRun, s: int):


    torch.manual_seed(1000 + s)
    layers = []
    for _ in range(cfg.layers_per_stage):
        layers += [torch.nn.Linear(cfg.hidden, cfg.hidden), torch.nn.Tanh()]
    module = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    shape = (cfg.micro_batch_size, cfg.hidden)

    def data(it: int, mb: int, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(salt * 1_000_003 + it * 1009 + mb)
        return torch.randn(shape, generator=g)

    def loss_fn(out, it, mb):
        return torch.nn.functional.mse_loss(out, data(it, mb, 2).tanh()) / cfg.micro_batches

    return PipelineStage(stage=s, num_stages=cfg.num_stages, module=module, optimizer=opt,
                         num_micro_batches=cfg.micro_batches, activation_shape=shape,
                         output_shape=shape, input_fn=lambda it, mb: data(it, mb, 1),
                         loss_fn=loss_fn, schedule=cfg.schedule)


class _Stage:
    """State of one stage process across process-group generations."""

    def __init__(self, cfg: PipelineRun, s: int, generation: int, role: str, store: dist.Store,
                 member: Optional[StageMembership] = None):
        self.cfg, self.s, self.gen, self.role = cfg, s, generation, role
        self.member = member  # under jitckpt run --recovery stage: the launcher's view
        self.run = Path(cfg.run_dir)
        self.ckpt_dir = self.run / "ckpt"
        self.log_root = Path(cfg.log_root) if cfg.log_root else self.run / "logs"
        self.log_dir = self.log_root / f"stage{s}"
        if role == "replacement":
            shutil.rmtree(self.log_dir, ignore_errors=True)  # lost with the failed machine
        settings = apply_determinism(num_threads=1)
        write_manifest(self.log_dir, settings)
        self.store = store
        self.stage = _build_stage(cfg, s)
        peers = [p for p in (s - 1, s + 1)
                 if 0 <= p < cfg.num_stages and p not in cfg.group_of(s)]
        # About four iterations per chunk (2 sends + 2 receive digests per micro-batch): one
        # chunk file per iteration cost more than the records in it.
        self.logger = (SendLogger(stage=s, log_dir=self.log_dir, log_peers=peers,
                                  chunk_records=16 * cfg.micro_batches, generation=generation,
                                  # PipelineStage never modifies sent/received tensors
                                  copy_at_bubble=False).install() if cfg.logging else None)
        self.completed = 0
        self.dropped_through = -1  # logs through this iteration are deleted
        self.stats: dict = {"stage": s, "role": role, "generation": generation,
                            "loaded_checkpoint": None, "replayed": [], "catch_up": None,
                            "completed_log": [], "losses": {}, "iteration_times": {},
                            "completed_at": {}, "cpu_at": {},
                            "checked_outputs": 0, "replayed_inputs": 0}

    # -- helpers
    def mark(self, event: str) -> None:
        """Record a wall-clock timestamp (for recovery-time breakdowns)."""
        self.stats.setdefault("timeline", []).append((event, time.time()))

    def _checkpoint(self, it: int) -> None:

        if it % self.cfg.checkpoint_every == 0:
            save_stage_checkpoint(self.ckpt_dir, it, self.s, self.stage.state_dict())
        # Logs older than the newest global checkpoint go. Only a checkpoint this stage has
        # written and not yet seen complete can change that: no directory listing otherwise.
        due = it - it % self.cfg.checkpoint_every
        if self.logger is not None and due > self.dropped_through:
            done = latest_global_checkpoint(self.ckpt_dir, self.cfg.num_stages)
            if done is not None and done > self.dropped_through:
                self.logger.drop_through(done)
                self.dropped_through = done

    def _complete(self, it: int, loss, t0: float) -> None:
        self.completed = it
        self.stats["completed_log"].append(it)
        now = time.monotonic()
        self.stats["iteration_times"][it] = now - t0
        self.stats["completed_at"][it] = now
        self.stats["cpu_at"][it] = time.process_time()  # all threads, incl. the log writer
        if loss is not None:
            self.stats["losses"][it] = loss
        if it == self.cfg.fail_iteration:
            self.store.set(f"reached/{self.s}", repr(time.time()))
        self._checkpoint(it)

    def _index(self, peers, after: int):

        dirs = [self.log_root / f"stage{p}" for p in peers]
        for d in dirs:
            check_determinism(read_manifest(d))
        return LogIndex(dirs, after_iteration=after)

    def _neighbours(self):
        return [p for p in (self.s - 1, self.s + 1) if 0 <= p < self.cfg.num_stages]

    def _maybe_die(self, it: int, op: int) -> None:
        cfg = self.cfg
        if cfg.fail_stage is None:
            return
        plan = [(cfg.fail_stage, cfg.fail_iteration, cfg.fail_op), *cfg.later_failures]
        first = self.gen == 0 and self.s in cfg.also_fail and (it, op) == plan[0][1:]
        if first or self.gen < len(plan) and plan[self.gen] == (self.s, it, op):
            if self.gen == 0:
                self.store.wait([f"reached/{p}" for p in cfg.fail_after])
            self.store.set(FAILED, repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def _run(self, channel, it: int) -> None:
        if self.member is not None:
            self.member.mark_iteration(it - 1)
        t0 = time.monotonic()
        loss = self.stage.run_iteration(channel, it, on_op=self._maybe_die)
        self.stats["checked_outputs"] += channel.checked_outputs
        self.stats["replayed_inputs"] += channel.replayed_inputs
        self._complete(it, loss, t0)

    # -- phases
    def restore(self) -> None:
        """Replacement/restart: load the last complete global checkpoint."""


        t0 = time.monotonic()
        c = latest_global_checkpoint(self.ckpt_dir, self.cfg.num_stages)
        if c is None:
            raise RuntimeError(f"no complete global checkpoint in {self.ckpt_dir}")
        path = checkpoint_path(self.ckpt_dir, c, self.s)
        self.stage.load_state_dict(torch.load(path, weights_only=True))
        self.completed = c
        self.stats["loaded_checkpoint"] = c
        if self.member is not None:
            self.member.report_restored(path=str(path), step=c, seconds=time.monotonic() - t0)
        if self.cfg.tamper_replay:
            with torch.no_grad():
                next(self.stage.module.parameters()).view(-1)[0] += 1e-3

    def replay_group(self) -> None:
        """Replacement (and, under selective logging, the failed stage's group-mates, rolled
        back to the checkpoint): replay iterations c+1..low, live within the group, inputs
        from other groups from their logs. Survivors outside the group do not roll back."""
        cfg, members = self.cfg, self.cfg.group_of(self.s)
        outside = [p for p in range(cfg.num_stages) if p not in members]
        self.store.wait([f"gen{self.gen}/completed/{p}" for p in outside])
        done = {p: int(self.store.get(f"gen{self.gen}/completed/{p}")) for p in outside}
        low, _ = recovery_targets(done)
        sub = None
        if len(members) > 1:
            sub = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{self.gen}/replay", self.store),
                                        members.index(self.s), len(members),
                                        timedelta(seconds=cfg.group_timeout))
        logged = [p for p in self._neighbours() if p not in members]
        index = self._index(logged, after=self.completed)
        for it in range(self.completed + 1, low + 1):
            ch = PipelineChannel(stage=self.s, group=sub, logger=self.logger, index=index,
                                 logged_peers=logged,
                                 ranks={m: i for i, m in enumerate(members)})
            self._run(ch, it)
            self.stats["replayed"].append(it)

    def train(self) -> None:
        """Join generation ``gen``, catch up if behind, then train to the end; on a peer
        failure flush the logs and move to the next generation without rolling back."""


        cfg, S = self.cfg, self.cfg.num_stages
        self.store.set(f"gen{self.gen}/completed/{self.s}", str(self.completed))
        if self.gen == 0 and self.role == "initial":
            self._checkpoint(0)
        while True:
            group = None
            flag = FailureFlag(store=self.store, generation=self.gen)
            waiter = WorkWaiter()  # per generation: an old one may stay blocked on a dead peer
            try:
                group = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{self.gen}", self.store),
                                              self.s, S, timedelta(seconds=cfg.group_timeout))
                self.mark(f"group{self.gen}")
                keys = [f"gen{self.gen}/completed/{p}" for p in range(S)]
                self.store.wait(keys)
                done = {p: int(self.store.get(k)) for p, k in enumerate(keys)}
                _, high = recovery_targets(done)
                idle = self.logger.idle if self.logger is not None else None
                if self.completed < high:
                    ahead = catch_up_peers(done, iteration=high)
                    index = self._index(ahead & set(self._neighbours()), after=high - 1)
                    ch = PipelineChannel(stage=self.s, group=group, logger=self.logger,
                                         index=index, logged_peers=ahead, idle=idle,
                                         failure=flag.is_set, waiter=waiter)
                    self._run(ch, high)
                    self.stats["catch_up"] = high
                for it in range(self.completed + 1, cfg.iterations + 1):
                    ch = PipelineChannel(stage=self.s, group=group, logger=self.logger,
                                         idle=idle, failure=flag.is_set, waiter=waiter)
                    self._run(ch, it)
                    if self.logger is not None:
                        self.logger.bubble()  # end of iteration: idle until the next starts
                if self.logger is not None:
                    self.logger.flush()
                # Nobody closes its connections while a peer may still read from them.
                if self.store.add(f"gen{self.gen}/finished", 1) == S:
                    self.store.set(f"gen{self.gen}/all_finished", "1")
                self.store.wait([f"gen{self.gen}/all_finished"])
                return
            except PeerFailure as exc:
                self.stats.setdefault("failures_seen", []).append(str(exc)[:200])
                self.mark("failure_seen")
                flag.raise_flag()
                if self.logger is not None:
                    self.logger.flush()
                if group is not None:
                    try:
                        group.abort()  # wake peers blocked on us: the failure cascades
                    except RuntimeError:
                        pass  # already broken; abandoning it is enough
                self.gen += 1
                if self.logger is not None:
                    self.logger.generation = self.gen
                self.store.wait([announce_key(self.gen)])  # bounded by the store timeout
                failed = int(self.store.get(announce_key(self.gen)))
                self.mark("announced")
                if failed in cfg.group_of(self.s):
                    # Intra-group messages were not logged: the group recovers together.
                    self.stats["rolled_back"] = True
                    self.restore()
                    self.replay_group()
                self.store.set(f"gen{self.gen}/completed/{self.s}", str(self.completed))

    def finish(self) -> None:

        out = self.run / "final"
        out.mkdir(parents=True, exist_ok=True)
        torch.save(self.stage.module.state_dict(), out / f"stage{self.s}.pt")
        if self.logger is not None:
            self.stats["bytes_logged"] = self.logger.bytes_logged
            self.logger.close()
        (out / f"stage{self.s}.json").write_text(json.dumps(self.stats))


def _run_stage(cfg: PipelineRun, s: int, generation: int, role: str, store: dist.Store,
               member: Optional[StageMembership] = None) -> None:
    st = _Stage(cfg, s, generation, role, store, member)
    st.mark("started")
    if role in ("replacement", "restart"):
        st.restore()
        st.mark("restored")
    if role == "replacement":
        st.replay_group()
        st.mark("replayed")
        if member is not None:
            member.report_caught_up(checkpoint=st.stats["loaded_checkpoint"],
                                    replayed=len(st.stats["replayed"]))
    st.train()
    st.finish()


def _stage_entry(cfg: PipelineRun, s: int, generation: int, role: str, port: int) -> None:
    # A stage still alive near the deadline prints its Python stacks (diagnosing hangs).
    faulthandler.dump_traceback_later(max(1.0, cfg.group_timeout * 0.9), exit=False)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=cfg.timeout))
        _run_stage(cfg, s, generation, role, store)
    except BaseException:
        text = traceback.format_exc()
        sys.stderr.write(text)
        errors = Path(cfg.run_dir) / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        (errors / f"stage{s}.txt").write_text(text)
        os._exit(3)
    os._exit(0)


# ------------------------------------------------------------------ supervisor -------------
@dataclass
class RunResult:
    """What a supervised run produced."""

    ok: bool
    wall_time: float
    stats: dict = field(default_factory=dict)  # stage -> stats json
    failure_time: Optional[float] = None
    reached_time: dict = field(default_factory=dict)  # stage -> time fail_iteration completed
    exit_codes: list = field(default_factory=list)

    @property
    def recovery_time(self) -> Optional[float]:
        """Seconds from the failure until every stage had completed the failed iteration."""
        if self.failure_time is None or not self.reached_time:
            return None
        return max(self.reached_time.values()) - self.failure_time


def run_pipeline(cfg: PipelineRun) -> RunResult:
    """Run the pipeline in forked stage processes; every process is killed by PID on exit."""
    if cfg.later_failures or cfg.also_fail:
        raise ValueError("later_failures/also_fail: this supervisor handles one failure; run the "
                         "example under jitckpt run --recovery stage for more")
    with StoreServer() as server:  # master in its own process: forking stages stays safe
        return _supervise(cfg, server)


def _supervise(cfg: PipelineRun, server: StoreServer) -> RunResult:
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    store = server.client(timeout=cfg.timeout)
    ctx = multiprocessing.get_context("fork")
    procs: dict[int, multiprocessing.Process] = {}
    exit_codes: list = []
    gen = 0

    def spawn(s: int, role: str) -> None:
        p = ctx.Process(target=_stage_entry, args=(cfg, s, gen, role, store.port), daemon=True)
        p.start()
        procs[s] = p

    t0 = time.monotonic()
    deadline = t0 + cfg.timeout
    ok = False
    try:
        for s in range(cfg.num_stages):
            spawn(s, "initial")
        while procs:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"pipeline run did not finish within {cfg.timeout}s")
            multiprocessing.connection.wait([p.sentinel for p in procs.values()], left)
            for s, p in list(procs.items()):
                if p.exitcode is None:
                    continue
                del procs[s]
                exit_codes.append((s, p.exitcode))
                if p.exitcode == 0:
                    continue
                if p.exitcode == -signal.SIGKILL and gen == 0 and s == cfg.fail_stage:
                    store.set(failure_key(gen), "1")
                    gen += 1
                    if cfg.recovery == "logging":
                        spawn(s, "replacement")
                        store.set(announce_key(gen), str(s))
                    else:  # baseline: restart every stage from the global checkpoint
                        for q in list(procs.values()):
                            os.kill(q.pid, signal.SIGKILL)
                            q.join(cfg.timeout)
                        procs.clear()
                        for q in range(cfg.num_stages):
                            spawn(q, "restart")
                        break  # the snapshot being iterated holds the killed processes
                    continue
                err = run / "errors" / f"stage{s}.txt"
                detail = err.read_text() if err.exists() else "(no traceback; see stderr)"
                raise RuntimeError(f"stage {s} exited with code {p.exitcode}:\n{detail}")
        ok = True
    finally:
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    return _collect(cfg, store, ok, time.monotonic() - t0, exit_codes)


def _collect(cfg: PipelineRun, store, ok: bool, wall: float, exit_codes: list) -> RunResult:
    run = Path(cfg.run_dir)
    res = RunResult(ok=ok, wall_time=wall, exit_codes=exit_codes)
    for s in range(cfg.num_stages):
        f = run / "final" / f"stage{s}.json"
        if f.exists():
            res.stats[s] = json.loads(f.read_text())
        key = f"reached/{s}"
        if store.check([key]):
            res.reached_time[s] = float(store.get(key))
    if store.check([FAILED]):
        res.failure_time = float(store.get(FAILED))
    return res


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="/tmp/pipeline_logging_demo")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--fail-stage", type=int, default=None)
    ap.add_argument("--fail-iter", type=int, default=7)
    ap.add_argument("--fail-op", type=int, default=3)
    ap.add_argument("--recovery", choices=("logging", "restart"), default="logging")
    ap.add_argument("--then-fail", action="append", default=[], metavar="STAGE:ITER:OP",
                    help="under jitckpt run --recovery stage: a further failure, injected after "
                         "the previous one was replaced (repeatable)")
    ap.add_argument("--also-fail", action="append", type=int, default=[], metavar="STAGE",
                    help="under jitckpt run --recovery stage: a stage that dies together with "
                         "--fail-stage, at the same point (repeatable)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="bound on every wait (store, process group, the whole run)")
    args = ap.parse_args(argv)
    member = StageMembership.from_launcher(timeout=args.timeout)
    cfg_kw = dict(run_dir=args.run_dir, iterations=args.iterations,
                  checkpoint_every=args.checkpoint_every, fail_stage=args.fail_stage,
                  fail_iteration=args.fail_iter, fail_op=args.fail_op, recovery=args.recovery,
                  timeout=args.timeout, group_timeout=args.timeout,
                  later_failures=tuple(tuple(int(x) for x in f.split(":")) for f in args.then_fail),
                  also_fail=tuple(args.also_fail))
    if member is not None:
        # One stage per worker of `jitckpt run --recovery stage`: the launcher supervises and
        # starts a replacement for a dead stage. The run directory holds the checkpoints a
        # replacement needs, so it is never cleared here.
        cfg = PipelineRun(num_stages=member.world_size, **cfg_kw)
        _run_stage(cfg, member.rank, member.generation, member.role, member.store, member)
        member.exit(0)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    res = run_pipeline(PipelineRun(**cfg_kw))
    print(json.dumps({"ok": res.ok, "wall_time": res.wall_time,
                      "recovery_time": res.recovery_time,
                      "stats": {s: {k: v for k, v in st.items()
                                    if k not in ("iteration_times", "completed_at", "cpu_at")}
                                for s, st in res.stats.items()}}, indent=1))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
