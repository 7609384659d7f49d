"""Console status for `jitckpt run`: a periodic line while training, a table after a recovery."""
from __future__ import annotations

import sys
import time
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from jitckpt.console_log import stamp
from jitckpt.hang_timeout import HangTimeout


def _or_unknown(v: Any) -> str:
    return "unknown" if v is None else str(v)


class StatusDisplay:
    """``hang_timeout``: a running rank whose step has not changed for longer than the shortest
    timeout the policy can give (the fixed one, else the adaptive floor) shows as "no progress
    for N s", never "ok" (e.g. a rank stopped where no region of the other ranks watches it)."""

    def __init__(self, *, enabled: bool, interval: float,
                 hang_timeout: Optional[HangTimeout] = None) -> None:
        self.enabled, self.interval = enabled, interval
        # A log file or a pipe gets each line whole (no wrapping at 80 columns: grep finds it).
        self.console = Console(file=sys.stderr, highlight=False, markup=False, soft_wrap=not sys.stderr.isatty())
        self._last = time.monotonic()
        self.stall_after: Optional[float] = None
        if hang_timeout is not None:
            self.stall_after = hang_timeout.fixed if hang_timeout.fixed is not None else hang_timeout.floor
        self._progress: dict[int, tuple[Optional[int], float]] = {}  # rank -> (step, since when)

    def health(self, w: Any, failure: Optional[Any], now: Optional[float] = None) -> str:
        """What the status line says of worker ``w`` (a launcher Worker)."""
        now = time.monotonic() if now is None else now
        step, since = self._progress.get(w.rank, (w.step, now))
        if step != w.step:
            since = now
        self._progress[w.rank] = (w.step, since)
        if w.exit_code is not None:
            return "done" if w.exit_code == 0 else f"exit {w.exit_code}"
        if failure is not None:
            return "saving"
        if self.stall_after is not None and now - since > self.stall_after:
            return f"no progress for {now - since:.0f}s"
        return "ok"

    def maybe_show(self, gen: int, workers: list, failure: Optional[Any]) -> None:
        if not self.enabled or time.monotonic() - self._last < self.interval:
            return
        self._last = time.monotonic()
        parts = []
        now = time.monotonic()
        for w in workers:
            health = self.health(w, failure, now)
            step = "-" if w.step is None or w.step < 0 else str(w.step)
            st = f" {w.step_time * 1000:.0f}ms" if w.step_time else ""
            parts.append(f"r{w.rank}:{step}{st} {health}")
        self.console.print(f"{stamp()} gen {gen} | " + " | ".join(parts))

    def say(self, text: str) -> None:
        """One line of the launcher's, whatever ``enabled`` says (a fact the user must see)."""
        self.console.print(f"{stamp()} {text}")

    def show_failure(self, f: Any, *, restarting: bool) -> None:
        """One line once the failed generation is gone (``f``: a launcher FailureRecord)."""
        ranks = sorted(set(f.failed_ranks))
        who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks
               else "unknown rank")
        by = f", detected by rank {f.reporter}" if f.reporter is not None and f.reporter not in ranks else ""
        self.console.print(
            f"{stamp()} failure ({f.label}) of {who}{by} — {f.detail}; JIT checkpoints from ranks "
            f"{sorted(set(f.saved_ranks)) or 'none'}; {'restarting' if restarting else 'no restart'}")

    def show_summary(self, s: dict) -> None:
        t = Table(title="jitckpt recovery summary", show_header=True)
        t.add_column("what")
        t.add_column("value", justify="right")
        def sec(v: Optional[float]) -> str:
            return "-" if v is None else f"{v:.2f} s"
        if s.get("scope") == "stage":  # --recovery stage: one rank replaced, the rest ran on
            rows = [
                ("failure", f"{s['failure_kind']} (rank "
                            f"{', '.join(map(str, s['failed_ranks'])) or '?'}, replaced alone)"),
                ("replacement started", sec(s["restart_s"])),
                ("checkpoint load + replay from logs", sec(s["restore_s"])),
                ("total (detection → caught up)", sec(s["total_s"])),
                ("replayed from checkpoint of step", str(s["step_resumed"])),
                ("iterations replayed (by this rank only)", str(s["steps_redone"])),
            ]
        else:
            rows = [
                ("failure", f"{s['failure_kind']} (ranks {s['failed_ranks'] or 'unknown'})"),
                ("JIT save (detection → every shard saved)", sec(s["save_s"])),
                ("restart (workers up, rendezvous)", sec(s["restart_s"])),
                ("restarted on warm standbys", "yes" if s.get("standbys", "ready") == "ready" else f"no, {s['standbys']}"),
                *([("kept their processes (in-process)", "ranks " + ", ".join(map(str, s["kept_ranks"])))]
                  if s.get("kept_ranks") else []),
                ("restore (checkpoint load)", sec(s["restore_s"])),
                ("total (detection → first step done)", sec(s["total_s"])),
                ("checkpoint size", f"{s['checkpoint_bytes'] / 1e6:.1f} MB"),
                ("step at failure → resumed at", f"{_or_unknown(s['step_failed'])} → {s['step_resumed']}"),
                ("minibatches redone", _or_unknown(s["steps_redone"])),
            ]
        for a, b in rows:
            t.add_row(a, b)
        self.console.print(t)
