"""One pipeline stage's process across process-group generations: :class:`StageRuntime`.

A stage trains its part of the model with its neighbours over gloo, logs what it sends (SWIFT
logging) and checkpoints every ``checkpoint_every`` iterations. When a peer dies it keeps its
state (no roll back), flushes its logs, waits for the replacement and joins the next generation's
group under a new store prefix; a stage one iteration behind re-runs that iteration. A
replacement (or, under selective logging, the dead stage's group-mates) loads the last global
checkpoint and replays the lost iterations from the neighbours' logs first. :func:`run_stage`
runs one stage from start to finish, as a forked process of
:mod:`~jitckpt.swift.pipeline.forked_supervisor` or as a worker of
``jitckpt run --recovery stage`` (with its :class:`StageMembership`).

The model comes from a stage builder (:data:`StageBuilder`), the failures to inject from a
:class:`~jitckpt.swift.pipeline.fault_plan.FaultPlan`.
"""
from __future__ import annotations

import json
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from jitckpt.swift.pipeline.channel import PeerFailure, PipelineChannel, WorkWaiter
from jitckpt.swift.pipeline.failure_flag import FailureFlag, announce_key
from jitckpt.swift.pipeline.fault_plan import FaultPlan
from jitckpt.swift.pipeline.logging_determinism import (apply_determinism, check_determinism,
                                                        read_manifest, write_manifest)
from jitckpt.swift.pipeline.logging_replay import LogIndex
from jitckpt.swift.pipeline.logging_sender import SendLogger
from jitckpt.swift.pipeline.recovery import (catch_up_peers, checkpoint_path,
                                             latest_global_checkpoint, recovery_targets,
                                             save_stage_checkpoint)
from jitckpt.swift.pipeline.run_config import PipelineRun
from jitckpt.swift.pipeline.stage import PipelineStage
from jitckpt.swift.pipeline.stage_membership import StageMembership

# Builds stage ``stage`` of a run: its module, optimizer, data and loss. It is called in the
# stage's own process (and again in a replacement), so it must build the same stage every time.
StageBuilder = Callable[[PipelineRun, int], PipelineStage]


class StageRuntime:
    """State of one stage process across process-group generations.

    ``role`` is ``initial``, ``replacement`` (of a dead stage: :meth:`restore`, then
    :meth:`replay_group`) or ``restart`` (every stage restarted from the checkpoint: :meth:`restore`);
    then :meth:`train` to the last iteration and :meth:`finish`. ``stats`` is what the stage
    writes to ``run_dir/final/stage<s>.json``.
    """

    def __init__(self, cfg: PipelineRun, s: int, generation: int, role: str, store: dist.Store, *,
                 build_stage: StageBuilder, faults: FaultPlan = FaultPlan(),
                 member: Optional[StageMembership] = None) -> None:
        faults.check(cfg)
        self.cfg, self.s, self.gen, self.role = cfg, s, generation, role
        self.faults = faults
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
        self.stage = build_stage(cfg, s)
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

    def _complete(self, it: int, loss: Optional[float], t0: float) -> None:
        self.completed = it
        self.stats["completed_log"].append(it)
        now = time.monotonic()
        self.stats["iteration_times"][it] = now - t0
        self.stats["completed_at"][it] = now
        self.stats["cpu_at"][it] = time.process_time()  # all threads, incl. the log writer
        if loss is not None:
            self.stats["losses"][it] = loss
        self.faults.on_completed(self.store, stage=self.s, iteration=it)
        self._checkpoint(it)

    def _index(self, peers: Iterable[int], after: int) -> LogIndex:
        dirs = [self.log_root / f"stage{p}" for p in peers]
        for d in dirs:
            check_determinism(read_manifest(d))
        return LogIndex(dirs, after_iteration=after)

    def _neighbours(self) -> list[int]:
        return [p for p in (self.s - 1, self.s + 1) if 0 <= p < self.cfg.num_stages]

    def _on_op(self, it: int, op: int) -> None:
        self.faults.on_op(self.store, stage=self.s, generation=self.gen, iteration=it, op=op)

    def _run(self, channel: PipelineChannel, it: int) -> None:
        if self.member is not None:
            self.member.mark_iteration(it - 1)
        t0 = time.monotonic()
        loss = self.stage.run_iteration(channel, it, on_op=self._on_op)
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
        self.faults.after_restore(self.stage)

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
        """Write the final parameters and ``stats`` to ``run_dir/final``; close the logger."""
        out = self.run / "final"
        out.mkdir(parents=True, exist_ok=True)
        torch.save(self.stage.module.state_dict(), out / f"stage{self.s}.pt")
        if self.logger is not None:
            self.stats["bytes_logged"] = self.logger.bytes_logged
            self.logger.close()
        (out / f"stage{self.s}.json").write_text(json.dumps(self.stats))


def run_stage(cfg: PipelineRun, s: int, generation: int, role: str, store: dist.Store, *,
              build_stage: StageBuilder, faults: FaultPlan = FaultPlan(),
              member: Optional[StageMembership] = None) -> None:
    """Run stage ``s`` of ``cfg`` in this process from ``generation`` (in ``role``) to the last
    iteration, coordinating through ``store``; under ``jitckpt run --recovery stage`` pass the
    worker's ``member`` (its rank, generation, role and store), so the launcher hears of the
    stage's progress and of a replacement having caught up."""
    st = StageRuntime(cfg, s, generation, role, store, build_stage=build_stage, faults=faults,
                      member=member)
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
