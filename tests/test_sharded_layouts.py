"""``jitckpt.protect`` on DTensor-sharded models (FSDP2 ``fully_shard``, HSDP): the job must run as it
does under torchrun. jitckpt cannot JIT-save such state yet (issue 44): protect() says so at the
start, and a failure restarts the job from step 0. (Before: the first ``optimizer.step()`` crashed
in the save reserve's size count, ``_state_bytes``, on the DTensor shards' storage, and the launcher
restarted the job until it gave up.) Real processes, gloo, torch's own FSDP2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from jobs import ROOT, run_bounded, run_job

SCRIPT = ROOT / "tests" / "scripts" / "train_fsdp2.py"
STEPS = 8


def torchrun_final(tmp: Path, nproc: int, mesh: str) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    rc, out = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--standalone", str(SCRIPT), "--no-jitckpt", "--mesh", mesh,
                           "--steps", str(STEPS), "--out", str(tmp / "final.pt")], cwd=tmp, timeout=180)
    assert rc == 0, out[-4000:]
    return torch.load(tmp / "final.pt", weights_only=True)


@pytest.mark.parametrize("nproc,mesh", [(2, "fsdp"), pytest.param(4, "hsdp", marks=pytest.mark.slow)])
def test_a_sharded_job_under_protect_trains_as_under_torchrun_and_restarts_after_a_failure(tmp_path, nproc, mesh):
    want = torchrun_final(tmp_path / "torchrun", nproc, mesh)
    res = run_job(tmp_path / "jit", nproc=nproc, script=SCRIPT,
                  script_args=["--mesh", mesh, "--steps", str(STEPS), "--kill", f"{nproc - 1}:4"])
    assert res.rc == 0, res.out[-4000:]
    assert "this model's state is DTensor-sharded" in res.out and "restarts it from step 0" in res.out, res.out[-4000:]
    assert "Shard(dim=0)" in res.out, res.out[-4000:]  # the layout it found
    # One failure: the launcher's word of the death, or a survivor's failed collective first.
    assert len(res.ev("failure_detected")) == 1, res.ev("failure_detected")
    assert [s["failed_ranks"] for s in res.ev("recovery_summary")] == [[nproc - 1]], res.ev("recovery_summary")
    assert not res.ev("checkpoint_saved"), res.ev("checkpoint_saved")
    assert [e["reason"] for e in res.ev("restart")] == ["failure"]
    got = torch.load(res.workdir / "final.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_preempted_sharded_job_says_why_it_saved_nothing(tmp_path):
    """SIGTERM to a worker is a preemption: every rank would save, then the job stops. A layout
    protect() cannot save is named as the reason (was: "stopped, hung, or too slow")."""
    res = run_job(tmp_path, nproc=2, script=SCRIPT, script_args=["--steps", str(STEPS), "--kill", "1:3:term"])
    assert res.rc == 143, res.out[-4000:]
    assert "saved no JIT checkpoint (jitckpt.protect(): this model's state is DTensor-sharded" in res.out, res.out[-4000:]
    assert not res.ev("checkpoint_saved")
