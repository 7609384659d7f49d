"""SWIFT §5.3 selective logging: group adjacent pipeline machines, log only across groups.

Starting from one group per machine, repeatedly merge the adjacent pair whose merge adds the
least expected recovery time per byte of log storage saved (smallest dR/dM), until the log
storage of one checkpoint interval fits the budget. Recovery of a group re-runs the whole group
(its intra-group messages are not logged), so coarser groups trade recovery time for space.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class GroupPlan:
    """Result of :func:`plan_groups`.

    ``groups`` are contiguous machine indices; ``logged_boundaries`` are the indices ``i`` of
    the boundaries between machine ``i`` and ``i+1`` whose traffic must be logged;
    ``storage_bytes`` is T * sum of logged per-iteration bytes; ``expected_recovery_time`` is
    sum_i R(G_i) * |G_i| / N (equal failure probability per machine; R divided by the number of
    data-parallel recovery groups when parallel recovery is on).
    """

    groups: tuple[tuple[int, ...], ...]
    logged_boundaries: tuple[int, ...]
    storage_bytes: float
    expected_recovery_time: float


def _effective(recovery: float, size: int, n: int, parallel: bool) -> float:
    # §5.3: with parallel recovery a group is re-computed by floor(N/|G|) data-parallel groups,
    # assumed to scale linearly.
    return recovery / (n // size) if parallel else recovery


def plan_groups(
    *,
    compute_times: Sequence[float],
    boundary_bytes: Sequence[float],
    bandwidth: float,
    checkpoint_interval: int,
    storage_budget: float,
    parallel_recovery: bool = False,
) -> GroupPlan:
    """Greedy SWIFT §5.3 grouping of ``len(compute_times)`` pipeline machines.

    ``compute_times[i]`` is machine i's profiled per-iteration compute time R (seconds),
    ``boundary_bytes[i]`` the bytes per iteration sent between machine i and i+1 (both
    directions), ``bandwidth`` B in bytes/second, ``checkpoint_interval`` T in iterations and
    ``storage_budget`` M_max in bytes. Merging adjacent groups a, b gives
    R(a+b) = R(a) + R(b) + M(a,b)/B, dR = (R(a+b)|a+b| - R(a)|a| - R(b)|b|)/N, dM = M(a,b)*T;
    the pair with the smallest dR/dM (lowest index on ties) is merged until T * sum of logged
    bytes <= M_max.
    """
    n = len(compute_times)
    if n < 1:
        raise ValueError("compute_times is empty: give one profiled compute time per machine")
    if len(boundary_bytes) != n - 1:
        raise ValueError(
            f"boundary_bytes has {len(boundary_bytes)} entries but {n} machines have {n - 1} "
            "boundaries: give the bytes sent between machine i and i+1 for each i")
    for name, values in (("compute_times", compute_times), ("boundary_bytes", boundary_bytes)):
        bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"{name} must be finite and >= 0, got {bad[0]!r}")
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
    if not (isinstance(checkpoint_interval, int) and checkpoint_interval >= 1):
        raise ValueError(
            f"checkpoint_interval must be an int >= 1 (iterations), got {checkpoint_interval!r}")
    if not (math.isfinite(storage_budget) and storage_budget >= 0):
        raise ValueError(f"storage_budget must be >= 0 bytes, got {storage_budget!r}")

    groups: list[list[int]] = [[i] for i in range(n)]
    recovery: list[float] = [float(t) for t in compute_times]
    # bounds[j] = bytes per iteration across the boundary between groups j and j+1
    bounds: list[float] = [float(b) for b in boundary_bytes]
    T = checkpoint_interval

    def storage() -> float:
        return T * sum(bounds)

    while storage() > storage_budget and len(groups) > 1:
        best, best_ratio = -1, math.inf
        for j, m in enumerate(bounds):
            if m == 0:
                continue  # merging saves no space
            a, b = len(groups[j]), len(groups[j + 1])
            merged = recovery[j] + recovery[j + 1] + m / bandwidth
            d_r = (_effective(merged, a + b, n, parallel_recovery) * (a + b)
                   - _effective(recovery[j], a, n, parallel_recovery) * a
                   - _effective(recovery[j + 1], b, n, parallel_recovery) * b) / n
            ratio = d_r / (m * T)
            if ratio < best_ratio:
                best, best_ratio = j, ratio
        j = best
        recovery[j] = recovery[j] + recovery[j + 1] + bounds[j] / bandwidth
        groups[j] = groups[j] + groups[j + 1]
        del groups[j + 1], recovery[j + 1], bounds[j]

    logged = tuple(g[-1] for g in groups[:-1])
    expected = sum(_effective(r, len(g), n, parallel_recovery) * len(g) / n
                   for g, r in zip(groups, recovery))
    return GroupPlan(groups=tuple(tuple(g) for g in groups), logged_boundaries=logged,
                     storage_bytes=storage(), expected_recovery_time=expected)


def logged_peers(plan: GroupPlan, machine: int) -> frozenset[int]:
    """Neighbours of ``machine`` in another group: the peers whose messages it logs (sends)
    and digests (receives) under ``plan``; pass them as ``SendLogger(log_peers=...)``."""
    n = sum(len(g) for g in plan.groups)
    if not 0 <= machine < n:
        raise ValueError(f"machine {machine} is not in the plan (0..{n - 1})")
    group_of = {m: i for i, g in enumerate(plan.groups) for m in g}
    return frozenset(p for p in (machine - 1, machine + 1)
                     if 0 <= p < n and group_of[p] != group_of[machine])
