"""What a data loader's next ``iter()`` draws its order from: the global RNG and the generators of
its samplers. A framework's resume makes the interrupted epoch's iterator again from it."""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("jitckpt.integrations")


def sampler_generators(loader: Any) -> list:
    """The ``torch.Generator`` objects a loader's samplers draw their order from (torchdata's
    RandomSampler seeds its own once and advances it at every iter(); Lightning and accelerate wrap
    a sampler for DDP), found along sampler attributes only, never inside a dataset's data."""
    found: list = []
    seen: set = set()
    todo = [(loader, 0)]
    while todo:
        obj, depth = todo.pop(0)
        if obj is None or id(obj) in seen or depth > 6:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Generator):
            found.append(obj)
            continue
        for name in ("generator", "batch_sampler", "sampler", "_sampler"):
            todo.append((getattr(obj, name, None), depth + 1))
        if isinstance(obj, torch.utils.data.Sampler) and depth > 0:
            todo.append((getattr(obj, "dataset", None), depth + 1))  # Lightning's DistributedSamplerWrapper
    return found


def data_rng(loaders: list) -> dict:
    """The global RNG and the loaders' samplers' generators, as they are now."""
    from jitckpt.runtime.ddp_buffers import rng_state

    return {"global": rng_state(), "samplers": [g.get_state() for dl in loaders for g in sampler_generators(dl)]}


def set_data_rng(loaders: list, state: dict) -> None:
    """Restore a :func:`data_rng` state (a warning, and the generators left, if they do not match)."""
    from jitckpt.runtime.ddp_buffers import set_rng_state

    set_rng_state(state["global"])
    gens = [g for dl in loaders for g in sampler_generators(dl)]
    if len(gens) != len(state["samplers"]):
        log.warning("resuming: the data loader's samplers have %d random generators, the checkpoint %d: its "
                    "order is not the interrupted run's", len(gens), len(state["samplers"]))
        return
    for g, st in zip(gens, state["samplers"]):
        g.set_state(st)
