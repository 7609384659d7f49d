"""After a failure, which parts of its shard a DTensor job's survivor writes (runtime/shard_parts.py):
each part once while a replica of it survives, none waited for past a lost rank or a deadline."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from jitckpt.checkpoint_store import write_checkpoint
from jitckpt.runtime import shard_parts
from jitckpt.runtime.shard_parts import PartFill, node_of_rank, part_committed

GEN, STEP = 0, 7


def commit(root: Path, rank: int, shard_id: int, grid: int, part: bool = False) -> tuple:
    def save(d: str) -> None:
        (Path(d) / "state.bin").write_bytes(b"x" * 64)

    return write_checkpoint(root, save, kind="jit", step=STEP, rank=rank, world_size=4, gen=GEN,
                            shard_id=shard_id, num_shards=grid, part=shard_id if part else None)


def fill_of(root: Path, replica: int, ranks: tuple, *, lost=(), local=True) -> tuple:
    """A PartFill for ``replica`` of shard 0 (parts 0..R-1 of a grid of 2R), and its writer:
    it commits each part it is asked for and records the replica ids asked."""
    asked: list = []
    fill = PartFill(root=str(root), gen=GEN, step=STEP, replica=replica, replica_ranks=ranks,
                    on_this_node=lambda r: local, lost=lambda: set(lost))
    grid = 2 * len(ranks)

    def write_part(r):
        asked.append(r)
        me = ranks[replica]
        return commit(root, me, replica if r is None else r, grid, part=r is not None)

    return fill, write_part, asked


def test_a_lost_replicas_partner_writes_its_part_too_at_once(tmp_path):
    fill, write, asked = fill_of(tmp_path, 0, (1, 3), lost={3})
    t0 = time.monotonic()
    written = fill.write(write)
    assert asked == [None, 1] and len(written) == 2
    assert time.monotonic() - t0 < shard_parts.WAIT_MIN_S  # no wait for a rank known lost
    assert [p.name for p, _ in written] == ["jit-g0000-r00001-s7", "jit-g0000-r00001-s7-p1"]
    assert part_committed(tmp_path, kind="jit", gen=GEN, step=STEP, shard_id=1, num_shards=4)


def test_a_live_replica_on_this_node_that_committed_its_part_is_not_written_again(tmp_path):
    commit(tmp_path, 3, 1, 4)  # replica 1 (rank 3) has committed its own part
    fill, write, asked = fill_of(tmp_path, 0, (1, 3))
    assert [m.shard_id for _, m in fill.write(write)] == [0]
    assert asked == [None]


def test_a_replica_on_this_node_that_never_commits_is_written_for_at_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_parts, "WAIT_MIN_S", 0.3)
    fill, write, asked = fill_of(tmp_path, 0, (1, 3))  # rank 3 alive, as far as anyone knows: a hang
    t0 = time.monotonic()
    fill.write(write)
    assert asked == [None, 1]
    assert time.monotonic() - t0 >= 0.3  # it waited for rank 3 first


def test_a_replica_reported_lost_while_waited_for_ends_the_wait(tmp_path):
    lost: set = set()
    calls = []

    def lost_now() -> set:
        calls.append(1)
        if len(calls) == 3:  # RankLost arrives while the survivor waits
            lost.add(3)
        return set(lost)

    fill = PartFill(root=str(tmp_path), gen=GEN, step=STEP, replica=0, replica_ranks=(1, 3),
                    on_this_node=lambda r: True, lost=lost_now)
    asked = []

    def write(r):
        asked.append(r)
        return commit(tmp_path, 1, 0 if r is None else r, 4, part=r is not None)

    t0 = time.monotonic()
    fill.write(write)
    assert asked == [None, 1] and time.monotonic() - t0 < shard_parts.WAIT_MIN_S


def test_a_replica_on_another_node_is_written_for_as_before(tmp_path):
    # Its files may land in another node's directory: not waited for (what every survivor did before).
    fill, write, asked = fill_of(tmp_path, 0, (1, 3), local=False)
    t0 = time.monotonic()
    fill.write(write)
    assert asked == [None, 1] and time.monotonic() - t0 < shard_parts.WAIT_MIN_S


def test_three_replicas_one_lost_its_part_is_written_once_by_the_next(tmp_path):
    ranks = (0, 4, 8)  # replica 2 (rank 8) is lost: replica 0, next after it, writes its part
    fill0, write0, asked0 = fill_of(tmp_path, 0, ranks, lost={8})
    commit(tmp_path, 4, 1, 6)  # replica 1 (rank 4) commits its own part meanwhile
    fill0.write(write0)
    assert asked0 == [None, 2]
    fill1, write1, asked1 = fill_of(tmp_path, 1, ranks, lost={8})
    t0 = time.monotonic()
    fill1.write(write1)
    assert asked1 == [None] and time.monotonic() - t0 < shard_parts.WAIT_MIN_S  # the rest is on disk
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "jit-g0000-r00000-s7", "jit-g0000-r00000-s7-p2", "jit-g0000-r00004-s7"]


def test_ranks_are_on_this_node_by_torchruns_variables(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    here = node_of_rank()
    assert [here(r) for r in range(5)] == [False, False, True, True, False]
    monkeypatch.setenv("GROUP_RANK", "0")  # not the layout of ranks node by node: nothing is local
    assert not any(node_of_rank()(r) for r in range(5))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not node_of_rank()(3)


@pytest.mark.parametrize("step", [STEP + 1, STEP - 1])
def test_a_part_of_another_step_is_not_taken_for_committed(tmp_path, step):
    commit(tmp_path, 3, 1, 4)
    assert not part_committed(tmp_path, kind="jit", gen=GEN, step=step, shard_id=1, num_shards=4)
    assert not part_committed(tmp_path, kind="jit", gen=GEN + 1, step=STEP, shard_id=1, num_shards=4)
    assert not part_committed(tmp_path, kind="jit", gen=GEN, step=STEP, shard_id=1, num_shards=2)


def test_a_shards_parts_are_of_about_equal_bytes_and_the_same_on_every_replica():
    from jitckpt.runtime.sharded_state import balanced_parts

    # In name order every other tensor is a large one: a split by position would be 200 bytes to 2.
    sizes = {("model", "a.weight"): 100, ("model", "a.bias"): 1, ("optim", "a.weight", "exp_avg"): 100,
             ("optim", "a.bias", "exp_avg"): 1}
    parts = balanced_parts(sizes, 2)
    assert sorted(k for p in parts for k in p) == sorted(sizes)  # every tensor in one part
    assert [sum(sizes[k] for k in p) for p in parts] == [101, 101]
    assert balanced_parts(dict(reversed(list(sizes.items()))), 2) == parts  # whatever order they come in
    assert [len(p) for p in balanced_parts(sizes, 3)] == [1, 1, 2]
