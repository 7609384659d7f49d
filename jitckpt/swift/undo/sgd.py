"""Inverse of ``torch.optim.SGD`` (for-loop, foreach and fused CPU paths of torch 2.13).

Forward, per parameter (``g`` = grad, negated when ``maximize``; scalars are rounded to the
parameter dtype by torch before use)::

    g' = g + wd*x0                                   (if wd != 0)
    b1 = g'                      (first step: no buffer yet)
    b1 = mu*b0 + (1-tau)*g'      (later steps)
    d  = g' + mu*b1 if nesterov else b1              (d = g' when momentum == 0)
    x1 = x0 - lr*d

Inverse (float64; ``x0`` is rounded to the parameter dtype before it is reused, as the forward
stored it)::

    later steps:  x0 = x1 + lr*b1                            (no nesterov)
                  x0 = (x1 + lr*(g + mu*b1)) / (1 - lr*wd)   (nesterov)
                  b0 = (b1 - (1-tau)*g') / mu
    first step / no momentum:
                  x0 = (x1 + lr*k*g) / (1 - lr*k*wd),  k = 1 + mu if nesterov else 1
                  and the momentum buffer is deleted (it did not exist before).

When wd == 0 the update ``d`` is recomputed with the forward's own ops, so x0 = x1 + lr*d.
torch's foreach nesterov path (no maximize, no weight decay) writes d into ``p.grad`` in place;
then x0 = x1 + lr*d directly and g = d - mu*b1 for the buffer.

Marks: SGD keeps no per-parameter step counter. On the for-loop and foreach paths a parameter
was updated iff its tensor version counter advanced (every in-place op bumps it). The fused CPU
kernel does not bump version counters, so a fused step is undoable only if it completed (the
step post-hook ran); an interrupted fused step is refused at undo time.
"""
from __future__ import annotations

import torch

from jitckpt.swift.undo.errors import UndoError
from jitckpt.swift.undo.rule import (InverseRule, ParamMark, as_dtype_scalar, nonzero_divisor, refuse_flags,
                   scalar_hparam)


class SGDInverse(InverseRule):
    """Exact inverse of torch.optim.SGD's update."""

    name = "SGD"

    def validate_group(self, group: dict) -> None:
        refuse_flags(group, self.name, ("differentiable",))
        for key in ("lr", "weight_decay", "momentum", "dampening"):
            scalar_hparam(group, key, self.name)
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        nonzero_divisor(1.0 - lr * wd, "1 - lr*weight_decay", self.name)
        if group["nesterov"]:
            nonzero_divisor(1.0 - lr * (1.0 + mu) * wd, "1 - lr*(1+momentum)*weight_decay",
                            self.name)

    def capture(self, optimizer, p, mark: ParamMark) -> None:
        state = optimizer.state.get(p, {})
        mark.had_buffer = state.get("momentum_buffer") is not None

    def was_updated(self, optimizer, p, mark, path, step_completed) -> bool:
        if path == "fused":
            if not step_completed:
                raise UndoError(
                    "SGD(fused=True) was interrupted inside step(): the fused kernel leaves no "
                    "per-parameter progress marks, so the updated parameters are unknown. Fix: "
                    "use foreach=True or the default for-loop path with UpdateUndo.")
            return mark.grad_ref is not None
        return p._version != mark.version

    def grad_mutations(self, hp: dict, path: str) -> int:
        # torch's foreach nesterov path adds mu*buf into the gradient tensors in place when
        # it did not need a copy for maximize/weight decay; p.grad then holds the direction d.
        return int(path == "foreach" and hp["momentum"] != 0 and bool(hp["nesterov"])
                   and not hp["maximize"] and hp["weight_decay"] == 0)

    def undo_param(self, optimizer, p, grad, hp, mark, path) -> None:
        if self.grad_mutations(hp, path):
            self._undo_from_direction(optimizer, p, grad, hp, mark)
            return
        dt = p.dtype
        lr = as_dtype_scalar(hp["lr"], dt)
        wd = as_dtype_scalar(hp["weight_decay"], dt)
        mu = hp["momentum"]
        nesterov = bool(hp["nesterov"])
        gs = -grad if hp["maximize"] else grad
        x1 = p.detach().to(torch.float64)
        state = optimizer.state.get(p, {})
        if mu == 0 or not mark.had_buffer:
            k = (1.0 + mu) if (mu != 0 and nesterov) else 1.0
            if hp["weight_decay"] == 0:
                d = gs.add(gs, alpha=mu) if k != 1.0 else gs
                x0 = x1 + lr * d.to(torch.float64)
            else:
                denom = nonzero_divisor(1.0 - lr * k * wd, "1 - lr*k*weight_decay", self.name)
                x0 = (x1 + (lr * k) * gs.to(torch.float64)) / denom
            p.detach().copy_(x0)
            if not mark.had_buffer:  # created by this step; a stale one (momentum now 0) stays
                state.pop("momentum_buffer", None)
            return
        buf1 = state["momentum_buffer"]
        b1 = buf1.to(torch.float64)
        mu_d = as_dtype_scalar(mu, dt)
        if not nesterov:
            x0 = x1 + lr * b1
        elif hp["weight_decay"] == 0:
            x0 = x1 + lr * gs.add(buf1, alpha=mu).to(torch.float64)
        else:
            denom = nonzero_divisor(1.0 - lr * wd, "1 - lr*weight_decay", self.name)
            x0 = (x1 + lr * (gs.to(torch.float64) + mu_d * b1)) / denom
        x0_dt = x0.to(dt)
        p.detach().copy_(x0_dt)
        gp = gs.add(x0_dt, alpha=hp["weight_decay"]) if hp["weight_decay"] != 0 else gs
        a = as_dtype_scalar(1.0 - hp["dampening"], dt)
        buf1.copy_((b1 - a * gp.to(torch.float64)) / mu_d)

    def _undo_from_direction(self, optimizer, p, d, hp, mark) -> None:
        """Foreach nesterov, no weight decay: ``p.grad`` now holds d = g + mu*b1."""
        dt = p.dtype
        lr = as_dtype_scalar(hp["lr"], dt)
        p.detach().copy_(p.detach().to(torch.float64) + lr * d.to(torch.float64))
        state = optimizer.state.get(p, {})
        if not mark.had_buffer:
            state.pop("momentum_buffer", None)
            return
        buf1 = state["momentum_buffer"]
        b1 = buf1.to(torch.float64)
        mu_d = as_dtype_scalar(hp["momentum"], dt)
        g = d.to(torch.float64) - mu_d * b1
        a = as_dtype_scalar(1.0 - hp["dampening"], dt)
        buf1.copy_((b1 - a * g) / mu_d)
