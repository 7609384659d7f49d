"""A ``jitckpt.protect()`` training script whose model and optimizer run on the device through ctypes
(``simcuda_progs/protect_input.cu``), for ``test_protect_marks.py``.

Each iteration is a PyTorch loop's: the batch goes from host memory to the device first
(``x = batch.to(device)``), then the model runs (protect()'s forward pre-hook fires), then
``optimizer.step()`` (its step hooks fire). The model's real parameters live on the device; the
torch module and optimizer only carry protect()'s hooks. At the end the parameters go to OUT.

    python protect_train.py LIB STEPS OUT
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

import jitckpt

DIM, BATCH, LR = 8, 16, 0.05


def check(rc: int, what: str) -> None:
    """Raise on a non-zero return code of the library."""
    if rc != 0:
        raise RuntimeError(f"{what} failed with code {rc}")


def fill_batch(host: ctypes.Array, step: int) -> None:
    """Deterministic features (an LCG seeded by the step) and targets of a fixed linear map."""
    state = (step * 2654435761 + 12345) & 0xFFFFFFFF
    for i in range(BATCH):
        target = 0.5
        for j in range(DIM):
            state = (state * 1664525 + 1013904223) & 0xFFFFFFFF
            v = (state >> 8) / float(1 << 24) - 0.5
            host[i * DIM + j] = v
            target += v * 0.1 * ((j % 7) - 3)
        host[BATCH * DIM + i] = target


class DeviceModel(torch.nn.Module):
    """Forward and backward in one library call (the gradients' all-reduce included)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.lib = lib
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # an optimizer needs a parameter to hold

    def forward(self, step: int) -> None:
        check(self.lib.pi_forward_backward(), f"forward/backward of step {step}")


class DeviceSGD(torch.optim.Optimizer):
    """SGD on the device parameters; a torch optimizer so that its step hooks run."""

    def __init__(self, model: DeviceModel) -> None:
        super().__init__(model.parameters(), {})
        self.lib = model.lib

    def step(self, closure=None) -> None:  # type: ignore[override]
        check(self.lib.pi_optimizer_step(ctypes.c_float(LR)), "optimizer step")


def main(argv: list[str]) -> int:
    lib_path, steps, out = argv[1], int(argv[2]), Path(argv[3])
    lib = ctypes.PyDLL(lib_path)
    check(lib.pi_init(DIM, BATCH), "pi_init")
    model = DeviceModel(lib)
    optimizer = DeviceSGD(model)
    state = jitckpt.protect(model, optimizer)
    host = (ctypes.c_float * (BATCH * DIM + BATCH))()
    for step in range(state.restore(), steps):
        fill_batch(host, step)
        check(lib.pi_load_batch(host), f"load batch {step}")  # before the model, as batch.to(device)
        model(step)
        optimizer.step()
    params = (ctypes.c_float * lib.pi_param_count())()
    check(lib.pi_get_params(params), "pi_get_params")
    out.write_bytes(bytes(params))
    print(f"finished {steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
