"""Update-undo marks (interrupted steps), refusals, gradient checks and scheduler rollback."""
from __future__ import annotations

import importlib

import pytest
import torch

from jitckpt.swift import Lamb, NotInvertibleError, UndoError, UpdateUndo
import jitckpt.swift.undo.lamb_optimizer as lamb_mod


class Injected(RuntimeError):
    pass


def interrupt_after(k: int):
    """Wrap a torch.optim functional so it updates only the first k params, then raises —
    a failure at a parameter boundary, like SWIFT's per-tensor all-reduce wait."""
    def wrap(orig):
        def run(params, *args, **kwargs):
            n = min(k, len(params))
            cut = [a[:n] if isinstance(a, list) and len(a) == len(params) else a for a in args]
            orig(params[:n], *cut, **kwargs)
            raise Injected(f"failure after {n} params")
        return run
    return wrap


SGD_MOD = importlib.import_module("torch.optim.sgd")  # torch.optim.sgd is shadowed by a function
ADAM_MOD = importlib.import_module("torch.optim.adam")
FUNCTIONALS = {
    ("SGD", "for-loop"): (SGD_MOD, "_single_tensor_sgd"),
    ("SGD", "foreach"): (SGD_MOD, "_multi_tensor_sgd"),
    ("Adam", "for-loop"): (ADAM_MOD, "_single_tensor_adam"),
    ("Adam", "foreach"): (ADAM_MOD, "_multi_tensor_adam"),
    ("Adam", "fused"): (ADAM_MOD, "_fused_adam"),
}
FLAGS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def build(kind, path, params):
    if kind == "SGD":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2, **FLAGS[path])
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2, **FLAGS[path])


def model_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(8, 4), (4,), (4, 3), (3,)]]


def grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def snapshot(opt, params):
    return ([p.detach().clone() for p in params],
            [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for p in params])


@pytest.mark.parametrize("kind,path", sorted(FUNCTIONALS))
@pytest.mark.parametrize("warm", [0, 2])
def test_interrupted_step_undoes_only_updated_params(monkeypatch, kind, path, warm):
    params = model_params()
    opt = build(kind, path, params)
    for i in range(warm):
        grads(params, 10 + i)
        opt.step()
    undo = UpdateUndo(opt)
    grads(params, 99)
    x0, s0 = snapshot(opt, params)
    module, name = FUNCTIONALS[(kind, path)]
    monkeypatch.setattr(module, name, interrupt_after(2)(getattr(module, name)))
    with pytest.raises(Injected):
        opt.step()
    monkeypatch.undo()
    updated = undo.updated_params()
    assert [id(p) for p in updated] == [id(p) for p in params[:2]]
    assert undo.undo_last_step() == 2
    for i, p in enumerate(params):
        if i >= 2:  # never touched: bitwise unchanged, including lazily created state removed
            assert torch.equal(p, x0[i])
        else:
            torch.testing.assert_close(p.detach(), x0[i], rtol=1e-5, atol=1e-6)
        assert set(opt.state[p].keys()) == set(s0[i].keys())
        for key, v in s0[i].items():
            torch.testing.assert_close(opt.state[p][key], v, rtol=1e-4, atol=1e-6)
    # After the undo the step can be redone: the result equals an uninterrupted step.
    ref_params = model_params()
    ref = build(kind, path, ref_params)
    for i in range(warm):
        grads(ref_params, 10 + i)
        ref.step()
    grads(ref_params, 99)
    ref.step()
    opt.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_interrupted_lamb_step(monkeypatch):
    params = model_params()
    opt = Lamb(params, lr=1e-2, weight_decay=1e-2)
    grads(params, 1)
    opt.step()
    undo = UpdateUndo(opt)
    grads(params, 2)
    x0, s0 = snapshot(opt, params)
    calls = {"n": 0}
    orig = lamb_mod.lamb_update

    def failing(p, grad, state, group):
        if calls["n"] == 3:
            raise Injected("failure after 3 params")
        calls["n"] += 1
        orig(p, grad, state, group)

    monkeypatch.setattr(lamb_mod, "lamb_update", failing)
    with pytest.raises(Injected):
        opt.step()
    assert undo.undo_last_step() == 3
    assert torch.equal(params[3], x0[3])
    for i, p in enumerate(params):
        torch.testing.assert_close(p.detach(), x0[i], rtol=1e-5, atol=1e-6)
        assert opt.state[p]["trust_ratio"] == s0[i]["trust_ratio"]
        assert float(opt.state[p]["step"]) == 1.0


def test_interrupted_fused_sgd_is_refused(monkeypatch):
    params = model_params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    grads(params, 1)
    opt.step()
    undo = UpdateUndo(opt)
    grads(params, 2)
    monkeypatch.setattr(SGD_MOD, "_fused_sgd",
                        interrupt_after(2)(SGD_MOD._fused_sgd))
    with pytest.raises(Injected):
        opt.step()
    with pytest.raises(UndoError, match="fused=True.*foreach=True"):
        undo.undo_last_step()


def test_default_path_on_cpu_is_for_loop():
    params = model_params()
    opt = torch.optim.Adam(params)  # foreach=None, fused=None
    undo = UpdateUndo(opt)
    grads(params, 1)
    opt.step()
    assert undo.paths == ["for-loop"]


# ------------------------------------------------------------------- refusals ---------------
class MySGD(torch.optim.SGD):
    pass


