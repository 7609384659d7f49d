"""SWIFT logging building blocks: SendLogger hooks (2 gloo processes), chunked logs and garbage
collection, replay order and divergence checks, determinism checks, schedules, recovery
decisions and the parallel-recovery partition."""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from jitckpt.swift.pipeline.logging_determinism import (DeterminismMismatchError, apply_determinism,
                                               check_determinism, current_determinism,
                                               read_manifest, write_manifest)
from jitckpt.swift.pipeline.logging_records import (ACTIVATION, GRADIENT, MessageKey, digest_matches,
                                           iter_chunks, tensor_digest)
from jitckpt.swift.pipeline.logging_replay import LogIndex, MissingLogError, ReplayDivergenceError
from jitckpt.swift.pipeline.logging_sender import SendLogger
from jitckpt.swift.pipeline.recovery import (catch_up_peers, partition_micro_batches,
                                             recovery_targets)
from jitckpt.swift.pipeline.schedule import pipeline_schedule

from forked_ranks import run_ranks

PROC_TIMEOUT = 60.0


def _key(it, mb, payload=ACTIVATION, src=0, dst=1):
    return MessageKey(iteration=it, micro_batch=mb, payload=payload, src=src, dst=dst)


def _t(seed: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------ hooks, two real processes ----
def _hook_worker(rank: int, port: int, root: str) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        peer = 1 - rank
        with SendLogger(stage=rank, log_dir=Path(root) / f"stage{rank}", log_peers=[peer],
                        chunk_records=3) as logger:
            if rank == 0:
                try:  # an untagged send to a logged peer is refused before anything is sent
                    dist.send(_t(0), dst=1)
                    raise AssertionError("untagged send was not refused")
                except RuntimeError as exc:
                    assert "tagged" in str(exc)
                with logger.tagged(iteration=1, micro_batch=0, payload=ACTIVATION):
                    dist.send(_t(10), dst=1)
                with logger.tagged(iteration=1, micro_batch=1, payload=ACTIVATION):
                    dist.isend(_t(11), dst=1).wait()
                r = torch.empty(3, 4)
                with logger.tagged(iteration=1, micro_batch=2, payload=ACTIVATION):
                    ops = [dist.P2POp(dist.isend, _t(12), 1), dist.P2POp(dist.irecv, r, 1)]
                    for w in dist.batch_isend_irecv(ops):
                        w.wait()
                assert torch.equal(r, _t(20))
                with logger.tagged(iteration=1, micro_batch=0, payload=GRADIENT):
                    dist.recv(r, src=1)
                assert torch.equal(r, _t(21))
            else:
                r = torch.empty(3, 4)
                with logger.tagged(iteration=1, micro_batch=0, payload=ACTIVATION):
                    dist.recv(r, src=0)
                    assert torch.equal(r, _t(10))
                with logger.tagged(iteration=1, micro_batch=1, payload=ACTIVATION):
                    w = dist.irecv(r, src=0)
                    logger.bubble()  # recv still pending: must not be digested yet
                    w.wait()
                    assert torch.equal(r, _t(11))
                r2 = torch.empty(3, 4)
                with logger.tagged(iteration=1, micro_batch=2, payload=ACTIVATION):
                    ops = [dist.P2POp(dist.irecv, r2, 0), dist.P2POp(dist.isend, _t(20), 0)]
                    for w in dist.batch_isend_irecv(ops):
                        w.wait()
                with logger.tagged(iteration=1, micro_batch=0, payload=GRADIENT):
                    dist.send(_t(21), dst=0)
            logger.bubble()
            logger.flush()
        assert dist.isend is not None and "hooked" not in dist.isend.__qualname__
        dist.destroy_process_group()
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def test_hooks_log_sends_and_receive_digests(tmp_path):
    assert run_ranks(_hook_worker, str(tmp_path), timeout=PROC_TIMEOUT) == [0, 0]
    # Chunked: stage 0 logged 3 sends + 2 receive digests with 3 records per chunk.
    assert len(list(iter_chunks(tmp_path / "stage0"))) >= 2
    index = LogIndex([tmp_path / "stage0", tmp_path / "stage1"])
    # Sender-side logs hold the exact tensors, for send, isend and batch_isend_irecv.
    for mb, seed in ((0, 10), (1, 11), (2, 12)):
        assert torch.equal(index.take_input(_key(1, mb)), _t(seed))
    assert torch.equal(index.take_input(_key(1, 2, src=1, dst=0)), _t(20))
    assert torch.equal(index.take_input(_key(1, 0, GRADIENT, src=1, dst=0)), _t(21))
    # Receiver-side digests match what was sent (recv, irecv, batch irecv).
    for mb, seed in ((0, 10), (1, 11), (2, 12)):
        index.check_output(_key(1, mb), _t(seed))
    index.check_output(_key(1, 0, GRADIENT, src=1, dst=0), _t(21))
    with pytest.raises(ReplayDivergenceError, match="diverged"):
        index.check_output(_key(1, 1), _t(12))


# -------------------------------------------------------------- single-process logging ----
def _log(tmp: Path, n: int, *, generation: int = 0, chunk: int = 2, offset: int = 0,
         iteration_of=lambda i: i + 1) -> SendLogger:
    lg = SendLogger(stage=0, log_dir=tmp, log_peers=[1], chunk_records=chunk,
                    generation=generation)
    for i in range(n):
        lg.record_send(_t(i + offset), _key(iteration_of(i), 0))
    lg.bubble()
    lg.flush()
    return lg


def test_chunks_and_garbage_collection(tmp_path):
    lg = _log(tmp_path, 5, chunk=2)  # iterations 1..5, 2 records per chunk -> 3 chunks
    chunks = sorted((lo, hi) for _, _, _, lo, hi in iter_chunks(tmp_path))
    assert chunks == [(1, 2), (3, 4), (5, 5)]
    assert lg.bytes_logged == 5 * 12 * 4
    # A global checkpoint after iteration 3 obsoletes only chunks entirely <= 3.
    assert lg.drop_through(3) == 1
    assert sorted(lo for _, _, _, lo, _ in iter_chunks(tmp_path)) == [3, 5]
    index = LogIndex([tmp_path], after_iteration=3)
    assert not index.has_input(_key(3, 0)) and index.has_input(_key(4, 0))
    lg.close()


def test_chunk_roundtrip_keeps_dtype_shape_and_bits(tmp_path):
    from jitckpt.swift.pipeline.logging_records import LogRecord, read_chunk, write_chunk
    ts = [torch.randn(2, 3, dtype=torch.bfloat16), torch.tensor(3.5, dtype=torch.float64),
          None, torch.empty(0, 4), torch.arange(6, dtype=torch.int64).reshape(3, 2)]
    # The layout stores a digest as its algorithm and 16 bytes: sends carry none, receives one.
    recs = [LogRecord(key=_key(1, i), seq=i, generation=0, kind="send" if t is not None
                      else "recv", digest="" if t is not None else tensor_digest(_t(i), "blake2b"))
            for i, t in enumerate(ts)]
    write_chunk(tmp_path, "chunk-g0-000000-it1-1.log", recs, ts)
    back = read_chunk(tmp_path / "chunk-g0-000000-it1-1.log")
    assert [r for r, _ in back] == recs
    for (_, got), want in zip(back, ts):
        if want is None:
            assert got is None
        else:
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)


