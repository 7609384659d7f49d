"""Issue 45: a PyTorch Lightning job under jitckpt, with the released lightning and torchdata.

tests/scripts/train_lightning.py trains an MLP with dropout (AdamW, a per-step StepLR, a shuffled
``StatefulDataLoader`` over two epochs, 2 DDP ranks on gloo) with ``callbacks=[JitCheckpointCallback()]``
and ``trainer.fit(..., ckpt_path=jitckpt.get_checkpoint_path())``. From outside a worker is
SIGKILLed at a random step (and, in the slow tests, at the exact points where an epoch ends and
the next begins): the job must exit 0, redo at most one step and end bitwise equal (weights and
AdamW state) to a failure-free torchrun run without jitckpt. Lightning's own mid-epoch resume is
not exact (its restore redraws a shuffled sampler's order and restores no RNG); jitckpt's is. The
JIT checkpoint of a preempted job is a Lightning ``.ckpt``: plain torchrun, without jitckpt,
resumes from it with ``ckpt_path`` to the same bits.
"""
from __future__ import annotations

import re

import pytest
import torch

from fault_harness import FAULTS
from framework_jobs import FrameworkConfig, torchrun, torchrun_reference
from integration_checks import assert_same_final, death_at, fault_case, preempted_checkpoint

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

CFG = FrameworkConfig(framework="lightning", nproc=2)
EPOCH = 8  # steps per epoch: 64 samples, 4 per rank, 2 ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return torchrun_reference(tmp_path_factory.mktemp("lightning-ref"), CFG)



def test_lightning_job_recovers_from_a_sigkill_at_a_random_step_bitwise(reference, tmp_path):
    fault_case(tmp_path, reference, FAULTS["sigkill"])


@pytest.mark.slow
@pytest.mark.parametrize("die", ["1:0:forward", "0:5:forward", "1:7:end", "0:8:forward", "1:12:forward"])
def test_lightning_job_recovers_from_a_death_at_an_exact_point_bitwise(reference, tmp_path, die):
    # 1:7:end and 0:8:forward: an epoch's end and the next one's first minibatch, where Lightning
    # restarts its loops from an epoch-end state and makes the next epoch's iterator afresh.
    out = death_at(tmp_path, reference, die, target=EPOCH)
    assert not out.problems, out.report()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop", "sigsegv", "recovery"])
def test_lightning_job_recovers_from_other_faults_bitwise(reference, tmp_path, fault):
    fault_case(tmp_path, reference, FAULTS[fault])


@pytest.mark.slow
def test_a_preempted_jobs_checkpoint_is_resumed_by_lightning_itself_outside_jitckpt(reference, tmp_path):
    meta, entry, notes = preempted_checkpoint(tmp_path, CFG)
    # ModelCheckpoint's name; an epoch's end is named for that epoch, as Lightning names it
    assert re.fullmatch(rf"epoch={meta['step'] // EPOCH}-step={meta['step']}\.ckpt|epoch={meta['step'] // EPOCH - 1}"
                        rf"-step={meta['step']}\.ckpt", entry.name) and entry.is_file(), meta
    ckpt = torch.load(entry, weights_only=False)  # Lightning's own keys
    assert ckpt["global_step"] == meta["step"] and {"state_dict", "optimizer_states", "lr_schedulers", "loops",
                                                    "callbacks"} <= ckpt.keys()
    assert set(ckpt["callbacks"]["JitCheckpointCallback"]["rng"]) == {0, 1}  # every rank's RNG
    assert_same_final(torchrun(tmp_path, CFG, "resumed", "--without-jitckpt", "--resume", str(entry),
                               "--keep-callback"), reference, f"resumed outside jitckpt from step {meta['step']} ({notes})")


def test_a_sharded_strategy_is_refused_naming_the_fix():
    from types import SimpleNamespace

    from jitckpt.integrations.lightning import _refusal

    trainer = SimpleNamespace(strategy=object(), optimizers=[object()], lr_scheduler_configs=[], precision="32-true")
    assert "strategy object" in _refusal(trainer) and "strategy='ddp'" in _refusal(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("flags, die", [(("--accum", "2"), "1:5:forward"), (("--accum", "2"), "0:3:end"),
                                        (("--validate",), "1:5:forward"), (("--validate",), "0:3:end")],
                         ids=["accum-inside", "accum-epoch-end", "validate-after-val", "validate-before-val"])
def test_lightning_job_with_accumulation_or_validation_recovers_bitwise(tmp_path, flags, die):
    # --accum 2: two batches per optimizer step (an epoch of 4 steps). --validate: a validation
    # loop at each half epoch inside fit (after steps 3 and 7 of each epoch of 8).
    cfg = FrameworkConfig(framework="lightning", nproc=2, flags=flags)
    reference = torchrun_reference(tmp_path / "ref", cfg)
    out = death_at(tmp_path / "run", reference, die, target=EPOCH)
    assert not out.problems, out.report()
