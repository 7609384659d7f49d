"""The JIT save reserve (jitckpt.runtime.save_reserve): written once, taken once, adopted from a
dead writer, never at the expense of room for a checkpoint, deleted at a job's end."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections import namedtuple

from jitckpt.checkpoint_store import prune_finished
from jitckpt.runtime.save_reserve import SaveReserve

MB = 1 << 20


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


def test_written_once_and_taken_once(tmp_path):
    r = SaveReserve(tmp_path)
    r.prepare(3 * MB + 5)
    r.prepare(50 * MB)  # only the first call writes
    assert r.wait_ready(30)
    assert r.path.stat().st_size == 3 * MB + 5
    assert r.path.name.startswith(".reserve-")
    assert r.take() == r.path
    assert r.take() is None  # the save renamed it away; there is one per process


def test_a_dead_writers_reserve_is_adopted_not_rewritten(tmp_path):
    host = socket.gethostname().replace("-", "_")
    orphan = tmp_path / f".reserve-{host}-{_dead_pid()}"
    orphan.write_bytes(b"x" * (2 * MB))
    alive = tmp_path / f".reserve-{host}-{os.getpid()}"  # a live writer's is never taken
    r = SaveReserve(tmp_path)
    assert r.path == alive
    r.prepare(2 * MB)
    assert r.wait_ready(30)
    assert not orphan.exists()
    assert r.path.read_bytes()[:1] == b"x"  # the orphan's pages, renamed


def test_no_reserve_when_it_would_take_the_room_of_a_checkpoint(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(100 * MB, 95 * MB, 5 * MB))
    r = SaveReserve(tmp_path)
    r.prepare(2 * MB)  # 3x the state must be free
    assert not r.wait_ready(1)
    assert r.take() is None
    assert not list(tmp_path.glob(".reserve-*"))


def test_a_finished_job_leaves_no_reserve(tmp_path):
    r = SaveReserve(tmp_path)
    r.prepare(MB)
    assert r.wait_ready(30)
    prune_finished(tmp_path)
    assert not list(tmp_path.glob(".reserve-*"))
