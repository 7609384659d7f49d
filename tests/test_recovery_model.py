"""The recovery-time model against job size (issue 48): its cited points, its shape, bad input named."""
from __future__ import annotations

import subprocess
import sys

import pytest

from jitckpt.observability import recovery_model as rm


def test_the_cited_points_and_the_shape():
    assert rm.nccl_init_s(8) == pytest.approx(rm.NCCL_INIT_8_S)
    assert rm.nccl_init_s(rm.NCCL_AT_SCALE_GPUS) == pytest.approx(rm.NCCL_INIT_AT_SCALE_S)
    for n, s in rm.SHRINK_POINTS:  # the fit stays within 0.3 s of every measured shrink
        assert abs(rm.nccl_shrink_s(n) - s) < 0.3
    rows = rm.evaluate(rm.RecoveryInputs(), [8, 64, 1024, 16384])
    for a, b in zip(rows, rows[1:]):
        assert a.restart_s <= b.restart_s and a.inprocess_reinit_s <= b.inprocess_reinit_s
    for r in rows:  # a restart pays all that the in-process path does, and more
        assert r.inprocess_shrink_s <= r.inprocess_reinit_s + 1e-9 or r.n_gpus < 64
        assert r.inprocess_reinit_s < r.restart_s


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="storage_gbps must be > 0"):
        rm.RecoveryInputs(storage_gbps=0)
    with pytest.raises(ValueError, match="compile_s must be a finite number"):
        rm.RecoveryInputs(compile_s=float("nan"))
    with pytest.raises(ValueError, match="no survivor"):
        rm.evaluate(rm.RecoveryInputs(), [1])


def test_jitckpt_analyze_prints_and_plots_it(tmp_path):
    out = tmp_path / "recovery.png"
    r = subprocess.run([sys.executable, "-m", "jitckpt", "analyze", "-N", "8:16384", "--recovery-time",
                        "--recovery-plot", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "in-process, shrink + grow" in r.stdout and "16384" in r.stdout
    assert out.stat().st_size > 10_000
