"""Pass-through overhead of libjit.so: runs bench_interposer with and without LD_PRELOAD=libjit.so
(same backend, same invocation) and prints per-call cost and the difference in ns.

    .venv/bin/python bench/bench_interposer.py [--backend real|simcuda] [--iters N] [--rounds R]

Rounds alternate plain/preloaded runs; the best time per call over all rounds is reported, which
filters scheduler noise on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BUILD = Path(os.environ.get("JITCKPT_BUILD_DIR", Path(__file__).resolve().parents[1] / "build" / "native"))
BUDGET_NS = 20.0


def run_once(binary: Path, env: dict[str, str], iters: int) -> dict[str, float]:
    """Run the benchmark binary once and parse its "<call> <ns>" lines."""
    out = subprocess.run([str(binary), str(iters), "5"], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return {name: float(ns) for name, ns in (line.rsplit(" ", 1) for line in out.splitlines() if line)}


def measure(backend: str, iters: int, rounds: int) -> dict[str, dict[str, float]]:
    """Return {call: {"direct": ns, "preloaded": ns, "overhead": ns}} for the chosen backend."""
    binary = BUILD / "bin" / "bench_interposer"
    libjit = BUILD / "lib" / "libjit.so"
    for path in (binary, libjit):
        if not path.exists():
            raise SystemExit(f"{path} is missing: build it with `make native`")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "JITCKPT_VERBOSE")}
    if backend == "simcuda":
        simcuda = BUILD / "lib" / "simcuda"
        if not (simcuda / "libcudart.so.13").exists():
            raise SystemExit(f"{simcuda}/libcudart.so.13 is missing: build simcuda with `make native`")
        env["LD_LIBRARY_PATH"] = f"{simcuda}:{env.get('LD_LIBRARY_PATH', '')}"
    best: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for label, extra in (("direct", {}), ("preloaded", {"LD_PRELOAD": str(libjit)})):
            for name, ns in run_once(binary, {**env, **extra}, iters).items():
                slot = best.setdefault(name, {})
                slot[label] = min(ns, slot.get(label, float("inf")))
    for slot in best.values():
        slot["overhead"] = slot["preloaded"] - slot["direct"]
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["real", "simcuda"], default="real",
                    help="real: /usr/local/cuda libcudart.so.13 (no GPU: error paths); simcuda: CPU backend")
    ap.add_argument("--iters", type=int, default=200_000, help="calls per timed loop")
    ap.add_argument("--rounds", type=int, default=3, help="alternating plain/preloaded runs")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    if args.iters <= 0 or args.rounds <= 0:
        ap.error("--iters and --rounds must be positive")
    results = measure(args.backend, args.iters, args.rounds)
    if args.json:
        print(json.dumps({"backend": args.backend, "budget_ns": BUDGET_NS, "calls": results}, indent=1))
        return 0
    print(f"backend={args.backend} iters={args.iters} rounds={args.rounds} (best ns/call)")
    print(f"{'call':36s} {'direct':>9s} {'preloaded':>10s} {'overhead':>9s}")
    for name, r in results.items():
        flag = "" if r["overhead"] <= BUDGET_NS else f"  > {BUDGET_NS:.0f} ns budget"
        print(f"{name:36s} {r['direct']:9.2f} {r['preloaded']:10.2f} {r['overhead']:+9.2f}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
