"""``jitckpt.protect`` on DTensor-sharded models (FSDP2 ``fully_shard``, HSDP): real processes, gloo,
torch's own FSDP2, compared bitwise (parameters and optimizer state) with the same job under torchrun.

HSDP keeps each shard on every replica group: after a lost rank the survivors save one copy of every
shard as DCP shards and the job resumes at the failed minibatch. Full sharding keeps each shard on
one rank: a lost rank's shard is gone, so the job starts again from step 0 (saying why), while a
preemption saves every shard. (Before: the first ``optimizer.step()`` crashed in the save reserve's
size count on the DTensor shards' storage; then: protect() saved nothing for such models.)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from etcd_cluster import etcd_cluster  # noqa: F401  (fixture)
from jobs import ROOT, run_bounded, run_job

SCRIPT = ROOT / "tests" / "scripts" / "train_fsdp2.py"
STEPS = 8


_REFERENCE: dict = {}  # (nproc, mesh, steps) -> final state: torch's runs are deterministic, run once


def torchrun_final(tmp: Path, nproc: int, mesh: str, steps: int = STEPS, extra: tuple = ()) -> dict:
    key = (nproc, mesh, steps, extra)
    if key not in _REFERENCE:
        _REFERENCE[key] = _torchrun(tmp, nproc, mesh, steps, extra)
    return _REFERENCE[key]


def _torchrun(tmp: Path, nproc: int, mesh: str, steps: int, extra: tuple) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           str(SCRIPT), "--no-jitckpt", "--mesh", mesh, "--steps", str(steps), "--out", str(tmp / "final.pt"),
           *extra]
    rc, out = run_reference(cmd, tmp)
    assert rc == 0, out[-4000:]
    return torch.load(tmp / "final.pt", weights_only=True)


def run_reference(cmd: list, cwd: Path, timeout: float = 180) -> tuple[int, str]:
    """A failure-free torchrun reference job (no jitckpt in it)."""
    rc, out = run_bounded(cmd, cwd=cwd, timeout=timeout)
    if rc != 0 and "terminate called without an active exception" in out:
        # torch's own job: gloo aborted one of its ranks at its exit, in CI and once here (SIGABRT,
        # 1 in 60+ runs). The reference is run again; jitckpt's runs are not.
        rc, out = run_bounded(cmd, cwd=cwd, timeout=timeout)
    return rc, out


def assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    assert any(k.startswith("optim.") or ".optim." in k for k in want)  # the optimizer state is compared too
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad


def test_hsdp_recovers_a_lost_rank_from_its_replica_bitwise(tmp_path):
    want = torchrun_final(tmp_path / "torchrun", 4, "hsdp")
    res = run_job(tmp_path / "jit", nproc=4, script=SCRIPT, script_args=["--mesh", "hsdp", "--steps", str(STEPS),
                                                                         "--kill", "3:4"])
    assert res.rc == 0, res.out[-4000:]
    assert [s["failed_ranks"] for s in res.ev("recovery_summary")] == [[3]], res.ev("recovery_summary")
    saved = {e["rank"] for e in res.ev("checkpoint_saved")}
    assert saved and 3 not in saved and {r % 2 for r in saved} == {0, 1}, saved  # both shards covered
    # Mesh [[0, 1], [2, 3]]: shard 0 on ranks 0 and 2, shard 1 on 1 and 3. Each shard is written
    # once: ranks 0 and 2 half of shard 0 each, rank 1 its half of shard 1 and then rank 3's.
    names = sorted(Path(e["path"]).name for e in res.ev("checkpoint_saved"))
    assert names == ["jit-g0000-r00000-s4", "jit-g0000-r00001-s4", "jit-g0000-r00001-s4-p3",
                     "jit-g0000-r00002-s4"], names
    by_rank: dict = {}
    for e in res.ev("checkpoint_saved"):
        by_rank[e["rank"]] = by_rank.get(e["rank"], 0) + e["bytes"]
    assert abs(by_rank[0] + by_rank[2] - by_rank[1]) < 0.05 * by_rank[1], by_rank  # two equal shards
    assert "resuming from step 4" in res.out, res.out[-4000:]
    [summary] = res.ev("recovery_summary")
    assert summary["steps_redone"] <= 1, summary
    assert_bitwise(torch.load(res.workdir / "final.pt", weights_only=True), want)


@pytest.mark.slow  # FSDP2 under protect() (the crash this file began with) runs in every fast test here
def test_full_sharding_starts_again_after_a_lost_rank_and_says_why(tmp_path):
    want = torchrun_final(tmp_path / "torchrun", 2, "fsdp")
    res = run_job(tmp_path / "jit", nproc=2, script=SCRIPT, script_args=["--steps", str(STEPS), "--kill", "1:4"])
    assert res.rc == 0, res.out[-4000:]
    assert "keeps each shard on one rank only (no replica)" in res.out and "--periodic-every N" in res.out
    assert "no copy of shard(s) [1] survived" in res.out and "starts again from step 0" in res.out, res.out[-4000:]
    assert [s["failed_ranks"] for s in res.ev("recovery_summary")] == [[1]], res.ev("recovery_summary")
    assert [e["reason"] for e in res.ev("restart")] == ["failure"]
    assert_bitwise(torch.load(res.workdir / "final.pt", weights_only=True), want)


# Slow (make test's 15 minutes): TP with periodic checkpoints is in the fast compiled-model test.
@pytest.mark.slow
@pytest.mark.parametrize("nproc,mesh", [(2, "fsdp"), (2, "tp"), (4, "fsdp_tp")])
def test_layouts_without_replicas_resume_from_periodic_checkpoints_bitwise(tmp_path, nproc, mesh):
    """--periodic-every 2: every rank writes its shard every 2 steps, so a rank lost in minibatch 5
    costs minibatches 4 and 5, not the job. TP's forward all-reduces are functional collectives:
    the survivor's failed one is seen as the failure, not raised into the training loop."""
    want = torchrun_final(tmp_path / "torchrun", nproc, mesh)
    res = run_job(tmp_path / "jit", nproc=nproc, script=SCRIPT, launcher_args=["--periodic-every", "2"],
                  script_args=["--mesh", mesh, "--steps", str(STEPS), "--kill", f"{nproc - 1}:5"])
    assert res.rc == 0, res.out[-4000:]
    assert "no replica" not in res.out  # protected: no warning
    assert "Traceback" not in res.out, res.out[-4000:]
    assert "resuming from step 4: periodic checkpoint" in res.out, res.out[-4000:]
    assert [s["failed_ranks"] for s in res.ev("recovery_summary")] == [[nproc - 1]], res.ev("recovery_summary")
    assert_bitwise(torch.load(res.workdir / "final.pt", weights_only=True), want)


