"""Issue 45: ``jitckpt.protect(model, opt, sched, dataloader=loader)`` in a hand-written loop whose
data position is a ``StatefulDataLoader``'s (over a shuffling ``DistributedSampler``), not data
chosen by step (tests/scripts/train_loader.py).

A worker SIGKILLed from outside at a random step, or at an exact point inside an epoch, at an
epoch's end and in the next epoch's first minibatch: exit 0, at most one minibatch redone, final
weights and AdamW state bitwise equal to a failure-free torchrun run of the same loop without
jitckpt. A plain ``DataLoader`` (no ``state_dict()``) is fast-forwarded: its epoch's iterator made
again, the batches already trained on read past, with a warning of what that cost. Anything else
without ``state_dict()`` is refused naming the fix.
"""
from __future__ import annotations

import pytest
import torch

from fault_harness import FAULTS
from framework_jobs import FrameworkConfig, torchrun_reference
from integration_checks import death_at, fault_case

pytest.importorskip("torchdata")

CFG = FrameworkConfig(framework="loader", nproc=2)
PLAIN = FrameworkConfig(framework="loader", nproc=2, flags=("--loader", "shuffle"))
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


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    return torchrun_reference(tmp_path_factory.mktemp("plain-loader-ref"), PLAIN)


@pytest.mark.slow  # make test's 15-minute budget: the fast-forward's unit test stays fast
def test_a_plain_loader_job_recovers_inside_an_epoch_bitwise(plain_reference, tmp_path):
    # A plain DataLoader(shuffle=True) draws its order from the global RNG at each iter(): the
    # resume makes the epoch's iterator again from that RNG and reads past the batches done.
    out = death_at(tmp_path, plain_reference, "1:5:forward", target=EPOCH)
    assert not out.problems, out.report()
    log = "\n".join(job.output() for job in out.jobs)
    assert "read past the 5 batches of it already trained on" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("die", ["0:7:end", "1:8:forward", "0:11:end"])
def test_a_plain_loader_job_recovers_at_an_epoch_boundary_and_after_it_bitwise(plain_reference, tmp_path, die):
    out = death_at(tmp_path, plain_reference, die, target=EPOCH)
    assert not out.problems, out.report()


@pytest.mark.slow
@pytest.mark.parametrize("flags, die", [
    (("--loader", "plain"), "1:5:forward"),  # a plain DataLoader over a DistributedSampler
    (("--loader", "shuffle", "--rank-seed"), "1:5:forward"),
    (("--loader", "shuffle", "--rank-seed"), "0:7:end"),
    (("--loader", "stateful", "--rank-seed"), "0:10:forward")],
    ids=["plain-distributed-sampler", "rank-seeded-inside", "rank-seeded-end", "rank-seeded-stateful"])
def test_each_rank_resumes_with_its_own_rng_and_position_bitwise(tmp_path, flags, die):
    # --rank-seed: every rank's dropout (and its shuffle) draws from an RNG of its own. The rank
    # that saves writes every rank's resume state from the node's rank-state board (posted at each
    # step's end and minibatch start), and each rank resumes with its own: with the saver's, the
    # lost rank's draws would differ.
    reference = torchrun_reference(tmp_path / "ref", FrameworkConfig(framework="loader", nproc=2, flags=flags))
    out = death_at(tmp_path / "run", reference, die, target=EPOCH)
    assert not out.problems, out.report()


def test_a_loader_without_state_that_is_no_dataloader_is_refused_naming_the_fix():
    from jitckpt.runtime.protected_state import Protected

    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="a list is no torch DataLoader.*StatefulDataLoader"):
        Protected(model, torch.optim.SGD(model.parameters(), lr=0.1), dataloader=[1, 2])


def test_a_plain_loader_stays_a_dataloader_and_yields_the_same_batches():
    from jitckpt.runtime.protected_state import Protected

    model = torch.nn.Linear(2, 1)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    Protected(model, torch.optim.SGD(model.parameters(), lr=0.1), dataloader=loader)
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 4
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_plain_loaders_resume_reads_past_the_batches_done_and_remakes_the_epochs_order(caplog):
    from jitckpt.runtime.ddp_buffers import set_rng_state
    from jitckpt.runtime.loader_fast_forward import FastForward

    loader = torch.utils.data.DataLoader(list(range(12)), batch_size=2, shuffle=True)
    steps = iter(range(100))
    ff = FastForward(loader, lambda: next(steps))
    torch.manual_seed(3)
    epoch = [b.tolist() for b in loader]  # the shuffle draws from the global RNG at iter()
    where = ff.position(2)  # two batches of this epoch trained on
    assert where is not None and where["skip"] == 2 and ff.position(6) is None  # 6: drawn out
    torch.manual_seed(4)  # a restarted process's RNG, until the resume sets it
    ff.resume_at(where["skip"])
    set_rng_state(where["iter_rng"])
    with caplog.at_level("WARNING", logger="jitckpt.protect"):
        assert [b.tolist() for b in loader] == epoch[2:]
    assert "read past the 2 batches of it already trained on" in caplog.text
