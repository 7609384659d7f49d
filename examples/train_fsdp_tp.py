"""A small transformer trained with FSDP2, HSDP, tensor parallel or FSDP2+TP, protected by jitckpt.

    jitckpt run --nproc-per-node 4 examples/train_fsdp_tp.py --parallel hsdp
    jitckpt run --nproc-per-node 2 --periodic-every 10 examples/train_fsdp_tp.py --parallel tp

fsdp: fully_shard over every rank; hsdp: 2 replica groups x shards (a lost rank comes back from its
replica); tp: Megatron-style column/row-parallel attention and MLP; fsdp_tp: a (dp=2, tp) mesh, TP
inside, fully_shard over dp. Layouts without replicas (fsdp, tp, fsdp_tp) recover from
--periodic-every checkpoints (docs/sharded.md). Data is chosen by step and data-parallel rank, so a
resumed run matches an uninterrupted one bitwise. CPU/gloo here; on GPUs use "cuda" and nccl.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import jitckpt

VOCAB, DIM, HEAD_DIM, SEQ = 64, 64, 16, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM) for _ in range(4))
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        # Under TP q/k/v are column-parallel: this rank's share of the heads.
        q, k, v = (f(h).view(b, t, -1, HEAD_DIM).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.out(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def parallelize(model: Transformer, how: str, world: int):  # type: ignore[no-untyped-def]
    """The model laid out on its mesh; returns it and this rank's data-parallel rank."""
    shapes = {"fsdp": ((world,), ("dp",)), "hsdp": ((2, world // 2), ("replicate", "dp")),
              "tp": ((world,), ("tp",)), "fsdp_tp": ((2, world // 2), ("dp", "tp"))}
    shape, names = shapes[how]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "tp" in names:
        plan = {**{n: ColwiseParallel() for n in ("q", "k", "v", "up")},
                **{n: RowwiseParallel() for n in ("out", "down")}}
        for blk in model.blocks:
            parallelize_module(blk, mesh["tp"], plan)
    if how != "tp":
        dp = mesh if how == "hsdp" else mesh["dp"]
        for blk in model.blocks:
            fully_shard(blk, mesh=dp)
        fully_shard(model, mesh=dp)
    data_rank = 0  # the ranks of one TP group see the same batch
    for i, n in enumerate(names):
        if n != "tp":
            data_rank = data_rank * shape[i] + mesh.get_coordinate()[i]
    return model, data_rank


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parallel", choices=["fsdp", "hsdp", "tp", "fsdp_tp"], default="fsdp")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    model, data_rank = parallelize(Transformer(args.layers), args.parallel, dist.get_world_size())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    state = jitckpt.protect(model, opt, sched)
    for step in range(state.restore(), args.steps):
        g = torch.Generator().manual_seed(1000 * step + data_rank)
        tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 10 == 0 and dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if dist.get_rank() == 0 and args.out:
        torch.save(whole, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
