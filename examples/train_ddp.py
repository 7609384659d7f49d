"""A deterministic DDP training script used by the demo, the tests and the benchmarks.

Data for step s comes from a generator seeded with s, so a resumed job sees the same minibatches.
Failure injection: --inject GEN:RANK:STEP:MODE (repeatable) fires in launch GEN
(TORCHELASTIC_RESTART_COUNT) on RANK at minibatch STEP, with MODE one of
  kill     SIGKILL self before the forward pass (with --model bn the others are then in DDP's
           broadcast of the buffers, at the start of their forward)
  fwdkill  SIGKILL self inside the forward, after DDP's buffer broadcast (a forward pre-hook of
           the wrapped module): the others have this minibatch's buffers, and fail in backward
  stop     SIGSTOP self (a hang: the process is alive but does nothing)
  gil      hang inside a C call that holds the GIL (libc sleep through ctypes.PyDLL)
  raise    an exception in the training step
  optim    SIGKILL self inside optimizer.step(), after the gradient all-reduce
  restore  SIGKILL self right after restoring (STEP ignored): a failure during recovery
  exitabort  SIGABRT at process exit, after jitckpt's exit barrier and all of Python's shutdown
           (STEP ignored): a C++ destructor that aborts once the job is done
  save     SIGKILL self in the middle of writing its JIT checkpoint
  keeper   SIGKILL this node's snapshot keeper (jitckpt run --snapshot-every) before the forward
  node     a whole node lost: SIGKILL this node's snapshot keeper, then self, before the forward
  midstep  with --overlap-step: launch the all-reduce of only the first 2 gradients, then SIGKILL
           self; the other ranks' optimizer step has updated 2 parameters when its wait for the
           third gradient fails (a step torn on the survivors: jitckpt run --plugin undo)

When kill/node fires on every rank at the same step (the whole job lost at once), the ranks meet
in a barrier after the keepers are dead and before any dies: else the first death could stop a
rank (its launcher tells it of the failure) before it killed its keeper.

--overlap-step runs data parallelism without DDP, the optimizer step overlapped with the gradient
all-reduce as in SWIFT: the step launches every gradient's all-reduce, then updates each parameter as
soon as its own all-reduce is done. PyTorch has
no such optimizer on CPU, so it is emulated by wrapping torch's for-loop update function, which the
step then calls once per parameter.

--api init runs the same training with the paper's API instead of jitckpt.protect(): the script's
own save function registered with jitckpt.init(save_fn, step_fn=...) (torch.save of model,
optimizer, scheduler, step and RNG into the directory it is given, no collectives) and
jitckpt.get_checkpoint_path() loaded at the start; no jitckpt.mark_step().
"""
import argparse
import contextlib
import json
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import jitckpt


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--in-dim", type=int, default=32)
    p.add_argument("--out-dim", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model", default="mlp", choices=["mlp", "bn", "ln", "dropout"],
                   help="mlp: Linear+Tanh; bn: + BatchNorm1d after each hidden Linear (buffers DDP "
                        "broadcasts at every forward); ln: + LayerNorm; dropout: + Dropout(0.25) "
                        "(RNG state)")
    p.add_argument("--rank-rng", action="store_true",
                   help="after building the model, draw rank+1 numbers from torch's and NumPy's RNGs, so "
                        "every rank's RNG state differs (as in a script that seeds by rank); training "
                        "draws none with --model mlp, so the run stays deterministic")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optim", default="adam", choices=["adam", "sgd", "zero-adam"],
                   help="zero-adam: ZeroRedundancyOptimizer(Adam), ZeRO-1 (needs --snapshot-every)")
    p.add_argument("--parallel", default="ddp", choices=["ddp", "hsdp", "fsdp"],
                   help="hsdp: FSDP2 (fully_shard on each linear layer and the root) over a 2-D mesh, "
                        "2 replica groups x the rest, instead of DDP; fsdp: the same on a 1-D mesh "
                        "(full sharding: no replica, protected by --snapshot-every)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model and batches live (cuda: every rank on cuda:LOCAL_RANK modulo the "
                        "GPUs there, gloo collectives on CUDA tensors; DDP only)")
    p.add_argument("--inject", action="append", default=[], metavar="GEN:RANK:STEP:MODE")
    p.add_argument("--out", default="")
    p.add_argument("--steps-log", default="")
    p.add_argument("--no-jitckpt", action="store_true", help="plain DDP, for overhead comparisons")
    p.add_argument("--api", default="protect", choices=["protect", "init"],
                   help="protect: jitckpt.protect(model, opt, sched); init: the paper's API, "
                        "jitckpt.init(save_fn) + get_checkpoint_path(), the script saving and loading")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (slow steps)")
    p.add_argument("--pause-before-step", default="", metavar="RANK:STEP:SECONDS",
                   help="in the first launch, RANK sleeps SECONDS between the backward and the optimizer "
                        "step of minibatch STEP (its gradient all-reduce done)")
    p.add_argument("--slow-forward", default="", metavar="STEP:SECONDS",
                   help="in the first launch, the forward of minibatch STEP takes SECONDS longer on every "
                        "rank (a slow model)")
    p.add_argument("--baseline-save-every", type=int, default=0,
                   help="with --no-jitckpt: torch.save on rank 0 every N steps, resume from it (the "
                        "torchrun + periodic checkpoint baseline)")
    p.add_argument("--baseline-dir", default="")
    p.add_argument("--baseline-dcp-every", type=int, default=0,
                   help="with --no-jitckpt: torch.distributed.checkpoint.async_save of every rank's state "
                        "every N steps into --baseline-dir, resume from the newest complete one (the "
                        "torchrun + DCP baseline)")
    p.add_argument("--compile", action="store_true", help="run the forward through torch.compile(model)")
    p.add_argument("--overlap-step", action="store_true",
                   help="no DDP; each parameter's update waits only for its own gradient all-reduce")
    args = p.parse_args()
    if args.overlap_step and args.optim not in ("adam", "sgd"):
        p.error("--overlap-step works with --optim adam or sgd")
    if args.api == "init" and (args.no_jitckpt or args.optim == "zero-adam"):
        p.error("--api init needs jitckpt and a replicated optimizer (not --no-jitckpt, --optim zero-adam)")
    return args