@pytest.mark.parametrize("nproc,mesh,how", [(2, "fsdp", "kill"), pytest.param(4, "pp", "kill", marks=pytest.mark.slow),
                                             pytest.param(2, "fsdp", "optim", marks=pytest.mark.slow),
                                             pytest.param(2, "tp", "stop", marks=pytest.mark.slow),
                                             pytest.param(4, "fsdp_tp", "kill", marks=pytest.mark.slow),
                                             pytest.param(4, "hsdp", "kill", marks=pytest.mark.slow)])
def test_dtensor_layouts_resume_from_the_keepers_shard_snapshots_bitwise(tmp_path, nproc, mesh, how):
    """--snapshot-every 1: each rank's own shard is in its node's keeper at the start of every
    minibatch, so a rank lost (killed, or stopped: a hang) in minibatch 5 costs that minibatch only,
    its shard coming back from the keeper (HSDP too, which also has replicas). (Before: the tier
    held whole replicas only, and a job without replicas restarted from step 0; a pipeline job's stages, FSDP2 on a (pp, dp) mesh's dp sub-mesh, were
    taken for replicas of each other.) Lost inside its optimizer step (optim), its updated shard is gone:
    the survivor is held at the end of minibatch 5 until every rank committed the next snapshot, and
    the job resumes at 5, one minibatch redone (the launcher counted two: it took the survivor's
    step board, already at 6 after its optimizer step, for the minibatch it was in). The launcher
    restarts as soon as its keeper holds every shard of the failed minibatch, without waiting for
    JIT saves (a rank hung holding the GIL never finishes one: --save-timeout was waited)."""
    want = torchrun_final(tmp_path / "torchrun", nproc, mesh)
    kill = f"{nproc - 1}:5" + {"kill": "", "stop": ":stop", "optim": ":optim"}[how]
    res = run_job(tmp_path / "jit", nproc=nproc, script=SCRIPT,
                  launcher_args=["--snapshot-every", "1", "--hang-timeout", "auto:floor=3,startup=60"],
                  script_args=["--mesh", mesh, "--steps", str(STEPS), "--kill", kill])
    assert res.rc == 0, res.out[-4000:]
    assert "no replica" not in res.out and "Traceback" not in res.out, res.out[-4000:]
    assert "resuming from step 5: memory" in res.out, res.out[-4000:]
    assert [e["source"] for e in res.ev("restore")] == ["memory"] * nproc, res.ev("restore")
    [summary] = res.ev("recovery_summary")
    assert summary["failed_ranks"] == [nproc - 1] and summary["steps_redone"] <= 1, summary
    # Every shard of the failed minibatch was in the keeper: no JIT save waited for.
    assert any("is in the snapshot keeper: restarting without waiting" in e["reason"] for e in res.ev("warning"))
    if how == "optim":  # the survivor, done with minibatch 5, was held before minibatch 6
        assert summary["step_failed"] == 5, summary
    assert_bitwise(torch.load(res.workdir / "final.pt", weights_only=True), want)


