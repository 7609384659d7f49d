"""Issue 13 items 6 and 7: old checkpoints are never reused silently, a job's checkpoints are its
own (--rdzv-id) and a finished job leaves no JIT checkpoints behind; a checkpoint that verifies
but does not load is quarantined and the next older complete one is used."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from jitckpt.checkpoint_store import META_FILE, _crc32c_file, list_candidates, write_checkpoint
from jobs import COLD, ROOT, run_job

STEPS = 12
COMMON = ["--steps", str(STEPS)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    res = run_job(tmp_path_factory.mktemp("ref"), nproc=2, script_args=COMMON, launcher_args=COLD)
    assert res.rc == 0, res.out[-4000:]
    return res.final_params()


def assert_bitwise(params: dict, ref: dict) -> None:
    assert params.keys() == ref.keys()
    for k in ref:
        assert torch.equal(params[k], ref[k]), f"parameter {k} differs from the failure-free run"


def reseal(directory: Path) -> None:
    """Rewrite a checkpoint's metadata for its current files: damage its checksums cannot see."""
    meta = json.loads((directory / META_FILE).read_text())
    for rel in meta["files"]:
        crc, size = _crc32c_file(directory / rel)
        meta["files"][rel] = {"size": size, "crc32c": crc}
    (directory / META_FILE).write_text(json.dumps(meta))


class Planted:
    """A pickle that runs a command when unpickled without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_checkpoints_that_do_not_load_fall_back_to_older(reference, tmp_path):
    """The newest checkpoint holds a planted pickle, the next one CRC-valid garbage: both are
    quarantined with their reason and the job resumes from the one before, bitwise."""
    ckpt = tmp_path / "ckpt"
    first = run_job(tmp_path / "first", ckpt=ckpt, nproc=2,
                    launcher_args=["--max-restarts", "0", "--periodic-every", "2"],
                    script_args=[*COMMON, "--inject", "0:1:5:kill"])
    assert first.rc == 1, first.out[-3000:]
    names = {c.path.name: c.path for c in list_candidates(ckpt)}
    jit, garbage = names["jit-g0000-r00000-s5"], names["periodic-g0000-r00000-s4"]
    marker = tmp_path / "PWNED"
    torch.save({"step": 5, "model": Planted(marker)}, jit / "state.pt")
    (garbage / "state.pt").write_bytes(os.urandom((garbage / "state.pt").stat().st_size))
    reseal(jit)
    reseal(garbage)

    second = run_job(tmp_path / "second", ckpt=ckpt, nproc=2, launcher_args=["--periodic-every", "2"],
                     script_args=COMMON)
    second.show_on_failure()  # it failed twice under a full suite's load, the cause unseen
    assert second.rc == 0, second.out[-4000:]
    assert not marker.exists(), "the planted pickle ran"
    assert "refused by torch.load(weights_only=True)" in second.out and "posix.system" in second.out
    assert f"checkpoint {garbage} cannot be loaded: " in second.out
    restores = second.ev("restore")
    assert len(second.ev("restart")) == 0, ("the fallback must not cost a restart", second.out[-6000:])
    assert {(e["step"], e["path"]) for e in restores} == {(2, str(ckpt / "periodic-g0000-r00000-s2"))}, \
        second.out[-6000:]
    run_id = first.ev("job_start")[0].get("run_id")
    # Said loudly, with the job that wrote it.
    assert (f"resuming from step 2: periodic checkpoint of run {run_id} written " in second.out
            and "from an earlier job" in second.out), second.out[-3000:]
    # Kept for inspection, never used again.
    assert (ckpt / f"bad-{jit.name}" / "state.pt").is_file()
    assert (ckpt / f"bad-{garbage.name}" / "state.pt").is_file()
    assert_bitwise(second.final_params(), reference)


@pytest.mark.slow  # ~6 s; the fall-back past bad checkpoints is test_checkpoints_that_do_not_load_fall_back_to_older's
def test_a_job_whose_every_checkpoint_is_bad_says_it_starts_again_from_step_0(tmp_path):
    """The only checkpoint verifies but does not load: it is quarantined, and the fresh start is
    the launcher's own console line and a "warning" event, not only a line in a worker's log."""
    ckpt = tmp_path / "ckpt"
    path, _ = write_checkpoint(ckpt, lambda p: (Path(p) / "state.pt").write_bytes(os.urandom(3000)) and None,
                               kind="jit", step=5, rank=0, world_size=2, gen=0)
    res = run_job(tmp_path / "job", ckpt=ckpt, nproc=2, script_args=["--steps", "2"], launcher_args=["-r", "3"])
    assert res.rc == 0, res.out[-4000:]
    said = [w for w in res.ev("warning") if "no usable checkpoint is left" in w["reason"]]
    assert len(said) == 1 and said[0]["rank"] == 0, res.ev("warning")
    assert str(ckpt) in said[0]["reason"] and "starts again from step 0" in said[0]["reason"]
    # Worker output goes to files (-r 3): the line on the console is the launcher's.
    assert "warning from rank 0: no usable checkpoint is left" in res.out, res.out[-3000:]
    assert (ckpt / f"bad-{Path(path).name}" / "state.pt").is_file() and not res.ev("restore")
    assert sorted({r["step"] for r in res.log if "step" in r}) == [0, 1]  # from scratch


@pytest.mark.slow  # make test's 15-minute budget: checkpoint pruning stays fast in test_checkpoint_store
def test_named_jobs_keep_their_own_checkpoints_and_finished_jobs_leave_no_jit(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    stale = ckpt / "A" / ".tmp-jit-g0000-r00001-s3-999999999-1"  # a save killed half-way, long ago
    stale.mkdir(parents=True)
    a = run_job(tmp_path / "a", ckpt=ckpt, nproc=2, launcher_args=["--rdzv-id", "A", "--periodic-every", "4"],
                script_args=[*COMMON, "--inject", "0:1:5:kill"])
    assert a.rc == 0, a.out[-4000:]
    assert [e["step"] for e in a.ev("checkpoint_saved") if e["kind"] == "jit"] == [5]
    assert_bitwise(a.final_params(), reference)
    assert list_candidates(ckpt) == [], "a named job's checkpoints go to <checkpoint-dir>/<id>/"
    left = sorted(p.name for p in (ckpt / "A").iterdir())
    # Periodic checkpoints were asked for and stay; the JIT ones and the temporary dir are gone.
    assert left == ["periodic-g0001-r00000-s8"], left
    b = run_job(tmp_path / "b", ckpt=ckpt, nproc=2, launcher_args=["--rdzv-id", "B"],
                script_args=["--steps", "3"])
    assert b.rc == 0, b.out[-4000:]
    assert not b.ev("restore") and "resuming from" not in b.out, "job B resumed job A's state"


SHARDED = textwrap.dedent('''
    import json, os, sys, torch, jitckpt
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = jitckpt.protect(model, opt, shard_id=int(os.environ["RANK"]), num_shards=2)
    try:
        print(json.dumps({"step": state.restore()}))
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
''')


def _restore_as(ckpt: Path, rank: int) -> dict:
    """protect() + restore() in a fresh process as ``rank`` of a 2-shard job (a worker's start)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "WORLD_SIZE": "2",
           "JITCKPT_CHECKPOINT_DIR": str(ckpt)}
    env.pop("JITCKPT_CONTROL_FD", None)
    p = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # make test's 15-minute budget: quarantine and fall-back stay fast in the other tests here
