"""What every optimizer family's inverse provides, plus the float helpers they share.

A rule sees three moments of a step: ``validate_group`` (at construction and before each step:
refuse what has no inverse), ``capture`` (step pre-hook: O(1) scalars per parameter, never a
copy of a tensor) and ``undo_param`` (apply the inverse to one parameter marked as updated).
"""
from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from jitckpt.swift.undo.errors import NotInvertibleError


@dataclass
class ParamMark:
    """Pre-step scalars for one parameter: enough to decide "updated in step t" and to restore
    the scalar parts of its optimizer state exactly."""

    version: int                       # param._version before the step
    grad_ref: Optional[weakref.ref]    # the gradient tensor the step is going to read
    grad_version: int
    had_state: bool                    # optimizer.state[p] was non-empty before the step
    step: Optional[float] = None       # Adam/Lamb per-parameter step counter before the step
    had_buffer: bool = False           # SGD momentum buffer existed before the step
    extra: dict[str, Any] = field(default_factory=dict)  # rule-specific scalars (Lamb trust ratio)


def as_dtype_scalar(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded the way a Python scalar is rounded when passed to a ``dtype`` kernel
    (torch casts scalar arguments to the tensor's dtype before the arithmetic)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).item())


def scalar_hparam(group: dict, key: str, optimizer_name: str) -> None:
    """Refuse a tensor-valued hyperparameter: the inverse is written for Python scalars."""
    value = group.get(key)
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if isinstance(v, torch.Tensor):
            raise NotInvertibleError(
                f"{optimizer_name}: hyperparameter {key!r} is a Tensor; update-undo supports "
                f"Python-float hyperparameters only. Fix: pass {key} as a float.")


def refuse_flags(group: dict, optimizer_name: str, flags: tuple[str, ...]) -> None:
    """Refuse boolean options whose update rule has no inverse here."""
    reasons = {
        "amsgrad": "AMSGrad keeps max(v_max, v_t): the max discards v_{t-1}, so it has no inverse",
        "capturable": "capturable=True (CUDA-graph path) is not supported by update-undo",
        "differentiable": "differentiable=True is not supported by update-undo",
    }
    for flag in flags:
        if group.get(flag, False):
            raise NotInvertibleError(
                f"{optimizer_name}: {reasons[flag]}. Fix: construct the optimizer with "
                f"{flag}=False, or do not wrap it in UpdateUndo.")


def refuse_param(p: torch.Tensor, optimizer_name: str) -> None:
    """Refuse parameter kinds the inverses are not written for."""
    if not torch.is_floating_point(p):
        raise NotInvertibleError(
            f"{optimizer_name}: parameter of dtype {p.dtype} is not a real floating-point tensor; "
            "update-undo supports real floating-point parameters only.")


def implementation_path(group: dict, params: list[torch.Tensor]) -> str:
    """Which torch implementation a group's step takes: 'fused', 'foreach' or 'for-loop'.

    Mirrors torch.optim: explicit flags win; with both unset torch picks foreach only for
    devices that have foreach kernels (not CPU), otherwise the for-loop."""
    if group.get("fused"):
        return "fused"
    if group.get("foreach"):
        return "foreach"
    if group.get("foreach") is None and not group.get("fused"):
        from torch.optim.optimizer import _default_to_fused_or_foreach

        _, foreach = _default_to_fused_or_foreach(
            params, differentiable=bool(group.get("differentiable", False)), use_fused=False)
        return "foreach" if foreach else "for-loop"
    return "for-loop"


def nonzero_divisor(value: float, what: str, optimizer_name: str) -> float:
    """Return ``value``; refuse it when the inverse would divide by zero."""
    if value == 0.0:
        raise NotInvertibleError(
            f"{optimizer_name}: {what} is 0, so the step multiplies state by 0 and the previous "
            "value cannot be recovered. Fix: use a non-zero value.")
    return value


class InverseRule(ABC):
    """Exact inverse of one optimizer family's update (see the module docstring)."""

    name: str = "optimizer"

    @abstractmethod
    def validate_group(self, group: dict) -> None:
        """Raise NotInvertibleError if this group's configuration has no inverse."""

    @abstractmethod
    def capture(self, optimizer: torch.optim.Optimizer, p: torch.Tensor, mark: ParamMark) -> None:
        """Fill the rule-specific pre-step scalars of ``mark``."""

    @abstractmethod
    def was_updated(self, optimizer: torch.optim.Optimizer, p: torch.Tensor, mark: ParamMark,
                    path: str, step_completed: bool) -> bool:
        """True iff the recorded step updated ``p``."""

    @abstractmethod
    def undo_param(self, optimizer: torch.optim.Optimizer, p: torch.Tensor, grad: torch.Tensor,
                   hp: dict, mark: ParamMark, path: str) -> None:
        """Invert the step for one updated parameter, in float64; ``hp`` holds the group's
        hyperparameters as they were when the step ran."""

    def grad_mutations(self, hp: dict, path: str) -> int:
        """How many in-place ops the step itself applies to ``p.grad`` (normally none)."""
        return 0

    def restore_scalars(self, optimizer: torch.optim.Optimizer, p: torch.Tensor,
                        mark: ParamMark) -> None:
        """Restore scalar state (step counters, lazily created state) after any inverse."""
        if not mark.had_state and p in optimizer.state:
            del optimizer.state[p]
