"""jitckpt.protect(): what it refuses at construction, with the fix in the message."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from jitckpt.runtime.protected_state import Protected
from jobs import ROOT


def test_wrong_types_are_refused():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        Protected(object(), opt)
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        Protected(model, object())
    with pytest.raises(TypeError, match="state_dict"):
        Protected(model, opt, scheduler=object())


ZERO = r'''
import tempfile, torch, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from jitckpt.runtime.protected_state import Protected
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.Linear(2, 2)
zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
try:
    Protected(model, zero)
    print("accepted")
except TypeError as e:
    print("refused:", e)
finally:
    dist.destroy_process_group()
'''


def test_zero_redundancy_optimizer_without_snapshots_is_refused_with_the_alternatives():
    # A process group in a subprocess: gloo's threads must not live in the forking pytest process.
    p = subprocess.run([sys.executable, "-c", ZERO], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout.strip()
    assert out.startswith("refused:"), out
    assert "only copy of its optimizer partition" in out and "jitckpt.init(save_fn)" in out
    assert "--snapshot-every" in out


def test_zero_job_refuses_the_disk_tier_it_cannot_resume_from():
    """The snapshot flush holds the parameters only; periodic checkpoints are per-rank shards with
    each rank's partition (test_snapshot_launcher.py resumes a ZeRO job from them)."""
    from types import SimpleNamespace

    from jitckpt import _check_zero_job

    rt = SimpleNamespace(periodic_every=0, snapshots=SimpleNamespace(flush_every=3))
    with pytest.raises(ValueError, match="without the optimizer partitions.*--periodic-every"):
        _check_zero_job(rt)
    for periodic in (0, 5):
        _check_zero_job(SimpleNamespace(periodic_every=periodic, snapshots=SimpleNamespace(flush_every=0)))


def _one_step(state: Protected, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(4, 2)).sum().backward()
    opt.step()


def test_roll_back_of_a_completed_step_whose_scheduler_step_is_pending():
    # --plugin undo: a failure between optimizer.step() and scheduler.step() (a collective there).
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = Protected(model, opt, sched)
    state.enable_undo()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _one_step(state, model, opt)
    assert state.torn() and state.step == 1
    assert state.roll_back() == 2
    assert not state.torn() and state.step == 0 and state.state_dict()["step"] == 0
    for k, v in model.state_dict().items():  # within a few ulp (the stated UpdateUndo bound)
        torch.testing.assert_close(v, before[k], rtol=0, atol=1e-6)
    assert not opt.state[model.weight]  # Adam's lazily created state is gone again
    # After the scheduler's step the minibatch's update is complete: nothing is torn.
    _one_step(state, model, opt)
    sched.step()
    assert not state.torn() and state.step == 1


def test_roll_back_of_an_interrupted_step_keeps_the_step_count():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = Protected(model, opt)
    state.enable_undo()

    def fail(*_a, **_k):
        raise RuntimeError("peer died")  # as a wait inside the step would

    handle = opt.register_step_pre_hook(fail)  # after Protected's and UpdateUndo's pre-hooks
    model(torch.ones(4, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="peer died"):
        opt.step()
    handle.remove()
    assert state.torn() and state.step == 0
    assert state.roll_back() == 0  # nothing was updated yet
    assert not state.torn() and state.step == 0


def test_enable_undo_refuses_an_optimizer_without_inverse():
    from jitckpt.swift import NotInvertibleError

    model = torch.nn.Linear(2, 2)
    state = Protected(model, torch.optim.Adagrad(model.parameters()))
    with pytest.raises(NotInvertibleError, match="drop --plugin undo"):
        state.enable_undo()


class _MarkRecorder:
    """jitckpt._native as the runtime sees it, recording the minibatch marks into ``events``."""

    def __init__(self, events: list) -> None:
        self.events = events

    def mark_minibatch(self, step: int) -> None:
        self.events.append(("mark", step))

    def set_phase(self, phase: str) -> None:
        pass


def test_protect_marks_each_minibatch_before_its_batch_is_copied_to_the_device(monkeypatch):
    """Proxy mode replays a failed minibatch from its mark on the buffers as they are at the failure,
    so the mark must come before the loop copies the batch to the device (issue 43 item 3): at
    restore() and when the previous optimizer.step() returns, not in the forward pre-hook. One
    mark per minibatch, also with another forward (an evaluation) between the steps."""
    import jitckpt
    from jitckpt.hang_timeout import HangTimeout
    from jitckpt.runtime import current
    from jitckpt.runtime.worker_runtime import WorkerRuntime

    events: list = []
    rt = WorkerRuntime(rank=0, world_size=1, gen=0, checkpoint_dir="/nonexistent", channel=None,
                       hang_timeout=HangTimeout())
    rt._native = _MarkRecorder(events)
    monkeypatch.setattr(current, "_runtime", rt)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = jitckpt.protect(model, opt)
    for step in range(state.restore(), 3):
        events.append(("copy", step))  # x = batch.to(device)
        model(torch.ones(4, 2)).sum().backward()
        opt.step()
        with torch.no_grad():
            model(torch.ones(1, 2))  # an evaluation between steps: in the next minibatch
    assert events == [("mark", 0), ("copy", 0), ("mark", 1), ("copy", 1), ("mark", 2), ("copy", 2), ("mark", 3)]


def test_mark_step_marks_a_minibatch_protect_did_not_begin():
    """A jitckpt.init() job's mark_step() at the top of each iteration is its minibatch mark."""
    from jitckpt.hang_timeout import HangTimeout
    from jitckpt.runtime.worker_runtime import WorkerRuntime

    events: list = []
    rt = WorkerRuntime(rank=0, world_size=1, gen=0, checkpoint_dir="/nonexistent", channel=None,
                       hang_timeout=HangTimeout())
    rt._native = _MarkRecorder(events)
    rt.mark_step(0)
    rt.optimizer_pre_step()
    rt.mark_step(1)
    rt.mark_step(1)  # again in the same minibatch (gradient accumulation): no new mark
    rt.optimizer_pre_step()
    rt.mark_step(1)  # after an optimizer step the same number starts a new minibatch
    assert events == [("mark", 0), ("mark", 1), ("mark", 1)]


@pytest.mark.parametrize("how", ["keyword", "positional", "lbfgs"])
def test_a_closure_steps_forward_and_backward_are_an_untouched_minibatch(how):
    """optimizer.step(closure) (Lightning's automatic optimization, LBFGS) runs the forward and
    backward inside the step: until the closure returns the state is the minibatch's start, so a
    save there is taken (not refused as a torn step); after it, inside the update, it is torn."""
    model = torch.nn.Linear(3, 1)
    opt = (torch.optim.LBFGS(model.parameters(), max_iter=3) if how == "lbfgs"
           else torch.optim.AdamW(model.parameters(), lr=0.1))
    state = Protected(model, opt)
    seen = []

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).square().sum()
        loss.backward()
        seen.append((state.step, state.untouched_mid_minibatch(), state.torn()))
        return loss

    for _ in range(2):
        opt.step(closure=closure) if how == "keyword" else opt.step(closure)
    for step in (0, 1):
        calls = [(untouched, torn) for s, untouched, torn in seen if s == step]
        assert calls[0] == (True, False), seen  # each step's first closure
        assert all(c == (False, True) for c in calls[1:]), seen  # LBFGS's later calls are inside its update
    assert state.step == 2 and not state.torn()