@pytest.mark.parametrize("make,match", [
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), "AMSGrad"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "AMSGrad"),
    (lambda ps: torch.optim.Adam(ps, betas=(0.0, 0.999)), r"betas\[0\].*is 0"),
    (lambda ps: torch.optim.Adam(ps, betas=(0.9, 0.0)), r"betas\[1\].*is 0"),
    (lambda ps: Lamb(ps, betas=(0.0, 0.9)), r"betas\[0\]"),
    (lambda ps: torch.optim.RMSprop(ps), "no inverse is known.*RMSprop"),
    (lambda ps: MySGD(ps, lr=0.1), "no inverse is known.*MySGD"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, differentiable=True), "differentiable"),
    (lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01)), "Tensor.*Fix: pass lr as a float"),
    (lambda ps: torch.optim.AdamW(ps, lr=2.0, weight_decay=0.5), r"1 - lr\*weight_decay is 0"),
    (lambda ps: torch.optim.SGD(ps, lr=1.0, weight_decay=1.0), r"1 - lr\*weight_decay is 0"),
])
def test_non_invertible_configurations_are_refused_at_setup(make, match):
    with pytest.raises(NotInvertibleError, match=match):
        UpdateUndo(make(model_params()))


def test_configuration_made_non_invertible_later_is_refused_before_the_step():
    params = model_params()
    opt = torch.optim.Adam(params)
    UpdateUndo(opt)
    opt.param_groups[0]["amsgrad"] = True
    grads(params, 1)
    before = [p.detach().clone() for p in params]
    with pytest.raises(NotInvertibleError, match="AMSGrad"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_undo_needs_the_step_gradient():
    params = model_params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    undo = UpdateUndo(opt)
    with pytest.raises(UndoError, match="no optimizer step recorded"):
        undo.undo_last_step()
    grads(params, 1)
    opt.step()
    opt.zero_grad()
    after = [p.detach().clone() for p in params]
    with pytest.raises(UndoError, match="before optimizer.zero_grad"):
        undo.undo_last_step()
    assert all(torch.equal(a, b) for a, b in zip(params, after))  # refusal changed nothing


def test_second_undo_is_refused():
    params = model_params()
    opt = torch.optim.SGD(params, lr=0.1)
    undo = UpdateUndo(opt)
    grads(params, 1)
    opt.step()
    undo.undo_last_step()
    with pytest.raises(UndoError, match="nothing to undo"):
        undo.undo_last_step()


def test_params_without_grad_are_not_touched():
    params = model_params()
    opt = torch.optim.Adam(params, lr=0.1)
    undo = UpdateUndo(opt)
    grads(params, 1)
    params[1].grad = None
    opt.step()
    assert undo.undo_last_step() == 3
    assert len(opt.state[params[1]]) == 0


# ------------------------------------------------------------------ schedulers --------------
@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
], ids=["steplr", "onecycle", "lambdalr"])
def test_scheduler_rolls_back_with_the_step(make_sched):
    params = model_params()
    opt = torch.optim.AdamW(params, lr=0.05)
    sched = make_sched(opt)
    undo = UpdateUndo(opt, sched)
    for i in range(3):
        grads(params, i)
        opt.step()
        sched.step()
    grads(params, 50)
    lr_before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    sched_before = sched.state_dict()
    x_before = [p.detach().clone() for p in params]
    opt.step()
    sched.step()
    lrs_first = sched.get_last_lr()
    assert opt.param_groups[0]["lr"] != lr_before[0]["lr"] or \
        opt.param_groups[0].get("betas") != lr_before[0].get("betas")
    undo.undo_last_step()
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] \
        == lr_before
    assert sched.state_dict() == sched_before
    for a, b in zip(params, x_before):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    # The redone step + scheduler step give the same learning rate as the first time.
    opt.step()
    sched.step()
    assert sched.get_last_lr() == lrs_first


def test_scheduler_for_other_optimizer_is_rejected():
    a = torch.optim.SGD(model_params(), lr=0.1)
    b = torch.optim.SGD(model_params(), lr=0.1)
    with pytest.raises(ValueError, match="different optimizer"):
        UpdateUndo(a, torch.optim.lr_scheduler.StepLR(b, 1))


def test_stale_momentum_buffer_survives_undo_when_momentum_set_to_zero():
    params = model_params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    grads(params, 1)
    opt.step()
    opt.param_groups[0]["momentum"] = 0.0
    undo = UpdateUndo(opt)
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in params]
    grads(params, 2)
    opt.step()
    undo.undo_last_step()
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in zip(params, bufs))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: Lamb(ps, lr=1e-2, weight_decay=1e-2),
], ids=["sgd", "adamw", "lamb"])
def test_other_float_dtypes_undo_to_a_few_ulp(dtype, make):
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in model_params()]
    opt = make(params)
    for i in range(2):
        for p, g in zip(params, model_params(10 + i)):
            p.grad = g.detach().to(dtype)
        opt.step()
    undo = UpdateUndo(opt)
    for p, g in zip(params, model_params(20)):
        p.grad = g.detach().to(dtype)
    x0 = [p.detach().clone() for p in params]
    opt.step()
    x1 = [p.detach().clone() for p in params]
    undo.undo_last_step()
    eps = torch.finfo(dtype).eps
    for p, a, b in zip(params, x0, x1):
        a64, b64 = a.double(), b.double()
        bound = 4 * eps * (a64.abs() + b64.abs() + (a64 - b64).abs())
        assert ((p.detach().double() - a64).abs() <= bound).all()
