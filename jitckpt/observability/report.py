"""``jitckpt report RUN_DIR``: a job's failures and recovery phases, from its event log.

Reads ``<run_dir>/events.jsonl`` (schema in :mod:`jitckpt.observability.events`) and prints a summary table
(one row per failure, times in seconds, bytes in MB) and optionally a timeline PNG. The same
summary feeds ``jitckpt analyze --from-run`` (measured o, r, m).

Grouping: a *failure* is an incident that may be reported by several ranks (one rank exits, the
others hang). Events are walked in time order; the first ``failure_detected`` opens an incident,
later ones join it, and the next ``recovery_summary`` closes it. A ``recovery_summary`` without a
preceding ``failure_detected`` is its own incident; an incident still open at the end of the log
was not recovered.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from jitckpt.observability.events import EVENTS_FILE, read_events

PHASES = ("detect", "save", "restart", "restore")


@dataclass
class Recovery:
    """One failure and its recovery. Times in seconds; ``t_failure`` is Unix time (s)."""

    index: int
    t_failure: float
    failure_kind: str
    failed_ranks: list
    nodes: list
    recovered: bool
    detect_s: float = 0.0
    save_s: float = 0.0
    restart_s: float = 0.0
    restore_s: float = 0.0
    total_s: float = 0.0
    checkpoint_bytes: int = 0
    step_failed: int | None = None
    step_resumed: int | None = None
    steps_redone: int | None = None

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each of :data:`PHASES`."""
        return {p: getattr(self, f"{p}_s") for p in PHASES}


@dataclass
class TransparentRecovery:
    """A worker's device proxy replaced in place and its calls replayed (``transparent_recovery``).

    The breakdown follows the JIT paper's Table 7: buffers saved from the old proxy (with minibatch
    marks), the peers' word that they recover too (communicators with peers in other processes),
    a new proxy, allocations/handles/communicators recreated (of it, the communicators' inits, which
    wait for the peers), buffers restored, the minibatch's calls replayed (without marks: every
    call), the device synchronized."""

    t: float
    rank: int | None
    cause: str
    recovered: bool
    reason: str
    calls: int
    minibatch_calls: int
    save_s: float
    new_proxy_s: float
    recreate_s: float
    restore_s: float
    replay_s: float
    synchronize_s: float
    total_s: float
    agree_s: float = 0.0
    communicators_s: float = 0.0


@dataclass
class RunSummary:
    """Everything ``report`` shows about one job; times in seconds, bytes in bytes."""

    run_dir: str
    world_size: int | None = None
    script: str | None = None
    t_start: float | None = None
    t_end: float | None = None
    status: str | None = None
    exit_code: int | None = None
    restarts: int = 0
    recoveries: list[Recovery] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_points: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, rank, step, gen)
    worker_starts: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rank, gen)
    checkpoints: dict[str, int] = field(default_factory=dict)  # kind -> count of checkpoints
    checkpoint_seconds: list[float] = field(default_factory=list)  # per checkpoint, slowest rank
    periodic_checkpoint_seconds: list[float] = field(default_factory=list)  # the periodic ones of those
    checkpoint_bytes: int = 0
    checkpoint_failures: int = 0
    last_step: int | None = None
    # --transparent: lost device proxies libjit.so replaced in place (no restart), as logged.
    transparent: list[TransparentRecovery] = field(default_factory=list)
    validations: int = 0  # transparent_validation records: replays checked against the live buffers
    validations_failed: int = 0

    @property
    def duration_s(self) -> float | None:
        """Wall-clock seconds from job_start (or first event) to job_end (or last event)."""
        if self.t_start is None or self.t_end is None:
            return None
        return self.t_end - self.t_start

    @property
    def failures(self) -> int:
        """Number of failure incidents (recovered or not)."""
        return len(self.recoveries)

    @property
    def step_time_median(self) -> float | None:
        """Median sampled step time (s), the model's m."""
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def checkpoint_time_median(self) -> float | None:
        """Median time of one periodic checkpoint (s, slowest rank of each): the model's o, what a
        periodic checkpoint costs every rank. JIT saves happen only after failures (not o)."""
        return statistics.median(self.periodic_checkpoint_seconds) if self.periodic_checkpoint_seconds else None

    @property
    def restart_cost_mean(self) -> float | None:
        """Mean fixed cost of a failure (s): detect + restart + restore, the model's r.

        Detection is included because every GPU idles through it, whatever the checkpointing
        method; the save phase is the model's o and redone steps its m/2, so both are excluded.
        """
        rec = [r for r in self.recoveries if r.recovered]
        if not rec:
            return None
        return statistics.fmean(r.detect_s + r.restart_s + r.restore_s for r in rec)

    @property
    def recovery_total_s(self) -> float:
        """Sum of recovery times over recovered failures (s)."""
        return sum(r.total_s for r in self.recoveries if r.recovered)

    @property
    def steps_redone(self) -> int:
        """Steps redone after all failures."""
        return sum(r.steps_redone or 0 for r in self.recoveries)

    @property
    def wasted_gpu_seconds(self) -> float | None:
        """Estimated GPU-seconds lost to failures: world_size x (recovery time + redone steps x m)."""
        if self.world_size is None:
            return None
        m = self.step_time_median or 0.0
        return self.world_size * (self.recovery_total_s + self.steps_redone * m)

    def as_dict(self) -> dict:
        """JSON-ready summary (seconds, bytes)."""
        d = asdict(self)
        d.pop("step_points")
        d.pop("worker_starts")
        d.pop("step_times")
        d["recoveries"] = [asdict(r) for r in self.recoveries]
        d["transparent"] = [asdict(r) for r in self.transparent]
        for name in (
            "duration_s",
            "failures",
            "step_time_median",
            "checkpoint_time_median",
            "restart_cost_mean",
            "recovery_total_s",
            "steps_redone",
            "wasted_gpu_seconds",
        ):
            d[name] = getattr(self, name)
        d["step_samples"] = len(self.step_times)
        return d


