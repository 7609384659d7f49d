"""`make demo`: a 2-rank DDP job, one rank SIGKILLed mid-training, recovered by jitckpt.

Runs examples/train_ddp.py twice under `jitckpt run` -- once with an injected failure, once
without -- and checks that the final parameters are bitwise identical.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_ddp.py"


def _run(workdir: Path, extra: list) -> int:
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2",
           "--checkpoint-dir", str(workdir / "ckpt"), "--run-dir", str(workdir / "run"),
           "--status-interval", "2", str(SCRIPT), "--steps", "16",
           "--out", str(workdir / "final.pt"), "--steps-log", str(workdir / "train.jsonl"), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=workdir, env=env, timeout=600).returncode


def main() -> int:
    import torch

    if not SCRIPT.exists():
        print(f"demo script {SCRIPT} not found: run `make demo` from a jitckpt checkout", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="jitckpt-demo-"))
    print(f"== jitckpt demo (files in {base}) ==")
    print("-- 1. training with 2 ranks; rank 1 is SIGKILLed at minibatch 8 --", flush=True)
    failed, ref = base / "with-failure", base / "reference"
    failed.mkdir()
    ref.mkdir()
    if _run(failed, ["--inject", "0:1:8:kill"]) != 0:
        print("demo job failed", file=sys.stderr)
        return 1
    print("-- 2. the same job without a failure, for comparison --", flush=True)
    if _run(ref, []) != 0:
        print("reference job failed", file=sys.stderr)
        return 1
    a = torch.load(failed / "final.pt", weights_only=True)
    b = torch.load(ref / "final.pt", weights_only=True)
    same = all(torch.equal(a[k], b[k]) for k in b)
    steps = [json.loads(x) for x in (failed / "train.jsonl").read_text().splitlines()]
    ran = sorted(r["step"] for r in steps if r.get("rank") == 0 and "step" in r)
    redone = len(ran) - len(set(ran))
    print(f"-- result: final parameters bitwise identical to the failure-free run: {same}; "
          f"completed minibatches run twice: {redone}")
    cli = Path(sys.executable).parent / "jitckpt"  # the venv's, where `make` installed the package
    print(f"   event log: {failed / 'run' / 'events.jsonl'}  (try: {cli if cli.exists() else 'jitckpt'} report "
          f"{failed / 'run'})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
