"""A small FSDP2 job (``fully_shard`` on each layer and the root, AdamW, a step scheduler) under
``jitckpt.protect``; rank 0 writes the full final parameters and optimizer state to ``--out``
(tests/test_sharded_layouts.py).

--mesh fsdp: a 1-D mesh over every rank (full sharding); hsdp: a 2-D mesh (--replicas x shard); tp:
tensor parallel (column- then row-wise, the last layer plain) on a 1-D mesh; fsdp_tp: a 2-D mesh
(dp x tp), TP inside, fully_shard over dp (the last layer on the dp sub-mesh only); pp: pipeline stages
(torch.distributed.pipelining, GPipe, 2 microbatches) on a (pp 2 x dp) mesh, each stage fully_shard over
dp, its layers named from "0" as the other stage's are; stages: each
rank fully_shards its own copy on a 1-rank mesh of its own (as pipeline stages' meshes are). --kill R:S[:term|stop|keeper|optim]: rank R SIGKILLs (SIGTERMs, SIGSTOPs) itself before minibatch S of the first launch
(keeper: SIGKILLs its node's snapshot keeper first; optim: SIGKILLs itself inside that minibatch's optimizer.step()).
--no-jitckpt: the same training without jitckpt (under torchrun). --hidden: the width (another
model); --foreign-param: the optimizer also holds a tensor that is not the model's; --compile: the
forward through torch.compile (aot_eager: no C++ compiler needed). Data is chosen by step and rank.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--mesh", choices=["fsdp", "hsdp", "tp", "fsdp_tp", "stages", "pp"], default="fsdp")
p.add_argument("--replicas", type=int, default=2)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--foreign-param", action="store_true")
p.add_argument("--compile", action="store_true")
p.add_argument("--kill", default="")
p.add_argument("--no-jitckpt", action="store_true")
p.add_argument("--out", required=True)
p.add_argument("--steps-log", default=None)  # accepted for tests/jobs.py's run_job; unused
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
layouts = {"fsdp": ((world,), ("shard",)), "hsdp": ((args.replicas, world // args.replicas), ("replicate", "shard")),
           "tp": ((world,), ("tp",)), "fsdp_tp": ((2, world // 2), ("dp", "tp")), "stages": (None, None),
           "pp": ((2, world // 2), ("pp", "dp"))}
shape, names = layouts[args.mesh]
if args.mesh == "stages":
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [rank], mesh_dim_names=("stage",))
else:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

torch.manual_seed(0)
H = args.hidden
model = nn.Sequential(nn.Linear(16, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, 4))
data_rank = rank  # the ranks of one TP group see the same data
if args.mesh in ("tp", "fsdp_tp"):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    data_rank = 0 if args.mesh == "tp" else mesh.get_coordinate()[0]
if args.mesh == "pp":  # this rank's stage of the model (each stage's layers named from "0": names coincide)
    layers = list(model.children())
    model = nn.Sequential(*(layers[:2] if mesh.get_coordinate()[0] == 0 else layers[2:]))
    data_rank = mesh.get_coordinate()[1]
if args.mesh != "tp":
    dp = mesh["dp"] if args.mesh in ("fsdp_tp", "pp") else mesh
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
groups = [{"params": list(model.parameters())}]
if args.foreign_param:  # a tensor the model does not hold, optimized beside it
    groups.append({"params": [nn.Parameter(torch.zeros(3))]})
opt = torch.optim.AdamW(groups, lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)

start = 0
if not args.no_jitckpt:
    import jitckpt

    state = jitckpt.protect(model, opt, sched)
    start = state.restore()
forward = torch.compile(model, backend="aot_eager") if args.compile else model
if args.mesh == "pp":
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage_index = mesh.get_coordinate()[0]
    pipe = ScheduleGPipe(PipelineStage(model, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group()),
                         n_microbatches=2, loss_fn=nn.functional.mse_loss)
kill_rank, kill_step, *how = args.kill.split(":") if args.kill else (-1, -1)
kill_rank, kill_step = int(kill_rank), int(kill_step)
sig = {"term": signal.SIGTERM, "stop": signal.SIGSTOP}.get(how[0] if how else "", signal.SIGKILL)
if how == ["optim"] and gen == 0 and rank == kill_rank:  # SIGKILL inside optimizer.step() of minibatch S
    opt.register_step_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL) if step == kill_step else None)
for step in range(start, args.steps):
    if gen == 0 and (rank, step) == (kill_rank, kill_step) and how != ["optim"]:
        if how == ["keeper"]:  # the node's snapshot keeper too (the process serving its socket)
            import psutil

            from jitckpt.runtime.current import runtime_or_none

            sock = runtime_or_none().snapshots.socket_path
            for proc in psutil.process_iter(["cmdline"]):
                if sock in (proc.info["cmdline"] or []):
                    proc.kill()
        os.kill(os.getpid(), sig)
    g = torch.Generator().manual_seed(1000 * step + data_rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if args.mesh == "pp":  # forward and backward of both microbatches through the stages
        pipe.step(x) if stage_index == 0 else pipe.step(target=y)
    else:
        loss = nn.functional.mse_loss(forward(x), y)
        loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
def whole(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v  # a collective: every rank


full = {k: whole(v) for k, v in model.state_dict().items()}
names_of = {id(p): n for n, p in model.named_parameters()}
for p_, st in opt.state.items():
    full.update({f"optim.{names_of[id(p_)]}.{k}": whole(v) for k, v in st.items()})
if args.mesh == "pp":  # every stage's state, named by stage, to rank 0
    everyone = [None] * world
    dist.gather_object({f"stage{stage_index}.{k}": v for k, v in full.items()} if data_rank == 0 else None,
                       everyone if rank == 0 else None, dst=0)
    full = {k: v for part in everyone or [] if part for k, v in part.items()}
if rank == 0:
    torch.save(full, args.out)
dist.destroy_process_group()
