"""The benchmarks' baselines are honest (issue 19): torchrun + DCP async_save every N steps, as
examples/train_ddp.py --no-jitckpt --baseline-dcp-every runs it, resumes a killed job from its newest
complete DCP checkpoint and ends bitwise where a failure-free run ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from jobs import ROOT, TRAIN

pytestmark = pytest.mark.slow  # a benchmark's baseline (~15 s), not jitckpt itself

ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun(tmp, name: str, *args: str) -> dict:
    out = tmp / f"{name}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.1", str(TRAIN), "--no-jitckpt", "--steps", "14", "--out", str(out),
           "--steps-log", str(tmp / f"{name}.jsonl"), *args]
    p = subprocess.run(cmd, cwd=tmp, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_torchrun_with_dcp_async_save_resumes_from_its_newest_complete_checkpoint_bitwise(tmp_path) -> None:
    expected = torchrun(tmp_path, "clean")
    got = torchrun(tmp_path, "killed", "--baseline-dcp-every", "5", "--baseline-dir", str(tmp_path / "dcp"),
                   "--inject", "0:1:12:kill")
    log = [json.loads(line) for line in (tmp_path / "killed.jsonl").read_text().splitlines()]
    # From DCP's step 10, or step 5 when the kill (2 steps later) came before step 10's async save was done.
    assert min(r["step"] for r in log if r.get("gen") == 1 and "step" in r) in (5, 10)
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == ["step-00000005", "step-00000010"]
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