def test_tensor_is_copied_at_the_bubble_not_at_send(tmp_path):
    lg = SendLogger(stage=0, log_dir=tmp_path, log_peers=[1])
    t = torch.zeros(2)
    lg.record_send(t, _key(1, 0))
    t += 1  # still pending: the contract allows changes only after the bubble
    lg.bubble()
    t += 1  # after the bubble the log holds its own copy
    lg.flush()
    assert torch.equal(LogIndex([tmp_path]).take_input(_key(1, 0)), torch.ones(2))
    lg.close()


def test_replay_order_and_missing_messages(tmp_path):
    _log(tmp_path, 3, iteration_of=lambda i: 1).close()  # same key three times
    assert len(LogIndex([tmp_path])) == 1  # the newest record of a key wins
    d2 = tmp_path / "ordered"
    lg = SendLogger(stage=0, log_dir=d2, log_peers=[1])
    for mb in range(3):
        lg.record_send(_t(mb), _key(1, mb))
    lg.bubble()
    lg.close()
    index = LogIndex([d2])
    index.take_input(_key(1, 0))
    index.take_input(_key(1, 2))
    with pytest.raises(ReplayDivergenceError, match="original send order"):
        index.take_input(_key(1, 1))  # mb 1 was sent before mb 2
    with pytest.raises(MissingLogError, match="does not cover iteration 9"):
        index.take_input(_key(9, 0))
    with pytest.raises(MissingLogError, match="no digest"):
        index.check_output(_key(1, 0), _t(0))


def test_writer_waits_for_bubbles_but_bounds_the_backlog(tmp_path):
    lg = SendLogger(stage=0, log_dir=tmp_path, log_peers=[1], chunk_records=1, max_backlog=3)
    try:
        lg.record_send(_t(0), _key(1, 0))
        lg.bubble()  # handed over, but no bubble is open: nothing may be written yet
        assert lg._queue.qsize() <= 1 and not list(iter_chunks(tmp_path))
        with lg.idle():  # a bubble: the writer drains
            deadline_ok = _wait_for(lambda: len(list(iter_chunks(tmp_path))) == 1)
        assert deadline_ok
        for i in range(1, 5):  # four hand-overs outside any bubble: over the backlog bound
            lg.record_send(_t(i), _key(1, i))
            lg.bubble()
        assert _wait_for(lambda: len(list(iter_chunks(tmp_path))) >= 2)
    finally:
        lg.close()
    assert len(list(iter_chunks(tmp_path))) == 5