MIDSTEP_ALLREDUCES = 2  # gradients the midstep victim still contributes before it dies


def overlap_step_with_allreduce(optim_name, wait):
    """Make the optimizer's for-loop update (``foreach=False``) call ``wait(i, param)`` before it
    updates the i-th parameter of a group, e.g. to wait for that gradient's all-reduce only."""
    import importlib

    module_name, fn_name = {"adam": ("torch.optim.adam", "_single_tensor_adam"),
                            "sgd": ("torch.optim.sgd", "_single_tensor_sgd")}[optim_name]
    module = importlib.import_module(module_name)
    single = getattr(module, fn_name)

    def per_param(params, *args, **kwargs):
        for i, p in enumerate(params):
            wait(i, p)
            lists = [isinstance(a, list) and len(a) == len(params) for a in args]
            cut = [a[i:i + 1] if is_list else a for a, is_list in zip(args, lists)]
            single([p], *cut, **kwargs)
            for a, c, is_list in zip(args, cut, lists):
                if is_list:  # e.g. SGD's first step creates its momentum buffer in the list
                    a[i] = c[0]

    setattr(module, fn_name, per_param)


def build(args):
    torch.manual_seed(0)
    dims = [args.in_dim] + [args.hidden] * args.layers + [args.out_dim]
    norm = {"bn": nn.BatchNorm1d, "ln": nn.LayerNorm}.get(args.model)
    layers = []
    for a, b in zip(dims[:-2], dims[1:-1]):  # hidden layers; the output layer is a bare Linear
        layers.append(nn.Linear(a, b))
        if norm is not None:
            layers.append(norm(b))
        layers.append(nn.Tanh())
        if args.model == "dropout":
            layers.append(nn.Dropout(0.25))
    return nn.Sequential(*layers, nn.Linear(dims[-2], dims[-1]))


def batch_for(step, rank, args):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(args.batch, args.in_dim, generator=g)
    y = torch.randn(args.batch, args.out_dim, generator=g)
    return x, y


class DcpBaseline:
    """torchrun + torch.distributed.checkpoint, as a user would set it up today: async_save of
    every rank's model and optimizer state (and the scheduler, the step) every N steps, one save in
    flight at a time; a restarted job loads the newest complete one (DCP writes .metadata last)."""

    def __init__(self, args, model, opt, sched):
        self.dir, self.model, self.opt, self.sched = args.baseline_dir, model, opt, sched
        self.pending = None
        self.last = ""  # the newest save started
        # The background save's collectives on a group of their own: on the training's group they
        # would interleave with the gradient all-reduces (gloo runs one stream of operations).
        self.group = dist.new_group(backend="gloo")

    def _state(self, step):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd, "extra": {"step": step, "sched": self.sched.state_dict()}}

    def save(self, step):
        import torch.distributed.checkpoint as dcp

        if self.pending is not None:
            self.pending.result()  # every rank's part of the previous save is written, .metadata too
            if dist.get_rank() == 0:  # older ones go, as a user's retention would (every step fills a disk)
                for d in os.listdir(self.dir):
                    if d.startswith("step-") and d < self.last:
                        shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)
        self.last = f"step-{step:08d}"
        self.pending = dcp.async_save(self._state(step), checkpoint_id=os.path.join(self.dir, self.last),
                                      process_group=self.group)

    def restore(self, start):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        done = sorted(d for d in os.listdir(self.dir) if os.path.exists(os.path.join(self.dir, d, ".metadata"))) \
            if os.path.isdir(self.dir) else []
        if not done:
            return start
        sd = self._state(0)
        dcp.load(sd, checkpoint_id=os.path.join(self.dir, done[-1]), process_group=self.group)
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["extra"]["sched"])
        return int(sd["extra"]["step"])

    def finish(self):
        if self.pending is not None:
            self.pending.result()


