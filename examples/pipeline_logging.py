"""4-stage pipeline (1F1B, gloo, one process per stage) with SWIFT logging-based recovery.

A dead stage gets a replacement that loads the last global checkpoint and replays its lost
iterations alone from its neighbours' logs; the other stages keep their state (``--recovery
restart``: every stage restarts from the checkpoint instead). ``--fail-stage`` makes one stage
SIGKILL itself, to see it. Run directly (the stages are forked processes of this one)::

    python examples/pipeline_logging.py --fail-stage 2 --fail-iter 7

or under the launcher, which then supervises (one stage per worker)::

    jitckpt run --nproc-per-node 4 --plugin logging examples/pipeline_logging.py \
        --run-dir /tmp/pl --fail-stage 2 --fail-iter 7
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitckpt.swift.pipeline.fault_plan import FaultPlan  # noqa: E402
from jitckpt.swift.pipeline.forked_supervisor import run_pipeline  # noqa: E402
from jitckpt.swift.pipeline.reference_model import MlpStages  # noqa: E402
from jitckpt.swift.pipeline.run_config import PipelineRun  # noqa: E402
from jitckpt.swift.pipeline.stage_membership import StageMembership  # noqa: E402
from jitckpt.swift.pipeline.stage_runtime import run_stage  # noqa: E402

# Replace with your model: any callable (run, stage index) -> jitckpt.swift.PipelineStage.
BUILD_STAGE = MlpStages(hidden=32, layers_per_stage=2, micro_batch_size=8)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="/tmp/pipeline_logging_demo")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--recovery", choices=("logging", "restart"), default="logging")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="bound on every wait (store, process group, the whole run)")
    ap.add_argument("--fail-stage", type=int, default=None)
    ap.add_argument("--fail-iter", type=int, default=7)
    ap.add_argument("--fail-op", type=int, default=3)
    ap.add_argument("--then-fail", action="append", default=[], metavar="STAGE:ITER:OP",
                    help="under jitckpt run --recovery stage: a further failure, injected after "
                         "the previous one was replaced (repeatable)")
    ap.add_argument("--also-fail", action="append", type=int, default=[], metavar="STAGE",
                    help="under jitckpt run --recovery stage: a stage that dies together with "
                         "--fail-stage, at the same point (repeatable)")
    args = ap.parse_args(argv)
    faults = FaultPlan(fail_stage=args.fail_stage, fail_iteration=args.fail_iter,
                       fail_op=args.fail_op, also_fail=tuple(args.also_fail),
                       later_failures=tuple(tuple(int(x) for x in f.split(":"))
                                            for f in args.then_fail))
    run = dict(run_dir=args.run_dir, iterations=args.iterations,
               checkpoint_every=args.checkpoint_every, recovery=args.recovery,
               timeout=args.timeout, group_timeout=args.timeout)
    member = StageMembership.from_launcher(timeout=args.timeout)
    if member is not None:
        # One stage per worker of `jitckpt run --recovery stage`: the launcher supervises and
        # starts a replacement for a dead stage. The run directory holds the checkpoints a
        # replacement needs, so it is never cleared here.
        cfg = PipelineRun(num_stages=member.world_size, **run)
        run_stage(cfg, member.rank, member.generation, member.role, member.store,
                  build_stage=BUILD_STAGE, faults=faults, member=member)
        member.exit(0)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    res = run_pipeline(PipelineRun(**run), build_stage=BUILD_STAGE, faults=faults)
    print(json.dumps({"ok": res.ok, "wall_time": res.wall_time,
                      "recovery_time": res.recovery_time,
                      "stats": {s: {k: v for k, v in st.items()
                                    if k not in ("iteration_times", "completed_at", "cpu_at")}
                                for s, st in res.stats.items()}}, indent=1))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
