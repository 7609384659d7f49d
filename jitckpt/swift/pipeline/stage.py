"""One stage of a synchronous pipeline: runs an iteration's schedule over a channel.

The same ``run_iteration`` serves live training, catch-up and replay; only the channel
differs, so a replayed iteration executes exactly the ops of the original one, in order.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch

from jitckpt.swift.pipeline.logging_records import ACTIVATION, GRADIENT, MessageKey
from jitckpt.swift.pipeline.channel import PipelineChannel
from jitckpt.swift.pipeline.schedule import BACKWARD, pipeline_schedule

InputFn = Callable[[int, int], torch.Tensor]
LossFn = Callable[[torch.Tensor, int, int], torch.Tensor]


class PipelineStage:
    """A stage's module and optimizer plus the pipeline wiring.

    ``activation_shape`` is the shape of the tensor received from the previous stage (unused on
    stage 0), ``output_shape`` the shape this stage sends forward (its gradient comes back);
    ``input_fn(iteration, micro_batch)`` gives stage 0's inputs and ``loss_fn(out, iteration,
    micro_batch)`` the last stage's loss (already scaled by 1/micro-batches if wanted). Both
    must be deterministic functions of their arguments.
    """

    def __init__(self, *, stage: int, num_stages: int, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, num_micro_batches: int,
                 activation_shape: tuple[int, ...], output_shape: tuple[int, ...],
                 input_fn: Optional[InputFn] = None, loss_fn: Optional[LossFn] = None,
                 schedule: str = "1f1b") -> None:
        if stage == 0 and input_fn is None:
            raise ValueError("stage 0 needs input_fn(iteration, micro_batch) for its inputs")
        if stage == num_stages - 1 and loss_fn is None:
            raise ValueError("the last stage needs loss_fn(output, iteration, micro_batch)")
        self.stage, self.num_stages = stage, num_stages
        self.module, self.optimizer = module, optimizer
        self.num_micro_batches = num_micro_batches
        self.activation_like = torch.empty(activation_shape)
        self.output_like = torch.empty(output_shape)
        self.input_fn, self.loss_fn = input_fn, loss_fn
        self.ops = pipeline_schedule(stage=stage, num_stages=num_stages,
                                     num_micro_batches=num_micro_batches, kind=schedule)

    def _key(self, it: int, mb: int, payload: str, src: int, dst: int) -> MessageKey:
        return MessageKey(iteration=it, micro_batch=mb, payload=payload, src=src, dst=dst)

    def run_iteration(self, channel: PipelineChannel, iteration: int,
                      on_op: Optional[Callable[[int, int], None]] = None) -> Optional[float]:
        """Run one iteration's forwards/backwards and the optimizer step; return the summed
        loss on the last stage. ``on_op(iteration, op_index)`` runs before each op (failure
        injection in tests). Partial state is dropped if a :class:`PeerFailure` escapes."""
        s, last = self.stage, self.stage == self.num_stages - 1
        stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        total = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for i, (op, mb) in enumerate(self.ops):
            if on_op is not None:
                on_op(iteration, i)
            if op == BACKWARD:
                x, out = stash.pop(mb)
                if last:
                    out.backward()
                else:
                    g = channel.recv(self.output_like,
                                     self._key(iteration, mb, GRADIENT, s + 1, s))
                    out.backward(g)
                if s > 0:
                    channel.send(x.grad, self._key(iteration, mb, GRADIENT, s, s - 1))
                continue
            if s == 0:
                x = self.input_fn(iteration, mb)
            else:
                x = channel.recv(self.activation_like,
                                 self._key(iteration, mb, ACTIVATION, s - 1, s))
                x.requires_grad_(True)
            out = self.module(x)
            if last:
                out = self.loss_fn(out, iteration, mb)
                total += float(out.detach())
            else:
                channel.send(out.detach(), self._key(iteration, mb, ACTIVATION, s, s + 1))
            stash[mb] = (x, out)
        channel.finish()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total if last else None

    def state_dict(self) -> dict:
        """Module and optimizer state (a stage checkpoint)."""
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (``state`` is not aliased afterwards)."""
        self.module.load_state_dict(state["module"])
        # Optimizer.load_state_dict keeps the given state tensors (e.g. momentum buffers) and
        # updates them in place later: copy, so the same checkpoint can be loaded twice.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