class InitApiState:
    """``jitckpt.init()``'s side of the script: its own save function and the step it counts.

    ``step`` is the minibatch under way, and the number completed once its scheduler step is done
    (what ``step_fn`` must return); the fault hooks read it like ``protect()``'s ``state.step``."""

    FILE = "state.pt"  # one file per rank's directory; any replica's loads on every rank

    def __init__(self, net, opt, sched):
        self.net, self.opt, self.sched, self.step = net, opt, sched, 0

    def save(self, path):
        """save_fn: this rank's state into ``path``, without any collective (peers may be dead)."""
        torch.save({"model": self.net.state_dict(), "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(), "step": self.step,
                    "rng": torch.get_rng_state()}, os.path.join(path, self.FILE))

    def restore(self):
        """The newest checkpoint jitckpt knows of, loaded; the step to start at (0: none)."""
        path = jitckpt.get_checkpoint_path()
        if path is None:
            return 0
        sd = torch.load(os.path.join(path, self.FILE), weights_only=True)
        self.net.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])
        torch.set_rng_state(sd["rng"])
        self.step = int(sd["step"])
        return self.step


def shard_fsdp2(net, world, replicas):
    """FSDP2 on a (replicas, world/replicas) mesh: each shard kept by every replica group (1: full sharding)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = (init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
            if replicas > 1 else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    for m in net.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def wait_gone(pid, timeout=10.0):
    """Until ``pid`` (not our child: we cannot reap it) has died, so a restart finds it dead."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)
    raise RuntimeError(f"pid {pid} still alive {timeout}s after SIGKILL")


