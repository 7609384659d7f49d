"""``jitckpt analyze``: wasted GPU time of periodic vs JIT checkpointing (JIT paper §5).

Evaluates :mod:`jitckpt.observability.analysis` for a list or range of N, prints a table (c*, w_f per method,
optionally $/month) and can write a PNG of w_f against N. Parameters come from flags, from the
measurements a job recorded in its event log (``--from-run``), or from the paper's BERT-L-PT
example (§6.5: o = 5 s, r = 9.9 s, f = 2e-3 failures per GPU per day), in that order.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from jitckpt.observability import analysis
from jitckpt.observability.analysis import SECONDS_PER_DAY, SECONDS_PER_HOUR, CostParams, CostRow

#: Defaults: the paper's §6.5 BERT-L-PT example; m = 1 s and o_jit = 0 are our placeholders.
DEFAULTS = {"overhead": 5.0, "restart_cost": 9.9, "failures_per_gpu_day": 2e-3, "minibatch_time": 1.0,
            "jit_overhead": 0.0}
DEFAULT_GPUS = "4,1024,8192"  # the N of the paper's Table 8


def parse_gpus(text: str) -> list[int]:
    """Parse ``-N``: a comma list ("4,1024,8192") or a power-of-two range ("8:16384")."""
    try:
        if ":" in text:
            lo_s, hi_s = text.split(":", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo < 1 or hi < lo:
                raise ValueError
            out, n = [], lo
            while n <= hi:
                out.append(n)
                n *= 2
            if out[-1] != hi:
                out.append(hi)
            return out
        values = [int(v) for v in text.split(",") if v.strip()]
        if not values or min(values) < 1:
            raise ValueError
        return sorted(set(values))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad GPU count list {text!r}: use positive integers, e.g. '4,1024,8192' or a range "
            "'8:16384' (doubling from 8)"
        ) from None


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return v


def _pos_float(text: str) -> float:
    v = _nonneg_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return v


def resolve_params(args: argparse.Namespace) -> tuple[CostParams, dict[str, str]]:
    """Combine flags, ``--from-run`` measurements and defaults; return params and each one's source."""
    values: dict[str, float] = {}
    source: dict[str, str] = {}
    if args.from_run:
        from jitckpt.observability.report import load_run

        run = load_run(args.from_run)
        measured = {
            "overhead": run.checkpoint_time_median,  # periodic saves only (jitckpt run --periodic-every)
            "restart_cost": run.restart_cost_mean,
            "minibatch_time": run.step_time_median,
        }
        for k, v in measured.items():
            if v is not None and (v > 0 or k == "restart_cost"):  # only r may legitimately be 0
                values[k], source[k] = float(v), f"run {args.from_run}"
        if args.baseline_step_time is not None and run.step_time_median:
            # o_jit: extra step time with jitckpt's interception vs. a run without it.
            values["jit_overhead"] = max(0.0, run.step_time_median / args.baseline_step_time - 1.0)
            source["jit_overhead"] = f"run step time vs --baseline-step-time {args.baseline_step_time:g} s"
    for k in ("overhead", "restart_cost", "failures_per_gpu_day", "minibatch_time", "jit_overhead"):
        flag = getattr(args, k)
        if flag is not None:
            values[k], source[k] = flag, "flag"
        elif k not in values:
            values[k] = DEFAULTS[k]
            source[k] = "default" + ((" (no periodic checkpoint in the run)" if k == "overhead" else
                                      " (not measured in run)")
                                     if args.from_run and k != "failures_per_gpu_day" else "")
    params = CostParams(
        failure_rate=values["failures_per_gpu_day"] / SECONDS_PER_DAY,
        overhead=values["overhead"],
        restart_cost=values["restart_cost"],
        minibatch_time=values["minibatch_time"],
        jit_overhead=values["jit_overhead"],
    )
    source["failure_rate"] = source.pop("failures_per_gpu_day")
    return params, source


