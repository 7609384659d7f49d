"""What the framework integration tests (issue 45) share: a fault case, a death at an exact point,
a preempted job's JIT checkpoint, and a resumed run's final state against the reference."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from fault_harness import FAULTS, Fault, Job, Outcome, Reference, _check, _inject, case_seed, record, run_case
from framework_jobs import FrameworkConfig


def preempted_checkpoint(workdir: Path, cfg: FrameworkConfig) -> tuple[dict, Path, list]:
    """Run ``cfg``'s script under ``jitckpt run``, SIGTERM the launcher at a random step (a
    preemption: every rank saves a JIT checkpoint and the job stops) and return the metadata of a
    non-zero rank's checkpoint, the framework's entry inside it, and the harness's notes."""
    fault = FAULTS["launcher_sigterm"]
    out = Outcome(f"resume-outside-{cfg.id}", case_seed(f"resume-outside-{cfg.id}"))
    rnd = random.Random(out.seed)
    target = rnd.randint(3, cfg.steps - 4)
    # Slow steps (the numbers are the same), so that the signal lands before training ends.
    job = Job(workdir, cfg, ckpt=workdir / "ckpt", name="run1", script_args=("--step-sleep", "0.3"))
    try:
        _inject(job, fault, 0, target, rnd.random(), rnd, out)
    finally:
        problems = job.finish()
    assert not problems and job.rc == fault.expect_rc, (problems, out.notes, job.output())
    saved = sorted((workdir / "ckpt").glob("jit-*"))
    metas = [json.loads((d / "jitckpt-meta.json").read_text()) for d in saved]
    assert saved and len({m["step"] for m in metas}) == 1, (saved, job.output())
    meta = metas[-1]
    assert meta["rank"] != 0 and target <= meta["step"] <= target + 1 < cfg.steps, (meta, out.notes)
    assert meta["entry"], meta
    return meta, saved[-1] / meta["entry"], out.notes


def death_at(workdir: Path, reference: Reference, die: str, *, target: int) -> Outcome:
    """Run the reference's script under ``jitckpt run`` with ``--die RANK:STEP:forward|end`` (the
    rank SIGKILLs itself at that exact point) and check the recovery as the fault harness does."""
    fault = Fault(f"die-{die}", sig=None)
    out = Outcome(fault.name, 0)
    job = Job(workdir, reference.cfg, ckpt=workdir / "ckpt", name="run1", script_args=("--die", die))
    out.jobs.append(job)
    out.problems += job.finish()
    _check(out, reference, fault, [job], workdir / "ckpt", target)
    record(out)
    return out


def fault_case(workdir: Path, reference: Reference, fault: Fault) -> None:
    """The fault harness's case of ``fault`` on the reference's script; fails naming its problems."""
    out = run_case(workdir, reference, fault)
    record(out)
    assert not out.problems, out.report()


def assert_same_final(final_path: Path, reference: Reference, what: str) -> None:
    """Rank 0's final state at ``final_path`` is bitwise the failure-free run's."""
    final = torch.load(final_path, weights_only=True)
    assert final.keys() == reference.final.keys(), sorted(final.keys() ^ reference.final.keys())
    diff = [k for k in final if not torch.equal(final[k], reference.final[k])]
    assert not diff, f"{what}: {diff} differ from the failure-free run"
