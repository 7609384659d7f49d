"""Inverse of ``torch.optim.Adam`` / ``torch.optim.AdamW`` (for-loop, foreach, fused CPU paths).

Forward of torch 2.13, per parameter at step t (``g`` negated when ``maximize``)::

    t  += 1
    x'  = x0*(1 - lr*wd)                    (AdamW / decoupled_weight_decay)   else x' = x0
    g'  = g + wd*x0                         (Adam, L2)                         else g' = g
    m1  = lerp(m0, g', 1-b1) = b1*m0 + (1-b1)*g'
    v1  = b2*v0 + (1-b2)*g'^2
    x1  = x' - (lr/(1-b1^t)) * m1 / (sqrt(v1)/sqrt(1-b2^t) + eps)

Inverse, in float64 from the post-step m1, v1, x1 and the kept gradient::

    x'  = x1 + (lr/(1-b1^t)) * m1 / (sqrt(v1)/sqrt(1-b2^t) + eps)     (denominator recomputed
                                                                      with the forward's ops)
    x0  = x' / (1 - lr*wd)   (decoupled)   else x0 = x'
    m0  = (m1 - (1-b1)*g') / b1            (g' recomputed from the restored x0 for L2)
    v0  = max((v1 - (1-b2)*g'^2) / b2, 0)  (true v0 >= 0; clamping only removes rounding)
    t  -= 1                                (restored exactly from the pre-step mark)

Marks: Adam keeps a per-parameter ``step`` tensor that every path (for-loop, foreach, fused)
increments for exactly the parameters it updates, so "updated in step t" is "step counter
differs from its pre-step value". A parameter whose state was created lazily by the
interrupted step gets its state removed again.
"""
from __future__ import annotations

import torch

from jitckpt.swift.undo.rule import (InverseRule, ParamMark, as_dtype_scalar, nonzero_divisor, refuse_flags,
                   scalar_hparam)


def restore_step_counter(optimizer, p, mark: ParamMark) -> None:
    """Put back the pre-step per-parameter step counter, or drop lazily created state."""
    if not mark.had_state:
        optimizer.state.pop(p, None)
        return
    state = optimizer.state.get(p)
    if state is not None and float(state["step"]) != mark.step:
        state["step"].fill_(mark.step)


def capture_step_counter(optimizer, p, mark: ParamMark) -> None:
    """Record the per-parameter step counter (0 when the state does not exist yet)."""
    state = optimizer.state.get(p)
    mark.step = float(state["step"]) if state else 0.0


def step_counter_advanced(optimizer, p, mark: ParamMark) -> bool:
    """True iff the step incremented this parameter's step counter."""
    state = optimizer.state.get(p)
    return bool(state) and "step" in state and float(state["step"]) != mark.step


def invert_moments(m1: torch.Tensor, v1: torch.Tensor, gp: torch.Tensor, b1: float, b2: float,
                   dt: torch.dtype) -> None:
    """Undo ``m1 = lerp(m0, g', 1-b1)`` and ``v1 = b2*v0 + (1-b2)*g'^2`` in place (float64)."""
    w = as_dtype_scalar(1.0 - b1, dt)
    g64 = gp.to(torch.float64)
    m1.copy_((m1.to(torch.float64) - w * g64) / (1.0 - w))
    b2_d = as_dtype_scalar(b2, dt)
    c2 = as_dtype_scalar(1.0 - b2, dt)
    v1.copy_(((v1.to(torch.float64) - c2 * g64 * g64) / b2_d).clamp_(min=0.0))


class AdamInverse(InverseRule):
    """Exact inverse of torch.optim.Adam and torch.optim.AdamW."""

    name = "Adam"

    def __init__(self, name: str = "Adam") -> None:
        self.name = name

    def validate_group(self, group: dict) -> None:
        refuse_flags(group, self.name, ("amsgrad", "capturable", "differentiable"))
        for key in ("lr", "betas", "eps", "weight_decay"):
            scalar_hparam(group, key, self.name)
        b1, b2 = group["betas"]
        nonzero_divisor(b1, "betas[0] (the first-moment factor)", self.name)
        nonzero_divisor(b2, "betas[1] (the second-moment factor)", self.name)
        if group.get("decoupled_weight_decay", False):
            nonzero_divisor(1.0 - group["lr"] * group["weight_decay"], "1 - lr*weight_decay",
                            self.name)

    def capture(self, optimizer, p, mark: ParamMark) -> None:
        capture_step_counter(optimizer, p, mark)

    def was_updated(self, optimizer, p, mark, path, step_completed) -> bool:
        return step_counter_advanced(optimizer, p, mark)

    def undo_param(self, optimizer, p, grad, hp, mark, path) -> None:
        dt = p.dtype
        state = optimizer.state[p]
        t = float(state["step"])
        b1, b2 = hp["betas"]
        lr, eps, wd = hp["lr"], hp["eps"], hp["weight_decay"]
        decoupled = bool(hp.get("decoupled_weight_decay", False))
        gs = -grad if hp["maximize"] else grad
        m1, v1 = state["exp_avg"], state["exp_avg_sq"]
        step_size = as_dtype_scalar(lr / (1.0 - b1 ** t), dt)
        denom = (v1.sqrt() / ((1.0 - b2 ** t) ** 0.5)).add_(eps)
        x_mid = p.detach().to(torch.float64) + step_size * m1.to(torch.float64) / denom.to(
            torch.float64)
        if decoupled and wd != 0:
            c = nonzero_divisor(as_dtype_scalar(1.0 - lr * wd, dt), "1 - lr*weight_decay",
                                self.name)
            x0 = x_mid.to(dt).to(torch.float64) / c
        else:
            x0 = x_mid
        x0_dt = x0.to(dt)
        p.detach().copy_(x0_dt)
        gp = gs.add(x0_dt, alpha=wd) if (wd != 0 and not decoupled) else gs
        invert_moments(m1, v1, gp, b1, b2, dt)

    def restore_scalars(self, optimizer, p, mark) -> None:
        restore_step_counter(optimizer, p, mark)
