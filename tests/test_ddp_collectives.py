"""Issue 13 items 1, 2 and 8: collectives that DDP (and async work handles) issue outside the wrapped
torch.distributed functions are covered, model buffers resume bitwise, and jitckpt.init() jobs get
DDP's bucket layout saved.

Real processes, gloo, 3 ranks (with 3 or more ranks the all-reduce's summation order, and so the
bucket layout, shows in the low bits). Rank 0 is the victim where the others must be inside DDP's
forward: it is the source of DDP's buffer broadcast and of the bucket-rebuild broadcast, so the
others wait for it there (a non-source rank's death is seen only later, in backward).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from jobs import COLD, ROOT, run_job

NPROC = 3
STEPS = 8
FAIL_STEP = 4
# Adaptive: 3 s once warm, 20 s while a kind of region has fewer than 2 samples (start-up).
HANG = ["--hang-timeout", "auto:floor=3,mult=10,startup=20,warmup=2"]
SCRIPTS = ROOT / "tests" / "scripts"

_refs: dict = {}


def reference(tmp_path_factory, model: str) -> dict:
    if model not in _refs:
        res = run_job(tmp_path_factory.mktemp(f"ref-{model}"), nproc=NPROC,
                      script_args=["--steps", str(STEPS), "--model", model], launcher_args=[*HANG, *COLD],
                      timeout=300)
        assert res.rc == 0 and not res.ev("failure_detected"), res.out[-4000:]
        _refs[model] = res.final_params()
    return _refs[model]


def assert_bitwise(final: dict, ref: dict) -> None:
    assert final.keys() == ref.keys()
    differ = {k: float((final[k].double() - ref[k].double()).abs().max()) for k in ref
              if not torch.equal(final[k], ref[k])}
    assert not differ, f"differs from the failure-free run (max abs difference): {differ}"


def assert_one_recovery(res, step: int, *, hang_in: str = "") -> None:
    """One failure (a hang the survivors found in region ``hang_in``, if given); the survivors
    JIT-saved step ``step``; at most one minibatch redone."""
    assert res.rc == 0, res.out[-4000:]
    failures = res.ev("failure_detected")
    assert len(failures) == 1, (failures, res.out[-4000:])
    if hang_in:  # a killed rank is seen by the launcher first, a stopped one by the survivors only
        assert failures[0]["kind"] == "hang" and f"{hang_in} blocked" in failures[0]["detail"], failures
    saved = [e for e in res.ev("checkpoint_saved") if e["kind"] == "jit"]
    assert saved and {e["step"] for e in saved} == {step}, saved
    done0 = sorted({r["step"] for r in res.log if r["gen"] == 0 and "step" in r})
    done1 = sorted({r["step"] for r in res.log if r["gen"] == 1 and "step" in r})
    assert done1 and done1[0] == step and (not done0 or done0[-1] == step - 1), (done0, done1)
    summaries = res.ev("recovery_summary")
    assert summaries and all(s["steps_redone"] is not None and s["steps_redone"] <= 1
                             for s in summaries), summaries


def run_case(tmp_path, model: str, inject: str, script: Path = ROOT / "examples" / "train_ddp.py",
             extra: tuple = ()):
    return run_job(tmp_path, nproc=NPROC, script=script, launcher_args=HANG, timeout=300,
                   script_args=["--steps", str(STEPS), *(["--model", model] if model else []),
                                "--inject", inject, *extra])


@pytest.mark.slow
@pytest.mark.timeout(900)  # a failure-free reference run and a run with a recovery, 3 ranks each
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_failure_during_forward_buffer_broadcast(tmp_path, tmp_path_factory, mode):
    """Rank 0 lost before its broadcast of the BatchNorm buffers: the others are inside DDP's
    _sync_buffers (C++ _broadcast_coalesced). Before: kill crashed them (no JIT save, restart from
    step 0), stop hung the job. Params and buffers must end bitwise equal."""
    res = run_case(tmp_path, "bn", f"0:0:{FAIL_STEP}:{mode}")
    assert_one_recovery(res, FAIL_STEP, hang_in="ddp_forward" if mode == "stop" else "")
    assert_bitwise(res.final_params(), reference(tmp_path_factory, "bn"))


@pytest.mark.slow
@pytest.mark.timeout(900)  # a failure-free reference run and a run with a recovery, 3 ranks each
@pytest.mark.parametrize("model,mode", [("bn", "kill"), ("mlp", "kill"), ("bn", "stop")])
def test_failure_at_step_1_bucket_rebuild(tmp_path, tmp_path_factory, model, mode):
    """Step 1: DDP's one-time bucket rebuild (a broadcast from rank 0 of the new layout) would run
    at the start of this forward; jitckpt does it right after the first backward and records the
    layout, so the survivors save step 1 with the layout minibatch 1 runs on."""
    res = run_case(tmp_path, model, f"0:0:1:{mode}")
    # With buffers the others wait for rank 0 in DDP's buffer broadcast, else in backward.
    region = "ddp_forward" if model == "bn" else "backward"
    assert_one_recovery(res, 1, hang_in=region if mode == "stop" else "")
    assert_bitwise(res.final_params(), reference(tmp_path_factory, model))


@pytest.mark.slow
@pytest.mark.timeout(900)  # a failure-free reference run and a run with a recovery, 3 ranks each
def test_batchnorm_rank0_lost_after_its_broadcast_resumes_bitwise(tmp_path, tmp_path_factory):
    """Item 2: rank 0 dies inside its forward, after broadcasting the buffers; the others fail
    later in the minibatch and save. Before, they saved their own buffers from before the
    broadcast, not the ones every rank's forward started from."""
    res = run_case(tmp_path, "bn", f"0:0:{FAIL_STEP}:fwdkill")
    assert_one_recovery(res, FAIL_STEP)
    assert_bitwise(res.final_params(), reference(tmp_path_factory, "bn"))


