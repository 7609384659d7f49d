"""Issue 45: an accelerate job under jitckpt, with the released accelerate.

tests/scripts/train_accelerate.py trains an MLP with dropout (AdamW, a per-step StepLR, a shuffled
plain ``DataLoader`` over two epochs, 2 DDP ranks on gloo, prepared by an ``Accelerator``) with
``JitCheckpoint(accelerator)``, resuming as accelerate's examples do: ``load_state`` of
``jitckpt.get_checkpoint_path()``, then ``skip_first_batches``. From outside a worker is SIGKILLed
at a random step (and, in the slow tests, at the exact points where an epoch ends and the next
begins): the job must exit 0, redo at most one step and end bitwise equal (weights and AdamW state)
to a failure-free torchrun run without jitckpt. accelerate advances the shuffled sampler's
generator at every epoch and does not save it, so its own resume of a later epoch reshuffles it;
jitckpt's does not. The JIT checkpoint of a preempted job is ``save_state``'s layout: plain torchrun
resumes from it with ``accelerator.load_state`` to the same bits.
"""
from __future__ import annotations

import pytest
import torch

from fault_harness import FAULTS
from framework_jobs import FrameworkConfig, torchrun, torchrun_reference
from integration_checks import assert_same_final, death_at, fault_case, preempted_checkpoint

pytest.importorskip("accelerate")

CFG = FrameworkConfig(framework="accelerate", nproc=2)
EPOCH = 8  # steps per epoch: 64 samples, 4 per rank, 2 ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return torchrun_reference(tmp_path_factory.mktemp("accelerate-ref"), CFG)


@pytest.mark.slow  # make test runs the Lightning one (test_integration_lightning.py)
def test_accelerate_job_recovers_from_a_sigkill_at_a_random_step_bitwise(reference, tmp_path):
    fault_case(tmp_path, reference, FAULTS["sigkill"])


@pytest.mark.slow
@pytest.mark.parametrize("die", ["1:0:forward", "0:5:forward", "1:7:end", "0:8:forward", "1:12:forward"])
def test_accelerate_job_recovers_from_a_death_at_an_exact_point_bitwise(reference, tmp_path, die):
    # 1:7:end and 0:8:forward: an epoch's end (the next epoch's iterator not yet made: it is made
    # from the RNG as it is then) and the next epoch's first minibatch.
    out = death_at(tmp_path, reference, die, target=EPOCH)
    assert not out.problems, out.report()


@pytest.mark.slow
@pytest.mark.parametrize("die", ["1:3:end", "0:6:forward"])
def test_accelerate_job_of_four_epochs_recovers_bitwise(tmp_path, die):
    # 4 steps per epoch: the epochs after the resumed one are shuffled on from the restored generator.
    cfg = FrameworkConfig(framework="accelerate", nproc=2, flags=("--samples", "32"))
    out = death_at(tmp_path / "run", torchrun_reference(tmp_path / "ref", cfg), die, target=4)
    assert not out.problems, out.report()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop", "recovery"])
def test_accelerate_job_recovers_from_other_faults_bitwise(reference, tmp_path, fault):
    fault_case(tmp_path, reference, FAULTS[fault])


@pytest.mark.slow
def test_a_preempted_jobs_checkpoint_is_resumed_by_accelerate_itself_outside_jitckpt(reference, tmp_path):
    meta, entry, notes = preempted_checkpoint(tmp_path, CFG)
    assert entry.name == f"step_{meta['step']}" and entry.is_dir(), meta
    # save_state's files, every rank's RNG among them, and the registered JitCheckpoint state
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl",
            "custom_checkpoint_0.pkl"} <= {f.name for f in entry.iterdir()}, sorted(entry.iterdir())
    rng = torch.load(entry / "random_states_1.pkl", weights_only=False)
    assert {"step", "random_state", "numpy_random_seed", "torch_manual_seed"} <= rng.keys()
    assert_same_final(torchrun(tmp_path, CFG, "resumed", "--without-jitckpt", "--resume", str(entry),
                               "--keep-jitckpt"), reference, f"resumed outside jitckpt from step {meta['step']} ({notes})")
    # accelerate's own resume of the same files, without JitCheckpoint in the script (its registered
    # state removed: load_state refuses a count mismatch), is not exact: skip_first_batches draws.
    (entry / "custom_checkpoint_0.pkl").unlink()
    plain = torch.load(torchrun(tmp_path, CFG, "plain", "--without-jitckpt", "--resume", str(entry)), weights_only=True)
    assert any(not torch.equal(plain[k], reference.final[k]) for k in plain), "accelerate's own resume was exact"


@pytest.mark.parametrize("change, named", [
    (dict(scaler=object(), mixed_precision="fp16"), "mixed_precision='fp16'"),
    (dict(gradient_accumulation_steps=4), "gradient_accumulation_steps=4"),
    (dict(distributed_type="FSDP"), "distributed_type FSDP"),
    (dict(_optimizers=[object(), object()]), "2 optimizer(s)"),
    (dict(dataloader_config=type("C", (), {"use_stateful_dataloader": True})()), "use_stateful_dataloader=True"),
])
def test_an_unsupported_accelerator_is_refused_naming_the_fix(change, named):
    from types import SimpleNamespace

    from jitckpt.integrations.accelerate import _refusal

    base = dict(distributed_type="MULTI_CPU", _models=[object()], _optimizers=[object()], _schedulers=[],
                scaler=None, mixed_precision="no", gradient_accumulation_steps=1,
                dataloader_config=SimpleNamespace(use_stateful_dataloader=False, use_seedable_sampler=False,
                                                  dispatch_batches=None))
    why = _refusal(SimpleNamespace(**{**base, **change}))
    assert why is not None and named in why and "without JitCheckpoint" in why, why
    assert _refusal(SimpleNamespace(**base)) is None
