"""SWIFT logging at the NCCL level in libjit.so: the send log and a replacement's receive replay
(verified on simcuda).

Two pipeline stages (simcuda_progs/pipeline_sends.cu, a genuine nvcc program linked against
NVIDIA's libnccl.so.2) exchange activations and gradients with ncclSend/ncclRecv under
LD_PRELOAD=libjit.so with $JITCKPT_SEND_LOG_DIR set per stage. Each stage overwrites its send
buffer right after ncclSend, so a log that copied the buffer at any other point in stream order
would hold the wrong bytes. The logs are read back with the Python reader of the SWIFT log format
(jitckpt.swift.pipeline.logging_records / LogIndex), the same one a replacement stage replays from, and
by libjit.so's own receive replay: a replacement stage's ncclRecv served from the logs while a
survivor goes on without rolling back.
"""
from __future__ import annotations

import json

import pytest
import torch

from dp_build import LIBJIT
from jitckpt.swift.pipeline.logging_records import ACTIVATION, GRADIENT, MessageKey, iter_chunks, read_chunk
from jitckpt.swift.pipeline.logging_replay import LogIndex
from simcuda_progs.simcuda_harness import REPO, Program, RankGroup, build_program

pytestmark = pytest.mark.native
TIMEOUT_S = 60
ITERS, MB, N, GEN = 4, 2, 1000, 3


@pytest.fixture(scope="module")
def prog() -> Program:
    if not LIBJIT.exists():
        pytest.skip(f"{LIBJIT} is missing: build with `make native`")
    return build_program("pipeline_sends", kernels=True, nccl=True,
                         headers=(REPO / "interposer" / "include" / "jitckpt" / "jit_abi.h",))


def _expected(it: int, mb: int, n: int = N) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float32)
    return torch.tensor(float(100 * it + 10 * mb), dtype=torch.float32) + torch.tensor(0.001, dtype=torch.float32) * i


# Observe mode, and proxy mode (`--transparent`): there the send log's pinned copies and events,
# and the receive replay's copies, run behind the proxy's NCCL calls (issue 16's logging plugin).
MODES = {"observe": {}, "proxy": {"JITCKPT_MODE": "proxy"}}


def _run(prog: Program, tmp_path, *, drop_through: int = 0, chunk: int = 2, mode: str = "observe") -> list[dict]:
    env = prog.env(LD_PRELOAD=str(LIBJIT), JITCKPT_SEND_LOG_CHUNK=str(chunk), JITCKPT_GEN=str(GEN), **MODES[mode])
    dirs = [tmp_path / f"stage{r}" for r in range(2)]
    for d in dirs:
        d.mkdir()
    with RankGroup(prog, "pipeline", 2, env=env, window_ms=drop_through,
                   rank_env=lambda r: {"JITCKPT_SEND_LOG_DIR": str(dirs[r])}) as group:
        out = [rp.finish(timeout=TIMEOUT_S) for rp in group.ranks]
    for r, kv in enumerate(out):
        assert kv.get("done") == "1" and kv["libjit"] == "1", (r, kv)
        assert kv["mismatches"] == "0" and kv["flush"] == "0", (r, kv)
        assert json.loads(kv["status"])["mode"] == mode, (r, kv)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_every_send_is_logged_with_the_bytes_sent(prog: Program, tmp_path, mode: str) -> None:
    out = _run(prog, tmp_path, mode=mode)
    # Logging enqueues a copy and an event: ncclSend still returned with the stream busy.
    assert out[0]["busy_after_send"] == "1", out[0]
    for stage, payload, dst, sign in ((0, ACTIVATION, 1, 1.0), (1, GRADIENT, 0, -1.0)):
        chunks = list(iter_chunks(tmp_path / f"stage{stage}"))
        # two records a chunk, one iteration's two micro-batches each
        assert [(g, lo, hi) for _, g, _, lo, hi in chunks] == [(GEN, it, it) for it in range(1, ITERS + 1)]
        records = [rt for path, *_ in chunks for rt in read_chunk(path)]
        keys = [(r.key.iteration, r.key.micro_batch, r.key.payload, r.key.src, r.key.dst, r.seq, r.generation,
                 r.kind) for r, _ in records]
        assert keys == [(it, mb, payload, stage, dst, 2 * (it - 1) + mb, GEN, "send")
                        for it in range(1, ITERS + 1) for mb in range(MB)]
        for r, t in records:
            assert t.dtype == torch.float32 and t.shape == (N,)
            assert torch.equal(t, sign * _expected(r.key.iteration, r.key.micro_batch)), r


def test_replay_index_serves_logged_messages(prog: Program, tmp_path) -> None:
    """A replacement of stage 1 finds stage 0's activations by message key (the replay path)."""
    _run(prog, tmp_path, chunk=3)
    index = LogIndex([tmp_path / "stage0"], after_iteration=2)  # replay after the iteration-2 checkpoint
    assert len(index) == (ITERS - 2) * MB
    for it in range(3, ITERS + 1):  # in the original send order, as a replay consumes them
        for mb in range(MB):
            t = index.take_input(MessageKey(iteration=it, micro_batch=mb, payload=ACTIVATION, src=0, dst=1))
            assert torch.equal(t, _expected(it, mb))


