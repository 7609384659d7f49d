"""End to end: 4-stage 1F1B pipeline over gloo (one real process per stage) with SWIFT logging.

One stage SIGKILLs itself at (iteration, op). Its replacement loads the last global checkpoint
and replays its lost iterations alone from the neighbours' logs; the survivors keep their state
(no roll back: each completes every iteration exactly once and never loads a checkpoint) and
re-form a gloo group with the replacement under a new store prefix. The final parameters of
every stage must be bitwise identical to a failure-free run. A replacement whose replay is
perturbed must be caught by the digest check (divergence is detected, not ignored).

Every run has a deadline (PipelineRun.timeout) and its processes are killed by PID on exit.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from jitckpt.swift.pipeline.fault_plan import FaultPlan
from jitckpt.swift.pipeline.forked_supervisor import run_pipeline
from jitckpt.swift.pipeline.logging_records import MessageKey
from jitckpt.swift.pipeline.reference_model import MlpStages
from jitckpt.swift.pipeline.run_config import PipelineRun

ITERS, CKPT, FAIL_IT = 8, 4, 6
FAULT_FIELDS = {f.name for f in dataclasses.fields(FaultPlan)}


def _configure(run_dir: str, **kw) -> tuple[PipelineRun, FaultPlan]:
    """A run and its fault plan from one set of keywords (FaultPlan's fields go to the plan)."""
    faults = FaultPlan(**{k: kw.pop(k) for k in FAULT_FIELDS & kw.keys()})
    cfg = PipelineRun(run_dir=run_dir, **kw)
    faults.check(cfg)
    return cfg, faults


def _run(tmp: Path, name: str, **kw):
    cfg, faults = _configure(str(tmp / name), iterations=ITERS, checkpoint_every=CKPT,
                             timeout=60.0, **kw)
    return run_pipeline(cfg, build_stage=MlpStages(), faults=faults)


def _final(res_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {s: torch.load(res_dir / "final" / f"stage{s}.pt", weights_only=True)
            for s in range(4)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    res = _run(tmp, "ref")
    assert res.ok
    return _final(tmp / "ref"), res


def _assert_bitwise(got, want):
    for s in range(4):
        assert got[s].keys() == want[s].keys()
        for k in want[s]:
            assert torch.equal(got[s][k], want[s][k]), f"stage {s} {k} differs"


def _ops(stage: int) -> list:
    from jitckpt.swift.pipeline.schedule import pipeline_schedule
    return pipeline_schedule(stage=stage, num_stages=4, num_micro_batches=4)


@pytest.mark.parametrize("fail_stage, fail_op, fail_after", [
    # stage 2 dies mid-iteration (before its 4th op): every survivor is still in FAIL_IT.
    (2, 3, ()),
    # stage 1 dies before its last backward, once stage 3 has finished FAIL_IT: stage 3 keeps
    # it (no roll back), stage 0 cannot have finished it -> the replacement replays alone to
    # FAIL_IT-1, then re-runs FAIL_IT with stage 0 live and later stages' messages from logs.
    (1, len(_ops(1)) - 1, (3,)),
])
def test_single_stage_recovery_is_bitwise_identical(tmp_path, reference, fail_stage, fail_op,
                                                    fail_after):
    want, ref = reference
    res = _run(tmp_path, "fail", fail_stage=fail_stage, fail_iteration=FAIL_IT, fail_op=fail_op,
               fail_after=fail_after)
    assert res.ok
    assert (fail_stage, -9) in res.exit_codes  # the stage really died
    _assert_bitwise(_final(tmp_path / "fail"), want)
    for s, st in res.stats.items():
        if s == fail_stage:
            assert st["role"] == "replacement"
            assert st["loaded_checkpoint"] == CKPT
            # everything after the checkpoint up to (at least) FAIL_IT-1 came from the logs
            assert st["replayed"][:FAIL_IT - 1 - CKPT] == list(range(CKPT + 1, FAIL_IT))
            assert st["checked_outputs"] > 0 and st["replayed_inputs"] > 0
            assert st["completed_log"] == list(range(CKPT + 1, ITERS + 1))
        else:
            assert st["role"] == "initial" and st["loaded_checkpoint"] is None
            # no roll back: every iteration completed exactly once, in order
            assert st["completed_log"] == list(range(1, ITERS + 1))
            assert st.get("failures_seen"), f"stage {s} never noticed the failure"
    # the losses of the last stage equal the failure-free run's
    assert res.stats[3]["losses"] == ref.stats[3]["losses"]
    if fail_after:
        assert res.stats[0]["catch_up"] == FAIL_IT  # behind survivor re-ran FAIL_IT
        assert res.stats[1]["catch_up"] == FAIL_IT  # replacement joined that re-run
        assert res.stats[1]["replayed"] == list(range(CKPT + 1, FAIL_IT))
        assert res.stats[3]["catch_up"] is None  # ahead survivor kept its FAIL_IT
        # (stage 2 is either: its last send to the dead stage may or may not have completed)
    else:
        assert all(st["catch_up"] is None for st in res.stats.values())
    assert res.recovery_time is not None and res.recovery_time > 0


def test_selective_logging_group_recovers_together(tmp_path, reference):
    # Groups [[0], [1, 2], [3]] (as plan_groups gives for R=[4,1,1,4], see
    # test_selective_logging.py): the 1-2 boundary is not logged. Stage 2 dies mid-iteration:
    # its group-mate stage 1 rolls back to the checkpoint and replays with the replacement
    # (live between them, stage 0's and 3's messages from their logs); 0 and 3 do not roll back.
    want, _ = reference
    res = _run(tmp_path, "group", fail_stage=2, fail_iteration=FAIL_IT, fail_op=3,
               groups=((0,), (1, 2), (3,)))
    assert res.ok
    _assert_bitwise(_final(tmp_path / "group"), want)
    st = res.stats
    assert st[2]["role"] == "replacement" and st[2]["loaded_checkpoint"] == CKPT
    assert st[1].get("rolled_back") and st[1]["loaded_checkpoint"] == CKPT
    assert st[1]["replayed"] == st[2]["replayed"] == list(range(CKPT + 1, FAIL_IT))
    for s in (0, 3):
        assert st[s]["loaded_checkpoint"] is None and not st[s].get("rolled_back")
        assert st[s]["completed_log"] == list(range(1, ITERS + 1))
    # nothing crosses the unlogged boundary in the logs
    from jitckpt.swift.pipeline.logging_replay import LogIndex
    index = LogIndex([tmp_path / "group" / "logs" / f"stage{s}" for s in range(4)])
    assert not any(index.has_input(MessageKey(iteration=it, micro_batch=mb, payload=p,
                                              src=a, dst=b))
                   for it in range(CKPT + 1, ITERS + 1) for mb in range(4)
                   for p, a, b in (("activation", 1, 2), ("gradient", 2, 1)))
    assert index.has_input(MessageKey(iteration=ITERS, micro_batch=0, payload="activation",
                                      src=2, dst=3))


def test_divergent_replay_is_detected(tmp_path):
    with pytest.raises(RuntimeError, match="ReplayDivergenceError"):
        _run(tmp_path, "tamper", fail_stage=2, fail_iteration=FAIL_IT, fail_op=3,
             tamper_replay=True)


@pytest.mark.parametrize("kw, match", [
    (dict(recovery="rollback"), "recovery must be"),
    (dict(fail_stage=2, fail_iteration=3, logging=False), "needs logging=True"),
    (dict(fail_stage=4, fail_iteration=3), "fail_stage 4 outside"),
    (dict(fail_stage=1, fail_iteration=ITERS + 1), "fail_iteration must be in"),
    (dict(later_failures=((1, 3, 0),)), "need a first failure"),
    (dict(fail_stage=1, fail_iteration=2, later_failures=((5, 3, 0),)), "later failure of stage 5"),
])
def test_bad_run_configuration_is_refused(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _configure(str(tmp_path), iterations=ITERS, **kw)


def test_several_failures_need_the_launcher(tmp_path):
    cfg, faults = _configure(str(tmp_path), iterations=ITERS, fail_stage=1, fail_iteration=2,
                             later_failures=((2, 3, 0),))
    with pytest.raises(ValueError, match="--recovery stage"):
        run_pipeline(cfg, build_stage=MlpStages(), faults=faults)