@pytest.mark.slow
def test_pipeline_stages_are_shards_of_their_own_preempted_resumed_and_exported_by_stage(tmp_path):
    """Two stages (torch.distributed.pipelining) x FSDP2 over dp: the pp dimension, on which no
    tensor lies, holds each stage's own tensors (their names coincide: both stages' layers are named
    from "0"). A preemption saves every rank's shard; the rerun resumes bitwise; the export names
    each stage's tensors ``stage<k>.``."""
    import torch.distributed.checkpoint as dcp

    import jitckpt

    want = torchrun_final(tmp_path / "torchrun", 4, "pp")
    first = run_job(tmp_path / "a", nproc=4, script=SCRIPT, script_args=["--mesh", "pp", "--steps", str(STEPS),
                                                                         "--kill", "2:3:term"])
    assert first.rc == 143, first.out[-4000:]
    assert "(stages over ('pp',))" in first.out, first.out[-4000:]
    saved = first.ev("checkpoint_saved")
    assert sorted(e["rank"] for e in saved) == [0, 1, 2, 3], saved
    [step] = {e["step"] for e in saved}  # every rank's next minibatch boundary: 3 or 4
    out = Path(jitckpt.export_dcp(str(first.ckpt), str(tmp_path / "exported")))
    md = dcp.FileSystemReader(str(out)).read_metadata()
    assert {k.split(".")[1] for k in md.state_dict_metadata if k.startswith("model.")} == {"stage0", "stage1"}
    again = run_job(tmp_path / "b", nproc=4, script=SCRIPT, script_args=["--mesh", "pp", "--steps", str(STEPS)],
                    ckpt=first.ckpt)
    assert again.rc == 0, again.out[-4000:]
    assert f"resuming from step {step}" in again.out, again.out[-4000:]
    assert_bitwise(torch.load(again.workdir / "final.pt", weights_only=True), want)


@pytest.mark.slow
def test_shard_snapshots_lost_with_their_keeper_fall_back_to_disk_and_say_why(tmp_path):
    """The keeper SIGKILLed with a rank: its shards are gone from memory, the disk holds the
    survivor's shard only, so the job starts again from step 0, saying which shard no copy of
    survived, and still ends bitwise."""
    want = torchrun_final(tmp_path / "torchrun", 2, "fsdp")
    res = run_job(tmp_path / "jit", nproc=2, script=SCRIPT, launcher_args=["--snapshot-every", "1"],
                  script_args=["--steps", str(STEPS), "--kill", "1:5:keeper"])
    assert res.rc == 0, res.out[-4000:]
    assert "no copy of shard(s) [1] survived" in res.out and "starts again from step 0" in res.out, res.out[-4000:]
    assert_bitwise(torch.load(res.workdir / "final.pt", weights_only=True), want)


