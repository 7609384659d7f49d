"""SWIFT §5.3 greedy grouping (plan_groups) on hand-checked cases.

Notation: R = per-iteration compute time of a group, M = bytes per iteration across a
boundary, B = bandwidth, T = checkpoint interval, N = machines. Merging groups a, b:
R(a+b) = R(a) + R(b) + M/B, dR = (R(a+b)|a+b| - R(a)|a| - R(b)|b|)/N, dM = M*T.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitckpt.swift.pipeline.selective_logging import plan_groups


def test_fits_budget_without_merging():
    plan = plan_groups(compute_times=[1, 1, 1], boundary_bytes=[100, 10], bandwidth=10,
                       checkpoint_interval=1, storage_budget=110)
    assert plan.groups == ((0,), (1,), (2,))
    assert plan.logged_boundaries == (0, 1)
    assert plan.storage_bytes == 110
    assert plan.expected_recovery_time == pytest.approx(1.0)  # (1+1+1)/3


def test_smallest_added_recovery_time_per_byte_wins_over_smallest_added_time():
    # N=3, R=[1,1,1], M=[100,10], B=10, T=1, budget 100; initial storage 110 > 100.
    #  merge 0|1: R = 1+1+100/10 = 12, dR = 12*2/3 - 1/3 - 1/3 = 22/3 = 7.33, dM = 100 -> 0.0733/B
    #  merge 1|2: R = 1+1+10/10  = 3,  dR = 3*2/3  - 1/3 - 1/3 = 4/3  = 1.33, dM = 10  -> 0.1333/B
    # -> merge 0|1 (larger dR, but far more bytes saved); storage 10 <= 100, stop.
    plan = plan_groups(compute_times=[1, 1, 1], boundary_bytes=[100, 10], bandwidth=10,
                       checkpoint_interval=1, storage_budget=100)
    assert plan.groups == ((0, 1), (2,))
    assert plan.logged_boundaries == (1,)
    assert plan.storage_bytes == 10
    # expected recovery = 12*2/3 + 1*1/3 = 25/3
    assert plan.expected_recovery_time == pytest.approx(25 / 3)


def test_budget_below_any_logging_gives_one_group():
    # Continuing the case above with budget 5: storage 10 > 5, only merge left: R = 12+1+1 = 14.
    plan = plan_groups(compute_times=[1, 1, 1], boundary_bytes=[100, 10], bandwidth=10,
                       checkpoint_interval=1, storage_budget=5)
    assert plan.groups == ((0, 1, 2),)
    assert plan.logged_boundaries == ()
    assert plan.storage_bytes == 0
    assert plan.expected_recovery_time == pytest.approx(14.0)


def test_unbalanced_stages_merge_the_cheap_middle_first_then_tie_breaks_low():
    # N=4, R=[4,1,1,4], M=[10,10,10], B=10 (M/B=1), T=2; initial storage 2*30 = 60.
    # Budget 40: candidates (dM = 20 each):
    #  0|1: R=4+1+1=6, dR = 6*2/4 - 4/4 - 1/4 = 1.75
    #  1|2: R=1+1+1=3, dR = 3*2/4 - 1/4 - 1/4 = 1.00   <- smallest
    #  2|3: 1.75 (mirror of 0|1)
    # -> [[0],[1,2],[3]], storage 40 <= 40.
    kw = dict(compute_times=[4, 1, 1, 4], boundary_bytes=[10, 10, 10], bandwidth=10,
              checkpoint_interval=2)
    plan = plan_groups(**kw, storage_budget=40)
    assert plan.groups == ((0,), (1, 2), (3,))
    assert plan.storage_bytes == 40
    # expected = 4*1/4 + 3*2/4 + 4*1/4 = 3.5
    assert plan.expected_recovery_time == pytest.approx(3.5)
    # Budget 20: next candidates [0]+[1,2]: R=4+3+1=8, dR = 8*3/4 - 4/4 - 3*2/4 = 3.5;
    # [1,2]+[3]: same 3.5 -> tie, lowest index merges: [[0,1,2],[3]], storage 20.
    plan = plan_groups(**kw, storage_budget=20)
    assert plan.groups == ((0, 1, 2), (3,))
    assert plan.logged_boundaries == (2,)
    assert plan.storage_bytes == 20


def test_parallel_recovery_divides_by_data_parallel_groups():
    # Same as above with parallel recovery, budget 40: R_eff(G) = R(G) / floor(4/|G|).
    #  0|1: R=6, R_eff=6/2=3: dR = 3*2/4 - (4/4)*1/4 - (1/4)*1/4 = 1.5 - 0.25 - 0.0625 = 1.1875
    #  1|2: R=3, R_eff=1.5:   dR = 1.5*2/4 - 0.0625 - 0.0625 = 0.625   <- smallest
    # expected = (4/4)*1/4 + (3/2)*2/4 + (4/4)*1/4 = 1.25
    plan = plan_groups(compute_times=[4, 1, 1, 4], boundary_bytes=[10, 10, 10], bandwidth=10,
                       checkpoint_interval=2, storage_budget=40, parallel_recovery=True)
    assert plan.groups == ((0,), (1, 2), (3,))
    assert plan.expected_recovery_time == pytest.approx(1.25)


def test_zero_byte_boundary_is_never_merged_for_space():
    # Boundary 0 carries nothing: merging it saves no space, so boundary 1 is merged.
    plan = plan_groups(compute_times=[1, 1, 1], boundary_bytes=[0, 10], bandwidth=1,
                       checkpoint_interval=1, storage_budget=0)
    assert plan.groups == ((0,), (1, 2))
    assert plan.storage_bytes == 0


@pytest.mark.parametrize("kw, needle", [
    (dict(compute_times=[], boundary_bytes=[]), "compute_times is empty"),
    (dict(compute_times=[1, 1], boundary_bytes=[]), "boundaries"),
    (dict(compute_times=[1, -1], boundary_bytes=[1]), "compute_times must be"),
    (dict(compute_times=[1, 1], boundary_bytes=[1], bandwidth=0), "bandwidth"),
    (dict(compute_times=[1, 1], boundary_bytes=[1], checkpoint_interval=0), "checkpoint_interval"),
    (dict(compute_times=[1, 1], boundary_bytes=[1], storage_budget=-1), "storage_budget"),
])
def test_bad_input_names_the_problem(kw, needle):
    full = dict(bandwidth=1.0, checkpoint_interval=1, storage_budget=10.0)
    full.update(kw)
    with pytest.raises(ValueError, match=needle):
        plan_groups(**full)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 100), min_size=2, max_size=9).flatmap(
    lambda r: st.tuples(st.just(r), st.lists(st.floats(1, 1e6), min_size=len(r) - 1,
                                             max_size=len(r) - 1))),
       st.integers(1, 20), st.floats(0, 1e7))
def test_properties(rb, interval, budget):
    compute, bounds = rb
    kw = dict(compute_times=compute, boundary_bytes=bounds, bandwidth=1e6,
              checkpoint_interval=interval)
    plan = plan_groups(**kw, storage_budget=budget)
    flat = [m for g in plan.groups for m in g]
    assert flat == list(range(len(compute)))  # contiguous partition in order
    assert plan.storage_bytes <= budget + 1e-6 * max(1.0, budget)
    assert plan.storage_bytes == pytest.approx(
        interval * sum(bounds[i] for i in plan.logged_boundaries))
    # A smaller budget only ever coarsens the grouping (greedy merges are nested).
    smaller = plan_groups(**kw, storage_budget=budget / 2)
    for g in plan.groups:
        assert any(set(g) <= set(h) for h in smaller.groups)


def test_logged_peers_follow_the_group_boundaries():
    from jitckpt.swift.pipeline.selective_logging import logged_peers
    plan = plan_groups(compute_times=[4, 1, 1, 4], boundary_bytes=[10, 10, 10], bandwidth=10,
                       checkpoint_interval=2, storage_budget=40)  # [[0], [1, 2], [3]]
    assert [logged_peers(plan, m) for m in range(4)] == [{1}, {0}, {3}, {2}]
    with pytest.raises(ValueError, match="not in the plan"):
        logged_peers(plan, 4)
