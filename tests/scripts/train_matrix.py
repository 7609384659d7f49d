"""The training script of the fault-injection matrix (tests/fault_harness.py, test_fault_matrix.py).

Deterministic DDP training (data chosen by step, as examples/train_ddp.py), so a resumed run's final
parameters and buffers can be compared bitwise with a failure-free run's. Faults come from outside
(the harness signals worker PIDs at random times); the few a plain signal cannot cause are armed:

* ``--on-usr1 MODE``: SIGUSR1 makes this rank fail, MODE one of
    gil     hold the GIL in a C call (libc sleep through ctypes.PyDLL), at the point the signal hit
    raise   raise an exception at the next point the training loop checks (several per step)
    optim   SIGKILL itself inside the next optimizer.step(), after the gradient all-reduce
    backward  SIGKILL itself inside the next backward, in the middle of the model: the layers after
            it have issued their gradient reduction (FSDP2's reduce-scatters, DDP's buckets)
    reduce_scatter  SIGKILL itself right after issuing its next reduce-scatter (FSDP2's gradient
            reduction, asynchronous): the peers are inside that collective
* ``--exit-fault GEN:RANK:MODE``: RANK of launch GEN dies once it passed jitckpt's exit barrier:
    abort   SIGABRT from a libc exit handler, after the interpreter has finalized
    kill    SIGKILL from a Python atexit handler that runs after jitckpt's exit barrier

``--phase-sleep S`` spreads each step over its phases (before the forward, in the forward, in the
backward before DDP's all-reduce, before and inside the optimizer step) so a signal at a random
time lands in any of them. Every step logs ``begin`` and, once done, ``step`` records (gen, rank,
pid) to ``--steps-log``; rank 0 saves the final ``state_dict`` (parameters and buffers) to ``--out``.

``--parallel hsdp``: FSDP2 instead of DDP, ``fully_shard`` on each linear layer and the root over a
2-D mesh (2 replica groups x the rest), ``protect()`` only; the final state is gathered whole.
``fsdp``: the same on a 1-D mesh (full sharding); ``tp``: tensor parallel on a 1-D mesh, each linear
layer column- or row-wise with replicated activations between them (the norms see whole features),
the ranks of a TP group on the same data; ``fsdp_tp``: a (dp 2 x tp) mesh, TP inside, FSDP2 over dp;
``pp``: two pipeline stages (torch.distributed.pipelining, GPipe, 2 microbatches) on a (pp 2 x dp)
mesh, each stage's half of the model fully_shard over dp; ``pp_ddp``: the same stages, each a plain
module in DDP over its dp group (no DTensor: the stages are told apart by their DDP groups), the
activations and their gradients sent point to point (Megatron-style: torch.distributed.pipelining's
microbatches trip DDP's bucket rebuild in this torch, with or without jitckpt).
"""
import argparse
import atexit
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import jitckpt
from jitckpt.runtime.current import runtime_or_none

IN, HIDDEN, OUT, BATCH = 32, 64, 8, 16


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="ln", choices=["ln", "bn", "dropout"])
    p.add_argument("--optim", default="adam", choices=["adam", "sgd", "adamw"])
    p.add_argument("--api", default="protect", choices=["protect", "init"])
    p.add_argument("--parallel", default="ddp", choices=["ddp", "hsdp", "fsdp", "tp", "fsdp_tp", "pp", "pp_ddp"])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--phase-sleep", type=float, default=0.0)
    p.add_argument("--on-usr1", default="", choices=["", "gil", "raise", "optim", "backward", "reduce_scatter"])
    p.add_argument("--exit-fault", default="", metavar="GEN:RANK:MODE")
    p.add_argument("--compile", action="store_true", help="the forward through torch.compile (DDP only)")
    p.add_argument("--out", default="")
    p.add_argument("--steps-log", default="")
    return p.parse_args()


