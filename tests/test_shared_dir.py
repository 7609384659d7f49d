"""With several nodes the launchers check that they share --checkpoint-dir (jitckpt.launcher.shared_dir)."""
from __future__ import annotations

import pytest

from jitckpt.launcher.shared_dir import check_shared, leave_marker


def test_a_shared_directory_shows_every_nodes_marker(tmp_path) -> None:
    for node in (0, 1):
        leave_marker(str(tmp_path), node, f"job g3 host{node}:1234")
    check_shared(str(tmp_path), {0: "job g3 host0:1234", 1: "job g3 host1:1234"}, this_node=1, wait_s=0)


def test_node_local_directories_are_refused_naming_the_fix(tmp_path) -> None:
    mine, theirs = tmp_path / "node0", tmp_path / "node1"
    leave_marker(str(mine), 0, "job g0 a:1")
    leave_marker(str(theirs), 1, "job g0 b:2")
    with pytest.raises(RuntimeError, match=r"not shared between the job's nodes: node 0 does not see what "
                                           r"node\(s\) \[1\] wrote there.*mounts at the same path"):
        check_shared(str(mine), {0: "job g0 a:1", 1: "job g0 b:2"}, this_node=0, wait_s=0.3)


def test_a_marker_left_by_an_earlier_generation_does_not_pass(tmp_path) -> None:
    """A node-local directory that once held a marker of the other node (an earlier run, a copied
    directory) must not pass for shared: each generation's token is new."""
    leave_marker(str(tmp_path), 0, "job g1 a:1")
    leave_marker(str(tmp_path), 1, "job g0 b:2")  # stale
    with pytest.raises(RuntimeError, match=r"node\(s\) \[1\]"):
        check_shared(str(tmp_path), {0: "job g1 a:1", 1: "job g1 b:7"}, this_node=0, wait_s=0)