def test_a_shard_that_cannot_load_its_copy_stops_rather_than_resume_elsewhere(tmp_path):
    """Shard 1's copy of step 4 is garbage. Shard 0 loads step 4; shard 1 must not resume at
    step 2 beside it: it stops (the job restarts), and after that every shard chooses step 2."""
    from jitckpt.runtime.protected_state import Protected

    ckpt = tmp_path / "ckpt"
    model = torch.nn.Linear(4, 4)
    state = Protected(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in (2, 4):
        state.step = step
        for shard in (0, 1):
            write_checkpoint(ckpt, state.save, kind="jit", step=step, rank=shard, world_size=2,
                             gen=0, shard_id=shard, num_shards=2)
    bad = ckpt / "jit-g0000-r00001-s4"
    (bad / "state.pt").write_bytes(b"\0" * 1000)
    reseal(bad)
    assert _restore_as(ckpt, 0) == {"step": 4}
    out = _restore_as(ckpt, 1)
    assert "error" in out and "shard 1's checkpoint of step 4" in out["error"], out
    assert (ckpt / f"bad-{bad.name}").is_dir()
    # The restarted job: step 4 lacks shard 1 now, so both shards resume at step 2.
    assert _restore_as(ckpt, 0) == {"step": 2}
    assert _restore_as(ckpt, 1) == {"step": 2}


OWN_LOAD = textwrap.dedent('''
    """jitckpt.init() with the script's own save and load."""
    import os, torch, torch.distributed as dist, jitckpt
    dist.init_process_group("gloo")
    state = {"step": 0, "w": torch.zeros(4)}
    jitckpt.init(lambda path: torch.save(state, os.path.join(path, "own.pt")),
                 step_fn=lambda: state["step"])
    path = jitckpt.get_checkpoint_path()
    if path is not None:
        state.update(torch.load(os.path.join(path, "own.pt"), weights_only=True))
    print(f"rank {dist.get_rank()} starts at step {state['step']}", flush=True)
    for step in range(state["step"], 6):
        jitckpt.mark_step(step)
        t = torch.ones(4)
        dist.all_reduce(t)
        state["w"] += t
        state["step"] = step + 1
    dist.destroy_process_group()
''')


def test_own_load_that_fails_before_the_first_step_quarantines_the_checkpoint(tmp_path):
    """A jitckpt.init() script's torch.load of the checkpoint it was given raises: the restart
    resumes from the next older complete checkpoint instead of failing the same way again."""
    ckpt = tmp_path / "ckpt"
    for step, kind in ((2, "periodic"), (4, "jit")):
        state = {"step": step, "w": torch.full((4,), 2.0 * step)}
        write_checkpoint(ckpt, lambda p: torch.save(state, Path(p) / "own.pt"), kind=kind,
                         step=step, rank=0, world_size=2, gen=0)
    bad = ckpt / "jit-g0000-r00000-s4"
    (bad / "own.pt").write_bytes(os.urandom(2000))
    reseal(bad)
    script = tmp_path / "own_load.py"
    script.write_text(OWN_LOAD)
    res = run_job(tmp_path / "job", ckpt=ckpt, nproc=2, script=script, script_args=[],
                  launcher_args=["--max-restarts", "2"])
    assert res.rc == 0, res.out[-4000:]
    assert len(res.ev("restart")) == 1, res.out[-4000:]
    assert "rank 0 starts at step 2" in res.out and "rank 1 starts at step 2" in res.out
    assert (ckpt / f"bad-{bad.name}" / "own.pt").is_file()
