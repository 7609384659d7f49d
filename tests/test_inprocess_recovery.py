"""Issue 48: ``jitckpt run --recovery inprocess``, tried from outside.

Each case runs tests/scripts/train_matrix.py under the launcher with a fault sent to a worker at a
random moment (tests/fault_harness.py) and checks what every recovery must (launcher rc, at most one
minibatch redone, final state bitwise equal to a failure-free run, nothing left running, no good
checkpoint lost) and, in-process, that every surviving rank kept its process: the same pid after the
recovery, started as a ``survivor``, and the recovery summary names the ranks kept.
"""
from __future__ import annotations

import pytest

from fault_harness import FAULTS, Config, record, run_case, run_reference

BN3 = Config("bn", "protect", 3, recovery="inprocess")   # BatchNorm buffers broadcast by DDP, 3 ranks
LN2 = Config("ln", "protect", 2, recovery="inprocess")
INIT2 = Config("ln", "init", 2, recovery="inprocess")     # jitckpt.init(save_fn): the script loads itself
FAST = [("sigkill", BN3)]
SLOW_FAULTS = ["sigkill", "sigstop", "exception", "gil", "optim", "backward", "step1", "recovery", "sigterm",
               "launcher_sigterm", "after_barrier_kill"]
COMPILED = Config("bn", "protect", 2, recovery="inprocess", compiled=True)  # torch.compile'd forward
SLOW = [(f, c) for c in (BN3, LN2, INIT2) for f in SLOW_FAULTS if (f, c) not in FAST]
SLOW += [(f, COMPILED) for f in ("sigkill", "sigstop", "exception")]
# FSDP2 on a 2x2 HSDP mesh: the survivors' DeviceMesh groups are re-formed too; a lost rank's shard
# comes back from its replica (the survivors are told to unwind only once every one saved). Faults
# that leave every survivor in the same minibatch: a death mid-backward can let one replica group
# finish the step while the other cannot (docs/recovery.md: the same for --recovery jit).
HSDP = Config("ln", "protect", 4, parallel="hsdp", recovery="inprocess")
SLOW += [(f, HSDP) for f in ("exception", "optim", "step1")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict = {}

    def get(cfg: Config):
        if cfg not in cache:
            cache[cfg] = run_reference(tmp_path_factory.mktemp(f"ref-{cfg.id}"), cfg)
        return cache[cfg]

    return get


def check(reference, tmp_path, fault: str, cfg: Config) -> None:
    outcome = run_case(tmp_path, reference(cfg), FAULTS[fault])
    record(outcome)
    assert not outcome.problems, outcome.report()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault,cfg", FAST, ids=[f"{f}-{c.id}" for f, c in FAST])
def test_survivors_keep_their_processes(reference, tmp_path, fault, cfg):
    check(reference, tmp_path, fault, cfg)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault,cfg", SLOW, ids=[f"{f}-{c.id}" for f, c in SLOW])
def test_inprocess_matrix(reference, tmp_path, fault, cfg):
    check(reference, tmp_path, fault, cfg)