def test_logs_through_a_checkpoint_are_dropped(prog: Program, tmp_path) -> None:
    out = _run(prog, tmp_path, drop_through=2)
    for stage in range(2):
        assert out[stage]["dropped"] == "2", out[stage]
        left = [(lo, hi) for _, _, _, lo, hi in iter_chunks(tmp_path / f"stage{stage}")]
        assert left == [(3, 3), (4, 4)]


def test_off_without_the_variable(prog: Program, tmp_path) -> None:
    env = prog.env(LD_PRELOAD=str(LIBJIT))
    with RankGroup(prog, "pipeline", 2, env=env, window_ms=0) as group:
        out = [rp.finish(timeout=TIMEOUT_S) for rp in group.ranks]
    assert all(kv["mismatches"] == "0" and kv["flush"] == "0" for kv in out), out
    assert not list(tmp_path.iterdir())


def test_a_send_that_never_completes_is_logged(prog: Program, tmp_path) -> None:
    """The copy is enqueued before the send: a receiver that died leaves the send hung, and the
    message it never got is still in the sender's log."""
    env = prog.env(LD_PRELOAD=str(LIBJIT), JITCKPT_SEND_LOG_DIR=str(tmp_path))
    with RankGroup(prog, "orphan", 2, env=env, window_ms=0) as group:
        assert group.ranks[1].wait_for("waiting", TIMEOUT_S) == "1"
        out = group.ranks[0].finish(timeout=TIMEOUT_S)  # rank 1 is killed on leaving the block
    assert out["flush"] == "0" and out["send_pending"] == "1", out
    [(path, *_)] = list(iter_chunks(tmp_path))
    [(rec, t)] = read_chunk(path)
    assert (rec.key.iteration, rec.key.micro_batch, rec.key.dst) == (1, 0, 1)
    assert torch.equal(t, _expected(1, 0, 8 << 20))


PY_API = """
import json, sys
from jitckpt import _native
assert _native.preloaded()
_native.set_log_context(1, 0, "gradient")
_native.flush_send_log(1.0)  # nothing logged yet: returns at once
try:
    _native.set_log_context(1, 0, "weights")
except ValueError as e:
    print("bad_payload=" + str(e).split(":")[0])
print("status=" + json.dumps(_native.status()["send_log"]))
print("dropped=%d" % _native.drop_send_logs_through(10))
"""


def test_a_detected_failure_flushes_the_log(prog: Program, tmp_path) -> None:
    """No flush by the application: it blocks behind a send whose receiver never receives.
    libjit.so's watchdog detects the hang and writes the log (a partial chunk) before its
    failure handler runs, so the message is there for the receiver's replacement."""
    env = prog.env(LD_PRELOAD=str(LIBJIT), JITCKPT_SEND_LOG_DIR=str(tmp_path), JITCKPT_HANG_TIMEOUT="3")
    with RankGroup(prog, "orphan_hang", 2, env=env, window_ms=0) as group:
        rank0 = group.ranks[0]
        rank0.wait_for("blocking", TIMEOUT_S)
        assert not list(iter_chunks(tmp_path))  # one record, still in the partial chunk (3 s margin)
        rank0.wait_for_line(lambda line: "no failure callback registered" in line, "the handler step", TIMEOUT_S)
        [(path, *_)] = list(iter_chunks(tmp_path))
        [(rec, t)] = read_chunk(path)
    assert any("failure detected: hang" in line for line in rank0.seen), rank0.seen
    assert rec.key.iteration == 1 and torch.equal(t, _expected(1, 0, 8 << 20))


def test_python_api(tmp_path) -> None:
    """jitckpt._native's send-log calls reach libjit.so (a torch CUDA job would call them)."""
    import subprocess
    import sys

    if not LIBJIT.exists():
        pytest.skip(f"{LIBJIT} is missing: build with `make native`")
    (tmp_path / "chunk-g0-000000-it1-2.log").write_bytes(b"x")  # an old chunk, to be dropped
    env = {"LD_PRELOAD": str(LIBJIT), "JITCKPT_SEND_LOG_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", PY_API], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kv = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert kv["bad_payload"] == "set_log_context"
    import json

    status = json.loads(kv["status"])
    assert status["enabled"] is True and status["dir"] == str(tmp_path) and status["error"] == ""
    assert kv["dropped"] == "1" and not list(tmp_path.iterdir())