def main():
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.device == "cuda":
        if args.parallel != "ddp":
            raise SystemExit("--device cuda: with --parallel ddp only")
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dev = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if args.parallel != "ddp":
        model = shard_fsdp2(build(args), world, 2 if args.parallel == "hsdp" else 1)
    else:
        model = build(args).to(dev) if args.overlap_step else DDP(build(args).to(dev))
    if args.rank_rng:
        import numpy as np

        torch.rand(rank + 1)
        np.random.rand(rank + 1)
    net = model if args.overlap_step or args.parallel != "ddp" else model.module
    works, to_reduce = {}, []
    if args.overlap_step:  # a wait raises if a peer died before contributing that gradient
        def wait(i, p):
            # The all-reduces start when the step does, from inside optimizer.step(): a rank whose
            # gradients a peer received has begun its step (it is torn, not saved before it).
            while to_reduce:
                q = to_reduce.pop(0)
                works[id(q)] = dist.all_reduce(q.grad, async_op=True)
            works.pop(id(p)).wait()

        overlap_step_with_allreduce(args.optim, wait)
    if args.optim == "zero-adam":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
    elif args.optim == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, foreach=False if args.overlap_step else None)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                              foreach=False if args.overlap_step else None)
    # The rate changes before the tests' resume points, so a restore that misses it shows.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    mine = {}
    dying: dict = {}  # step -> ranks that kill/node themselves there in this launch
    for spec in args.inject:
        g, r, s, mode = spec.split(":")
        if int(g) == gen and int(r) == rank:
            mine[mode] = int(s)
        if int(g) == gen and mode in ("kill", "node"):
            dying.setdefault(int(s), set()).add(int(r))
    start = 0
    if args.api == "init":
        state = InitApiState(net, opt, sched)
        save_fn = state.save
        if "save" in mine:
            def save_fn(path):
                state.save(path)
                os.kill(os.getpid(), signal.SIGKILL)  # files written, metadata not yet
        jitckpt.init(save_fn, step_fn=lambda: state.step)
        start = state.restore()
        if "restore" in mine:
            os.kill(os.getpid(), signal.SIGKILL)
    elif not args.no_jitckpt:
        state = jitckpt.protect(model, opt, sched)
        if "save" in mine:
            real_save = state.save
            def save_then_die(path):
                real_save(path)
                os.kill(os.getpid(), signal.SIGKILL)  # files written, metadata not yet
            jitckpt.init(save_then_die, step_fn=lambda: state.step)
        start = state.restore()
        if "restore" in mine:
            os.kill(os.getpid(), signal.SIGKILL)
    if "exitabort" in mine:  # libc runs this after the interpreter has finalized
        import ctypes

        libc = ctypes.CDLL(None)
        libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
    baseline_file = os.path.join(args.baseline_dir, "ckpt.pt") if args.baseline_dir else ""
    if args.no_jitckpt and baseline_file and os.path.exists(baseline_file):
        sd = torch.load(baseline_file, weights_only=True)
        net.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        sched.load_state_dict(sd["scheduler"])
        start = sd["step"]
    dcp_saver = DcpBaseline(args, model, opt, sched) if args.no_jitckpt and args.baseline_dcp_every else None
    if dcp_saver is not None:
        start = dcp_saver.restore(start)
    if "fwdkill" in mine:
        def die_in_forward(*_a):
            if state.step == mine["fwdkill"]:
                os.kill(os.getpid(), signal.SIGKILL)
        net.register_forward_pre_hook(die_in_forward)
    if "optim" in mine:
        def die_in_step(*_a, **_k):
            if state.step == mine["optim"]:
                os.kill(os.getpid(), signal.SIGKILL)
        opt.register_step_pre_hook(die_in_step)
    if args.slow_forward and gen == 0:
        slow_step, slow_s = args.slow_forward.split(":")

        def slow(*_a):
            if state.step == int(slow_step):
                time.sleep(float(slow_s))
        net.register_forward_pre_hook(slow)
    forward = torch.compile(model) if args.compile else model
    logf = open(args.steps_log, "a") if args.steps_log else None
    loss_fn = nn.MSELoss()
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        if args.api == "init":
            state.step = step
        x, y = (t.to(dev) for t in batch_for(step, rank, args))
        if step in (mine.get("node"), mine.get("keeper")):
            from jitckpt.runtime.current import get_runtime
            from jitckpt.snapshot.keeper_client import KeeperClient

            keeper = KeeperClient(get_runtime().snapshots.socket_path)  # this node's keeper
            keeper_pid = keeper.ping().pid
            keeper.close()
            os.kill(keeper_pid, signal.SIGKILL)
            wait_gone(keeper_pid)
            if mine.get("node") == step:
                mine["kill"] = step
        if mine.get("kill") == step:
            if len(dying[step]) == world:
                dist.barrier()
            if logf:
                logf.write(json.dumps({"gen": gen, "rank": rank, "dying": step, "t": time.time()}) + "\n")
                logf.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if mine.get("stop") == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if mine.get("gil") == step:
            import ctypes
            ctypes.PyDLL(None).sleep(3600)  # PyDLL keeps the GIL: no Python thread here runs
        if mine.get("raise") == step:
            raise RuntimeError(f"injected failure in rank {rank} at step {step}")
        loss = loss_fn(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.pause_before_step and gen == 0:
            p_rank, p_step, p_s = args.pause_before_step.split(":")
            if (int(p_rank), int(p_step)) == (rank, step):
                time.sleep(float(p_s))
        if args.overlap_step:
            params = [p for p in model.parameters() if p.grad is not None]
            if mine.get("midstep") == step:
                params = params[:MIDSTEP_ALLREDUCES]
            for p in params:  # the mean: each rank adds its gradient / world
                p.grad.div_(world)
            if mine.get("midstep") == step:
                for p in params:  # delivered to every peer (gloo sends from its own thread)
                    dist.all_reduce(p.grad)
                os.kill(os.getpid(), signal.SIGKILL)
            to_reduce[:] = params
            # The waits inside the step are collectives jitckpt cannot see: mark them.
            with contextlib.nullcontext() if args.no_jitckpt else jitckpt.blocking_region("allreduce"):
                opt.step()
        else:
            opt.step()
        sched.step()
        if args.api == "init":
            state.step = step + 1  # the minibatch is complete: what a save now must resume at
        if args.baseline_save_every and rank == 0 and (step + 1) % args.baseline_save_every == 0:
            os.makedirs(args.baseline_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "step": step + 1}, baseline_file + ".tmp")
            os.replace(baseline_file + ".tmp", baseline_file)
        if dcp_saver is not None and (step + 1) % args.baseline_dcp_every == 0:
            dcp_saver.save(step + 1)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if logf:
            # This rank's own values (a DTensor's whole sum would be a collective every step).
            psum = float(sum(getattr(p.detach(), "to_local", p.detach)().double().sum() for p in model.parameters()))
            logf.write(json.dumps({"gen": gen, "rank": rank, "step": step, "loss": loss.item(), "psum": psum,
                                   "t": time.time(), "dt": time.perf_counter() - t0, "pid": os.getpid()}) + "\n")
            logf.flush()
    if dcp_saver is not None:
        dcp_saver.finish()
    sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().cpu().clone()  # every rank: a collective
          for k, v in net.state_dict().items()}
    if rank == 0 and args.out:
        tmp = args.out + ".tmp"
        torch.save(sd, tmp)
        os.replace(tmp, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
