"""The rank-state board (issue 45): a lost rank's RNG at its last minibatch start stays readable
by the survivors on its node; what is missing or torn reads as missing, never as another rank's."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from jitckpt.integrations.versions import require
from jitckpt.runtime.rank_state import RankStateBoard
from jobs import ROOT

CHILD = """
import os, sys, torch
from jitckpt.runtime.rank_state import RankStateBoard
board = RankStateBoard(directory=sys.argv[2], rank=1)
for step in range(int(sys.argv[1])):
    board.publish(step, {"torch": torch.full((4,), step, dtype=torch.uint8)})
os.kill(os.getpid(), 9)
"""


def test_a_killed_ranks_last_state_is_read_by_another(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-c", CHILD, "7", str(tmp_path)], env=env, timeout=120)
    assert p.returncode == -9
    seen = RankStateBoard(directory=str(tmp_path), rank=0).read(1)
    assert seen is not None and seen.rank == 1 and seen.step == 6
    assert torch.equal(seen.state["torch"], torch.full((4,), 6, dtype=torch.uint8))


def test_missing_torn_or_misfiled_states_read_as_missing(tmp_path):
    board = RankStateBoard(directory=str(tmp_path), rank=0)
    assert board.read(1) is None
    (tmp_path / "rank1.pt").write_bytes(b"torn")
    assert board.read(1) is None
    board.publish(3, {"x": 1})
    (tmp_path / "rank0.pt").rename(tmp_path / "rank1.pt")  # rank 0's file under rank 1's name
    assert board.read(1) is None


def test_no_board_outside_jitckpt_run(tmp_path):
    assert RankStateBoard.of_job(0) is None
    with pytest.raises(ValueError, match="not a directory"):
        RankStateBoard(directory=str(tmp_path / "nope"), rank=0)


def test_an_unsupported_framework_version_is_refused_naming_version_and_fix():
    this = re.escape(".".join(torch.__version__.split(".")[:2]))
    with pytest.raises(ImportError, match=rf"supports torch >=1.0,<2; this is torch {this}.*pip install 'jitckpt\[x\]'"):
        require("torch", extra="x", at_least="1.0", below="2")
    with pytest.raises(ImportError, match=r"needs no-such-dist.*not installed: pip install 'jitckpt\[y\]'"):
        require("no-such-dist", extra="y", at_least="1.0", below="2")
    assert torch.__version__.startswith(require("torch", extra="x", at_least="2.0", below="3"))
