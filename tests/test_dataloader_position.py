"""Issue 45: ``jitckpt.protect(model, opt, sched, dataloader=loader)`` in a hand-written loop whose
data position is a ``StatefulDataLoader``'s (over a shuffling ``DistributedSampler``), not data
chosen by step (tests/scripts/train_loader.py).

A worker SIGKILLed from outside at a random step, or at an exact point inside an epoch, at an
epoch's end and in the next epoch's first minibatch: exit 0, at most one minibatch redone, final
weights and AdamW state bitwise equal to a failure-free torchrun run of the same loop without
jitckpt. A loader without ``state_dict()`` is refused naming the fix.
"""
from __future__ import annotations

import pytest
import torch

from fault_harness import FAULTS
from framework_jobs import FrameworkConfig, torchrun_reference
from integration_checks import death_at, fault_case

pytest.importorskip("torchdata")

CFG = FrameworkConfig(framework="loader", nproc=2)
EPOCH = 8  # batches per epoch and rank: 64 samples, 2 ranks, 4 per batch


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return torchrun_reference(tmp_path_factory.mktemp("loader-ref"), CFG)


@pytest.mark.slow  # make test's budget: the Lightning job's fault case runs there
def test_a_loader_job_recovers_from_a_sigkill_at_a_random_step_bitwise(reference, tmp_path):
    fault_case(tmp_path, reference, FAULTS["sigkill"])


@pytest.mark.slow
@pytest.mark.parametrize("die", ["1:5:forward", "0:7:end", "1:8:forward", "0:0:forward"])
def test_a_loader_job_recovers_from_a_death_at_an_exact_point_bitwise(reference, tmp_path, die):
    # 0:7:end: the epoch's batches are all drawn when the step is done; the resume must begin
    # epoch 1 afresh, not finish the drawn-out epoch 0 (which would skip an epoch).
    out = death_at(tmp_path, reference, die, target=EPOCH)
    assert not out.problems, out.report()


def test_a_loader_without_state_is_refused_naming_the_fix():
    from jitckpt.runtime.protected_state import Protected

    model = torch.nn.Linear(2, 1)
    loader = torch.utils.data.DataLoader(list(range(4)))
    with pytest.raises(TypeError, match="DataLoader has no state_dict.*StatefulDataLoader"):
        Protected(model, torch.optim.SGD(model.parameters(), lr=0.1), dataloader=loader)
