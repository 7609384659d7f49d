"""The reference model of the pipeline runtime: :class:`MlpStages`, a stage builder.

A stage builder is what the runtime calls in each stage process to get that stage's model,
optimizer, data and loss: ``build_stage(run, stage) -> PipelineStage``. ``MlpStages`` is the one
the tests, the benchmark and ``examples/pipeline_logging.py`` use (a user replaces it with their
model): a few ``Linear + Tanh`` layers per stage on synthetic data, seeded per stage and per
(iteration, micro-batch), so two runs of the same configuration end bitwise identical.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from jitckpt.swift.pipeline.run_config import PipelineRun
from jitckpt.swift.pipeline.stage import PipelineStage


@dataclass(frozen=True, kw_only=True)
class MlpStages:
    """``layers_per_stage`` x (Linear(hidden, hidden) + Tanh) per stage, SGD with momentum,
    micro-batches of ``micro_batch_size`` random rows, MSE loss against a fixed target.
    Keyword-only, validated at construction."""

    hidden: int = 32
    layers_per_stage: int = 2
    micro_batch_size: int = 8

    def __post_init__(self) -> None:
        if min(self.hidden, self.layers_per_stage, self.micro_batch_size) < 1:
            raise ValueError(f"hidden, layers_per_stage and micro_batch_size must be >= 1, got "
                             f"{self.hidden}, {self.layers_per_stage}, {self.micro_batch_size}")

    def __call__(self, run: PipelineRun, stage: int) -> PipelineStage:
        """Stage ``stage`` of ``run`` (the same parameters in every process and generation)."""
        torch.manual_seed(1000 + stage)
        layers = []
        for _ in range(self.layers_per_stage):
            layers += [torch.nn.Linear(self.hidden, self.hidden), torch.nn.Tanh()]
        module = torch.nn.Sequential(*layers)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        shape = (self.micro_batch_size, self.hidden)

        def data(it: int, mb: int, salt: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(salt * 1_000_003 + it * 1009 + mb)
            return torch.randn(shape, generator=g)

        def loss_fn(out: torch.Tensor, it: int, mb: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(out, data(it, mb, 2).tanh()) / run.micro_batches

        return PipelineStage(stage=stage, num_stages=run.num_stages, module=module, optimizer=opt,
                             num_micro_batches=run.micro_batches, activation_shape=shape,
                             output_shape=shape, input_fn=lambda it, mb: data(it, mb, 1),
                             loss_fn=loss_fn, schedule=run.schedule)