def _num(value: Any, default: float = 0.0) -> float:
    """A finite float from an event field, else ``default`` (event fields may be absent/null)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def summarize(events: Iterable[dict], run_dir: str = "") -> RunSummary:
    """Build a :class:`RunSummary` from event records (any order; sorted by ``t`` here)."""
    evs = sorted((e for e in events if isinstance(e, dict) and "event" in e), key=lambda e: _num(e.get("t")))
    s = RunSummary(run_dir=str(run_dir))
    if not evs:
        return s
    s.t_start = _num(evs[0].get("t"))
    s.t_end = _num(evs[-1].get("t"))
    open_failures: list[dict] = []
    ckpt_groups: dict[tuple, float] = {}

    def close(summary: dict | None) -> None:
        first = open_failures[0] if open_failures else None
        kinds = [f.get("kind") for f in open_failures if f.get("kind")]
        ranks = sorted({r for f in open_failures for r in _as_list(f.get("rank")) if r is not None})
        nodes = sorted({str(f.get("node")) for f in open_failures if f.get("node") is not None})
        rec = Recovery(
            index=len(s.recoveries) + 1,
            t_failure=0.0,
            failure_kind=str(kinds[0]) if kinds else "unknown",
            failed_ranks=ranks,
            nodes=nodes,
            recovered=summary is not None,
        )
        if summary is not None:
            for p in PHASES:
                setattr(rec, f"{p}_s", _num(summary.get(f"{p}_s")))
            rec.total_s = _num(summary.get("total_s"), sum(rec.phase_seconds().values()))
            rec.checkpoint_bytes = int(_num(summary.get("checkpoint_bytes")))
            rec.failure_kind = str(summary.get("failure_kind") or rec.failure_kind)
            if summary.get("failed_ranks") is not None:
                rec.failed_ranks = _as_list(summary.get("failed_ranks"))
            for k in ("step_failed", "step_resumed", "steps_redone"):
                if summary.get(k) is not None:
                    setattr(rec, k, int(_num(summary.get(k))))
        elif first is not None:
            rec.detect_s = _num(first.get("detect_time"))
        # The failure happened detect_s before it was first detected.
        if first is not None:
            rec.t_failure = _num(first.get("t")) - rec.detect_s
        else:
            rec.t_failure = _num(summary.get("t")) - rec.total_s if summary else 0.0
        s.recoveries.append(rec)
        open_failures.clear()

    for e in evs:
        kind = e["event"]
        if kind == "job_start":
            s.t_start = _num(e.get("t"))
            ws = e.get("world_size")
            s.world_size = int(ws) if ws is not None else s.world_size
            s.script = e.get("script")
        elif kind == "job_end":
            s.status = e.get("status")
            s.exit_code = e.get("exit_code")
            s.restarts = int(_num(e.get("restarts"), s.restarts))
        elif kind == "restart":
            s.restarts = max(s.restarts, int(_num(e.get("restart_count"), s.restarts + 1)))
        elif kind == "step":
            st = e.get("step_time")
            if st is not None and _num(st, -1) >= 0:
                s.step_times.append(_num(st))
            if e.get("step") is not None:
                step = int(_num(e.get("step")))
                s.step_points.append((_num(e.get("t")), int(_num(e.get("rank"))), step, int(_num(e.get("gen")))))
                s.last_step = step if s.last_step is None else max(s.last_step, step)
        elif kind == "worker_start" and isinstance(e.get("rank"), int):
            s.worker_starts.append((_num(e.get("t")), e["rank"], int(_num(e.get("gen")))))
        elif kind == "checkpoint_saved":
            ck = str(e.get("kind") or "unknown")
            key = (e.get("gen"), e.get("step"), ck)
            if key not in ckpt_groups:
                s.checkpoints[ck] = s.checkpoints.get(ck, 0) + 1
            # A synchronous job waits for its slowest rank, so a checkpoint costs the max.
            ckpt_groups[key] = max(ckpt_groups.get(key, 0.0), _num(e.get("seconds")))
            s.checkpoint_bytes += int(_num(e.get("bytes")))
        elif kind == "checkpoint_failed":
            s.checkpoint_failures += 1
        elif kind == "failure_detected":
            open_failures.append(e)
        elif kind == "recovery_summary":
            close(e)
        elif kind == "transparent_validation":
            s.validations += 1
            s.validations_failed += not e.get("matched")
        elif kind == "transparent_recovery":
            rank = e.get("rank")
            s.transparent.append(TransparentRecovery(
                t=_num(e.get("t")), rank=rank if isinstance(rank, int) and rank >= 0 else None,
                cause=str(e.get("cause", "")), recovered=bool(e.get("recovered")), reason=str(e.get("reason", "")),
                calls=int(_num(e.get("calls"))), minibatch_calls=int(_num(e.get("minibatch_calls"))), save_s=_num(e.get("save_s")), new_proxy_s=_num(e.get("new_proxy_s")),
                recreate_s=_num(e.get("recreate_s")), restore_s=_num(e.get("restore_s")),
                replay_s=_num(e.get("replay_s")), synchronize_s=_num(e.get("synchronize_s")),
                total_s=_num(e.get("total_s")), agree_s=_num(e.get("agree_s")),
                communicators_s=_num(e.get("communicators_s"))))
    if open_failures:
        close(None)
    s.checkpoint_seconds = list(ckpt_groups.values())
    s.periodic_checkpoint_seconds = [v for (_, _, kind), v in ckpt_groups.items() if kind == "periodic"]
    return s


def newest_run(path: str | Path) -> Path:
    """The run directory ``path`` names: itself when it holds an event log, else the newest run
    under it (a checkpoint directory's ``runs/<run id>/``, or a ``runs`` directory's children), so
    `jitckpt report CHECKPOINT_DIR` shows the last job. Unchanged when nothing matches (load_run
    then says what is missing)."""
    p = Path(path)
    if not p.is_dir() or (p / EVENTS_FILE).is_file():
        return p
    logs = [*p.glob(f"runs/*/{EVENTS_FILE}"), *p.glob(f"*/{EVENTS_FILE}")]
    if not logs:
        return p
    return max(logs, key=lambda f: f.stat().st_mtime).parent


def load_run(run_dir: str | Path) -> RunSummary:
    """Summarize ``run_dir`` (or an events.jsonl path).

    Raises FileNotFoundError (no such log) or ValueError (the file is not an event log), both
    naming the file and what was expected.
    """
    p = Path(run_dir)
    path = p / EVENTS_FILE if p.is_dir() else p
    if not path.is_file():
        raise FileNotFoundError(
            f"no event log at {path}: pass the run directory of a job started with `jitckpt run` "
            f"(it holds {EVENTS_FILE})"
        )
    with open(path, "rb") as f:
        head = f.read(4096)
    not_a_log = (f"{path} is not a jitckpt event log: expected JSON lines with an \"event\" field, "
                 f"as `jitckpt run` writes to RUN_DIR/{EVENTS_FILE}")
    if b"\0" in head:
        raise ValueError(f"{not_a_log} (this is a binary file)")
    records = [r for r in read_events(path) if "event" in r]
    if head.strip() and not records:  # text, but not one event record (torn lines are skipped)
        raise ValueError(not_a_log)
    return summarize(records, run_dir=str(run_dir))


# ---------------------------------------------------------------- output


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _table(title: str, columns: list[str], rows: list[list[str]]):
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for c in columns:
        t.add_column(c, justify="left" if c in ("kind", "ranks", "quantity", "value") else "right")
    for r in rows:
        t.add_row(*r)
    return t


def print_summary(s: RunSummary, file=None) -> None:
    """Print the job and per-failure tables (rich; plain text without colour when not a TTY)."""
    from rich.console import Console

    out = file or sys.stdout
    # Piped output is plain text (rich drops colour); widen it so the failure table doesn't wrap.
    tty = getattr(out, "isatty", lambda: False)()
    console = Console(file=out, width=None if tty else 160, highlight=False)
    job = [
        ["run dir", s.run_dir],
        ["status", f"{s.status or 'unknown'} (exit code {_fmt(s.exit_code, '')})"],
        ["world size (GPUs/ranks)", _fmt(s.world_size, "")],
        ["wall-clock duration (s)", _fmt(s.duration_s, ".1f")],
        ["last step", _fmt(s.last_step, "")],
        ["failures", str(s.failures)],
        ["transparent recoveries (no restart)", f"{sum(r.recovered for r in s.transparent)} of {len(s.transparent)}"],
        ["replay validations (failed)", f"{s.validations} ({s.validations_failed})"],
        ["restarts", str(s.restarts)],
        ["recovery time, total (s)", _fmt(s.recovery_total_s, ".2f")],
        ["steps redone, total", str(s.steps_redone)],
        ["step time, median (s)", _fmt(s.step_time_median, ".4f")],
        ["checkpoints (by kind)", ", ".join(f"{k}: {v}" for k, v in sorted(s.checkpoints.items())) or "0"],
        ["periodic checkpoint time, median (s)", _fmt(s.checkpoint_time_median, ".3f")],
        ["checkpoint data written (MB)", f"{s.checkpoint_bytes / 1e6:.1f}"],
        ["failed checkpoints", str(s.checkpoint_failures)],
        ["est. wasted GPU time (GPU-s)", _fmt(s.wasted_gpu_seconds, ".1f")],
    ]
    console.print(_table("Job", ["quantity", "value"], job))
    if s.transparent:
        t0 = s.t_start or 0.0
        # Two tables: the cause and outcome, then the breakdown (JIT paper Table 7), narrow enough for
        # a terminal.
        rows = [[str(i), f"{r.t - t0:.1f}", _fmt(r.rank, ""), r.cause,
                 "recovered" if r.recovered else f"not recovered: {r.reason}"] for i, r in enumerate(s.transparent)]
        console.print(_table("Transparent recoveries: device proxies replaced in place (--transparent)",
                             ["#", "at (s)", "rank", "kind", "outcome"], rows))
        rows = [[str(i), _fmt(r.rank, ""), f"{r.calls} ({r.minibatch_calls})"]
                + [f"{x * 1e3:.1f}" for x in (r.save_s, r.agree_s, r.new_proxy_s)]
                + [f"{r.recreate_s * 1e3:.1f} ({r.communicators_s * 1e3:.1f})"]
                + [f"{x * 1e3:.1f}" for x in (r.restore_s, r.replay_s, r.synchronize_s, r.total_s)]
                for i, r in enumerate(s.transparent) if r.recovered]
        if rows:
            console.print(_table("Transparent recovery breakdown (ms)",
                                 ["#", "rank", "calls (minibatch)", "save buffers", "peers agree", "new proxy",
                                  "recreate handles (comms)", "restore buffers", "replay", "synchronize", "total"],
                                 rows))
    if not s.recoveries:
        console.print("No failures recorded.")
        return
    t0 = s.t_start or 0.0
    rows = []
    for r in s.recoveries:
        rows.append(
            [
                str(r.index),
                f"{r.t_failure - t0:.1f}",
                r.failure_kind,
                ",".join(map(str, r.failed_ranks)) or "-",
                *(f"{v:.2f}" for v in r.phase_seconds().values()),
                f"{r.total_s:.2f}" if r.recovered else "not recovered",
                f"{r.checkpoint_bytes / 1e6:.1f}",
                f"{_fmt(r.step_failed, '')} -> {_fmt(r.step_resumed, '')}",
                _fmt(r.steps_redone, ""),
            ]
        )
    cols = ["#", "at (s)", "kind", "ranks", "detect (s)", "save (s)", "restart (s)", "restore (s)",
            "total (s)", "ckpt (MB)", "step failed -> resumed", "redone"]
    console.print(_table("Failures and recovery phases (times since job start)", cols, rows))


PHASE_COLOURS = {"detect": "#d62728", "save": "#ff7f0e", "restart": "#7f7f7f", "restore": "#1f77b4",
                 "redo": "#9467bd"}


ZOOMED = 4  # recoveries drawn enlarged (the first ones); the overview shows every one


def _lanes(s: RunSummary) -> list[int]:
    """Every rank the log knows: the job's world size, else the ranks seen."""
    seen = ({p[1] for p in s.step_points} | {r for _, r, _ in s.worker_starts}
            | {r for rec in s.recoveries for r in rec.failed_ranks if isinstance(r, int)})
    return list(range(s.world_size)) if s.world_size else sorted(seen)


