"""Checkpoint layout: atomic commit, verification, discovery across replicas and shards."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jitckpt.checkpoint_store import (META_FILE, CheckpointError, find_complete_set, find_latest, list_candidates,
                                      prune, read_meta, resume_path, verify_checkpoint,
                                      write_checkpoint)


def saver(payload: bytes):
    def save(path: str) -> None:
        Path(path, "state.bin").write_bytes(payload)
        Path(path, "sub").mkdir()
        Path(path, "sub", "extra.bin").write_bytes(payload[::-1])
    return save


def write(root, step, rank=0, kind="jit", gen=0, shard_id=0, num_shards=1, payload=b"x" * 1000):
    return write_checkpoint(root, saver(payload), kind=kind, step=step, rank=rank, world_size=4,
                            gen=gen, shard_id=shard_id, num_shards=num_shards)


def test_commit_writes_data_then_metadata(tmp_path):
    path, meta = write(tmp_path, 7)
    assert path.name == "jit-g0000-r00000-s7"
    assert set(meta.files) == {"state.bin", "sub/extra.bin"}
    assert meta.total_bytes == 2000
    assert verify_checkpoint(path).step == 7
    assert not list(tmp_path.glob(".tmp-*"))


def test_failing_save_leaves_nothing_and_keeps_older(tmp_path):
    write(tmp_path, 3)

    def broken(path: str) -> None:
        Path(path, "half.bin").write_bytes(b"abc")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path, broken, kind="jit", step=4, rank=0, world_size=1, gen=0)
    assert [c.step for c in list_candidates(tmp_path)] == [3]
    assert not list(tmp_path.glob(".tmp-*"))
    assert find_latest(tmp_path)[1].step == 3


def test_empty_save_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="wrote no files"):
        write_checkpoint(tmp_path, lambda p: None, kind="jit", step=1, rank=0, world_size=1, gen=0)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_file", "delete_meta", "bad_json"])
def test_damaged_newest_is_skipped_with_reason(tmp_path, damage):
    write(tmp_path, 5)
    newest, _ = write(tmp_path, 6)
    f = newest / "state.bin"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:10])
    elif damage == "flip":
        data = bytearray(f.read_bytes()); data[0] ^= 1; f.write_bytes(bytes(data))
    elif damage == "delete_file":
        f.unlink()
    elif damage == "delete_meta":
        (newest / META_FILE).unlink()
    else:
        (newest / META_FILE).write_text("{not json")
    skipped = []
    path, meta = find_latest(tmp_path, skipped=skipped)
    assert meta.step == 5
    assert skipped and skipped[0][0] == newest
    reason = skipped[0][1]
    assert {"truncate": "truncated", "flip": "CRC32C", "delete_file": "missing",
            "delete_meta": "incomplete", "bad_json": "unreadable"}[damage] in reason


def test_any_replica_of_newest_step_is_used(tmp_path):
    bad, _ = write(tmp_path, 9, rank=1)
    good, _ = write(tmp_path, 9, rank=2)
    (bad / "state.bin").write_bytes(b"garbage")
    path, meta = find_latest(tmp_path)
    assert path == good and meta.step == 9


def test_step_counts_only_when_every_shard_has_a_replica(tmp_path):
    # Step 10 has shard 0 only; step 8 has both shards: step 8 wins.
    write(tmp_path, 10, rank=0, shard_id=0, num_shards=2)
    write(tmp_path, 8, rank=0, shard_id=0, num_shards=2)
    s1, _ = write(tmp_path, 8, rank=3, shard_id=1, num_shards=2)
    assert find_latest(tmp_path, shard_id=1, num_shards=2)[0] == s1
    assert find_latest(tmp_path, shard_id=0, num_shards=2)[1].step == 8


def test_shard_count_mismatch_is_reported(tmp_path):
    write(tmp_path, 2, num_shards=1)
    skipped = []
    assert find_latest(tmp_path, num_shards=2, skipped=skipped) is None
    assert "shards" in skipped[0][1]


def test_a_step_with_sets_of_two_shard_counts_uses_the_complete_one(tmp_path):
    """A DTensor job: a periodic set split in 4 parts (every rank alive), then a JIT set of 2 whole
    shards of the same step missing one (a lost rank with no replica). The complete one is used."""
    parts = {i: write(tmp_path, 4, kind="periodic", rank=i, shard_id=i, num_shards=4)[0] for i in range(4)}
    write(tmp_path, 4, kind="jit", gen=1, rank=0, shard_id=0, num_shards=2)
    found = find_complete_set(tmp_path)
    assert found is not None and {k: v[0] for k, v in found.items()} == parts


def test_jit_preferred_over_periodic_at_same_step(tmp_path):
    write(tmp_path, 4, kind="periodic")
    jit, _ = write(tmp_path, 4, kind="jit", rank=1)
    assert find_latest(tmp_path)[0] == jit


def test_future_format_version_is_refused(tmp_path):
    path, _ = write(tmp_path, 1)
    meta = json.loads((path / META_FILE).read_text())
    meta["format_version"] = 99
    (path / META_FILE).write_text(json.dumps(meta))
    skipped = []
    assert find_latest(tmp_path, skipped=skipped) is None
    assert "format 99" in skipped[0][1]


def test_prune_keeps_newer_and_removes_dead_writers_tmp(tmp_path):
    for s in (1, 2, 3):
        write(tmp_path, s)
    dead = tmp_path / ".tmp-jit-g0000-r00000-s4-999999999-12345"
    dead.mkdir()
    live = tmp_path / f".tmp-jit-g0000-r00001-s4-{os.getpid()}-12345"
    live.mkdir()
    removed = prune(tmp_path, older_than_step=3)
    assert [c.step for c in list_candidates(tmp_path)] == [3]
    assert dead in removed and live.exists()


def test_the_entry_a_save_function_names_is_what_a_resume_gets(tmp_path):
    def save(path: str) -> str:
        saver(b"y" * 10)(path)
        return "sub"  # a framework's directory inside the checkpoint (a Trainer's checkpoint-<step>/)

    path, meta = write_checkpoint(tmp_path, save, kind="jit", step=3, rank=0, world_size=2, gen=0)
    assert meta.entry == "sub" and read_meta(path).entry == "sub"
    assert resume_path(path) == str(path / "sub")
    plain, _ = write(tmp_path, 4)
    assert resume_path(plain) == str(plain)  # no entry named: the directory itself


def test_a_save_function_returning_something_else_than_a_name_writes_a_plain_checkpoint(tmp_path):
    # e.g. lambda p: Path(p, "state.bin").write_bytes(data), which returns the count written
    path, meta = write_checkpoint(tmp_path, lambda p: (Path(p) / "state.bin").write_bytes(b"abc"), kind="jit", step=2,
                                  rank=0, world_size=1, gen=0)
    assert meta.entry == "" and resume_path(path) == str(path) and (path / "state.bin").read_bytes() == b"abc"


@pytest.mark.parametrize("returned", ["/etc", "../x", "missing", ""])
def test_a_bad_entry_is_refused_and_leaves_no_checkpoint(tmp_path, returned):
    def save(path: str):
        saver(b"z")(path)
        return returned

    with pytest.raises(CheckpointError, match="save function returned"):
        write_checkpoint(tmp_path, save, kind="jit", step=5, rank=0, world_size=2, gen=0)
    assert find_latest(tmp_path) is None and not list(tmp_path.iterdir())
