"""Parallel recovery (SWIFT §5.2) from real pipeline logs, 2 gloo worker processes.

A failure-free 4-stage run with logging leaves a global checkpoint at iteration 4 and the logs
of iterations 5-6. Two workers load stage 2's checkpoint and re-compute its micro-batches in
parallel (worker 0: {0, 2}, worker 1: {1, 3}, as in SWIFT Fig. 7), exchange per-micro-batch
gradients and accumulate them in micro-batch order. Worker 0 also replays sequentially. Both
results must be bitwise identical to the stage's parameters at the end of the original run.

What this does not show: helpers here are fresh processes, not surviving data-parallel peers
of a running pipeline that checkpoint, lend themselves and restore (SWIFT Fig. 6c).
"""
from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from jitckpt.swift.pipeline.forked_supervisor import run_pipeline
from jitckpt.swift.pipeline.reference_model import MlpStages
from jitckpt.swift.pipeline.run_config import PipelineRun

from forked_ranks import run_ranks

STAGE, CKPT, ITERS = 2, 4, 6
PROC_TIMEOUT = 60.0


def _worker(rank: int, port: int, run_dir: str) -> None:
    try:
        from jitckpt.swift.pipeline.logging_determinism import apply_determinism
        from jitckpt.swift.pipeline.logging_replay import LogIndex
        from jitckpt.swift.pipeline.channel import PipelineChannel
        from jitckpt.swift.pipeline.parallel_recovery import parallel_replay_iteration
        from jitckpt.swift.pipeline.recovery import checkpoint_path

        apply_determinism(num_threads=1)
        cfg = PipelineRun(run_dir=run_dir, iterations=ITERS, checkpoint_every=CKPT)
        run = Path(run_dir)
        logs = [run / "logs" / f"stage{p}" for p in (STAGE - 1, STAGE + 1)]
        ckpt = torch.load(checkpoint_path(run / "ckpt", CKPT, STAGE), weights_only=True)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        stage = MlpStages()(cfg, STAGE)
        stage.load_state_dict(ckpt)
        index = LogIndex(logs, after_iteration=CKPT)
        assigned = {it: parallel_replay_iteration(stage, index, iteration=it,
                                                  group=dist.group.WORLD)
                    for it in range(CKPT + 1, ITERS + 1)}
        out = run / "parallel"
        out.mkdir(exist_ok=True)
        torch.save(stage.module.state_dict(), out / f"parallel{rank}.pt")
        (out / f"assigned{rank}.json").write_text(json.dumps(assigned))
        if rank == 0:  # sequential replay of the same iterations, same logs
            seq = MlpStages()(cfg, STAGE)
            seq.load_state_dict(ckpt)
            index = LogIndex(logs, after_iteration=CKPT)
            for it in range(CKPT + 1, ITERS + 1):
                ch = PipelineChannel(stage=STAGE, group=None, index=index,
                                     logged_peers=(STAGE - 1, STAGE + 1))
                seq.run_iteration(ch, it)
            torch.save(seq.module.state_dict(), out / "sequential.pt")
        dist.destroy_process_group()
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def test_parallel_recovery_is_bitwise_identical_to_sequential(tmp_path):
    run_dir = tmp_path / "run"
    res = run_pipeline(PipelineRun(run_dir=str(run_dir), iterations=ITERS,
                                   checkpoint_every=CKPT, timeout=60.0), build_stage=MlpStages())
    assert res.ok
    want = torch.load(run_dir / "final" / f"stage{STAGE}.pt", weights_only=True)
    assert run_ranks(_worker, str(run_dir), timeout=PROC_TIMEOUT) == [0, 0]
    out = run_dir / "parallel"
    assert json.loads((out / "assigned0.json").read_text()) == {"5": [0, 2], "6": [0, 2]}
    assert json.loads((out / "assigned1.json").read_text()) == {"5": [1, 3], "6": [1, 3]}
    for name in ("parallel0.pt", "parallel1.pt", "sequential.pt"):
        got = torch.load(out / name, weights_only=True)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{name}: {k} differs from the original run"
