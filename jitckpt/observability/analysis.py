"""Cost model of wasted GPU time for periodic vs just-in-time checkpointing (JIT paper, §5).

Gupta et al., "Just-In-Time Checkpointing: Low Cost Error Recovery from Deep Learning Training
Failures", EuroSys'24, §5.2-5.5. All quantities are SI:

=================  =============================================================  ===============
symbol / argument  meaning                                                        unit
=================  =============================================================  ===============
N  n_gpus          GPUs in the job                                                count
f  failure_rate    failure rate of ONE GPU                                        1/s (per GPU)
o  overhead        time one checkpoint costs one GPU                              s
r  restart_cost    fixed recovery time per failure per GPU (detect, restart,      s
                   re-initialise, load checkpoint) -- independent of redone work
m  minibatch_time  time of one training iteration (minibatch)                     s
o_jit jit_overhead steady-state overhead of JIT interception, per GPU per unit    s/s (fraction)
                   of useful time
c  frequency       periodic checkpoint frequency                                  1/s
t  duration        useful (failure-free) training time                            s
=================  =============================================================  ===============

The paper writes the wasted GPU time ``W`` over N GPUs and useful time t (GPU-seconds), and the
wasted time per GPU per unit of useful time ``w = W / (N t)`` (dimensionless, eq. 5). The
*wasted fraction* is eq. 6, ``w_f = w / (1 + w)``: wasted time over total (useful + wasted) time.

Choices where the paper is ambiguous (stated once here, referred to below):

* Eq. 6 is printed as ``w_f = W / (1 + W)`` but the text defines it with ``Wt`` over ``t + Wt``,
  i.e. with the per-GPU, per-unit-time ``w`` of eq. 5 (dimensionless); the capital ``W`` of eq. 1
  is GPU-seconds and would make the formula dimensionally wrong. We use ``w``. This reproduces
  the paper's own numbers: BERT-L-PT (o=5 s, r=9.9 s, f=2e-3/GPU/day) gives c*=0.35/h and
  w_f=0.096% at N=4, and w_f=1.54% at N=1024 (Table 8: 0.34/h, 0.096%, 1.53%). At N=8192 the
  paper's 4.5% matches w (4.54%) rather than w_f (4.35%); we follow eq. 6 as written in the text.
* Eq. 7 and 8 are used for every failure, i.e. we assume all failures are of the kind each
  method recovers from that way (eq. 8 is stated for transient errors only).
* o_jit may be 0 (the paper measures it as "nearly zero") and r may be 0; every other input
  must be strictly positive. All must be finite.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
#: A "month" for dollar costs: 30 days, as in the paper's §5.1 example (1 error/day = 30/month).
SECONDS_PER_MONTH = 30 * SECONDS_PER_DAY


def _check(name: str, value: float, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float, or raise ValueError naming the argument and the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if v < 0 or (v == 0 and not allow_zero):
        bound = "non-negative (>= 0)" if allow_zero else "positive (> 0)"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return v


# ---------------------------------------------------------------- periodic checkpointing


def optimal_periodic_frequency(n_gpus: float, failure_rate: float, overhead: float) -> float:
    """Eq. 3: optimal periodic checkpoint frequency c* = sqrt(N f / (2 o)), in checkpoints per second.

    It minimises eq. 1 (dW/dc = 0, eq. 2). ``failure_rate`` is per GPU per second, ``overhead`` in
    seconds per checkpoint.
    """
    n = _check("n_gpus", n_gpus)
    f = _check("failure_rate", failure_rate)
    o = _check("overhead", overhead)
    return math.sqrt(n * f / (2.0 * o))


def wasted_rate_periodic(
    n_gpus: float,
    failure_rate: float,
    overhead: float,
    restart_cost: float,
    *,
    frequency: float | None = None,
) -> float:
    """Eq. 1 divided by N t: wasted time per GPU per unit useful time, w = c o + N f r + N f / (2c).

    Dimensionless (s/s). With ``frequency=None`` the optimal c* of eq. 3 is used, which gives
    eq. 5: w* = 2 sqrt(N f o / 2) + N f r. ``frequency`` is in checkpoints per second; with an
    explicit frequency ``overhead`` may be 0.
    """
    n = _check("n_gpus", n_gpus)
    f = _check("failure_rate", failure_rate)
    r = _check("restart_cost", restart_cost, allow_zero=True)
    if frequency is None:
        o = _check("overhead", overhead)
        # Eq. 5 written out: the checkpointing and redone-work terms are equal at c*.
        return 2.0 * math.sqrt(n * f * o / 2.0) + n * f * r
    o = _check("overhead", overhead, allow_zero=True)
    c = _check("frequency", frequency)
    return c * o + n * f * r + n * f / (2.0 * c)


def wasted_time_periodic(
    n_gpus: float,
    failure_rate: float,
    overhead: float,
    restart_cost: float,
    duration: float,
    *,
    frequency: float | None = None,
) -> float:
    """Eq. 1 (explicit ``frequency``) or eq. 4 (``frequency=None``, i.e. c*): wasted GPU-seconds.

    W = N t (c o + N f r + N f / (2c)) over ``duration`` t seconds of useful training time.
    """
    t = _check("duration", duration)
    w = wasted_rate_periodic(n_gpus, failure_rate, overhead, restart_cost, frequency=frequency)
    return float(n_gpus) * t * w


def wasted_fraction(wasted_rate: float) -> float:
    """Eq. 6: wasted fraction w_f = w / (1 + w) of total GPU time, from w (s wasted per useful s).

    See the module docstring for why this uses the dimensionless w of eq. 5 and not W of eq. 1.
    """
    w = _check("wasted_rate", wasted_rate, allow_zero=True)
    return w / (1.0 + w)


def wasted_fraction_periodic(
    n_gpus: float,
    failure_rate: float,
    overhead: float,
    restart_cost: float,
    *,
    frequency: float | None = None,
) -> float:
    """Eq. 6 applied to eq. 5: wasted fraction of GPU time with periodic checkpointing at c*.

    Pass ``frequency`` (checkpoints per second) to evaluate a non-optimal interval via eq. 1.
    """
    return wasted_fraction(
        wasted_rate_periodic(n_gpus, failure_rate, overhead, restart_cost, frequency=frequency)
    )


# ---------------------------------------------------------------- user-level JIT (§5.4)


def wasted_rate_jit(
    n_gpus: float,
    failure_rate: float,
    overhead: float,
    restart_cost: float,
    minibatch_time: float,
    jit_overhead: float,
) -> float:
    """Eq. 7 divided by N t: w_jit = f o + o_jit + N f r + N f m / 2, dimensionless (s/s).

    One checkpoint (cost ``overhead`` s) per failure, the fixed restart cost r, and on average
    half a minibatch of redone work; ``jit_overhead`` is the steady-state interception overhead
    (fraction, may be 0).
    """
    n = _check("n_gpus", n_gpus)
    f = _check("failure_rate", failure_rate)
    o = _check("overhead", overhead, allow_zero=True)
    r = _check("restart_cost", restart_cost, allow_zero=True)
    m = _check("minibatch_time", minibatch_time)
    oj = _check("jit_overhead", jit_overhead, allow_zero=True)
    return f * o + oj + n * f * r + n * f * m / 2.0


def wasted_time_jit(
    n_gpus: float,
    failure_rate: float,
    overhead: float,
    restart_cost: float,
    minibatch_time: float,
    jit_overhead: float,
    duration: float,
) -> float:
    """Eq. 7: W_jit = N t (f o + o_jit + N f r + N f m / 2), wasted GPU-seconds over t = ``duration`` s."""
    t = _check("duration", duration)
    w = wasted_rate_jit(n_gpus, failure_rate, overhead, restart_cost, minibatch_time, jit_overhead)
    return float(n_gpus) * t * w


def wasted_fraction_jit(
    n_gpus: float,
    failure_rate: float,
    overhead: float,
    restart_cost: float,
    minibatch_time: float,
    jit_overhead: float,
) -> float:
    """Eq. 6 applied to eq. 7: wasted fraction of GPU time with user-level JIT checkpointing."""
    return wasted_fraction(
        wasted_rate_jit(n_gpus, failure_rate, overhead, restart_cost, minibatch_time, jit_overhead)
    )


# ---------------------------------------------------------------- transparent JIT (§5.5)


def wasted_rate_transparent(
    n_gpus: float, failure_rate: float, minibatch_time: float, jit_overhead: float
) -> float:
    """Eq. 8 divided by N t: w = o_jit + N f m / 2, dimensionless (s/s).

    Transparent JIT for transient errors: no checkpoint copy (o) and no fixed restart cost (r).
    """
    n = _check("n_gpus", n_gpus)
    f = _check("failure_rate", failure_rate)
    m = _check("minibatch_time", minibatch_time)
    oj = _check("jit_overhead", jit_overhead, allow_zero=True)
    return oj + n * f * m / 2.0


def wasted_time_transparent(
    n_gpus: float, failure_rate: float, minibatch_time: float, jit_overhead: float, duration: float
) -> float:
    """Eq. 8: W_jit = N t (o_jit + N f m / 2), wasted GPU-seconds over t = ``duration`` s."""
    t = _check("duration", duration)
    return float(n_gpus) * t * wasted_rate_transparent(n_gpus, failure_rate, minibatch_time, jit_overhead)


def wasted_fraction_transparent(
    n_gpus: float, failure_rate: float, minibatch_time: float, jit_overhead: float
) -> float:
    """Eq. 6 applied to eq. 8: wasted fraction of GPU time with transparent JIT checkpointing."""
    return wasted_fraction(wasted_rate_transparent(n_gpus, failure_rate, minibatch_time, jit_overhead))


# ---------------------------------------------------------------- dollars


def monthly_cost(n_gpus: float, wasted_fraction_value: float, gpu_hour_price: float) -> float:
    """Dollars per month wasted: N x (30 days in hours) x w_f x price per GPU-hour.

    A job that runs N GPUs for a wall-clock month spends the fraction w_f of those GPU-hours on
    checkpoints and recovery (the paper's §5.1 example: 1000 GPUs, 1 failure/day, checkpoints
    every 30 min, $4/GPU-hour -> about $30,000/month).
    """
    n = _check("n_gpus", n_gpus)
    wf = _check("wasted_fraction", wasted_fraction_value, allow_zero=True)
    if wf >= 1:
        raise ValueError(f"wasted_fraction must be < 1, got {wasted_fraction_value!r}")
    price = _check("gpu_hour_price", gpu_hour_price, allow_zero=True)
    return n * (SECONDS_PER_MONTH / SECONDS_PER_HOUR) * wf * price


# ---------------------------------------------------------------- all methods at once


@dataclass(frozen=True)
class CostParams:
    """The model's job parameters, SI units (see the module table); validated at construction."""

    failure_rate: float  # 1/s per GPU
    overhead: float  # s per checkpoint
    restart_cost: float  # s per failure
    minibatch_time: float  # s
    jit_overhead: float = 0.0  # s/s

    def __post_init__(self) -> None:
        _check("failure_rate", self.failure_rate)
        _check("overhead", self.overhead)
        _check("restart_cost", self.restart_cost, allow_zero=True)
        _check("minibatch_time", self.minibatch_time)
        _check("jit_overhead", self.jit_overhead, allow_zero=True)

    def as_dict(self) -> dict:
        """The parameters as a plain dict (SI units)."""
        return asdict(self)


