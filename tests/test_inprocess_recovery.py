"""Issue 48: ``jitckpt run --recovery inprocess``, tried from outside.

Each case runs tests/scripts/train_matrix.py under the launcher with a fault sent to a worker at a
random moment (tests/fault_harness.py) and checks what every recovery must (launcher rc, at most one
minibatch redone, final state bitwise equal to a failure-free run, nothing left running, no good
checkpoint lost) and, in-process, that every surviving rank kept its process: the same pid after the
recovery, started as a ``survivor``, and the recovery summary names the ranks kept.
"""
from __future__ import annotations

import pytest

from fault_harness import Config, check_case

BN3 = Config("bn", "protect", 3, recovery="inprocess")   # BatchNorm buffers broadcast by DDP, 3 ranks
LN2 = Config("ln", "protect", 2, recovery="inprocess")
INIT2 = Config("ln", "init", 2, recovery="inprocess")     # jitckpt.init(save_fn): the script loads itself
# Full sharding, no replica of a shard: the lost rank's shard comes back from the node's keeper.
FSDP2 = Config("ln", "protect", 2, parallel="fsdp", snapshot_every=1, recovery="inprocess")
FAST = [("sigkill", BN3), ("sigkill", FSDP2)]
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
# The in-memory tier (--snapshot-every 1): the layouts without replicas, and DDP, whose standby then
# restores from the keeper rather than from a survivor's checkpoint.
NO_REPLICA = [FSDP2, Config("ln", "protect", 2, parallel="tp", snapshot_every=1, recovery="inprocess"),
              Config("ln", "protect", 4, parallel="fsdp_tp", snapshot_every=1, recovery="inprocess")]
SLOW += [(f, c) for c in NO_REPLICA for f in ("sigkill", "sigstop", "exception", "optim") if (f, c) not in FAST]
SLOW += [(f, Config("bn", "protect", 3, snapshot_every=1, recovery="inprocess")) for f in ("sigkill", "sigstop")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault,cfg", FAST, ids=[f"{f}-{c.id}" for f, c in FAST])
def test_survivors_keep_their_processes(fault_references, tmp_path, fault, cfg):
    check_case(fault_references, tmp_path, fault, cfg)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault,cfg", SLOW, ids=[f"{f}-{c.id}" for f, c in SLOW])
def test_inprocess_matrix(fault_references, tmp_path, fault, cfg):
    check_case(fault_references, tmp_path, fault, cfg)