@pytest.mark.parametrize("standby", [pytest.param("warm", marks=pytest.mark.slow),  # make test's 15-minute budget
                                     pytest.param("none", marks=pytest.mark.slow)])
def test_a_compiled_model_keeps_its_step_boundary_and_resumes_bitwise(tmp_path, standby):
    """torch.compile traces a module's hooks: protect()'s minibatch boundary ran once, at trace time,
    and every periodic save failed inside dynamo. The hook now runs eagerly at every step: with the
    warm standby (dynamo imported before protect()) and without (dynamo imported by torch.compile)."""
    want = torchrun_final(tmp_path / "torchrun", 2, "tp", extra=("--compile",))
    res = run_job(tmp_path / "jit", nproc=2, script=SCRIPT,
                  launcher_args=["--periodic-every", "2", *(["--warm-standby", "0"] if standby == "none" else [])],
                  script_args=["--mesh", "tp", "--compile", "--steps", str(STEPS), "--kill", "1:5"])
    assert res.rc == 0, res.out[-4000:]
    assert not res.ev("checkpoint_failed"), res.ev("checkpoint_failed")
    assert sorted({e["step"] for e in res.ev("checkpoint_saved") if e.get("kind") == "periodic"}) == [2, 4, 6], \
        res.ev("checkpoint_saved")
    assert "resuming from step 4: periodic checkpoint" in res.out, res.out[-4000:]
    assert_bitwise(torch.load(res.workdir / "final.pt", weights_only=True), want)


@pytest.mark.slow
def test_a_layout_on_meshes_jitckpt_cannot_map_trains_as_under_torchrun_and_says_why(tmp_path):
    """Each rank's copy on a 1-rank mesh of its own (as pipeline stages' meshes are): protect()
    names the tensor and the reason, saves nothing, and a failure restarts the job from step 0."""
    want = torchrun_final(tmp_path / "torchrun", 2, "stages")
    res = run_job(tmp_path / "jit", nproc=2, script=SCRIPT,
                  script_args=["--mesh", "stages", "--steps", str(STEPS), "--kill", "1:4"])
    assert res.rc == 0, res.out[-4000:]
    assert "tensor '0.weight' is on a mesh of 1 ranks, the job has 2" in res.out, res.out[-4000:]
    assert "a failure restarts it from step 0" in res.out
    assert not res.ev("checkpoint_saved"), res.ev("checkpoint_saved")
    assert [e["reason"] for e in res.ev("restart")] == ["failure"]
    assert_bitwise(torch.load(res.workdir / "final.pt", weights_only=True), want)


@pytest.mark.slow  # make test's 15-minute budget: FSDP2 and HSDP deaths stay fast
def test_a_preempted_fsdp2_job_saves_every_shard_resumes_bitwise_and_exports_plain_dcp(tmp_path):
    """SIGTERM to a worker: every rank saves its shard at its next minibatch boundary, the job stops
    (143); run again, it resumes there. The checkpoint, exported, is read by a plain
    ``torch.distributed.checkpoint.load``."""
    import torch.distributed.checkpoint as dcp

    import jitckpt

    want = torchrun_final(tmp_path / "torchrun", 2, "fsdp")
    first = run_job(tmp_path / "a", nproc=2, script=SCRIPT, script_args=["--steps", str(STEPS), "--kill", "1:3:term"])
    assert first.rc == 143, first.out[-4000:]
    saved = first.ev("checkpoint_saved")
    assert sorted(e["rank"] for e in saved) == [0, 1], saved
    # Every rank saves at its next minibatch boundary: 3, or 4 when the signal's handler thread ran
    # after the main thread had begun minibatch 3 (it then finishes it).
    [step] = {e["step"] for e in saved}
    assert step in (3, 4), saved
    at3 = torchrun_final(tmp_path / "torchrun3", 2, "fsdp", steps=step)
    out = Path(jitckpt.export_dcp(str(first.ckpt), str(tmp_path / "exported")))
    plain = {k: torch.zeros_like(v) for k, v in at3.items()}  # whole tensors: DCP reshards the shards
    dcp.load({"model": {k: v for k, v in plain.items() if not k.startswith("optim.")},
              "optim": {k[len("optim."):]: v for k, v in plain.items() if k.startswith("optim.")}},
             checkpoint_id=str(out), no_dist=True)
    assert_bitwise(plain, at3)
    again = run_job(tmp_path / "b", nproc=2, script=SCRIPT, script_args=["--steps", str(STEPS)], ckpt=first.ckpt)
    assert again.rc == 0, again.out[-4000:]
    assert f"resuming from step {step}" in again.out, again.out[-4000:]
    assert_bitwise(torch.load(again.workdir / "final.pt", weights_only=True), want)


