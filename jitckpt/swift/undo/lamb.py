"""Inverse of :class:`jitckpt.swift.Lamb`, using the stored per-tensor trust ratio.

With ``s = lr*trust`` (trust ratio of the step, kept in ``state["trust_ratio"]``) and ``r``
recomputed from the post-step moments with the forward's own ops::

    x0 = (x1 + s*r) / (1 - s*wd)        (x0 = x1 + s*r when wd == 0)
    m0 = (m1 - (1-b1)*g) / b1;  v0 = max((v1 - (1-b2)*g^2) / b2, 0);  t -= 1

and ``state["trust_ratio"]`` goes back to its pre-step value (recorded as a scalar mark).
Marks: the per-parameter step counter, as for Adam.
"""
from __future__ import annotations

import torch

from jitckpt.swift.undo.adam import (capture_step_counter, invert_moments, restore_step_counter,
                        step_counter_advanced)
from jitckpt.swift.undo.errors import UndoError
from jitckpt.swift.undo.lamb_optimizer import lamb_direction
from jitckpt.swift.undo.rule import InverseRule, ParamMark, as_dtype_scalar, nonzero_divisor, scalar_hparam


class LambInverse(InverseRule):
    """Exact inverse of jitckpt.swift.Lamb's update."""

    name = "Lamb"

    def validate_group(self, group: dict) -> None:
        for key in ("lr", "betas", "eps", "weight_decay"):
            scalar_hparam(group, key, self.name)
        b1, b2 = group["betas"]
        nonzero_divisor(b1, "betas[0] (the first-moment factor)", self.name)
        nonzero_divisor(b2, "betas[1] (the second-moment factor)", self.name)

    def capture(self, optimizer, p, mark: ParamMark) -> None:
        capture_step_counter(optimizer, p, mark)
        mark.extra["trust_ratio"] = optimizer.state.get(p, {}).get("trust_ratio")

    def was_updated(self, optimizer, p, mark, path, step_completed) -> bool:
        return step_counter_advanced(optimizer, p, mark)

    def undo_param(self, optimizer, p, grad, hp, mark, path) -> None:
        dt = p.dtype
        state = optimizer.state[p]
        if "trust_ratio" not in state:
            raise UndoError("Lamb state has no trust_ratio for an updated parameter; the "
                            "optimizer is not jitckpt.swift.Lamb or its state was replaced.")
        t = float(state["step"])
        b1, b2 = hp["betas"]
        g = -grad if hp["maximize"] else grad
        m1, v1 = state["exp_avg"], state["exp_avg_sq"]
        r = lamb_direction(m1, v1, t, hp).to(torch.float64)
        s = as_dtype_scalar(-hp["lr"] * state["trust_ratio"], dt)
        x_mid = p.detach().to(torch.float64) - s * r
        if hp["weight_decay"] != 0:
            wd = as_dtype_scalar(hp["weight_decay"], dt)
            x0 = x_mid / nonzero_divisor(1.0 + s * wd, "1 - lr*trust_ratio*weight_decay",
                                         self.name)
        else:
            x0 = x_mid
        p.detach().copy_(x0.to(dt))
        invert_moments(m1, v1, g, b1, b2, dt)

    def restore_scalars(self, optimizer, p, mark) -> None:
        restore_step_counter(optimizer, p, mark)
        state = optimizer.state.get(p)
        if state is None:
            return
        previous = mark.extra.get("trust_ratio")
        if previous is None:
            state.pop("trust_ratio", None)
        else:
            state["trust_ratio"] = previous
