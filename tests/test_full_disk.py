"""Issue 13 item 4: a full disk costs at most the failed save. Checkpoint writes that run out of
space say so and leave nothing behind, the event log survives its own write errors, and a job
whose checkpoint or run directory is full finishes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from full_disk import PAGE, fill, small_fs
from jitckpt.checkpoint_store import CheckpointError, find_latest, list_candidates, write_checkpoint
from jitckpt.observability.events import EventLog, read_events


def tensor_saver(numel: int):
    def save(path: str) -> None:
        torch.save({"w": torch.arange(numel, dtype=torch.float32)}, Path(path) / "state.pt")
    return save


def test_torch_save_on_a_full_disk_is_a_clear_error_and_keeps_older(tmp_path):
    with small_fs(tmp_path / "fs", 256 * 1024) as fs:
        older, _ = write_checkpoint(fs, tensor_saver(20_000), kind="periodic", step=2, rank=0,
                                    world_size=1, gen=0)  # 80 kB
        fill(fs, leave=40 * 1024)
        with pytest.raises(CheckpointError, match=rf"no space left on {fs}: \d+ bytes needed") as e:
            write_checkpoint(fs, tensor_saver(20_000), kind="periodic", step=4, rank=0, world_size=1,
                             gen=0)
        needed = int(str(e.value).split(": ")[1].split()[0])
        assert needed >= 80_000  # the size of this rank's previous checkpoint
        assert not list(fs.glob(".tmp-*")), "the partial save must be removed"
        assert [c.step for c in list_candidates(fs)] == [2]
        assert find_latest(fs)[0] == older


def test_event_log_survives_a_full_disk_and_catches_up(tmp_path):
    with small_fs(tmp_path / "fs", 64 * 1024) as fs:
        filler = fill(fs, leave=PAGE)
        log = EventLog(fs / "run" / "events.jsonl")
        for i in range(200):  # ~70 bytes each: the one free page fills up half-way
            log.emit("step", rank=0, step=i, step_time=0.1)
        on_disk = list(read_events(log.path))
        assert 0 < len(on_disk) < 200
        assert [r["step"] for r in on_disk] == list(range(len(on_disk)))
        filler.unlink()
        log.emit("job_end", status="ok", exit_code=0, restarts=0)
        records = list(read_events(log.path))
        assert [r["step"] for r in records[:-1]] == list(range(200)), "events lost or reordered"
        assert records[-1]["event"] == "job_end"
        # The line the full disk tore stays on its own line, which readers skip.
        lines = log.path.read_bytes().split(b"\n")
        bad = [ln for ln in lines[:-1] if not _decodes(ln)]
        assert len(bad) <= 1


def _decodes(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def test_reader_skips_a_torn_line_in_the_middle(tmp_path):
    p = tmp_path / "events.jsonl"
    good = [{"t": 1.0, "event": "step", "gen": 0, "step": i} for i in range(3)]
    p.write_bytes(json.dumps(good[0]).encode() + b"\n" + b'{"t": 2.0, "event": "st'
                  + json.dumps(good[1]).encode() + b"\n" + b'{"t": 3.0, "ev\n'
                  + json.dumps(good[2]).encode() + b"\n")
    assert list(read_events(p)) == good


# ---- whole jobs ------------------------------------------------------------------------------
from jobs import run_job  # noqa: E402

CKPT_BYTES = 110 * 1024  # one checkpoint of train_ddp.py's default model with Adam (~105 kB)


def test_periodic_saves_on_a_full_disk_cost_only_the_saves(tmp_path):
    """Three periodic checkpoints fit; the later ones fail for lack of space: the job trains on
    to the end in its first launch, says why, and the older checkpoints stay usable."""
    with small_fs(tmp_path / "ckpt", 3 * CKPT_BYTES + 24 * 1024) as ckpt:
        res = run_job(tmp_path, nproc=2, ckpt=ckpt, script_args=["--steps", "12"],
                      launcher_args=["--periodic-every", "2"])
        assert res.rc == 0, res.out[-4000:]
        assert not res.ev("restart"), res.out[-4000:]
        assert sorted({r["step"] for r in res.log if "step" in r}) == list(range(12))
        failed = res.ev("checkpoint_failed")
        assert failed and {e["kind"] for e in failed} == {"periodic"}, failed
        assert all(f"no space left on {ckpt}: " in e["reason"] and "bytes needed" in e["reason"]
                   for e in failed), failed
        assert f"no space left on {ckpt}: " in res.out
        saved = sorted(e["step"] for e in res.ev("checkpoint_saved"))
        assert saved[:2] == [2, 4] and 8 not in saved and 10 not in saved, saved
        assert [c.step for c in list_candidates(ckpt)] == sorted(saved, reverse=True)
        assert find_latest(ckpt)[1].step == saved[-1]  # verified: intact
        assert not list(ckpt.glob(".tmp-*"))


def test_launcher_survives_a_full_run_dir(tmp_path):
    """The run directory's file system is full: the event log cannot be written (the first
    record is torn half-way), the job still runs to the end, and the log stays readable."""
    with small_fs(tmp_path / "run", 64 * 1024) as run:
        old = [{"t": 1.0 + i, "event": "step", "gen": 0, "rank": 0, "step": i, "step_time": 0.1}
               for i in range(40)]
        data = b"".join(json.dumps(r).encode() + b"\n" for r in old)
        while len(data) < PAGE - 60:  # an earlier job's records fill all but ~60 bytes of a page
            old.append(dict(old[-1], step=old[-1]["step"] + 1))
            data += json.dumps(old[-1]).encode() + b"\n"
        (run / "events.jsonl").write_bytes(data)
        fill(run, leave=0)
        res = run_job(tmp_path, nproc=2, script_args=["--steps", "6"])
        assert res.rc == 0, res.out[-4000:]
        assert "cannot write" in res.out and "events.jsonl" in res.out
        assert list(read_events(run))[:len(old)] == old