def _replay_stage1(prog: Program, log_dir, relog, mode: str = "observe") -> list[dict]:
    """A replacement of stage 1 replays iterations 1-2 from stage 0's log in `log_dir`, re-logging
    its own sends into `relog`, while stage 0 goes on at iteration 3."""
    import json

    env = prog.env(LD_PRELOAD=str(LIBJIT), JITCKPT_GEN=str(GEN + 1), **MODES[mode])
    relog.mkdir()
    per_rank = [{"PIPE_FIRST_ITER": "3"},
                {"JITCKPT_RECV_REPLAY_DIRS": str(log_dir), "JITCKPT_RECV_REPLAY_THROUGH": "2",
                 "JITCKPT_SEND_LOG_DIR": str(relog)}]
    with RankGroup(prog, "pipeline", 2, env=env, window_ms=0, rank_env=lambda r: per_rank[r]) as group:
        out = [rp.finish(timeout=TIMEOUT_S) for rp in group.ranks]
    # Both check every value they received: the replacement got iterations 1-2 from the log and
    # 3-4 live; the survivor got only the gradients of 3-4 (a gradient the replacement had sent
    # while replaying would have arrived in their place).
    assert [kv["mismatches"] for kv in out] == ["0", "0"], out
    assert json.loads(out[1]["status"])["mode"] == mode
    replay = json.loads(out[1]["status"])["recv_replay"]
    assert replay == {"enabled": True, "through": 2, "served": 2 * MB, "dropped_sends": 2 * MB, "error": ""}
    return out


@pytest.mark.parametrize("mode", MODES)
def test_replacement_replays_its_receives_from_the_logs(prog: Program, tmp_path, mode: str) -> None:
    first = tmp_path / "first"
    first.mkdir()
    _run(prog, first, mode=mode)  # the failure-free run that wrote stage 0's log
    relog = tmp_path / "relog"
    _replay_stage1(prog, first / "stage0", relog, mode=mode)
    # The replacement's own log is whole again: every gradient, replayed ones included.
    records = [rt for path, *_ in iter_chunks(relog) for rt in read_chunk(path)]
    assert sorted((r.key.iteration, r.key.micro_batch) for r, _ in records) == \
        [(it, mb) for it in range(1, ITERS + 1) for mb in range(MB)]
    assert all(r.generation == GEN + 1 and torch.equal(t, -_expected(r.key.iteration, r.key.micro_batch))
               for r, t in records)


def test_python_and_libjit_write_the_same_chunks_and_read_each_others(prog: Program, tmp_path) -> None:
    """The chunk layout is one definition in two languages: libjit.so's chunks rewritten by the
    Python writer are the same bytes, and libjit.so's receive replay serves a log the Python
    writer wrote with multi-dimensional shapes and receive digests among the sends."""
    from jitckpt.swift.pipeline.logging_records import LogRecord, tensor_digest, write_chunk

    first = tmp_path / "first"
    first.mkdir()
    _run(prog, first)
    same, mixed = tmp_path / "same", tmp_path / "mixed"
    same.mkdir()
    mixed.mkdir()
    for path, *_ in iter_chunks(first / "stage0"):
        records = read_chunk(path)
        write_chunk(same, path.name, [r for r, _ in records], [t for _, t in records])
        assert (same / path.name).read_bytes() == path.read_bytes(), path.name
        recs, tensors = [], []
        for r, t in records:  # each send as 10 x 100, then the receive digest of its gradient
            recs += [r, LogRecord(key=MessageKey(r.key.iteration, r.key.micro_batch, GRADIENT, 1, 0),
                                  seq=r.seq, generation=r.generation, kind="recv",
                                  digest=tensor_digest(-t))]
            tensors += [t.reshape(10, 100), None]
        write_chunk(mixed, path.name, recs, tensors)
    _replay_stage1(prog, mixed, tmp_path / "relog")


def test_replay_without_the_message_fails_the_receive(prog: Program, tmp_path) -> None:
    """Logs dropped through iteration 1 cannot replay iteration 1: the receive fails with an NCCL
    error naming the message, instead of running on with a wrong input."""
    first = tmp_path / "first"
    first.mkdir()
    _run(prog, first, drop_through=1)
    env = prog.env(LD_PRELOAD=str(LIBJIT))
    per_rank = [{"PIPE_FIRST_ITER": "3"},
                {"JITCKPT_RECV_REPLAY_DIRS": str(first / "stage0"), "JITCKPT_RECV_REPLAY_THROUGH": "2"}]
    with RankGroup(prog, "pipeline", 2, env=env, window_ms=0, rank_env=lambda r: per_rank[r]) as group:
        out = group.ranks[1].finish(timeout=TIMEOUT_S)  # the survivor is killed on leaving the block
        seen = "\n".join(group.ranks[1].seen)
    assert group.ranks[1].proc.returncode == 3, seen  # NCCLCHECK's exit
    assert "FAIL ncclRecv" in seen and "invalid usage" in seen.lower(), seen
    assert "no logged message (iteration 1, micro-batch 0, activation, from rank 0 to rank 1)" in seen, seen
    assert "done" not in out
