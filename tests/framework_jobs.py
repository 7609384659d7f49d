"""Framework jobs (issue 45) for the fault harness: a script under tests/scripts/ that trains with a
framework's own loop (Trainer, Lightning, accelerate) and takes the harness's flags (``--steps``,
``--out``, ``--steps-log``, ``--without-jitckpt``, ``--resume``), and its failure-free reference run
under plain torchrun without jitckpt."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fault_harness import Config, Reference
from jobs import ROOT, run_bounded

FRAMEWORK_STEPS = 16    # two epochs on two ranks in each script
TORCHRUN_TIMEOUT = 240.0


@dataclass(frozen=True)
class FrameworkConfig(Config):
    """A framework's script on ``nproc`` DDP ranks over gloo."""

    framework: str = "transformers"  # tests/scripts/train_<framework>.py: transformers | lightning | accelerate | loader
    flags: tuple = ()                # the script's own, in every run of it

    @property
    def script(self) -> Path:
        return ROOT / "tests" / "scripts" / f"train_{self.framework}.py"

    @property
    def steps(self) -> int:
        return FRAMEWORK_STEPS

    @property
    def id(self) -> str:
        return "-".join([self.framework, *(f.lstrip("-") for f in self.flags), f"{self.nproc}r"])

    def script_args(self) -> list:
        return ["--steps", str(self.steps), *self.flags]


def torchrun(workdir: Path, cfg: FrameworkConfig, name: str, *args: str) -> Path:
    """The script under plain torchrun, no jitckpt imported; the path of rank 0's final state."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{name}-final.pt"
    rc, log = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(cfg.nproc), str(cfg.script), *cfg.script_args(), "--out", str(out), *args],
                          cwd=workdir, timeout=TORCHRUN_TIMEOUT)
    assert rc == 0 and out.exists(), f"torchrun {cfg.script.name} {' '.join(args)}: rc {rc}\n{log[-6000:]}"
    return out


def torchrun_reference(workdir: Path, cfg: FrameworkConfig) -> Reference:
    """A failure-free torchrun run of the script without jitckpt: what a recovered job must equal."""
    out = torchrun(workdir, cfg, "ref", "--without-jitckpt")
    return Reference(cfg, torch.load(out, weights_only=True), periodic_bytes=0)
