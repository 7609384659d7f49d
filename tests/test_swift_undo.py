"""Update-undo (jitckpt.swift.UpdateUndo): accuracy bounds, marks, refusals, schedulers.

The bounds checked here are the ones stated in jitckpt/swift/undo/update_undo.py's docstring.
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitckpt.swift import Lamb, UpdateUndo

F32 = torch.float32
EPS = torch.finfo(F32).eps
SLACK = 8 * torch.finfo(F32).tiny * EPS  # a few subnormal ulps of absolute slack

PATHS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def assert_within(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (f64(got) - f64(want)).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} elements outside the stated bound; worst err "
        f"{float(err[bad].max()):.3e} vs bound {float(bound[bad][err[bad].argmax()]):.3e}")


def make_params(shapes, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * scale) for s in shapes]


def set_grads(params, gscale, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * gscale


def state_copy(opt, params):
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
            for p in params]


shapes_st = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
                     min_size=1, max_size=3)
scale_st = st.sampled_from([1e-3, 1e-1, 1.0, 10.0, 1e3])


# ---------------------------------------------------------------------------- SGD -----------
def sgd_bounds(x0, x1, g, b0, b1, hp):
    """Stated bounds for SGD: returns (param bound, buffer bound)."""
    lr, wd, mu, tau = hp["lr"], hp["weight_decay"], hp["momentum"], hp["dampening"]
    gs = -f64(g) if hp["maximize"] else f64(g)
    gp = gs + wd * f64(x0)
    nest = hp["nesterov"]
    if mu == 0 or b0 is None:
        k = (1 + mu) if (mu and nest) else 1.0
        D = lr * k * gp.abs()
        c = 1 - lr * k * wd
    else:
        D = lr * (gp.abs() + mu * f64(b1).abs()) if nest else lr * f64(b1).abs()
        c = 1 - lr * wd if nest else 1.0
    # |c|: with LAMB, lr * trust_ratio * wd can exceed 1 (the step flips the sign of x).
    bx = (2 * EPS * (f64(x1).abs() + D)) / abs(c) + EPS * f64(x0).abs() + SLACK
    if mu == 0 or b0 is None:
        return bx, None
    dgp = wd * bx + 2 * EPS * (gp.abs() + mu * f64(b1).abs())
    a = 1 - tau
    bb = (3 * EPS * (f64(b1).abs() + a * gp.abs()) + a * dgp + SLACK) / mu
    return bx, bb


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=shapes_st, scale=scale_st, gscale=scale_st,
       lr=st.floats(1e-4, 1.0), mu=st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.99]),
       tau=st.sampled_from([0.0, 0.1, 0.5]), nesterov=st.booleans(), maximize=st.booleans(),
       wd=st.sampled_from([0.0, 1e-4, 1e-2, 0.3]), warm=st.integers(0, 3),
       path=st.sampled_from(sorted(PATHS)), seed=st.integers(0, 2**16))
def test_sgd_undo_within_bound(shapes, scale, gscale, lr, mu, tau, nesterov, maximize, wd, warm,
                               path, seed):
    if nesterov and (mu == 0 or tau != 0):
        nesterov = False  # torch rejects nesterov without momentum / with dampening
    params = make_params(shapes, scale, seed)
    hp = dict(lr=lr, momentum=mu, dampening=tau, weight_decay=wd, nesterov=nesterov,
              maximize=maximize)
    opt = torch.optim.SGD(params, **hp, **PATHS[path])
    for i in range(warm):
        set_grads(params, gscale, seed + 1 + i)
        opt.step()
    undo = UpdateUndo(opt)
    set_grads(params, gscale, seed + 100)
    x0 = [p.detach().clone() for p in params]
    s0 = state_copy(opt, params)
    grads = [p.grad.clone() for p in params]
    opt.step()
    x1 = [p.detach().clone() for p in params]
    s1 = state_copy(opt, params)
    assert undo.paths == [path]
    assert undo.undo_last_step() == len(params)
    for i, p in enumerate(params):
        b0 = s0[i].get("momentum_buffer")
        b1 = s1[i].get("momentum_buffer")
        bx, bb = sgd_bounds(x0[i], x1[i], grads[i], b0, b1, hp)
        assert_within(f"param {i}", p, x0[i], bx)
        if b0 is None:
            assert "momentum_buffer" not in opt.state[p]  # first step: buffer removed exactly
        else:
            assert_within(f"momentum_buffer {i}", opt.state[p]["momentum_buffer"], b0, bb)


# ------------------------------------------------------------------------ Adam / AdamW ------
def adam_bounds(x0, x1, g, m0, m1, v1, hp, t, decoupled, lamb_trust=None):
    """Stated bounds for Adam/AdamW (and Lamb when lamb_trust is given): (x, m, v)."""
    lr, wd, eps_h = hp["lr"], hp["weight_decay"], hp["eps"]
    b1, b2 = hp["betas"]
    gs = -f64(g) if hp["maximize"] else f64(g)
    l2 = (wd != 0 and not decoupled)
    gp = gs + wd * f64(x0) if l2 else gs
    if lamb_trust is None:
        D = (lr / (1 - b1 ** t)) * f64(m1).abs() / (f64(v1).sqrt() / (1 - b2 ** t) ** 0.5 + eps_h)
        c = 1 - lr * wd if decoupled else 1.0
    else:
        bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if hp["bias_correction"] else (1.0, 1.0)
        r = (f64(m1) / bc1) / ((f64(v1) / bc2).sqrt() + eps_h)
        D = lr * lamb_trust * (r.abs() + wd * f64(x0).abs())
        c = 1 - lr * lamb_trust * wd
    # |c|: with LAMB, lr * trust_ratio * wd can exceed 1 (the step flips the sign of x).
    bx = (2 * EPS * (f64(x1).abs() + D)) / abs(c) + EPS * f64(x0).abs() + SLACK
    dgp = (wd * bx + EPS * gp.abs()) if l2 else torch.zeros_like(gp)
    bm = (3 * EPS * (f64(m1).abs() + (1 - b1) * gp.abs()) + (1 - b1) * dgp + SLACK) / b1
    bv = (3 * EPS * (f64(v1).abs() + (1 - b2) * gp * gp)
          + (1 - b2) * (2 * gp.abs() * dgp + dgp * dgp) + SLACK) / b2
    return bx, bm, bv


betas_st = st.tuples(st.sampled_from([0.5, 0.8, 0.9, 0.99]),
                     st.sampled_from([0.9, 0.99, 0.999, 0.9999]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=shapes_st, scale=scale_st, gscale=scale_st, lr=st.floats(1e-5, 0.5),
       betas=betas_st, eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
       wd=st.sampled_from([0.0, 1e-4, 1e-2, 0.3]), maximize=st.booleans(),
       adamw=st.booleans(), warm=st.integers(0, 3), path=st.sampled_from(sorted(PATHS)),
       seed=st.integers(0, 2**16))
def test_adam_undo_within_bound(shapes, scale, gscale, lr, betas, eps, wd, maximize, adamw, warm,
                                path, seed):
    params = make_params(shapes, scale, seed)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    hp = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd, maximize=maximize)
    opt = cls(params, **hp, **PATHS[path])
    for i in range(warm):
        set_grads(params, gscale, seed + 1 + i)
        opt.step()
    undo = UpdateUndo(opt)
    set_grads(params, gscale, seed + 100)
    x0 = [p.detach().clone() for p in params]
    s0 = state_copy(opt, params)
    grads = [p.grad.clone() for p in params]
    opt.step()
    x1 = [p.detach().clone() for p in params]
    s1 = state_copy(opt, params)
    assert undo.undo_last_step() == len(params)
    for i, p in enumerate(params):
        t = float(s1[i]["step"])
        bx, bm, bv = adam_bounds(x0[i], x1[i], grads[i], s0[i].get("exp_avg"), s1[i]["exp_avg"],
                                 s1[i]["exp_avg_sq"], hp, t, decoupled=adamw)
        assert_within(f"param {i}", p, x0[i], bx)
        if warm == 0:
            assert len(opt.state[p]) == 0  # lazily created state removed: exact
            continue
        assert float(opt.state[p]["step"]) == float(s0[i]["step"])
        assert_within(f"exp_avg {i}", opt.state[p]["exp_avg"], s0[i]["exp_avg"], bm)
        assert_within(f"exp_avg_sq {i}", opt.state[p]["exp_avg_sq"], s0[i]["exp_avg_sq"], bv)


# ------------------------------------------------------------------------------ Lamb --------
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=shapes_st, scale=scale_st, gscale=scale_st, lr=st.floats(1e-4, 0.5),
       betas=betas_st, eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
       wd=st.sampled_from([0.0, 1e-4, 1e-2, 0.3]), maximize=st.booleans(),
       bias_correction=st.booleans(), warm=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_lamb_undo_within_bound(shapes, scale, gscale, lr, betas, eps, wd, maximize,
                                bias_correction, warm, seed):
    params = make_params(shapes, scale, seed)
    hp = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd, maximize=maximize,
              bias_correction=bias_correction)
    opt = Lamb(params, **hp)
    for i in range(warm):
        set_grads(params, gscale, seed + 1 + i)
        opt.step()
    undo = UpdateUndo(opt)
    set_grads(params, gscale, seed + 100)
    x0 = [p.detach().clone() for p in params]
    s0 = state_copy(opt, params)
    grads = [p.grad.clone() for p in params]
    opt.step()
    x1 = [p.detach().clone() for p in params]
    s1 = state_copy(opt, params)
    assert undo.undo_last_step() == len(params)
    for i, p in enumerate(params):
        t = float(s1[i]["step"])
        bx, bm, bv = adam_bounds(x0[i], x1[i], grads[i], None, s1[i]["exp_avg"],
                                 s1[i]["exp_avg_sq"], hp, t, decoupled=True,
                                 lamb_trust=s1[i]["trust_ratio"])
        assert_within(f"param {i}", p, x0[i], bx)
        if warm == 0:
            assert len(opt.state[p]) == 0
            continue
        assert float(opt.state[p]["step"]) == float(s0[i]["step"])
        assert opt.state[p]["trust_ratio"] == s0[i]["trust_ratio"]  # previous ratio, exactly
        assert_within(f"exp_avg {i}", opt.state[p]["exp_avg"], s0[i]["exp_avg"], bm)
        assert_within(f"exp_avg_sq {i}", opt.state[p]["exp_avg_sq"], s0[i]["exp_avg_sq"], bv)


def test_lamb_step_matches_reference_formula():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7, 5))
    opt = Lamb([p], lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    x = f64(p).clone()
    m = torch.zeros_like(x)
    v = torch.zeros_like(x)
    for t in range(1, 4):
        g = torch.randn(7, 5)
        p.grad = g.clone()
        opt.step()
        g = f64(g)
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        r = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.99 ** t)).sqrt() + 1e-6)
        u = r + 0.01 * x
        trust = float(x.norm() / u.norm())
        x = x - 0.05 * trust * u
        assert opt.state[p]["trust_ratio"] == pytest.approx(trust, rel=1e-5)
    torch.testing.assert_close(f64(p), x, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- determinism ---------------
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2, foreach=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    lambda ps: Lamb(ps, lr=1e-2, weight_decay=1e-2),
], ids=["sgd", "adam-foreach", "adamw-fused", "lamb"])
def test_replicas_undo_to_bitwise_identical_state(make):
    def replica():
        params = make_params([(33, 17), (17,), (5, 4, 3)], 1.0, 7)
        opt = make(params)
        for i in range(3):
            set_grads(params, 0.5, 11 + i)
            opt.step()
        undo = UpdateUndo(opt)
        set_grads(params, 0.5, 99)
        opt.step()
        undo.undo_last_step()
        return params, opt

    pa, oa = replica()
    pb, ob = replica()
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
        for k, v in oa.state[a].items():
            w = ob.state[b][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w
