"""LAMB optimizer (You et al., 2019/ICLR'20) that records what its inverse needs.

torch has no LAMB. Update per tensor at step t (``g`` negated when ``maximize``)::

    m1 = lerp(m0, g, 1-b1);  v1 = b2*v0 + (1-b2)*g^2
    r  = (m1/(1-b1^t)) / (sqrt(v1/(1-b2^t)) + eps)       (bias correction optional)
    u  = r + wd*x0                                        (decoupled weight decay)
    trust = phi(||x0||) / ||u||   (phi = identity; trust = 1 if either norm is 0)
    x1 = x0 - lr*trust*u

``trust`` depends on ``||x0||``, a reduction over the whole tensor, so it cannot be recovered
from x1; SWIFT's answer is to keep that scalar. ``state["trust_ratio"]`` holds the trust ratio
of the latest step (one Python float per tensor), which is all the inverse needs beyond the
gradient.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch.optim import Optimizer


class Lamb(Optimizer):
    """Layer-wise Adaptive Moments optimizer for Batch training (LAMB), for-loop implementation.

    Keyword-only options after ``lr``: ``betas``, ``eps``, ``weight_decay`` (decoupled),
    ``bias_correction`` and ``maximize``; all validated here."""

    def __init__(self, params: Iterable, lr: float = 1e-3, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 maximize: bool = False) -> None:
        if not (isinstance(lr, float) or isinstance(lr, int)) or lr < 0.0:
            raise ValueError(f"Lamb: lr must be a non-negative float, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas must be two floats in [0, 1), got {betas!r}")
        if eps < 0.0:
            raise ValueError(f"Lamb: eps must be >= 0, got {eps!r}")
        if weight_decay < 0.0:
            raise ValueError(f"Lamb: weight_decay must be >= 0, got {weight_decay!r}")
        defaults = dict(lr=float(lr), betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, maximize=maximize)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Perform one LAMB step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                lamb_update(p, p.grad, state, group)
        return loss


def lamb_direction(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, t: float,
                   group: dict) -> torch.Tensor:
    """The Adam-style ratio r = m_hat / (sqrt(v_hat) + eps), in the parameter dtype.

    Shared by the forward step and the inverse so both round identically."""
    b1, b2 = group["betas"]
    if group["bias_correction"]:
        bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    else:
        bc1 = bc2 = 1.0
    return (exp_avg / bc1) / ((exp_avg_sq / bc2).sqrt().add_(group["eps"]))


def lamb_update(p: torch.Tensor, grad: torch.Tensor, state: dict,
                group: dict) -> None:
    """One LAMB update of ``p`` and its ``state`` (see the module docstring)."""
    b1, b2 = group["betas"]
    g = -grad if group["maximize"] else grad
    state["step"] += 1
    t = float(state["step"])
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(g, 1.0 - b1)
    exp_avg_sq.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    update = lamb_direction(exp_avg, exp_avg_sq, t, group)
    if group["weight_decay"] != 0:
        update.add_(p, alpha=group["weight_decay"])
    w_norm = float(p.norm())
    u_norm = float(update.norm())
    trust = w_norm / u_norm if (w_norm > 0.0 and u_norm > 0.0) else 1.0
    state["trust_ratio"] = trust
    p.add_(update, alpha=-group["lr"] * trust)

