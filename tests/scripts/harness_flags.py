"""What the framework scripts (train_transformers.py, train_lightning.py) share with
tests/fault_harness.py: its flags, the steps log it watches, and deaths at exact points."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, Optional

RANK = int(os.environ.get("RANK", "0"))
GEN = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parser() -> argparse.ArgumentParser:
    """The harness's flags; a script adds its own."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", default="", help="rank 0 saves its final parameters and optimizer state here")
    p.add_argument("--steps-log", default="")
    p.add_argument("--without-jitckpt", action="store_true", help="the same job with no jitckpt at all")
    p.add_argument("--resume", default="", help="resume from this checkpoint with the framework's own resume")
    p.add_argument("--die", default="", help="RANK:STEP:forward|end: that rank SIGKILLs itself (first run only) "
                   "after its forward of minibatch STEP, or once optimizer step STEP is done")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds slept at each step's start (the numbers are unchanged)")
    return p


class StepRecords:
    """The ``begin``/``step`` records of each rank the harness waits on, and ``--die``/``--step-sleep``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.f = open(args.steps_log, "a") if args.steps_log else None

    def _log(self, **rec: Any) -> None:
        if self.f:
            self.f.write(json.dumps({"gen": GEN, "rank": RANK, "pid": os.getpid(), "t": time.time(), **rec}) + "\n")
            self.f.flush()

    def began(self, step: int) -> None:
        self._log(begin=step)
        time.sleep(self.args.step_sleep)  # a slow step, for a signal to land mid-training

    def done(self, step: int) -> None:
        self._log(step=step)
        self.die(step, "end")

    def die(self, step: int, where: str) -> None:
        if self.args.die and GEN == 0 and self.args.die == f"{RANK}:{step}:{where}":
            os.kill(os.getpid(), signal.SIGKILL)


def save_final(model: Any, optimizer: Any, out: str) -> None:
    """Rank 0's final parameters, buffers and optimizer state tensors, for a bitwise comparison."""
    import torch

    if RANK != 0 or not out:
        return
    final = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in optimizer.state_dict()["state"].items():
        final.update({f"optim.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    torch.save(final, out)


def end(without_jitckpt: bool, code: Optional[int] = 0) -> None:
    """As a user's script ends (the framework leaves the process group up)."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if without_jitckpt:
        # A reference run must not fail after its work is done: torch's gloo teardown at interpreter
        # exit now and then aborts ("terminate called without an active exception"). Under jitckpt
        # run the exit barrier (atexit) must run, and such a death after it is no failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
