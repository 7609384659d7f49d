"""`jitckpt run --plugin logging` (= `--recovery stage`): the launcher replaces one dead pipeline
stage, alone.

Four workers run the 4-stage 1F1B pipeline of examples/pipeline_logging.py (SWIFT logging).
One stage SIGKILLs itself at iteration 6; the launcher keeps the other three running and starts
one replacement for the dead rank, which loads the global checkpoint of iteration 4 and replays
from its neighbours' logs. Survivors never roll back (each completes every iteration exactly
once and loads no checkpoint), the job ends with exit 0, and every stage's final parameters
are bitwise identical to a failure-free run. Rank 0 is among the cases (the job store lives in
the launcher, not in rank 0), and so is a second death after the first replacement. Two stages
dying at once fall back to a whole-job restart from the global checkpoint. Every job has a
deadline; its processes are killed by PID.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jitckpt.swift.pipeline.forked_supervisor import run_pipeline
from jitckpt.swift.pipeline.reference_model import MlpStages
from jitckpt.swift.pipeline.run_config import PipelineRun

from jobs import _read_jsonl, kill_tree, run_bounded

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "pipeline_logging.py"
ITERS, CKPT, FAIL_IT = 8, 4, 6


def _launch(work: Path, *, launcher_args: list, script_args: list, timeout: float = 150.0):
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "4", "--plugin", "logging",
           "--checkpoint-dir", str(work / "ckpt"), "--run-dir", str(work / "events"),
           "--status-interval", "0", *launcher_args, str(SCRIPT), "--run-dir", str(work / "run"),
           "--iterations", str(ITERS), "--checkpoint-every", str(CKPT), "--timeout", "60",
           *script_args]
    rc, out = run_bounded(cmd, cwd=work, timeout=timeout)
    return rc, out, _read_jsonl(work / "events" / "events.jsonl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _final(run: Path) -> dict:
    return {s: torch.load(run / "final" / f"stage{s}.pt", weights_only=True) for s in range(4)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The failure-free run, under the library's forked supervisor (the example's model)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    res = run_pipeline(PipelineRun(run_dir=str(run), iterations=ITERS, checkpoint_every=CKPT,
                                   timeout=60.0), build_stage=MlpStages())
    assert res.ok
    return _final(run)


@pytest.mark.parametrize("failures", [
    pytest.param([(2, FAIL_IT, 3)], marks=pytest.mark.slow),  # stage2-then-stage1 begins with it
    [(0, FAIL_IT, 5)],  # rank 0: the store it would host under torchrun is the launcher's
    # A second death after the first replacement: stage 1's replacement replays iterations
    # 5-6 from the logs of stage 2's replacement (which re-logged what it replayed).
    # Slow: test_two_nodes_each_launcher_replaces_its_own_dead_stage runs the same two deaths.
    pytest.param([(2, FAIL_IT, 3), (1, FAIL_IT + 1, 2)], marks=pytest.mark.slow),
], ids=["stage2", "stage0", "stage2-then-stage1"])
def test_launcher_replaces_only_the_dead_stage_bitwise(tmp_path, reference, failures):
    (stage, it, op), *later = failures
    rc, out, events = _launch(tmp_path, launcher_args=["--max-restarts", str(len(failures))],
                              script_args=["--fail-stage", str(stage), "--fail-iter", str(it),
                                           "--fail-op", str(op),
                                           *(a for s, i, o in later
                                             for a in ("--then-fail", f"{s}:{i}:{o}"))])
    assert rc == 0, out[-6000:]
    dead = [s for s, _, _ in failures]
    replaced = [e for e in events if e["event"] == "stage_replaced"]
    assert [(e["rank"], e["generation"]) for e in replaced] == [(s, g + 1) for g, s in enumerate(dead)]
    starts = [(e["rank"], e["role"]) for e in events if e["event"] == "worker_start"]
    assert starts == [(r, "initial") for r in range(4)] + [(s, "replacement") for s in dead]
    assert not [e for e in events if e["event"] == "restart"]  # no whole-job restart
    # Each replacement reported catching up: one recovery per death, timed by the launcher.
    summaries = [e for e in events if e["event"] == "recovery_summary"]
    assert [(e["scope"], e["failed_ranks"], e["step_resumed"]) for e in summaries] == \
        [("stage", [s], CKPT) for s in dead]
    assert all(e["steps_redone"] >= 1 and 0 < e["total_s"] < 60 for e in summaries)
    run = tmp_path / "run"
    stats = {s: json.loads((run / "final" / f"stage{s}.json").read_text()) for s in range(4)}
    for s, st in stats.items():
        if s in dead:
            assert st["role"] == "replacement" and st["loaded_checkpoint"] == CKPT
            assert st["replayed"] and st["replayed"][0] == CKPT + 1
        else:  # survivors: no roll back, every iteration exactly once
            assert st["role"] == "initial" and st["loaded_checkpoint"] is None
            assert st["completed_log"] == list(range(1, ITERS + 1))
    got = _final(run)
    for s in range(4):
        assert got[s].keys() == reference[s].keys()
        for k in reference[s]:
            assert torch.equal(got[s][k], reference[s][k]), f"stage {s} {k} differs"


@pytest.mark.parametrize("injection,dead", [
    # Both in the slow suite, as the two-node cases below are: the fast one keeps a replacement and a
    # job that runs out of restarts.
    pytest.param(["--fail-stage", "1", "--also-fail", "2", "--fail-iter", str(FAIL_IT), "--fail-op", "0"], [1, 2],
                 marks=pytest.mark.slow),
    # stage 2's replacement (generation 1) dies replaying iteration CKPT + 1
    pytest.param(["--fail-stage", "2", "--fail-iter", str(FAIL_IT), "--fail-op", "3",
                  "--then-fail", f"2:{CKPT + 1}:0"], [2], marks=pytest.mark.slow),
], ids=["two-stages-at-once", "replacement-dies-replaying"])
def test_overlapping_failures_restart_the_whole_job(tmp_path, reference, injection, dead):
    """Stages 1 and 2 die at the same op, or a replacement dies before it has caught up: the
    first death seen is replaced; the second finds that replacement still catching up (the
    survivors wait for it in a group that can no longer form), so the launcher falls back to
    restarting every rank from the global checkpoint. No wait runs into a timeout, and the
    result is bitwise that of a failure-free run."""
    rc, out, events = _launch(tmp_path, launcher_args=["--max-restarts", "3"],
                              script_args=injection)
    assert rc == 0, out[-6000:]
    assert "still catching up from the logs; restarting every rank" in out
    # One failure, both deaths in it, recovered by the restart from the iteration-CKPT checkpoint.
    [summary] = [e for e in events if e["event"] == "recovery_summary"]
    assert summary.get("scope") != "stage" and summary["step_resumed"] == CKPT, summary
    # Both deaths, not the survivors that gave up (no save function).
    assert sorted(summary["failed_ranks"]) == dead, summary
    assert {e["step"] for e in events if e["event"] == "restore"} == {CKPT}
    replaced = [e["rank"] for e in events if e["event"] == "stage_replaced"]
    assert len(replaced) == 1 and replaced[0] in (1, 2), replaced
    assert len([e for e in events if e["event"] == "restart"]) == 1
    starts = [(e["rank"], e["role"]) for e in events if e["event"] == "worker_start"]
    assert starts == ([(r, "initial") for r in range(4)] + [(replaced[0], "replacement")]
                      + [(r, "restart") for r in range(4)]), starts
    run = tmp_path / "run"
    for s in range(4):
        st = json.loads((run / "final" / f"stage{s}.json").read_text())
        assert st["role"] == "restart" and st["loaded_checkpoint"] == CKPT, st
    _assert_bitwise(run, reference)


def _launch_two_nodes(tmp_path: Path, script_args: list) -> list:
    """Two launchers of two stages each on node 0's rendezvous store; returns their events."""
    port = free_port()
    procs = []
    try:
        for node in (0, 1):
            work = tmp_path / f"node{node}"
            work.mkdir()
            cmd = [sys.executable, "-m", "jitckpt", "run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                   "stage2n", "--recovery", "stage", "--max-restarts", "2", "--checkpoint-dir",
                   str(tmp_path / "ckpt"), "--run-dir", str(work / "events"), "--status-interval", "0",
                   str(SCRIPT), "--run-dir", str(tmp_path / "run"), "--iterations", str(ITERS),
                   "--checkpoint-every", str(CKPT), "--timeout", "60", *script_args]
            procs.append(subprocess.Popen(cmd, cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        try:
            outs = [p.communicate(timeout=150)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_tree(p.pid)
            raise AssertionError("two-node stage job timed out:\n"
                                 + "\n".join(p.communicate()[0][-3000:] for p in procs)) from None
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    return [_read_jsonl(tmp_path / f"node{n}" / "events" / "events.jsonl") for n in (0, 1)]


def _assert_bitwise(run: Path, reference: dict) -> None:
    got = _final(run)
    for s in range(4):
        for k in reference[s]:
            assert torch.equal(got[s][k], reference[s][k]), f"stage {s} {k} differs"


@pytest.mark.slow  # ~15 s: the one-node replacement is in the fast suite
def test_two_nodes_each_launcher_replaces_its_own_dead_stage(tmp_path, reference):
    """Two launchers (2 stages each) share node 0's rendezvous store: stage 2 dies on node 1,
    then stage 1 on node 0; each launcher replaces its own rank, generations come from the
    shared store (1, then 2), and the result is bitwise that of a failure-free run."""
    events = _launch_two_nodes(tmp_path, ["--fail-stage", "2", "--fail-iter", str(FAIL_IT),
                                          "--fail-op", "3", "--then-fail", f"1:{FAIL_IT + 1}:2"])
    replaced = [[(e["rank"], e["generation"]) for e in ev if e["event"] == "stage_replaced"]
                for ev in events]
    assert replaced == [[(1, 2)], [(2, 1)]], replaced
    assert not [e for ev in events for e in ev if e["event"] == "restart"]
    _assert_bitwise(tmp_path / "run", reference)


@pytest.mark.slow  # ~15 s: two deaths at once
def test_two_nodes_losing_a_stage_each_at_once_restart_the_whole_job(tmp_path, reference):
    """Stage 1 (node 0) and stage 2 (node 1) die at the same op: the store lets one launcher
    start a replacement; the other falls back to the whole-job restart, which reaches the first
    through the rendezvous store. Both nodes restart once, bitwise result."""
    events = _launch_two_nodes(tmp_path, ["--fail-stage", "1", "--also-fail", "2",
                                          "--fail-iter", str(FAIL_IT), "--fail-op", "0"])
    replaced = [e["rank"] for ev in events for e in ev if e["event"] == "stage_replaced"]
    assert len(replaced) <= 1, replaced  # none if the restart reached the other node first
    assert [len([e for e in ev if e["event"] == "restart"]) for ev in events] == [1, 1]
    for s in range(4):
        st = json.loads((tmp_path / "run" / "final" / f"stage{s}.json").read_text())
        assert st["role"] == "restart" and st["loaded_checkpoint"] == CKPT, st
    _assert_bitwise(tmp_path / "run", reference)


def test_no_restarts_left_ends_the_job_with_an_error(tmp_path):
    rc, out, events = _launch(tmp_path, launcher_args=["--max-restarts", "0"],
                              script_args=["--fail-stage", "1", "--fail-iter", "2"])
    assert rc == 1
    assert "--max-restarts=0 is used up" in out
    assert not [e for e in events if e["event"] == "stage_replaced"]
    assert [e["status"] for e in events if e["event"] == "job_end"] == ["failed"]


def test_membership_from_environment(monkeypatch):
    import torch.distributed as dist

    from jitckpt.swift.pipeline.failure_flag import announce_key
    from jitckpt.swift.pipeline.stage_membership import StageMembership

    from jitckpt.protocol.worker_spec import StageSpec
    from jitckpt.runtime import current

    monkeypatch.setattr(current, "_runtime", None)
    assert StageMembership.from_launcher() is None  # not under --recovery stage
    with pytest.raises(ValueError, match="HOST:PORT"):
        StageSpec(store="no-port")
    store = dist.HashStore()
    with pytest.raises(ValueError, match="role 'survivor'"):
        StageMembership(rank=0, world_size=4, generation=0, role="survivor", store=store)
    with pytest.raises(ValueError, match="RANK=4"):
        StageMembership(rank=4, world_size=4, generation=0, role="initial", store=store)
    m = StageMembership(rank=1, world_size=4, generation=0, role="initial", store=store)
    store.set(announce_key(1), "2")
    assert m.failed_rank(1) == 2
    assert not m.failure_flag(1).is_set()