def test_writer_gets_one_hand_over_per_chunk(tmp_path):
    # Each hand-over wakes the writer thread; bubbles collect host copies until a chunk is full.
    lg = SendLogger(stage=0, log_dir=tmp_path, log_peers=[1], chunk_records=3)
    try:
        for i in range(2):
            lg.record_send(_t(i), _key(1, i))
            lg.bubble()
        assert lg._queue.qsize() == 0  # copied at the bubble, not yet handed over
        lg.record_send(_t(2), _key(1, 2))
        lg.bubble()
        assert lg._queue.qsize() == 1
        lg.record_send(_t(3), _key(1, 3))
        lg.bubble()
        lg.flush()  # the partial chunk is written too
        assert [(lo, hi) for _p, _g, _n, lo, hi in iter_chunks(tmp_path)] == [(1, 1), (1, 1)]
    finally:
        lg.close()
    index = LogIndex([tmp_path])
    assert all(torch.equal(index.take_input(_key(1, i)), _t(i)) for i in range(4))


@pytest.mark.parametrize("algorithm", ["xxh3_128", "blake2b"])
def test_digest_names_its_algorithm_and_catches_one_bit(algorithm):
    t = _t(0)
    d = tensor_digest(t, algorithm)
    assert d.startswith(algorithm + ":") and len(d) == len(algorithm) + 33
    assert digest_matches(t.clone(), d) == (True, d)
    flipped = t.clone()
    flipped.view(torch.int32)[1, 2] ^= 1  # one low mantissa bit
    assert not digest_matches(flipped, d)[0]
    assert not digest_matches(t.double(), d)[0]  # dtype is part of the digest
    assert not digest_matches(t.reshape(4, 3), d)[0]  # and the shape
    with pytest.raises(ValueError, match="names no known algorithm"):
        digest_matches(t, "0123456789abcdef0123456789abcdef")  # a digest from an older version
    with pytest.raises(ValueError, match="must be one of"):
        tensor_digest(t, "md5")


def _wait_for(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond`` until true or ``timeout`` (bounded wait on a background thread)."""
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_newer_generation_wins(tmp_path):
    _log(tmp_path, 1, generation=0, offset=0).close()
    _log(tmp_path, 1, generation=1, offset=7).close()
    assert torch.equal(LogIndex([tmp_path]).take_input(_key(1, 0)), _t(7))


def test_bad_configuration_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="log_peers contains this stage"):
        SendLogger(stage=1, log_dir=tmp_path, log_peers=[1])
    with pytest.raises(ValueError, match="chunk_records"):
        SendLogger(stage=0, log_dir=tmp_path, log_peers=[1], chunk_records=0)


# ---------------------------------------------------------------------- determinism -------
def test_determinism_manifest_roundtrip_and_mismatch(tmp_path):
    threads = torch.get_num_threads()
    was = torch.are_deterministic_algorithms_enabled()
    try:
        settings = apply_determinism(num_threads=1)
        assert settings["deterministic_algorithms"] and settings["num_threads"] == 1
        write_manifest(tmp_path, settings)
        check_determinism(read_manifest(tmp_path))
        torch.set_num_threads(2)
        with pytest.raises(DeterminismMismatchError, match="num_threads: logged run 1"):
            check_determinism(read_manifest(tmp_path))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was)
    with pytest.raises(DeterminismMismatchError, match="missing"):
        read_manifest(tmp_path / "nowhere")
    assert current_determinism()["torch"] == torch.__version__


# ------------------------------------------------------------ schedules and decisions -----
def test_schedules():
    assert pipeline_schedule(stage=0, num_stages=4, num_micro_batches=4) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)]
    assert pipeline_schedule(stage=2, num_stages=4, num_micro_batches=4) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert pipeline_schedule(stage=3, num_stages=4, num_micro_batches=2) == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert pipeline_schedule(stage=1, num_stages=4, num_micro_batches=2, kind="gpipe") == [
        ("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="unknown schedule"):
        pipeline_schedule(stage=0, num_stages=2, num_micro_batches=1, kind="zb")
    with pytest.raises(ValueError, match="outside"):
        pipeline_schedule(stage=4, num_stages=4, num_micro_batches=1)


def test_recovery_decisions():
    assert recovery_targets({0: 5, 2: 6, 3: 6}) == (5, 6)
    assert catch_up_peers({0: 5, 2: 6, 3: 6}, iteration=6) == {2, 3}
    with pytest.raises(RuntimeError, match="more than one"):
        recovery_targets({0: 4, 1: 6})
    with pytest.raises(ValueError, match="no survivor"):
        recovery_targets({})


def test_parallel_recovery_partition():
    # SWIFT Fig. 7: m = 4 micro-batches, d = 2 workers -> {0, 2} and {1, 3}.
    assert partition_micro_batches(4, 2) == [[0, 2], [1, 3]]
    assert partition_micro_batches(5, 2) == [[0, 2, 4], [1, 3]]
    assert partition_micro_batches(2, 3) == [[0], [1], []]
    parts = partition_micro_batches(16, 5)
    assert sorted(m for p in parts for m in p) == list(range(16))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        partition_micro_batches(0, 2)