class Sleep(nn.Module):
    """Identity whose forward and backward each take ``seconds`` (a phase of the step)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
            x = _SleepBackward.apply(x, self.seconds)
        return x


KILL_IN_BACKWARD = {"armed": False}  # --on-usr1 backward, once SIGUSR1 came
KILL_IN_REDUCE_SCATTER = {"armed": False}  # --on-usr1 reduce_scatter, once SIGUSR1 came


def kill_in_reduce_scatter() -> None:
    """--on-usr1 reduce_scatter: once armed, the next reduce-scatter is issued and this rank SIGKILLs
    itself before returning it (FSDP2 looks ``dist.reduce_scatter_single`` up at each call)."""
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def issue_then_die(*args, _fn=fn, **kwargs):  # type: ignore[no-untyped-def]
            work = _fn(*args, **kwargs)
            if KILL_IN_REDUCE_SCATTER["armed"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return work

        setattr(dist, name, issue_then_die)


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):  # type: ignore[no-untyped-def]
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        if KILL_IN_BACKWARD["armed"]:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(ctx.seconds)
        return g, None


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    norm = {"ln": lambda: nn.LayerNorm(HIDDEN), "bn": lambda: nn.BatchNorm1d(HIDDEN),
            "dropout": lambda: nn.Dropout(0.2)}[args.model]
    return nn.Sequential(nn.Linear(IN, HIDDEN), norm(), nn.Tanh(), Sleep(args.phase_sleep),
                         nn.Linear(HIDDEN, HIDDEN), norm(), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def make_optimizer(args: argparse.Namespace, params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    if args.optim == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if args.optim == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batch_for(step: int, rank: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def sharded(net: nn.Module, parallel: str) -> tuple:
    """``net`` laid out on a DeviceMesh (see the module docstring); (the model, the rank whose data
    this rank trains on, the pipeline schedule or None, the stage index or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world, rank = dist.get_world_size(), dist.get_rank()
    shape, names = {"hsdp": ((2, world // 2), ("replicate", "shard")), "fsdp": ((world,), ("shard",)),
                    "tp": ((world,), ("tp",)), "fsdp_tp": ((2, world // 2), ("dp", "tp")),
                    "pp": ((2, world // 2), ("pp", "dp")), "pp_ddp": ((2, world // 2), ("pp", "dp"))}[parallel]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    data_rank = rank
    if parallel in ("pp", "pp_ddp"):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        stage, data_rank = mesh.get_coordinate()
        layers = list(net.children())
        half = nn.Sequential(*(layers[:4] if stage == 0 else layers[4:]))
        if parallel == "pp_ddp":
            half = DDP(half, process_group=mesh["dp"].get_group())
            peer = dist.get_process_group_ranks(mesh["pp"].get_group())[1 - stage]
            return half, data_rank, PointToPointPipe(half, stage, peer), stage
        else:
            for layer in half:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["dp"])
            fully_shard(half, mesh=mesh["dp"])
        pipe = ScheduleGPipe(PipelineStage(half, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group()),
                             n_microbatches=2, loss_fn=nn.functional.mse_loss)
        return half, data_rank, pipe, stage
    if parallel in ("tp", "fsdp_tp"):
        whole = Replicate()
        parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(output_layouts=whole),
                                             "4": RowwiseParallel(input_layouts=whole),
                                             "7": ColwiseParallel(output_layouts=whole)})
        data_rank = 0 if parallel == "tp" else mesh.get_coordinate()[0]
    if parallel == "tp":
        return net, data_rank, None, None
    dp = mesh["dp"] if parallel == "fsdp_tp" else mesh
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp)
    return fully_shard(net, mesh=dp), data_rank, None, None


class PointToPointPipe:
    """Two stages, one microbatch: stage 0 sends its output to its peer in stage 1 and gets back
    the gradient of the loss with respect to it."""

    def __init__(self, module: nn.Module, stage: int, peer: int) -> None:
        self.module, self.stage, self.peer = module, stage, peer

    def step(self, x: torch.Tensor = None, target: torch.Tensor = None) -> None:  # type: ignore[assignment]
        if self.stage == 0:
            out = self.module(x)
            dist.send(out.detach().contiguous(), self.peer)
            grad = torch.empty_like(out)
            dist.recv(grad, self.peer)
            out.backward(grad)
        else:
            h = torch.empty(target.shape[0], HIDDEN)
            dist.recv(h, self.peer)
            h.requires_grad_(True)
            nn.functional.mse_loss(self.module(h), target).backward()
            dist.send(h.grad.contiguous(), self.peer)


def arm_exit_fault(mode: str) -> None:
    if mode == "abort":  # libc runs __cxa_atexit handlers after Py_Finalize
        import ctypes

        libc = ctypes.CDLL(None)
        libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
        return

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    # atexit runs last-registered first: ``die`` must be registered before the runtime's barrier,
    # which the warm standby registered before this script started.
    rt = runtime_or_none()
    barrier = getattr(rt, "_exit_barrier", None)
    if barrier is not None:
        atexit.unregister(barrier)
    atexit.register(die)
    if barrier is not None:
        atexit.register(barrier)


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.exit_fault:
        g, r, mode = args.exit_fault.split(":")
        if int(g) == gen and int(r) == rank:
            arm_exit_fault(mode)
    net = build(args)
    data_rank, pipe, stage = rank, None, None
    if args.parallel == "ddp":
        model = DDP(net)
    else:
        model, data_rank, pipe, stage = sharded(net, args.parallel)
        if pipe is not None:
            net = model  # this rank's stage
    opt = make_optimizer(args, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    forward = torch.compile(model) if args.compile else model
    armed = {"fire": False}

    def on_usr1(signum, frame):  # type: ignore[no-untyped-def]
        if args.on_usr1 == "gil":
            import ctypes

            ctypes.PyDLL(None).sleep(3600)  # PyDLL keeps the GIL: no Python thread here runs
        armed["fire"] = True
        KILL_IN_BACKWARD["armed"] = args.on_usr1 == "backward"
        KILL_IN_REDUCE_SCATTER["armed"] = args.on_usr1 == "reduce_scatter"

    signal.signal(signal.SIGUSR1, on_usr1)
    if args.on_usr1 == "reduce_scatter":
        kill_in_reduce_scatter()

    def check_raise() -> None:
        if armed["fire"] and args.on_usr1 == "raise":
            raise RuntimeError(f"injected exception in rank {rank} (SIGUSR1)")

    def in_optimizer_step(*_a, **_k) -> None:  # type: ignore[no-untyped-def]
        if armed["fire"] and args.on_usr1 == "optim":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.phase_sleep:
            time.sleep(args.phase_sleep)

    if args.api == "protect":
        state = jitckpt.protect(model, opt, sched)
        start = state.restore()
    else:
        done = {"steps": 0}

        def save_fn(path: str) -> None:  # what the README asks of a save function
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "step": done["steps"],
                        "rng": torch.get_rng_state()}, os.path.join(path, "state.pt"))

        jitckpt.init(save_fn, step_fn=lambda: done["steps"])
        path = jitckpt.get_checkpoint_path()
        if path is not None:
            sd = torch.load(os.path.join(path, "state.pt"), weights_only=True)
            net.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
            sched.load_state_dict(sd["scheduler"])
            torch.set_rng_state(sd["rng"])
            done["steps"] = sd["step"]
        start = done["steps"]
    opt.register_step_pre_hook(in_optimizer_step)
    logf = open(args.steps_log, "a") if args.steps_log else None

    def log(**rec) -> None:  # type: ignore[no-untyped-def]
        if logf:
            logf.write(json.dumps({"gen": gen, "rank": rank, "pid": os.getpid(), "t": time.time(), **rec}) + "\n")
            logf.flush()

    loss_fn = nn.MSELoss()
    for step in range(start, args.steps):
        if args.api == "init":
            jitckpt.mark_step(step)
        log(begin=step)
        x, y = batch_for(step, data_rank)
        if args.phase_sleep:
            time.sleep(args.phase_sleep)
        check_raise()
        if pipe is not None:  # forward and backward of both microbatches through the stages
            opt.zero_grad(set_to_none=True)
            pipe.step(x) if stage == 0 else pipe.step(target=y)
        else:
            loss = loss_fn(forward(x), y)
            check_raise()
            opt.zero_grad(set_to_none=True)
            loss.backward()
        check_raise()
        if args.phase_sleep:
            time.sleep(args.phase_sleep)
        opt.step()
        if args.api == "init":
            done["steps"] += 1
        sched.step()
        log(step=step)
    if args.parallel != "ddp":  # gathered whole: a collective, every rank
        sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
              for k, v in net.state_dict().items()}
    if pipe is not None:  # every stage's state, named by stage, to rank 0
        everyone = [None] * dist.get_world_size()
        dist.gather_object({f"stage{stage}.{k}": v for k, v in sd.items()} if data_rank == 0 else None,
                           everyone if rank == 0 else None, dst=0)
        sd = {k: v for part in everyone if part for k, v in part.items()} if rank == 0 else {}
    if rank == 0 and args.out:
        if args.parallel == "ddp":
            sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
        torch.save(sd, args.out + ".tmp")
        os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
