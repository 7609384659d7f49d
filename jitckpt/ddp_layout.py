"""Keep DDP's gradient bucket layout across a restart, so resumed training is bitwise identical.

DDP builds its first buckets in reverse parameter order and rebuilds them once, after the first
backward pass, in the order gradients became ready. With three or more ranks the all-reduce's
summation order per element depends on where the element sits in its bucket, so a restarted job
whose first minibatch runs on the initial layout computes different low bits than the original
job, which ran that minibatch on the rebuilt layout. ``protect()`` therefore records the layout
after DDP's rebuild, saves it with each checkpoint, and the restarted worker builds its DDP with
exactly that layout.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("jitckpt.ddp_layout")

LAYOUT_FILE = "ddp_layout.json"


def _reducer_params(ddp: torch.nn.Module) -> list:
    seen, out = set(), []
    for p in ddp.module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def capture(model: torch.nn.Module) -> Optional[dict]:
    """The bucket layout of a DDP model's reducer, as parameter indices per bucket (or None).

    Call it from the training thread outside backward: it takes the reducer's lock and allocates
    one bucket-sized buffer per bucket.
    """
    reducer = getattr(model, "reducer", None)
    if reducer is None or not hasattr(reducer, "_get_zeros_like_grad_buckets"):
        return None
    index = {id(p): i for i, p in enumerate(_reducer_params(model))}
    try:
        buckets = reducer._get_zeros_like_grad_buckets()
    except RuntimeError:
        return None
    layout = []
    for b in buckets:
        ids = [index.get(id(p)) for p in b.parameters()]
        if None in ids:
            return None
        layout.append(ids)
    shapes = [list(p.shape) for p in _reducer_params(model)]
    return {"buckets": layout, "shapes": shapes}


def write(layout: dict, directory: str) -> None:
    (Path(directory) / LAYOUT_FILE).write_text(json.dumps(layout))


def load(checkpoint_dir: Optional[str]) -> Optional[dict]:
    if checkpoint_dir is None:
        return None
    f = Path(checkpoint_dir) / LAYOUT_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError:
        return None


def install_pinning(layout_source: Callable[[], Optional[dict]]) -> None:
    """Make DDP's constructor use the saved layout when one matches the model's parameters."""
    original = dist._compute_bucket_assignment_by_size
    if getattr(original, "__jitckpt_wrapped__", False):
        return

    @functools.wraps(original)
    def assign(parameters, bucket_size_limits, *args, **kwargs):  # type: ignore[no-untyped-def]
        layout = layout_source()
        if layout and [list(p.shape) for p in parameters] == layout["shapes"]:
            buckets = layout["buckets"]
            if sorted(i for b in buckets for i in b) == list(range(len(parameters))):
                limits = [bucket_size_limits[-1]] * len(buckets)
                # DDP reverses what this returns before handing it to the reducer.
                return list(reversed(buckets)), list(reversed(limits))
            log.warning("saved DDP bucket layout does not cover the parameters; not used")
        return original(parameters, bucket_size_limits, *args, **kwargs)

    assign.__jitckpt_wrapped__ = True  # type: ignore[attr-defined]
    dist._compute_bucket_assignment_by_size = assign