def _segments(r: Recovery, step_median: float) -> list[tuple[str, float]]:
    segs = [(p, v) for p, v in r.phase_seconds().items() if v > 0]
    if r.steps_redone and step_median > 0:
        segs.append(("redo", r.steps_redone * step_median))
    return segs


def build_timeline(s: RunSummary):  # type: ignore[no-untyped-def]
    """The timeline figure (matplotlib): one lane per rank over the whole job, its start-up
    labelled and each failure marked (top); every recovery's phases on one time axis (middle); the
    first recoveries enlarged, each phase labelled with its seconds (bottom row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = s.t_start or 0.0
    lanes = _lanes(s)
    zoomed = s.recoveries[:ZOOMED]
    n = max(len(s.recoveries), 1)
    rows = 3 if zoomed else 2
    fig = plt.figure(figsize=(11, 3 + 0.25 * max(len(lanes), 1) + 0.4 * n + (2.2 if zoomed else 0)))
    grid = fig.add_gridspec(rows, max(len(zoomed), 1),
                            height_ratios=[1 + 0.15 * len(lanes), 0.6 + 0.3 * n] + ([1.3] if zoomed else []))
    ax_ranks = fig.add_subplot(grid[0, :])
    ax_rec = fig.add_subplot(grid[1, :], sharex=ax_ranks)
    end = max([s.duration_s or 0.0] + [r.t_failure - t0 + r.total_s for r in s.recoveries])
    # Lanes: each of a rank's processes, from its start to the next one's (a restart) or the job's end.
    for y, rank in enumerate(lanes):
        starts = sorted((t - t0, g) for t, r, g in s.worker_starts if r == rank)
        for (t, gen), nxt in zip(starts, [x for x, _ in starts[1:]] + [end]):
            ax_ranks.broken_barh([(t, max(nxt - t, end * 0.002))], (y - 0.35, 0.7), facecolors=f"C{gen % 10}", alpha=0.6)
    first_step = min((t for t, *_ in s.step_points), default=None)
    if first_step is not None and first_step - t0 > 0:
        ax_ranks.axvspan(0, first_step - t0, color="0.85")
        ax_ranks.text((first_step - t0) / 2, len(lanes) - 0.5 if lanes else 0, "start-up", ha="center", va="bottom",
                      fontsize="small")
    for r in s.recoveries:
        x = r.t_failure - t0
        for ax in (ax_ranks, ax_rec):
            ax.axvline(x, color=PHASE_COLOURS["detect"], ls="--", lw=1)
        for rank in r.failed_ranks:
            if rank in lanes:
                ax_ranks.plot([x], [lanes.index(rank)], "x", color=PHASE_COLOURS["detect"], ms=9, mew=2)
    ax_ranks.set_yticks(range(len(lanes)), [f"rank {r}" for r in lanes], fontsize="small")
    ax_ranks.set_ylim(-0.6, max(len(lanes), 1) - 0.4 + 0.6)
    ax_ranks.invert_yaxis()
    ax_ranks.grid(axis="x", alpha=0.3)
    ax_ranks.set_title(f"Job timeline: {s.failures} failure(s), {s.restarts} restart(s) — {Path(s.run_dir).name}"
                       " (bars: a rank's process, by generation; x: a rank that failed)")

    m = s.step_time_median or 0.0
    labels = []
    for i, r in enumerate(s.recoveries):
        x = r.t_failure - t0
        for phase, dur in _segments(r, m):
            ax_rec.broken_barh([(x, dur)], (i - 0.4, 0.8), facecolors=PHASE_COLOURS[phase])
            x += dur
        if not r.recovered:
            ax_rec.text(x, i, "  not recovered", va="center", fontsize="small")
        labels.append(f"#{r.index} {r.failure_kind}\nrank {','.join(map(str, r.failed_ranks)) or '?'}")
    ax_rec.set_yticks(range(len(labels)), labels, fontsize="small")
    ax_rec.set_ylim(-0.6, n - 0.4)
    ax_rec.invert_yaxis()
    ax_rec.set_xlabel("time since job start (s)")
    ax_rec.grid(axis="x", alpha=0.3)
    if s.recoveries:
        ax_rec.legend(handles=[Patch(color=c, label=p if p != "redo" else "redo (est.)") for p, c in PHASE_COLOURS.items()],
                      loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", title="phase")
    else:
        ax_rec.text(0.5, 0.5, "no failures", transform=ax_rec.transAxes, ha="center")
    if end:
        ax_rec.set_xlim(0, end * 1.02)
    # Each recovery enlarged: its phases in order, each labelled with its name and seconds.
    for k, r in enumerate(zoomed):
        ax = fig.add_subplot(grid[2, k])
        x = 0.0
        for j, (phase, dur) in enumerate(_segments(r, m)):
            ax.broken_barh([(x, dur)], (0, 1), facecolors=PHASE_COLOURS[phase])
            ax.text(x + dur / 2, 1.1 + 0.45 * (j % 2), f"{phase}\n{dur:.2f} s", ha="center", va="bottom",
                    fontsize="x-small")
            x += dur
        ax.set_xlim(0, max(x, 1e-3) * 1.05)
        ax.set_ylim(0, 2.4)
        ax.set_yticks([])
        ax.set_title(f"#{r.index} {r.failure_kind}, rank {','.join(map(str, r.failed_ranks)) or '?'}",
                     fontsize="small")
        ax.set_xlabel("s since the failure", fontsize="small")
    fig.tight_layout()
    return fig


def plot_timeline(s: RunSummary, out: str | Path) -> Path:
    """Write :func:`build_timeline`'s figure as a PNG."""
    import matplotlib.pyplot as plt

    fig = build_timeline(s)
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- CLI


