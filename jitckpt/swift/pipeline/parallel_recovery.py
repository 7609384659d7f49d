"""Parallel recovery (SWIFT §5.2): several workers re-compute a lost stage's micro-batches.

Every worker holds a copy of the lost stage (loaded from its checkpoint) and replays the
micro-batches :func:`partition_micro_batches` assigns it, taking inputs from the logs and
checking outputs against the receivers' digests. Instead of all-reducing summed gradients
(whose float sum order would differ from the original run), workers exchange the gradient of
each micro-batch and every worker accumulates them in micro-batch order, exactly as the
sequential schedule's backward passes did, so the result is bitwise identical to a
sequential replay.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from jitckpt.swift.pipeline.logging_records import ACTIVATION, GRADIENT, MessageKey
from jitckpt.swift.pipeline.logging_replay import LogIndex
from jitckpt.swift.pipeline.recovery import partition_micro_batches
from jitckpt.swift.pipeline.stage import PipelineStage


def micro_batch_gradients(stage: PipelineStage, index: LogIndex, *, iteration: int,
                          micro_batches: Sequence[int]) -> dict[int, list[torch.Tensor]]:
    """Re-compute the parameter gradients of ``micro_batches`` of one iteration from the
    logs (each micro-batch separately), checking every output against the logged digests."""
    s, last = stage.stage, stage.stage == stage.num_stages - 1
    params = [p for p in stage.module.parameters()]
    grads: dict[int, list[torch.Tensor]] = {}

    def key(mb: int, payload: str, src: int, dst: int) -> MessageKey:
        return MessageKey(iteration=iteration, micro_batch=mb, payload=payload, src=src, dst=dst)

    for mb in sorted(micro_batches):
        stage.optimizer.zero_grad(set_to_none=True)
        if s == 0:
            x = stage.input_fn(iteration, mb)
        else:
            x = index.take_input(key(mb, ACTIVATION, s - 1, s)).clone().requires_grad_(True)
        out = stage.module(x)
        if last:
            stage.loss_fn(out, iteration, mb).backward()
        else:
            index.check_output(key(mb, ACTIVATION, s, s + 1), out.detach())
            out.backward(index.take_input(key(mb, GRADIENT, s + 1, s)))
        if s > 0:
            index.check_output(key(mb, GRADIENT, s, s - 1), x.grad)
        grads[mb] = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                     for p in params]
    stage.optimizer.zero_grad(set_to_none=True)
    return grads


def apply_in_order(stage: PipelineStage, grads: dict[int, list[torch.Tensor]]) -> None:
    """Accumulate per-micro-batch gradients in micro-batch order (as autograd did in the
    sequential schedule: the first is taken as is, later ones added in place) and step."""
    params = list(stage.module.parameters())
    for p in params:
        p.grad = None
    for mb in sorted(grads):
        for p, g in zip(params, grads[mb]):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)
    stage.optimizer.step()
    stage.optimizer.zero_grad(set_to_none=True)


def parallel_replay_iteration(stage: PipelineStage, index: LogIndex, *, iteration: int,
                              group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """One iteration of parallel recovery on this worker of ``group`` (all workers call it
    with the same stage state); returns the micro-batches this worker re-computed."""
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    mine = partition_micro_batches(stage.num_micro_batches, world)[rank]
    local = micro_batch_gradients(stage, index, iteration=iteration, micro_batches=mine)
    if world > 1:
        gathered: list[Optional[dict]] = [None] * world
        dist.all_gather_object(gathered, local, group=group)
        merged: dict[int, list[torch.Tensor]] = {}
        for part in gathered:
            merged.update(part)
    else:
        merged = local
    missing = set(range(stage.num_micro_batches)) - set(merged)
    if missing:
        raise RuntimeError(f"parallel recovery lost micro-batches {sorted(missing)}")
    apply_in_order(stage, merged)
    return mine
