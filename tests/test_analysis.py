"""Cost model of the JIT paper §5, against hand-computed values and the paper's own numbers."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitckpt.observability import analysis as a

DAY = 86400.0


def test_optimal_frequency_eq3_hand_computed():
    # c* = sqrt(N f / (2 o)) = sqrt(2 * 1e-4 / 8) = sqrt(2.5e-5) = 0.005 checkpoints/s
    assert a.optimal_periodic_frequency(2, 1e-4, 4) == pytest.approx(0.005)
    assert a.optimal_periodic_frequency(n_gpus=2, failure_rate=1e-4, overhead=4) == pytest.approx(0.005)


def test_periodic_eq1_and_eq5_hand_computed():
    # eq. 5 at c*: 2 sqrt(N f o / 2) + N f r = 2 * sqrt(4e-4) + 2e-4 * 10 = 0.04 + 0.002
    assert a.wasted_rate_periodic(2, 1e-4, 4, 10) == pytest.approx(0.042)
    # eq. 1 at c = 0.01/s: c o + N f r + N f / (2c) = 0.04 + 0.002 + 0.01
    assert a.wasted_rate_periodic(2, 1e-4, 4, 10, frequency=0.01) == pytest.approx(0.052)
    # eq. 1 evaluated at c* equals eq. 5 (the two c-terms are equal there)
    assert a.wasted_rate_periodic(2, 1e-4, 4, 10, frequency=0.005) == pytest.approx(0.042)
    # eq. 6: w_f = w / (1 + w)
    assert a.wasted_fraction_periodic(2, 1e-4, 4, 10) == pytest.approx(0.042 / 1.042)
    # eq. 4: W* = N t w* GPU-seconds; over t = 1000 s on 2 GPUs
    assert a.wasted_time_periodic(2, 1e-4, 4, 10, 1000) == pytest.approx(84.0)
    assert a.wasted_time_periodic(2, 1e-4, 4, 10, 1000, frequency=0.01) == pytest.approx(104.0)


def test_user_jit_eq7_hand_computed():
    # f o + o_jit + N f r + N f m / 2 = 4e-4 + 0.01 + 0.002 + 5e-5 = 0.01245
    assert a.wasted_rate_jit(2, 1e-4, 4, 10, 0.5, 0.01) == pytest.approx(0.01245)
    assert a.wasted_fraction_jit(2, 1e-4, 4, 10, 0.5, 0.01) == pytest.approx(0.01245 / 1.01245)
    assert a.wasted_time_jit(2, 1e-4, 4, 10, 0.5, 0.01, 1000) == pytest.approx(24.9)


def test_transparent_jit_eq8_hand_computed():
    # o_jit + N f m / 2 = 0.01 + 5e-5
    assert a.wasted_rate_transparent(2, 1e-4, 0.5, 0.01) == pytest.approx(0.01005)
    assert a.wasted_fraction_transparent(2, 1e-4, 0.5, 0.01) == pytest.approx(0.01005 / 1.01005)
    assert a.wasted_time_transparent(2, 1e-4, 0.5, 0.01, 1000) == pytest.approx(20.1)
    # with o_jit = 0 only the half minibatch per failure remains
    assert a.wasted_fraction_transparent(2, 1e-4, 0.5, 0.0) == pytest.approx(5e-5 / (1 + 5e-5))


@pytest.mark.parametrize(
    "n, c_per_hour, wf_percent",
    [(4, 0.34, 0.096), (1024, 5.54, 1.53)],
)
def test_matches_paper_table8_bert_l_pt(n, c_per_hour, wf_percent):
    """§6.5: o = 5 s, r = 9.9 s, f = 2e-3 per GPU per day (Table 8, periodic, BERT-L-PT)."""
    f = 2e-3 / DAY
    assert a.optimal_periodic_frequency(n, f, 5) * 3600 == pytest.approx(c_per_hour, rel=0.025)
    assert a.wasted_fraction_periodic(n, f, 5, 9.9) * 100 == pytest.approx(wf_percent, rel=0.01)


def test_paper_eq10_coefficients():
    # w* = 4.8e-4 sqrt(N) + 2.3e-7 N for BERT-L-PT
    f = 2e-3 / DAY
    w1 = a.wasted_rate_periodic(1, f, 5, 9.9)
    w_no_r = a.wasted_rate_periodic(1, f, 5, 0)
    assert w_no_r == pytest.approx(4.8e-4, rel=0.01)
    assert w1 - w_no_r == pytest.approx(2.3e-7, rel=0.01)


def test_monthly_cost_matches_paper_section_5_1():
    """1000 GPUs, 1 failure/day for the job, checkpoint every 30 min, $4/GPU-hour: ~ $30,000/month."""
    f = 1 / DAY / 1000
    wf = a.wasted_fraction_periodic(1000, f, 0, 0, frequency=2 / 3600)
    assert a.monthly_cost(1000, wf, 4.0) == pytest.approx(30_000, rel=0.02)
    assert a.monthly_cost(10, 0.5, 2.0) == pytest.approx(10 * 720 * 0.5 * 2.0)


@given(
    n=st.integers(1, 100_000),
    f=st.floats(1e-10, 1e-4),
    o=st.floats(0.01, 1000),
    r=st.floats(0, 1000),
    k=st.floats(0.05, 20),
)
def test_c_star_minimises_eq1(n, f, o, r, k):
    c = a.optimal_periodic_frequency(n, f, o)
    best = a.wasted_rate_periodic(n, f, o, r, frequency=c)
    assert best == pytest.approx(a.wasted_rate_periodic(n, f, o, r), rel=1e-9)
    assert best <= a.wasted_rate_periodic(n, f, o, r, frequency=c * k) * (1 + 1e-12)


def test_jit_beats_periodic_at_scale():
    f = 2e-3 / DAY
    for n in (1024, 8192):
        p = a.wasted_fraction_periodic(n, f, 5, 9.9)
        j = a.wasted_fraction_jit(n, f, 5, 9.9, 1.0, 0.001)
        t = a.wasted_fraction_transparent(n, f, 1.0, 0.001)
        assert t < j < p


def test_evaluate_rows():
    params = a.CostParams(failure_rate=1e-4, overhead=4, restart_cost=10, minibatch_time=0.5, jit_overhead=0.01)
    (row,) = a.evaluate(params, [2], gpu_hour_price=3.0)
    assert row.optimal_frequency == pytest.approx(0.005)
    assert row.wf_periodic == pytest.approx(0.042 / 1.042)
    assert row.wf_jit == pytest.approx(0.01245 / 1.01245)
    assert row.cost_jit == pytest.approx(2 * 720 * row.wf_jit * 3.0)
    assert a.evaluate(params, [2])[0].cost_periodic is None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: a.optimal_periodic_frequency(0, 1e-6, 5), "n_gpus must be positive"),
        (lambda: a.optimal_periodic_frequency(4, -1e-6, 5), "failure_rate must be positive"),
        (lambda: a.optimal_periodic_frequency(4, 1e-6, 0), "overhead must be positive"),
        (lambda: a.optimal_periodic_frequency(4, math.nan, 5), "failure_rate must be finite"),
        (lambda: a.wasted_fraction_periodic(4, 1e-6, 5, math.inf), "restart_cost must be finite"),
        (lambda: a.wasted_fraction_periodic(4, 1e-6, 5, -1), "restart_cost must be non-negative"),
        (lambda: a.wasted_fraction_jit(4, 1e-6, 5, 1, 0, 0), "minibatch_time must be positive"),
        (lambda: a.wasted_fraction_jit(4, 1e-6, 5, 1, 1, -0.1), "jit_overhead must be non-negative"),
        (lambda: a.wasted_fraction_transparent(4, 1e-6, 1, math.inf), "jit_overhead must be finite"),
        (lambda: a.wasted_rate_periodic(4, 1e-6, 5, 1, frequency=0), "frequency must be positive"),
        (lambda: a.wasted_time_jit(4, 1e-6, 5, 1, 1, 0, -5), "duration must be positive"),
        (lambda: a.monthly_cost(4, 1.0, 3), "wasted_fraction must be < 1"),
        (lambda: a.CostParams(failure_rate=0, overhead=1, restart_cost=1, minibatch_time=1), "failure_rate"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("bad", ["4", None, True])
def test_non_numbers_rejected(bad):
    with pytest.raises(TypeError, match="n_gpus must be a real number"):
        a.optimal_periodic_frequency(bad, 1e-6, 5)