def _run(args: argparse.Namespace) -> int:
    run_dir = newest_run(args.run_dir)
    if run_dir != Path(args.run_dir):
        print(f"jitckpt report: the newest run in {args.run_dir}: {run_dir}", file=sys.stderr)
        args.run_dir = str(run_dir)
    try:
        s = load_run(args.run_dir)
    except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError) as exc:
        print(f"jitckpt report: {exc}", file=sys.stderr)
        return 2
    if s.t_start is None:
        print(f"jitckpt report: the event log in {args.run_dir} is empty: did the job start?", file=sys.stderr)
        return 2
    if args.json:
        json.dump(s.as_dict(), sys.stdout, indent=2, default=str)
        print()
    else:
        print_summary(s)
    if args.plot:
        try:
            out = plot_timeline(s, args.plot)
        except ImportError:
            print("jitckpt report: --plot needs matplotlib: pip install 'jitckpt[analysis]'", file=sys.stderr)
            return 2
        print(f"timeline written to {out}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand to an argparse subparsers object (sets ``func``)."""
    p = subparsers.add_parser(
        "report",
        help="summarize a job's failures and recovery phases from its event log",
        description="Summarize RUN_DIR/events.jsonl: per-failure detect/save/restart/restore times "
        "(seconds), steps redone, checkpoint sizes; optionally a timeline PNG.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="the job's run directory (holds events.jsonl), or a checkpoint directory: its newest run")
    p.add_argument("--plot", metavar="OUT.png", help="also write a timeline PNG of failures and recovery phases")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (seconds, bytes) instead of tables")
    p.set_defaults(func=_run)