@pytest.mark.slow
def test_an_hsdp_2x2_checkpoint_resumes_on_1x2(tmp_path):
    """DCP reshards: the 2x2 job's shards of step 3 (or 4: the preemption is saved at every rank's
    next minibatch boundary), loaded by a 2-rank job on a 1x2 mesh, are the parameters and optimizer
    state a failure-free 2x2 run has after that many steps."""
    first = run_job(tmp_path / "a", nproc=4, script=SCRIPT,
                    script_args=["--mesh", "hsdp", "--steps", str(STEPS), "--kill", "2:3:term"])
    assert first.rc == 143, first.out[-4000:]
    [step] = {e["step"] for e in first.ev("checkpoint_saved")}
    assert step in (3, 4), first.ev("checkpoint_saved")
    at3 = torchrun_final(tmp_path / "torchrun3", 4, "hsdp", steps=step)
    # Every rank alive: the two replicas of each shard wrote half of it each (4 parts of one copy).
    metas = [json.loads((p / "jitckpt-meta.json").read_text()) for p in first.ckpt.glob("jit-*")]
    assert sorted((m["shard_id"], m["num_shards"]) for m in metas) == [(i, 4) for i in range(4)], metas
    again = run_job(tmp_path / "b", nproc=2, script=SCRIPT, ckpt=first.ckpt,
                    script_args=["--mesh", "hsdp", "--replicas", "1", "--steps", str(step)])
    assert again.rc == 0, again.out[-4000:]
    assert f"resuming from step {step}" in again.out, again.out[-4000:]
    assert_bitwise(torch.load(again.workdir / "final.pt", weights_only=True), at3)


@pytest.mark.slow
def test_the_example_transformer_on_hsdp_survives_a_sigkill_from_outside(tmp_path):
    """examples/train_fsdp_tp.py as a user runs it: rank 3's worker SIGKILLed from outside once the
    job logged step 10; it ends with the weights of an uninterrupted torchrun run, one minibatch redone."""
    import signal
    import time

    from jobs import kill_tree, start_launcher

    example = ROOT / "examples" / "train_fsdp_tp.py"
    ref = tmp_path / "torchrun"
    ref.mkdir()
    rc, out = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(example), "--parallel", "hsdp", "--steps", "30", "--out", str(ref / "f.pt")],
                          cwd=ref, timeout=240)
    assert rc == 0, out[-3000:]
    work = tmp_path / "jit"
    proc = start_launcher(work, ["--nproc-per-node", "4", "--checkpoint-dir", str(work / "ck"), "--run-dir",
                                 str(work / "run"), "--status-interval", "0", str(example), "--parallel", "hsdp",
                                 "--steps", "30", "--out", str(work / "f.pt")])
    try:
        deadline = time.monotonic() + 180
        while "step 10 " not in (work / "out.txt").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (work / "out.txt").read_text()[-3000:]
            time.sleep(0.05)  # polling the job's output
        events = [json.loads(x) for x in (work / "run" / "events.jsonl").read_text().splitlines() if x.strip()]
        [victim] = [e["pid"] for e in events if e["event"] == "worker_start" and e["rank"] == 3 and e["gen"] == 0]
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=180)
    finally:
        kill_tree(proc.pid)
    text = (work / "out.txt").read_text()
    assert rc == 0, text[-3000:]
    events = [json.loads(x) for x in (work / "run" / "events.jsonl").read_text().splitlines() if x.strip()]
    [summary] = [e for e in events if e["event"] == "recovery_summary"]
    assert summary["failed_ranks"] == [3] and summary["steps_redone"] <= 1, summary
    got, want = (torch.load(d / "f.pt", weights_only=True) for d in (work, ref))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "fsdp-arc", "fsdp-aec"])
