"""Pipeline stages as plain modules, each in DDP over its own data-parallel group: protect() tells
the stages apart by their DDP groups (ddp_groups.ddp_shards), so a stage never resumes from
another stage's checkpoint; without DDP, by their parameters. End to end: test_fault_matrix's
pp_ddp cases (slow)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jobs import run_bounded

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "scripts" / "ddp_groups_probe.py"


def shards(tmp_path: Path, layout: str) -> dict:
    rc, out = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(PROBE), "--layout", layout, "--out", str(tmp_path)], cwd=tmp_path, timeout=120)
    assert rc == 0, out[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    return {r["rank"]: r for r in rows}


@pytest.mark.parametrize("layout,want", [pytest.param("stages", [[0, 2], [0, 2], [1, 2], [1, 2]], marks=pytest.mark.slow),  # make test's 15-minute budget
                                         pytest.param("strided", [[0, 2], [1, 2], [0, 2], [1, 2]],
                                                      marks=pytest.mark.slow),
                                         pytest.param("world", [None] * 4, marks=pytest.mark.slow)])
def test_ddp_groups_are_shards_of_their_own(tmp_path, layout, want):
    got = shards(tmp_path, layout)
    assert [got[r].get("shards") for r in range(4)] == want, got


@pytest.mark.slow
def test_ranks_outside_every_ddp_group_are_refused_on_every_rank_with_the_fix(tmp_path):
    got = shards(tmp_path, "mixed")
    assert all("do not split the job into disjoint groups" in got[r].get("error", "") for r in range(4)), got
    assert "pass shard_id/num_shards" in got[0]["error"]


@pytest.mark.parametrize("layout,want", [("plain-stages", [[0, 2], [0, 2], [1, 2], [1, 2]]),
                                         pytest.param("plain-pp", [[0, 4], [1, 4], [2, 4], [3, 4]],
                                                      marks=pytest.mark.slow),
                                         pytest.param("plain-replicas", [None] * 4, marks=pytest.mark.slow)])
def test_without_ddp_ranks_whose_parameters_differ_are_shards_of_their_own(tmp_path, layout, want):
    # Stage modules without DDP (or DTensor) were taken for replicas of each other: after a
    # failure a stage resumed from another stage's checkpoint (a crash, or with equal shapes a
    # silent mix). plain-stages: the same shapes, other parameters.
    got = shards(tmp_path, layout)
    assert [got[r].get("shards") for r in range(4)] == want, got