def _percent(fraction: float) -> str:
    """A fraction as a percentage with 3 decimals; exact values are in --json."""
    return f"{fraction * 100:.3f}%" if fraction >= 1e-5 else "<0.001%"


def action(params: CostParams, rows: list[CostRow], job_gpus: int | None) -> str:
    """The line to act on: the fallback tier's interval for this job, as a `jitckpt run` flag."""
    row = next((r for r in rows if r.n_gpus == job_gpus), None) or max(rows, key=lambda r: r.n_gpus)
    interval_s = 1 / row.optimal_frequency
    steps = max(1, round(interval_s / params.minibatch_time))
    return (f"For this job ({row.n_gpus:g} GPUs): `jitckpt run --periodic-every {steps}` steps (every "
            f"{interval_s / 60:.3g} minutes at {params.minibatch_time:.3g} s a step) as the fallback tier.")


def _print_tables(params: CostParams, source: dict[str, str], rows: list[CostRow], price: float | None,
                  job_gpus: int | None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    pt = Table(title="Model parameters (JIT paper §5)", box=box.SIMPLE_HEAD, title_justify="left")
    for c in ("symbol", "meaning", "value", "unit", "source"):
        pt.add_column(c, justify="right" if c == "value" else "left")
    p = params
    pt.add_row("o", "checkpoint overhead per checkpoint", f"{p.overhead:.4g}", "s", source["overhead"])
    pt.add_row("r", "fixed recovery cost per failure", f"{p.restart_cost:.4g}", "s", source["restart_cost"])
    pt.add_row("f", "failure rate per GPU", f"{p.failure_rate * SECONDS_PER_DAY:.4g}", "1/(GPU·day)",
               source["failure_rate"])
    pt.add_row("m", "minibatch (step) time", f"{p.minibatch_time:.4g}", "s", source["minibatch_time"])
    pt.add_row("o_jit", "JIT steady-state overhead", f"{p.jit_overhead * 100:.4g}", "% of time",
               source["jit_overhead"])
    console.print(pt)

    t = Table(title="Wasted fraction of GPU time w_f (eq. 6) by method", box=box.SIMPLE_HEAD,
              title_justify="left")
    cols = ["N (GPUs)", "c* (ckpt/hour, eq. 3)", "ckpt interval (min)", "periodic w_f (eq. 5)",
            "user JIT w_f (eq. 7)", "transparent JIT w_f (eq. 8)"]
    if price is not None:
        cols += ["periodic $/month", "user JIT $/month", "transparent $/month"]
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        cells = [f"{r.n_gpus:g}", f"{r.optimal_frequency * SECONDS_PER_HOUR:.3g}",
                 f"{1 / r.optimal_frequency / 60:.3g}",
                 *(_percent(wf) for wf in (r.wf_periodic, r.wf_jit, r.wf_transparent))]
        if price is not None:
            cells += [f"{c:,.0f}" for c in (r.cost_periodic, r.cost_jit, r.cost_transparent)]
        t.add_row(*cells)
    console.print(t)
    console.print("user JIT is what `jitckpt run` gives (with --periodic-every as the fallback when no replica "
                  "survives); transparent JIT is `jitckpt run --transparent` (transient errors; verified on simcuda); "
                  "periodic is checkpointing alone at the optimal interval.")
    if price is not None:
        console.print(f"$/month: N GPUs running a 30-day month at ${price:g} per GPU-hour, times w_f.")
    console.print(action(params, rows, job_gpus))


def plot_wasted_fraction(params: CostParams, n_gpus: list[int], out: str, *, title: str = "") -> None:
    """Write a PNG of w_f (%, log scale) against N (log scale) for the three methods."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    lo, hi = min(n_gpus), max(n_gpus)
    if lo == hi:
        lo, hi = max(1, lo // 8), hi * 8
    ns = np.unique(np.geomspace(lo, hi, 200).round().astype(int))
    rows = analysis.evaluate(params, ns.tolist())
    fig, (ax, ax_int) = plt.subplots(2, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    marked = analysis.evaluate(params, n_gpus)
    # The optimal periodic interval (eq. 3), in minutes and in steps: --periodic-every for that N.
    ax_int.plot(ns, [1 / r.optimal_frequency / 60 for r in rows], "-", lw=2, color="C0")
    ax_int.plot(n_gpus, [1 / r.optimal_frequency / 60 for r in marked], "o", ms=4, color="C0")
    for r in marked:
        steps = max(1, round(1 / r.optimal_frequency / params.minibatch_time))
        ax_int.annotate(f"--periodic-every {steps}", (r.n_gpus, 1 / r.optimal_frequency / 60), fontsize="x-small",
                        textcoords="offset points", xytext=(4, 4))
    ax_int.set_yscale("log")
    ax_int.set_ylabel("optimal checkpoint interval (min)")
    ax_int.grid(True, which="both", alpha=0.3)
    for i, (key, label, style) in enumerate((
        ("wf_periodic", "periodic at optimal c* (eq. 4-6)", "-"),
        ("wf_jit", "user-level JIT (eq. 7)", "--"),
        ("wf_transparent", "transparent JIT, transient errors (eq. 8)", ":"),
    )):
        ax.plot(ns, [getattr(r, key) * 100 for r in rows], style, lw=2, color=f"C{i}", label=label)
        # Dots at the N of the table, so plot and table can be read together.
        ax.plot(n_gpus, [getattr(r, key) * 100 for r in marked], "o", ms=4, color=f"C{i}")
    ax.set_xscale("log", base=2)
    plain = matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.set_yscale("log")
    ax_int.set_xlabel("N, number of GPUs in the job (log scale)")
    ax.set_ylabel("wasted fraction of GPU time w_f (%, log scale)")
    p = params
    ax.set_title(title or "Wasted GPU time: periodic vs just-in-time checkpointing")
    ax.text(0.99, 0.02,
            f"o={p.overhead:.3g} s, r={p.restart_cost:.3g} s, f={p.failure_rate * SECONDS_PER_DAY:.3g}/(GPU·day),\n"
            f"m={p.minibatch_time:.3g} s, o_jit={p.jit_overhead * 100:.3g}%",
            transform=ax.transAxes, ha="right", va="bottom", fontsize="small",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _print_recovery_time(n_gpus: list[int], plot_to: str | None) -> None:
    """The recovery-time model's table (restart vs in-process, jitckpt.observability.recovery_model)."""
    from rich.console import Console
    from rich.table import Table

    from jitckpt.observability import recovery_model

    inputs = recovery_model.RecoveryInputs()
    t = Table(title="recovery time against job size (model; sources in jitckpt/observability/recovery_model.py)")
    for col in ("N GPUs", "restart every rank", "in-process, re-init", "in-process, shrink + grow"):
        t.add_column(col, justify="right")
    sizes = [n for n in n_gpus if n >= 2]
    for r in recovery_model.evaluate(inputs, sizes):
        t.add_row(str(r.n_gpus), f"{r.restart_s:.0f} s", f"{r.inprocess_reinit_s:.0f} s", f"{r.inprocess_shrink_s:.0f} s")
    Console(width=None if sys.stdout.isatty() else 160, highlight=False).print(t)
    if plot_to:
        recovery_model.plot(inputs, sizes, plot_to)
        print(f"recovery-time plot written to {plot_to}", file=sys.stderr)


def _job_gpus(args: argparse.Namespace) -> int | None:
    """The measured job's size (--from-run), whose row the action line uses."""
    if not args.from_run:
        return None
    from jitckpt.observability.report import load_run

    return load_run(args.from_run).world_size


def _run(args: argparse.Namespace) -> int:
    try:
        params, source = resolve_params(args)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"jitckpt analyze: {exc}", file=sys.stderr)
        return 2
    rows = analysis.evaluate(params, args.gpus, gpu_hour_price=args.gpu_hour_price)
    if args.json:
        doc: dict[str, Any] = {
            "units": {"failure_rate": "1/s per GPU", "overhead": "s", "restart_cost": "s",
                      "minibatch_time": "s", "jit_overhead": "s/s", "optimal_frequency": "1/s",
                      "wf_*": "fraction of total GPU time", "cost_*": "USD per 30-day month"},
            "params": params.as_dict(),
            "sources": source,
            "gpu_hour_price": args.gpu_hour_price,
            "rows": [r.as_dict() for r in rows],
        }
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        _print_tables(params, source, rows, args.gpu_hour_price, _job_gpus(args))
    if args.recovery_time:
        _print_recovery_time(args.gpus, args.recovery_plot)
    if args.plot:
        try:
            plot_wasted_fraction(params, args.gpus, args.plot)
        except ImportError:
            print("jitckpt analyze: --plot needs matplotlib: pip install 'jitckpt[analysis]'", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``analyze`` subcommand to an argparse subparsers object (sets ``func``)."""
    p = subparsers.add_parser(
        "analyze",
        help="wasted GPU time of periodic vs just-in-time checkpointing (JIT paper §5)",
        description="Cost model of the JIT checkpointing paper §5. Unset parameters come from "
        "--from-run measurements, else the paper's BERT-L-PT example (o=5 s, r=9.9 s, "
        "f=2e-3 /GPU/day), with m=1 s and o_jit=0.",
    )
    p.add_argument("-o", "--overhead", type=_nonneg_float, metavar="SECONDS",
                   help="o: time one checkpoint costs each GPU, seconds (default 5)")
    p.add_argument("-r", "--restart-cost", type=_nonneg_float, metavar="SECONDS",
                   help="r: fixed recovery cost per failure per GPU (detect, restart, load), seconds (default 9.9)")
    p.add_argument("-f", "--failures-per-gpu-day", type=_nonneg_float, metavar="RATE",
                   help="f: failures per GPU per day (default 2e-3, i.e. ~2/day on 1000 GPUs)")
    p.add_argument("-m", "--minibatch-time", type=_nonneg_float, metavar="SECONDS",
                   help="m: time of one training step, seconds (default 1)")
    p.add_argument("-N", "--gpus", type=parse_gpus, default=parse_gpus(DEFAULT_GPUS), metavar="LIST|LO:HI",
                   help=f"GPU counts: a list '4,1024,8192' or a doubling range '8:16384' (default {DEFAULT_GPUS})")
    p.add_argument("--jit-overhead", "--o-jit", dest="jit_overhead", type=_nonneg_float, metavar="FRACTION",
                   help="o_jit: steady-state JIT overhead as a fraction of step time, e.g. 0.002 (default 0)")
    p.add_argument("--gpu-hour-price", type=_nonneg_float, metavar="USD",
                   help="price of one GPU-hour in dollars; adds $/month columns")
    p.add_argument("--from-run", metavar="RUN_DIR",
                   help="take o (median checkpoint time), r (mean detect+restart+restore) and m (median "
                   "step time) from a job's events.jsonl; flags still override")
    p.add_argument("--baseline-step-time", type=_pos_float, metavar="SECONDS",
                   help="with --from-run: step time of the same job without jitckpt, to measure o_jit")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG of w_f against N for each method")
    p.add_argument("--json", action="store_true", help="print parameters and rows as JSON (SI units)")
    p.add_argument("--recovery-time", action="store_true",
                   help="also the model of recovery time against N: every rank restarting vs the survivors "
                   "kept in their processes (jitckpt run --recovery inprocess), with its sources")
    p.add_argument("--recovery-plot", metavar="OUT.png", help="with --recovery-time: write that model's plot")
    p.set_defaults(func=_run)