def test_nodes_survive_the_loss_of_one_and_end_bitwise(tmp_path, etcd_cluster, layout):
    """Launchers on a real etcd; node 1's whole process tree (its keeper too) is SIGKILLed at a
    random step, a replacement launcher (same command) joins, and the job ends with the parameters
    of a failure-free run, at most one minibatch redone. hsdp (2 nodes x 2 ranks): the replicate
    dimension across the nodes (node 0 holds replica group 0, node 1 group 1), node 0's ranks save
    both shards. fsdp-arc (2 x 2): full sharding over the 4 ranks, --snapshot-every 1
    --snapshot-protection arc: each rank's shard is also in the next node's keeper, so node 1's
    come back from node 0's. fsdp-aec (3 nodes x 1 rank): full sharding, --snapshot-protection aec:
    each node keeps XOR parity of half a shard; node 1's shard is decoded from nodes 0 and 2."""
    import random
    import subprocess
    import time

    from jobs import kill_tree

    train = ROOT / "examples" / "train_ddp.py"
    nnodes, nproc = (3, 1) if layout == "fsdp-aec" else (2, 2)
    common = ["--parallel", layout.split("-")[0], "--steps", "30", "--step-sleep", "0.05"]
    tier = ["--snapshot-every", "1", "--snapshot-protection", layout.split("-")[1]] if "-" in layout else []
    ref = tmp_path / "ref"
    ref.mkdir()
    rc, out = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(nnodes * nproc), str(train), *common, "--no-jitckpt", "--out", str(ref / "f.pt")],
                            ref, timeout=240)
    assert rc == 0, out[-3000:]

    def node(i: int, name: str = "") -> tuple:
        d = tmp_path / f"node{i}{name}"
        d.mkdir()
        cmd = [sys.executable, "-m", "jitckpt", "run", "--nnodes", str(nnodes), "--node-rank", str(i),
               "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd-v2", "--rdzv-endpoint",
               etcd_cluster.endpoint(i), "--rdzv-id", "nodes", "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--run-dir", str(d / "run"), "--status-interval", "0", "--max-restarts", "2", *tier, str(train),
               *common, "--out", str(tmp_path / "f.pt"), "--steps-log", str(tmp_path / "train.jsonl")]
        with open(d / "out.txt", "wb") as f:
            return d, subprocess.Popen(cmd, cwd=d, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                       stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    nodes = [node(i) for i in range(nnodes)]
    try:
        at = random.randint(4, 20)
        log, deadline = tmp_path / "train.jsonl", time.monotonic() + 180
        while (sum('"step"' in x for x in log.read_text().splitlines()) if log.exists() else 0) < nnodes * nproc * at:
            assert time.monotonic() < deadline and all(p.poll() is None for _, p in nodes), "the job ended early"
            time.sleep(0.01)  # polling the training's progress: the moment is meant to be random
        kill_tree(nodes[1][1].pid)
        nodes.append(node(1, "-replacement"))
        kept = [nodes[i] for i in range(len(nodes)) if i != 1]
        rcs = [p.wait(timeout=240) for _, p in kept]
        outs = "\n".join(f"--- {d.name}\n{(d / 'out.txt').read_text()[-3000:]}" for d, _ in nodes)
        assert rcs == [0] * nnodes, outs
        events = [json.loads(x) for x in (nodes[0][0] / "run" / "events.jsonl").read_text().splitlines() if x.strip()]
        if layout == "hsdp":
            saved = {e["rank"] for e in events if e["event"] == "checkpoint_saved"}
            assert saved == {0, 1}, (saved, outs)  # node 0's ranks: one copy of each shard
        else:
            assert [e["source"] for e in events if e["event"] == "restore"] == ["memory"] * nproc, outs
            again = [json.loads(x) for x in (nodes[-1][0] / "run" / "events.jsonl").read_text().splitlines() if x.strip()]
            got = sorted((e["source"], *e["fetched"]) for e in again if e["event"] == "restore")
            want = ([("memory", "dt.r1 decoded from parity")] if layout == "fsdp-aec"
                    else [("memory", "dt.r2 from rank 0"), ("memory", "dt.r3 from rank 1")])
            assert got == want, (got, outs)
        [summary] = [e for e in events if e["event"] == "recovery_summary"]
        assert summary["steps_redone"] <= 1, summary
    finally:
        for _, p in nodes:
            kill_tree(p.pid)
    got, want = (torch.load(d / "f.pt", weights_only=True) for d in (tmp_path, ref))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_an_optimizer_holding_a_tensor_the_model_does_not_trains_as_under_torchrun_and_says_so(tmp_path):
    """Bad input at protect(): the optimizer's extra tensor has no name to be saved under. The job
    is not broken (it trains; a failure restarts from 0) and the message names the tensor and the fix."""
    res = run_job(tmp_path, nproc=2, script=SCRIPT, script_args=["--steps", "3", "--foreign-param"])
    assert res.rc == 0, res.out[-4000:]
    assert "the optimizer's parameter 0 of group 1 (shape (3,)) is not a parameter of the model" in res.out, \
        res.out[-4000:]
    assert "build the optimizer from model.parameters()" in res.out


@pytest.mark.slow
def test_another_models_checkpoint_is_refused_by_tensor_name_and_kept(tmp_path):
    """Bad input at restore: a checkpoint of a wider model. The job stops with the tensor named and
    the fix; the checkpoint is not touched (it is good state, of another model)."""
    first = run_job(tmp_path / "a", nproc=2, script=SCRIPT, script_args=["--steps", str(STEPS), "--kill", "1:3:term"])
    assert first.rc == 143, first.out[-4000:]
    before = sorted(p.name for p in first.ckpt.iterdir())
    other = run_job(tmp_path / "b", nproc=2, script=SCRIPT, ckpt=first.ckpt,
                    launcher_args=["--max-restarts", "0"], script_args=["--steps", str(STEPS), "--hidden", "48"])
    assert other.rc != 0
    assert "tensor '0.weight' is [32, 16] in the checkpoint" in other.out and "[48, 16] in this model" in other.out, \
        other.out[-4000:]
    assert sorted(p.name for p in first.ckpt.iterdir()) == before


@pytest.mark.slow
def test_a_stopped_rank_of_a_layout_without_replicas_is_not_waited_for(tmp_path):
    """SIGSTOP: the survivor sees the hang and saves its shard, which makes no complete set; the
    stopped rank can save nothing. The launcher restarts from the periodic checkpoint at once,
    not after --save-timeout (found from outside: 120 s waited on an FSDP2+TP job)."""
    want = torchrun_final(tmp_path / "torchrun", 2, "fsdp")
    res = run_job(tmp_path / "jit", nproc=2, script=SCRIPT,
                  launcher_args=["--periodic-every", "2", "--hang-timeout", "auto:floor=3,startup=60",
                                 "--save-timeout", "60"],
                  script_args=["--steps", str(STEPS), "--kill", "1:5:stop"])
    assert res.rc == 0, res.out[-4000:]
    assert "rank 1 is stopped (SIGSTOP?) and cannot save" in res.out, res.out[-4000:]
    [detected] = res.ev("failure_detected")
    [restart] = res.ev("restart")
    assert restart["t"] - detected["t"] < 20, (detected, restart)  # --save-timeout is 60
    assert "resuming from step 4: periodic checkpoint" in res.out, res.out[-4000:]
    assert_bitwise(torch.load(res.workdir / "final.pt", weights_only=True), want)