@pytest.mark.slow
@pytest.mark.timeout(900)  # a failure-free reference run and a run with a recovery, 3 ranks each
@pytest.mark.parametrize("wait,mode,kinds", [("work", "stop", {"hang"}), ("future", "kill", {"signal", "error"})])
def test_async_work_waited_later_is_covered(tmp_path, wait, mode, kinds):
    """all_reduce(async_op=True) waited for later (Work.wait / its Future): a hang is detected and
    an error saved, like a synchronous collective. Before: stop hung the job; kill crashed the
    survivors (no JIT save)."""
    ref = run_job(tmp_path / "ref", nproc=2, script=SCRIPTS / "async_wait.py", launcher_args=HANG,
                  script_args=["--wait", wait])
    assert ref.rc == 0, ref.out[-3000:]
    res = run_job(tmp_path / "run", nproc=2, script=SCRIPTS / "async_wait.py", launcher_args=HANG,
                  script_args=["--wait", wait, "--inject", f"0:1:{FAIL_STEP}:{mode}"])
    assert res.rc == 0, res.out[-4000:]
    failures = res.ev("failure_detected")
    assert len(failures) == 1 and failures[0]["kind"] in kinds, failures
    saved = [e for e in res.ev("checkpoint_saved") if e["kind"] == "jit"]
    assert [(e["rank"], e["step"]) for e in saved] == [(0, FAIL_STEP)], saved
    assert_bitwise(res.final_params(), ref.final_params())


@pytest.mark.slow
@pytest.mark.timeout(900)  # a failure-free reference run and a run with a recovery, 3 ranks each
def test_init_api_job_resumes_bitwise(tmp_path):
    """Item 8: a jitckpt.init(save_fn) job (its own save function) with 3 ranks resumes bitwise:
    its checkpoints carry DDP's bucket layout (without it the resumed minibatch runs on DDP's
    initial layout: differences of ~3e-8)."""
    script = SCRIPTS / "train_init.py"
    ref = run_job(tmp_path / "ref", nproc=NPROC, script=script, launcher_args=HANG, timeout=300,
                  script_args=["--steps", str(STEPS)])
    assert ref.rc == 0, ref.out[-3000:]
    res = run_case(tmp_path / "run", "", f"0:{NPROC - 1}:{FAIL_STEP}:kill", script=script)
    assert res.rc == 0, res.out[-4000:]
    saved = [e for e in res.ev("checkpoint_saved") if e["kind"] == "jit"]
    assert saved and {e["step"] for e in saved} == {FAIL_STEP}, saved
    assert_bitwise(res.final_params(), ref.final_params())


class _Model:  # stands for a DDP model (weakly referenced by the tracker)
    pass


def test_layout_is_written_into_every_checkpoint_before_its_checksums(tmp_path):
    """The runtime wraps any save function so the layout file is in the checkpoint's metadata."""
    from jitckpt.runtime import ddp_layout
    from jitckpt.checkpoint_store import verify_checkpoint, write_checkpoint

    tracker = ddp_layout.LayoutTracker()
    model = _Model()
    tracker._layouts[model] = {"buckets": [[1, 0]], "shapes": [[2], [3]]}

    def user_save(path):
        (Path(path) / "mine.pt").write_bytes(b"state")

    path, meta = write_checkpoint(tmp_path, tracker.saving(user_save), kind="jit", step=3, rank=1,
                                  world_size=3, gen=0)
    assert set(meta.files) == {"mine.pt", ddp_layout.LAYOUT_FILE}
    verify_checkpoint(path)
    assert ddp_layout.load(str(path))["buckets"] == [[1, 0]]


def test_status_line_never_ok_for_a_rank_without_progress(monkeypatch):
    from jitckpt.observability import status_display
    from jitckpt.observability.status_display import StatusDisplay
    from jitckpt.hang_timeout import HangTimeout

    clock = [1000.0]
    monkeypatch.setattr(status_display.time, "monotonic", lambda: clock[0])
    d = StatusDisplay(enabled=True, interval=0.0, hang_timeout=HangTimeout.parse("5"))
    ranks = [SimpleNamespace(rank=r, step=3, step_time=0.1, exit_code=None) for r in range(2)]
    assert [d.health(w, None) for w in ranks] == ["ok", "ok"]
    for t in (2.0, 4.0, 6.0):  # rank 0 advances, rank 1 is stopped at step 3
        clock[0] = 1000.0 + t
        ranks[0].step += 1
        health = [d.health(w, None) for w in ranks]
    assert health == ["ok", "no progress for 6s"], health
    # Adaptive policy: its floor is the shortest timeout it can give.
    d = StatusDisplay(enabled=True, interval=0.0, hang_timeout=HangTimeout.parse("auto:floor=2"))
    assert d.health(ranks[1], None) == "ok"
    clock[0] += 3.0
    assert d.health(ranks[1], None) == "no progress for 3s"
    # A stopped rank that exited shows its exit, and a known failure "saving".
    ranks[1].exit_code = -9
    assert d.health(ranks[1], None) == "exit -9"
