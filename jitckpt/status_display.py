"""Console status for `jitckpt run`: a periodic line while training, a table after a recovery."""
from __future__ import annotations

import sys
import time
from typing import Any, Optional

from rich.console import Console
from rich.table import Table


class StatusDisplay:
    def __init__(self, *, enabled: bool, interval: float) -> None:
        self.enabled, self.interval = enabled, interval
        self.console = Console(file=sys.stderr, highlight=False, markup=False)
        self._last = time.monotonic()

    def maybe_show(self, gen: int, workers: list, failure: Optional[Any]) -> None:
        if not self.enabled or time.monotonic() - self._last < self.interval:
            return
        self._last = time.monotonic()
        parts = []
        for w in workers:
            if w.exit_code is not None:
                health = "done" if w.exit_code == 0 else f"exit {w.exit_code}"
            elif failure is not None:
                health = "saving"
            else:
                health = "ok"
            step = "-" if w.step is None or w.step < 0 else str(w.step)
            st = f" {w.step_time * 1000:.0f}ms" if w.step_time else ""
            parts.append(f"r{w.rank}:{step}{st} {health}")
        self.console.print(f"[jitckpt] gen {gen} | " + " | ".join(parts))

    def show_failure(self, f: Any) -> None:
        self.console.print(
            f"[jitckpt] failure ({f.kind}) rank={f.rank} — {f.detail}; JIT checkpoints from ranks "
            f"{sorted(set(f.saved_ranks)) or 'none'}; restarting")

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
                ("failure", f"{s['failure_kind']} (ranks {s['failed_ranks'] or '?'})"),
                ("JIT save (detection → every shard saved)", sec(s["save_s"])),
                ("restart (workers up, rendezvous)", sec(s["restart_s"])),
                ("restore (checkpoint load)", sec(s["restore_s"])),
                ("total (detection → first step done)", sec(s["total_s"])),
                ("checkpoint size", f"{s['checkpoint_bytes'] / 1e6:.1f} MB"),
                ("step at failure → resumed at", f"{s['step_failed']} → {s['step_resumed']}"),
                ("minibatches redone", str(s["steps_redone"])),
            ]
        for a, b in rows:
            t.add_row(a, b)
        self.console.print(t)
