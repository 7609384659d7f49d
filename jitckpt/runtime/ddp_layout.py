"""Keep DDP's gradient bucket layout across a restart, so resumed training is bitwise identical.

DDP builds its first buckets in reverse parameter order and rebuilds them once, after the first
backward pass, in the order gradients became ready. With three or more ranks the all-reduce's
summation order per element depends on where the element sits in its bucket, so a restarted job
whose first minibatch runs on the initial layout computes different low bits than the original
job, which ran that minibatch on the rebuilt layout. The worker runtime therefore records each
DDP model's layout (:class:`LayoutTracker`, fed by class-level hooks on DDP), saves it with every
checkpoint it writes, whatever the save function (``protect()`` or ``jitckpt.init(save_fn)``), and
the restarted worker builds its DDP with exactly that layout (:func:`install_pinning`).

DDP would rebuild at the start of the second forward, inside the collective that syncs the new
layout: a failure there (a peer lost at step 1) would leave the survivors' checkpoint of step 1
without the layout minibatch 1 runs on. So the rebuild DDP would do there is done right after the
first backward instead (same call, same layout, every rank at the same point; DDP's own call is
then a no-op), and recorded before any collective of step 1.
"""
from __future__ import annotations

import functools
import json
import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from jitckpt.runtime.peer_failure import is_collective_failure

log = logging.getLogger("jitckpt.runtime.ddp_layout")

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


class LayoutTracker:
    """Each live DDP model's current bucket layout, captured on the training thread.

    Captured when a DDP model is constructed (or first seen in a forward) and again once its
    buckets were rebuilt; never at save time: a save may run while the main thread is blocked in
    a collective holding the reducer's lock, which :func:`capture` takes.
    """

    def __init__(self) -> None:
        self._layouts: "weakref.WeakKeyDictionary[Any, Optional[dict]]" = weakref.WeakKeyDictionary()
        self._settled: "weakref.WeakSet[Any]" = weakref.WeakSet()  # rebuilt, or never rebuilds

    def constructed(self, ddp: Any, *_: Any) -> None:
        """After ``DistributedDataParallel.__init__``: its initial layout."""
        self._layouts[ddp] = capture(ddp)

    def forward_began(self, ddp: Any, *_: Any) -> None:
        """After DDP's ``_pre_forward``: a model not seen yet, or a rebuild DDP did itself."""
        if ddp not in self._layouts:
            self._layouts[ddp] = capture(ddp)
        if ddp not in self._settled and getattr(ddp, "_has_rebuilt_buckets", False):
            self.rebuilt(ddp)

    def rebuilt(self, ddp: Any) -> None:
        """DDP's one-time bucket rebuild is done: its final layout."""
        self._settled.add(ddp)
        self._layouts[ddp] = capture(ddp) or self._layouts.get(ddp)

    def rebuild_after_backward(self, in_region: Callable[[Callable[[], Any]], Any]) -> None:
        """After a backward: DDP's one-time bucket rebuild, now (see the module docstring).

        ``in_region(fn)`` runs the rebuild, a collective, as a region of the worker runtime."""
        for ddp in list(self._layouts):
            if ddp in self._settled:
                continue
            if (ddp.find_unused_parameters or ddp.static_graph or ddp._use_python_reducer
                    or getattr(ddp, "_delay_all_reduce_all_params", False)):
                self._settled.add(ddp)  # DDP rebuilds late or never: leave it to DDP
                continue
            if not ddp.require_backward_grad_sync:
                continue  # no_sync(): this backward recorded no gradient order
            try:
                rebuilt = in_region(ddp.reducer._rebuild_buckets)
            except RuntimeError as e:
                if is_collective_failure(e):
                    raise
                # e.g. "Expected to have finished reduction in the prior iteration": DDP's own
                # forward raises it where users expect it.
                self._settled.add(ddp)
                continue
            if rebuilt:
                self.rebuilt(ddp)

    def layout_of(self, ddp: Any) -> Optional[dict]:
        return self._layouts.get(ddp)

    def current(self) -> Optional[dict]:
        """What a checkpoint stores: the first model's layout, and every model's under "models"."""
        layouts = [lay for lay in self._layouts.values() if lay is not None]
        if not layouts:
            return None
        return {**layouts[0], "models": layouts}

    def saving(self, save_fn: Callable[[str], Optional[str]]) -> Callable[[str], Optional[str]]:
        """``save_fn`` followed by writing the current layout into the same directory."""
        def save(path: str) -> Optional[str]:
            entry = save_fn(path)
            layout = self.current()
            if layout is not None and not (Path(path) / LAYOUT_FILE).exists():
                write(layout, path)
            return entry

        return save


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


_layout_source: Optional[Callable[[], Optional[dict]]] = None


def install_pinning(layout_source: Callable[[], Optional[dict]]) -> None:
    """Make DDP's constructor use the saved layout when one matches the model's parameters (from
    ``layout_source``: a later call, a new runtime in the same process, replaces the source)."""
    global _layout_source
    _layout_source = layout_source
    original = dist._compute_bucket_assignment_by_size
    if getattr(original, "__jitckpt_wrapped__", False):
        return

    @functools.wraps(original)
    def assign(parameters, bucket_size_limits, *args, **kwargs):  # type: ignore[no-untyped-def]
        saved = _layout_source() if _layout_source is not None else None
        shapes = [list(p.shape) for p in parameters]
        for layout in (saved.get("models") or [saved]) if saved else ():
            if shapes != layout["shapes"]:
                continue  # another DDP model of the job
            buckets = layout["buckets"]
            if sorted(i for b in buckets for i in b) == list(range(len(parameters))):
                limits = [bucket_size_limits[-1]] * len(buckets)
                # DDP reverses what this returns before handing it to the reducer.
                return list(reversed(buckets)), list(reversed(limits))
            log.warning("saved DDP bucket layout does not cover the parameters; not used")
        return original(parameters, bucket_size_limits, *args, **kwargs)

    assign.__jitckpt_wrapped__ = True  # type: ignore[attr-defined]
    dist._compute_bucket_assignment_by_size = assign
