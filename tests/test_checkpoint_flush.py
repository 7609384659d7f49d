"""The launcher's background fsync of JIT checkpoints (one node), and the pruning queued behind it."""
from __future__ import annotations

import threading

from jitckpt.checkpoint_store import find_latest, prune, write_checkpoint
from jitckpt.launcher.checkpoint_flush import CheckpointFlusher


def _save(step: int):
    def save(path: str) -> None:
        with open(f"{path}/state.bin", "wb") as f:
            f.write(bytes([step]) * 4096)
    return save


def _write(root, step: int, *, fsync: bool):
    path, _ = write_checkpoint(root, _save(step), kind="jit", step=step, rank=0, world_size=1, gen=0,
                               fsync=fsync)
    return path


def test_prune_waits_for_the_flush_queued_before_it(tmp_path):
    events = []
    old = _write(tmp_path, 3, fsync=True)
    new = _write(tmp_path, 4, fsync=False)  # as a survivor leaves it: in the page cache
    flusher = CheckpointFlusher(emit=lambda ev, **f: events.append((ev, f)))
    gate = threading.Event()
    flusher.then(gate.wait, what="holding the queue")  # the flush below cannot start yet
    flusher.flush(str(new))
    flusher.then(lambda: (events.append(("pruned", {})), prune(tmp_path, older_than_step=4)),
                 what="pruning")
    assert old.exists()  # nothing ran: the queue is held
    gate.set()
    flusher.close()
    assert [e for e, _ in events] == ["checkpoint_durable", "pruned"]
    assert events[0][1]["path"] == str(new) and events[0][1]["seconds"] >= 0
    assert not old.exists()
    assert find_latest(tmp_path)[1].step == 4  # the new checkpoint verifies


def test_a_failed_flush_keeps_the_older_checkpoints(tmp_path):
    events = []
    old = _write(tmp_path, 3, fsync=True)
    flusher = CheckpointFlusher(emit=lambda ev, **f: events.append((ev, f)))
    flusher.flush(str(tmp_path / "jit-g0000-r00000-s4-gone"))  # removed before its fsync: an error
    flusher.then(lambda: prune(tmp_path, older_than_step=4), what="pruning")
    flusher.close()
    assert flusher.failed
    assert events and events[0][0] == "checkpoint_flush_failed" and "gone" in events[0][1]["path"]
    assert old.exists() and find_latest(tmp_path)[1].step == 3