@dataclass(frozen=True)
class CostRow:
    """The model evaluated at one N: frequencies in 1/s, fractions dimensionless, costs in $/month."""

    n_gpus: float
    optimal_frequency: float
    wf_periodic: float
    wf_jit: float
    wf_transparent: float
    cost_periodic: float | None = None
    cost_jit: float | None = None
    cost_transparent: float | None = None

    def as_dict(self) -> dict:
        """The row as a plain dict."""
        return asdict(self)


def evaluate(
    params: CostParams, n_gpus: Iterable[float], *, gpu_hour_price: float | None = None
) -> list[CostRow]:
    """Evaluate eq. 3, 6+5, 6+7 and 6+8 for each N; with a price, also dollars per month."""
    rows = []
    p = params
    for n in n_gpus:
        wfp = wasted_fraction_periodic(n, p.failure_rate, p.overhead, p.restart_cost)
        wfj = wasted_fraction_jit(
            n, p.failure_rate, p.overhead, p.restart_cost, p.minibatch_time, p.jit_overhead
        )
        wft = wasted_fraction_transparent(n, p.failure_rate, p.minibatch_time, p.jit_overhead)
        costs: tuple[float | None, ...] = (None, None, None)
        if gpu_hour_price is not None:
            costs = tuple(monthly_cost(n, wf, gpu_hour_price) for wf in (wfp, wfj, wft))
        rows.append(
            CostRow(
                n_gpus=float(n),
                optimal_frequency=optimal_periodic_frequency(n, p.failure_rate, p.overhead),
                wf_periodic=wfp,
                wf_jit=wfj,
                wf_transparent=wft,
                cost_periodic=costs[0],
                cost_jit=costs[1],
                cost_transparent=costs[2],
            )
        )
    return rows
