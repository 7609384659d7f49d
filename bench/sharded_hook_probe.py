"""What jitckpt adds to an FSDP2 training thread's step, timed in one job (torchrun, 4 ranks, full
sharding; bench/bench_sharded.py section 6).

FSDP2 waits for each all-gather and reduce-scatter in a ``Work.wait()``, which jitckpt wraps as a
region (hang detection), so an FSDP2 step enters many more regions than a DDP step's one backward.
Each rank runs a worker runtime as `jitckpt run` gives it (no launcher channel), protects the
model, trains, and counts the regions its steps enter. Then, in the same process, it times the
per-step hooks (forward pre-hook, backward region, optimizer hooks, step done: as
bench_recovery.py's hook cost) and one wrapped ``Work.wait()`` of a completed collective against
the unwrapped one. Cost per step = hooks + (regions per step - 1) x the wrapper's own cost."""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
import train_ddp  # noqa: E402

import jitckpt  # noqa: E402
from jitckpt.hang_timeout import HangTimeout  # noqa: E402
from jitckpt.protocol.step_board import StepBoard  # noqa: E402
from jitckpt.runtime.current import install_runtime  # noqa: E402
from jitckpt.runtime.worker_runtime import WorkerRuntime  # noqa: E402


def per_call(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sys.argv = [sys.argv[0], "--in-dim", "1024", "--hidden", "2048", "--layers", "2", "--out-dim", "1024"]
    margs = train_ddp.parse()
    with tempfile.TemporaryDirectory() as d:
        rt = WorkerRuntime(rank=rank, world_size=world, gen=0, checkpoint_dir=d,
                           hang_timeout=HangTimeout(fixed=60), channel=None, board=StepBoard.create())
        rt.start()
        install_runtime(rt)
        entered = [0]
        enter = rt.region_enter

        def counting(kind: str) -> int:
            entered[0] += 1
            return enter(kind)

        rt.region_enter = counting  # the hooks call the runtime's attribute: every region counts
        model = train_ddp.shard_fsdp2(train_ddp.build(margs), world, 1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        state = jitckpt.protect(model, opt)
        x, y = torch.randn(32, 1024), torch.randn(32, 1024)
        times = []
        for step in range(3 + args.steps):
            if step == 3:
                entered[0] = 0
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step >= 3:
                times.append(time.perf_counter() - t0)
        regions = entered[0] / args.steps
        rt.region_enter = enter

        def hooks() -> None:
            state._on_forward(model, ())
            tok = rt.region_enter("backward")
            rt.region_exit(tok, None)
            rt.optimizer_pre_step()
            rt.optimizer_post_step()
            state._on_step_done()

        hook_s = per_call(hooks, args.iters)
        work = dist.all_reduce(torch.zeros(1), async_op=True)
        work.wait()
        raw = dist.Work.wait.__jitckpt_wrapped__
        wrapped_s = per_call(lambda: work.wait(), args.iters)
        raw_s = per_call(lambda: raw(work), args.iters)
        dist.barrier()
        state.close()
        rt._watchdog.stop()
        rt._hooks.remove()
    step_s = statistics.median(times)
    per_step = hook_s + max(0.0, regions - 1) * max(0.0, wrapped_s - raw_s)
    mine = {"rank": rank, "regions_per_step": regions, "hooks_s": hook_s, "wait_wrapper_s": wrapped_s - raw_s,
            "per_step_s": per_step, "step_s": step_s, "fraction": per_step / step_s}
    rows = [None] * world
    dist.all_gather_object(rows, mine)
    if rank == 0:
        worst = max(rows, key=lambda r: r["fraction"])
        Path(args.out).write_text(json.dumps({"ranks": rows, "worst": worst}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
