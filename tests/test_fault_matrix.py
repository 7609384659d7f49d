"""Issue 13: the fault-injection matrix, run from outside the training script.

Each case starts `jitckpt run` on tests/scripts/train_matrix.py, signals a worker (or the launcher) at
a random point of a random step from the harness (tests/fault_harness.py), and checks: the
launcher's exit code; at most one minibatch redone (a full disk: none since the newest checkpoint
that could be written); final parameters and buffers bitwise equal to a failure-free run; no
process left behind; no complete checkpoint lost. A failing case prints its seed: rerun it with
``FAULT_SEED=<seed> pytest tests/test_fault_matrix.py -k '<case>'``.

A few representative cases run in ``make test``; the matrix (every fault on four configurations
covering each pair of model x API x ranks, plus a dropout model) is ``@pytest.mark.slow``.
"""
from __future__ import annotations

import pytest

from fault_harness import FAULTS, Config, check_case

# Each pair of (model, API, ranks) values appears in one of these (an orthogonal array).
MATRIX_CONFIGS = [Config("ln", "protect", 2), Config("bn", "protect", 3), Config("ln", "init", 3),
                  Config("bn", "init", 2)]
DROPOUT = Config("dropout", "protect", 2)
DROPOUT_FAULTS = ["sigkill", "sigstop", "exception", "launcher_sigterm"]

# The main families of faults, on the config with the most state to get right (BatchNorm buffers
# broadcast by DDP): a death and a hang (GIL held at a random point). A preemption and its resume is
# in tests/test_preemption.py's fast tests, and on BatchNorm in the slow matrix.
FAST_CONFIG = Config("bn", "protect", 2)
FAST = [("sigkill", FAST_CONFIG)]  # the GIL case is slow (make test's 15-minute budget)

SLOW = [(f, c) for c in MATRIX_CONFIGS for f in FAULTS if (f, c) not in FAST and f != "reduce_scatter"]  # DDP has none
SLOW += [(f, DROPOUT) for f in DROPOUT_FAULTS]
# FSDP2 on a 2x2 HSDP mesh (issue 44): a lost rank's shards come back from its replica group. (A
# death of each layout is in test_sharded_layouts' fast tests.)
HSDP = Config("ln", "protect", 4, parallel="hsdp")
HSDP_FAULTS = ["sigkill", "sigstop", "exception", "optim", "gil", "step1", "recovery", "sigterm",
               "launcher_sigterm"]
SLOW += [(f, HSDP) for f in HSDP_FAULTS]
# Pipeline stages as plain modules, DDP over each stage's data-parallel group: the stages are told
# apart by their DDP groups, and a lost rank's stage comes back from its DDP replica.
PP_DDP = Config("ln", "protect", 4, parallel="pp_ddp")
SLOW += [(f, PP_DDP) for f in HSDP_FAULTS]
# Layouts without replicas (full sharding, TP, FSDP2+TP, pipeline stages x FSDP2): each rank's shard in its node's keeper
# (--snapshot-every 1). A death of FSDP2 and of PP from the keepers is in test_sharded_layouts' fast tests.
NO_REPLICA = [Config("ln", "protect", 2, parallel="fsdp", snapshot_every=1),
              Config("ln", "protect", 4, parallel="fsdp", snapshot_every=1),
              Config("ln", "protect", 2, parallel="tp", snapshot_every=1),
              Config("ln", "protect", 4, parallel="fsdp_tp", snapshot_every=1),
              Config("ln", "protect", 4, parallel="pp", snapshot_every=1)]
SLOW += [(f, c) for c in NO_REPLICA for f in HSDP_FAULTS]
# A death inside backward, with the later layers' reduce-scatters issued (not for PP: the script's
# middle of the model is in stage 0 only).
SLOW += [("backward", c) for c in [HSDP, *NO_REPLICA] if c.parallel != "pp"]
# A death right after issuing a gradient reduce-scatter (FSDP2's, asynchronous): the peers are inside
# it. Pipeline stages x FSDP2 too: each stage's backward reduce-scatters.
SLOW += [("reduce_scatter", c) for c in [HSDP, *NO_REPLICA] if c.parallel in ("hsdp", "fsdp", "fsdp_tp", "pp")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault,cfg", FAST, ids=[f"{f}-{c.id}" for f, c in FAST])
def test_fault(fault_references, tmp_path, fault, cfg):
    check_case(fault_references, tmp_path, fault, cfg)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault,cfg", SLOW, ids=[f"{f}-{c.id}" for f, c in SLOW])
def test_fault_matrix(fault_references, tmp_path, fault, cfg):
    check_case(fault_references, tmp_path, fault, cfg)
