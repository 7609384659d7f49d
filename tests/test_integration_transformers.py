"""Issue 45: a Hugging Face Trainer job under jitckpt, with the released transformers.

tests/scripts/train_transformers.py trains a tiny random-init GPT-2 with dropout (AdamW, linear
warmup and decay, a shuffled dataset over two epochs, 2 DDP ranks on gloo) with
``callbacks=[JitCheckpointCallback()]`` and ``trainer.train(resume_from_checkpoint=
jitckpt.get_checkpoint_path())``. From outside (tests/fault_harness.py) a worker is SIGKILLed at a
random step: the job must exit 0, redo at most one step and end bitwise equal (weights and AdamW
state) to a failure-free torchrun run of the script without jitckpt. The JIT checkpoint of a
preempted job is Trainer's own: plain torchrun, without jitckpt, resumes from it to the same bits.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from fault_harness import FAULTS
from framework_jobs import FrameworkConfig, torchrun, torchrun_reference
from integration_checks import assert_same_final, death_at, fault_case, preempted_checkpoint
from jobs import run_bounded

pytest.importorskip("transformers")

CFG = FrameworkConfig(framework="transformers", nproc=2)
EPOCH = 8  # steps per epoch: 64 samples, 4 per rank, 2 ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return torchrun_reference(tmp_path_factory.mktemp("hf-ref"), CFG)



@pytest.mark.slow  # make test runs the Lightning one (test_integration_lightning.py)
def test_trainer_job_recovers_from_a_sigkill_at_a_random_step_bitwise(reference, tmp_path):
    fault_case(tmp_path, reference, FAULTS["sigkill"])


@pytest.mark.slow
@pytest.mark.parametrize("step", [EPOCH - 1, EPOCH], ids=["last-of-epoch", "first-of-epoch"])
def test_trainer_job_recovers_at_an_epoch_boundary_bitwise(reference, tmp_path, step):
    # Trainer loads a resumed epoch's RNG before the epoch draws its shuffle when the resume
    # point is an epoch's first step, after skipping otherwise: both are saved as Trainer wants.
    fault_case(tmp_path, reference, dataclasses.replace(FAULTS["sigkill"], name=f"sigkill-step{step}",
                                                  window=(step, step)))


@pytest.mark.slow
@pytest.mark.parametrize("die", ["0:8:forward", "1:7:end"])
def test_trainer_job_recovers_from_a_death_at_an_exact_point_of_an_epoch_boundary_bitwise(reference, tmp_path, die):
    # 0:8:forward: rank 0 dies in the new epoch's first minibatch, after it posted that minibatch's
    # RNG; its checkpoint must hold the RNG as the epoch began (found by the random case above).
    # 1:7:end: rank 1 dies once the epoch's last optimizer step is done; rank 0 saves step 8.
    out = death_at(tmp_path, reference, die, target=EPOCH)
    assert not out.problems, out.report()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop", "sigsegv", "recovery"])
def test_trainer_job_recovers_from_other_faults_bitwise(reference, tmp_path, fault):
    fault_case(tmp_path, reference, FAULTS[fault])


@pytest.mark.slow
def test_a_preempted_jobs_checkpoint_is_resumed_by_trainer_itself_outside_jitckpt(reference, tmp_path):
    meta, entry, notes = preempted_checkpoint(tmp_path, CFG)
    assert entry.name == f"checkpoint-{meta['step']}" and entry.is_dir(), meta
    # Trainer's layout: what Trainer._save_checkpoint writes for a 2-rank DDP job.
    for name in ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                 "rng_state_0.pth", "rng_state_1.pth", "training_args.bin"):
        assert (entry / name).is_file(), (name, sorted(p.name for p in entry.iterdir()))
    assert json.loads((entry / "trainer_state.json").read_text())["global_step"] == meta["step"]
    assert_same_final(torchrun(tmp_path, CFG, "resumed", "--without-jitckpt", "--resume", str(entry)), reference,
                      f"resumed outside jitckpt from step {meta['step']} ({notes})")


@pytest.mark.slow  # the same refusal, without a job, is in the fast test below
def test_save_only_model_is_refused_when_the_trainer_is_built(tmp_path):
    rc, out = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(CFG.script), "--save-only-model", "--steps", "1"], cwd=tmp_path, timeout=120)
    assert rc != 0
    assert "TrainingArguments(save_only_model=True)" in out and "Remove save_only_model" in out, out[-3000:]
    assert "JitCheckpointCallback (transformers 5." in out, out[-3000:]  # the version it was checked against


@pytest.mark.parametrize("args,what", [
    ({"save_only_model": True}, "save_only_model=True"),
    ({"fsdp": "full_shard"}, "an FSDP Trainer"),
    ({"deepspeed": "ds.json"}, "a DeepSpeed Trainer"),
    ({"fp16": True}, "fp16=True"),
])
def test_sharded_and_fp16_trainers_are_refused_naming_the_fix(args, what):
    from types import SimpleNamespace

    from jitckpt.integrations.transformers import JitCheckpointCallback

    targs = SimpleNamespace(**{"save_only_model": False, "deepspeed": None, "fsdp": None, "fp16": False, **args})
    with pytest.raises(ValueError, match=what) as e:
        JitCheckpointCallback().on_init_end(targs, None, None, model=torch.nn.Linear(1, 1))
    assert any(fix in str(e.value) for fix in ("without JitCheckpointCallback", "Use bf16", "Remove save_only_model"))


@pytest.mark.slow
@pytest.mark.parametrize("die", ["1:5:forward", "0:4:forward", "1:3:end"])
def test_trainer_job_with_gradient_accumulation_recovers_bitwise(tmp_path, die):
    # Two batches per optimizer step (an epoch of 4 steps): the JIT checkpoint holds the start of
    # the failed step's first batch, and Trainer's resume skips the batches of the steps done.
    cfg = FrameworkConfig(framework="transformers", nproc=2, flags=("--accum", "2"))
    reference = torchrun_reference(tmp_path / "ref", cfg)
    out = death_at(tmp_path / "run", reference, die, target=4)
    assert not out.problems, out.report()
