"""SWIFT update-undo: bring a replica back to its state before the last optimizer step.

After a failure interrupts the optimizer step, surviving data-parallel replicas hold a mix of
updated and not-yet-updated parameters. :class:`UpdateUndo` inverts the step for exactly the
parameters it updated, using only the step's gradient (left in ``p.grad`` by the framework)
and O(1) scalar marks per parameter recorded by a step pre-hook (tensor version counter, step
counter, whether a momentum buffer existed, Lamb's previous trust ratio). No tensor is copied.

Supported: torch.optim.SGD, Adam, AdamW (for-loop, foreach and fused CPU paths) and
:class:`jitckpt.swift.Lamb`. Refused at construction with :class:`NotInvertibleError`: any other
optimizer (including subclasses, whose step may differ), amsgrad, capturable, differentiable,
tensor hyperparameters, a zero first/second-moment factor (betas[0] or betas[1] == 0: the step
multiplies the kept buffer by 0), and 1 - lr*weight_decay == 0. The same checks run again in
the step pre-hook, so a scheduler or a user cannot move the optimizer into a non-invertible
configuration unnoticed (the step then raises before touching anything).

LR schedulers: ``scheduler.state_dict()`` (a handful of scalars) and each group's
hyperparameters are recorded by the pre-hook and put back by the undo, so a
``scheduler.step()`` that ran after the optimizer step is rolled back too.

Accuracy (elementwise, eps = machine epsilon of the parameter dtype, 2^-23 for float32; x0 the
true pre-step value, x1 the post-step value, D the step's update lr*d; beta the factor the
kept buffer was multiplied by: SGD momentum, Adam b1 or b2; c = 1 - lr*wd for a decoupled /
L2 division):

* parameters:     |x0' - x0| <= 2*eps*(|x1| + |D|)/|c| + eps*|x0|  (LAMB: c = 1 - lr*trust*wd may be < 0)
* moment buffers: |m0' - m0| <= (3*eps*(|m1| + (1-beta)*|g'|) + (1-beta)*|g'' - g'|)/beta
                  (g'' - g': error of the recomputed L2 gradient, wd*|x0' - x0| or 0)
* second moments: |v0' - v0| <= (3*eps*(|v1| + (1-b2)*g'^2) + (1-b2)*|g''^2 - g'^2|)/b2
* step counters, lazily created state, trust ratios, scheduler: exact.

The first two terms are the forward step's own rounding (<= 1 ulp each of the quantities
it added) carried back through the inverse; dividing by beta (or c) amplifies them, which no
inverse can avoid. tests/test_swift_undo.py checks these bounds with hypothesis over shapes,
magnitudes and hyperparameters. The inverse is deterministic (elementwise float64 math, no
reductions except Lamb's, whose trust ratio is read back, not recomputed), so replicas with
identical state and marks undo to bitwise-identical state.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from jitckpt.torch_compat import require_tested_torch
from jitckpt.swift.undo.adam import AdamInverse
from jitckpt.swift.undo.errors import NotInvertibleError, UndoError
from jitckpt.swift.undo.lamb_optimizer import Lamb
from jitckpt.swift.undo.lamb import LambInverse
from jitckpt.swift.undo.rule import InverseRule, ParamMark, implementation_path, refuse_param
from jitckpt.swift.undo.sgd import SGDInverse


def _rule_for(optimizer: torch.optim.Optimizer) -> InverseRule:
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return SGDInverse()
    if kind is torch.optim.AdamW:
        return AdamInverse("AdamW")
    if kind is torch.optim.Adam:
        return AdamInverse("Adam")
    if kind is Lamb:
        return LambInverse()
    raise NotInvertibleError(
        f"UpdateUndo: no inverse is known for {kind.__module__}.{kind.__qualname__}. Supported: "
        "torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, jitckpt.swift.Lamb (exact "
        "classes, since a subclass may change the update). Fix: use one of these or recover "
        "from a checkpoint instead of update-undo.")


@dataclass
class _StepRecord:
    """What the pre-hook recorded for one optimizer step."""

    marks: dict[int, ParamMark] = field(default_factory=dict)  # id(param) -> mark
    hparams: list[dict[str, Any]] = field(default_factory=list)  # per group, without params
    paths: list[str] = field(default_factory=list)  # implementation path per group
    scheduler_state: Optional[dict[str, Any]] = None
    completed: bool = False


class UpdateUndo:
    """Undo the last ``optimizer.step()`` (complete or interrupted) without any snapshot.

    ``UpdateUndo(optimizer, scheduler=None)`` validates invertibility (raising
    :class:`NotInvertibleError`) and installs step pre/post hooks. After a step,
    :meth:`undo_last_step` restores parameters, optimizer state (including step counters) and
    the scheduler to their values before that step, for the parameters that step updated.
    Call it before ``zero_grad()``: the inverse needs the step's gradient."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 scheduler: Optional[Any] = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"UpdateUndo: optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("UpdateUndo: scheduler drives a different optimizer than the one "
                             "given; pass the scheduler built on this optimizer.")
        require_tested_torch("SWIFT update-undo")
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._rule = _rule_for(optimizer)
        self._validate()
        self._record: Optional[_StepRecord] = None
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
            optimizer.register_load_state_dict_post_hook(self._forget),
        ]

    # -- hooks -------------------------------------------------------------------------------
    def _validate(self) -> None:
        for group in self.optimizer.param_groups:
            self._rule.validate_group(group)
            for p in group["params"]:
                refuse_param(p, self._rule.name)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        self._validate()
        if getattr(optimizer, "grad_scale", None) is not None or \
                getattr(optimizer, "found_inf", None) is not None:
            raise NotInvertibleError(
                f"{self._rule.name}: a GradScaler drives this fused step (grad_scale/found_inf "
                "set); a skipped or unscaled fused step is not invertible here. Fix: use "
                "GradScaler with a non-fused optimizer.")
        record = _StepRecord()
        for group in optimizer.param_groups:
            record.hparams.append({k: v for k, v in group.items() if k != "params"})
            record.paths.append(implementation_path(group, group["params"]))
            for p in group["params"]:
                grad = p.grad
                if grad is not None and grad.is_sparse:
                    raise NotInvertibleError(f"{self._rule.name}: sparse gradients are not "
                                             "supported by update-undo.")
                mark = ParamMark(
                    version=p._version,
                    grad_ref=weakref.ref(grad) if grad is not None else None,
                    grad_version=grad._version if grad is not None else 0,
                    had_state=bool(optimizer.state.get(p)),
                )
                self._rule.capture(optimizer, p, mark)
                record.marks[id(p)] = mark
        if self.scheduler is not None:
            # A scheduler's state is a handful of scalars and small lists; deep-copied because
            # some schedulers update those lists in place.
            record.scheduler_state = copy.deepcopy(self.scheduler.state_dict())
        self._record = record

    def _post_step(self, optimizer, args, kwargs) -> None:
        if self._record is not None:
            self._record.completed = True

    def _forget(self, optimizer) -> None:
        self._record = None

    # -- public API --------------------------------------------------------------------------
    @property
    def paths(self) -> list[str]:
        """Implementation path ('for-loop', 'foreach', 'fused') each group's last step took."""
        return list(self._record.paths) if self._record else []

    def updated_params(self) -> list[torch.Tensor]:
        """The parameters the recorded step updated (its "updated in step t" marks)."""
        record = self._require_record()
        out = []
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                mark = record.marks.get(id(p))
                if mark is not None and self._rule.was_updated(
                        self.optimizer, p, mark, record.paths[gi], record.completed):
                    out.append(p)
        return out

    def undo_last_step(self) -> int:
        """Invert the last step for the parameters it updated; return how many were undone.

        Raises :class:`UndoError` if no step is recorded, if it was already undone, or if a
        needed gradient changed since the step (zero_grad, a new backward)."""
        record = self._require_record()
        updated = {id(p) for p in self.updated_params()}
        # Check every precondition before touching anything, so a refusal leaves state intact.
        grads: dict[int, torch.Tensor] = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) in updated:
                    mutations = self._rule.grad_mutations(record.hparams[gi], record.paths[gi])
                    grads[id(p)] = self._step_gradient(p, record.marks[id(p)], gi, i, mutations)
        count = 0
        with torch.no_grad():
            for gi, group in enumerate(self.optimizer.param_groups):
                hp = record.hparams[gi]
                for p in group["params"]:
                    mark = record.marks.get(id(p))
                    if mark is None:
                        continue
                    if id(p) in updated:
                        self._rule.undo_param(self.optimizer, p, grads[id(p)], hp, mark,
                                              record.paths[gi])
                        count += 1
                    self._rule.restore_scalars(self.optimizer, p, mark)
            for group, hp in zip(self.optimizer.param_groups, record.hparams):
                group.update(hp)
        if self.scheduler is not None and record.scheduler_state is not None:
            self.scheduler.load_state_dict(record.scheduler_state)
        self._record = None
        return count

    def close(self) -> None:
        """Remove the hooks this object installed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._record = None

    # -- helpers -----------------------------------------------------------------------------
    def _require_record(self) -> _StepRecord:
        if self._record is None:
            raise UndoError("UpdateUndo: no optimizer step recorded since construction, the "
                            "last undo or load_state_dict(); nothing to undo.")
        return self._record

    def _step_gradient(self, p: torch.Tensor, mark: ParamMark, gi: int, i: int,
                       mutations: int) -> torch.Tensor:
        grad = p.grad
        kept = mark.grad_ref() if mark.grad_ref is not None else None
        if grad is None or kept is None or grad is not kept or \
                grad._version != mark.grad_version + mutations:
            raise UndoError(
                f"UpdateUndo: the gradient of param_groups[{gi}]['params'][{i}] changed after "
                "the step (zero_grad or a new backward ran); the inverse needs the step's "
                "gradient. Fix: call undo_last_step() before optimizer.zero_grad().")
        return grad
