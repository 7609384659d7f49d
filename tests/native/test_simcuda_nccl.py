"""simcuda's libnccl.so.2: collectives between processes, hangs, abort, failure injection.

The rank program is linked against NVIDIA's libnccl.so.2 and run on simcuda's (same SONAME).
Verified on simcuda only.
"""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from simcuda_progs.simcuda_harness import Program, RankGroup, build_program, parse_kv

pytestmark = pytest.mark.native
STEP_TIMEOUT_S = 30
WINDOW_MS = 1500  # how long a rank watches a collective that must stay hung


@pytest.fixture(scope="module")
def ranks_prog() -> Program:
    return build_program("nccl_ranks", kernels=False, nccl=True)


@pytest.mark.parametrize("nranks", [2, 3])
def test_collectives_correct(ranks_prog: Program, nranks: int) -> None:
    with RankGroup(ranks_prog, "collectives", nranks) as group:
        results = [rp.finish(timeout=STEP_TIMEOUT_S) for rp in group.ranks]
    for rank, kv in enumerate(results):
        oks = {k: v for k, v in kv.items() if k.startswith("ok_")}
        assert len(oks) == 14, (rank, kv)
        assert all(v == "1" for v in oks.values()), (rank, oks)
        assert kv["exit_clean"] == "1"


def test_stopped_peer_hangs_collective_until_abort(ranks_prog: Program) -> None:
    with RankGroup(ranks_prog, "stop", 3, window_ms=WINDOW_MS, stdin=True) as group:
        for rp in group.ranks:
            assert rp.wait_for("phase1_done", STEP_TIMEOUT_S) == "1"
        stopped, survivors = group.ranks[2], group.ranks[:2]
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        for rp in survivors:
            assert rp.proc.stdin is not None
            rp.proc.stdin.write("go\n")
            rp.proc.stdin.flush()
        for rp in survivors:
            # The collective cannot finish: the event after it stays not-ready for the whole window.
            assert rp.wait_for("event_during_hang", STEP_TIMEOUT_S) == "cudaErrorNotReady"
            assert rp.wait_for("stream_during_hang", STEP_TIMEOUT_S) == "cudaErrorNotReady"
            # ncclCommAbort unblocks it and the stream drains.
            assert rp.wait_for("event_after_abort", STEP_TIMEOUT_S) == "cudaSuccess"
            assert rp.wait_for("exit_clean", STEP_TIMEOUT_S) == "1"
        assert stopped.proc.poll() is None  # still stopped; killed by RankGroup cleanup


def inject(prog: Program, mode: str, nranks: int = 2) -> list[dict[str, str]]:
    env = prog.env(SIMCUDA_FAIL_RANK="1", SIMCUDA_FAIL_AT="2", SIMCUDA_FAIL_MODE=mode)
    with RankGroup(prog, "inject", nranks, env=env, window_ms=WINDOW_MS) as group:
        return [rp.finish(timeout=STEP_TIMEOUT_S) for rp in group.ranks]


def test_inject_hang(ranks_prog: Program) -> None:
    for kv in inject(ranks_prog, "hang"):
        assert kv["call2"] == "0"  # the call itself succeeds; the stream never gets past it
        assert kv["event1"] == "cudaSuccess"
        assert kv["event2"] == "cudaErrorNotReady" and kv["event3"] == "cudaErrorNotReady"
        assert kv["async"] == "0" and kv["malloc_after"] == "cudaSuccess"
        assert kv["exit_clean"] == "1"


def test_inject_error(ranks_prog: Program) -> None:
    healthy, failing = inject(ranks_prog, "error")
    assert failing["call2"] == "2"  # ncclSystemError from the API call
    assert failing["async"] == "2"  # and as the communicator's async error
    assert failing["malloc_after"] == "cudaSuccess"  # the CUDA context is fine
    # The peer's second collective is matched by the failing rank's third; its third then hangs.
    assert healthy["event2"] == "cudaSuccess" and healthy["event3"] == "cudaErrorNotReady"
    assert healthy["async"] == "0"


def test_inject_sticky(ranks_prog: Program) -> None:
    healthy, failing = inject(ranks_prog, "sticky")
    assert failing["call2"] == "0"
    assert failing["event1"] == "cudaErrorIllegalAddress"  # every runtime call now fails
    assert failing["malloc_after"] == "cudaErrorIllegalAddress"
    assert failing["async"] == "1"  # ncclUnhandledCudaError
    # The faulted rank runs no further collectives, so the peer's second one hangs.
    assert healthy["event1"] == "cudaSuccess" and healthy["event2"] == "cudaErrorNotReady"
    assert healthy["malloc_after"] == "cudaSuccess"


def test_inject_crash(ranks_prog: Program) -> None:
    env = ranks_prog.env(SIMCUDA_FAIL_RANK="1", SIMCUDA_FAIL_AT="2", SIMCUDA_FAIL_MODE="crash")
    with RankGroup(ranks_prog, "inject", 2, env=env, window_ms=WINDOW_MS) as group:
        healthy = group.ranks[0].finish(timeout=STEP_TIMEOUT_S)
        group.ranks[1].finish(timeout=STEP_TIMEOUT_S)
        assert group.ranks[1].proc.returncode == -signal.SIGKILL
    # A dead peer hangs the collective (no error, no timeout), as on a GPU.
    assert healthy["event1"] == "cudaSuccess" and healthy["event2"] == "cudaErrorNotReady"
    assert healthy["async"] == "0" and healthy["exit_clean"] == "1"


def test_bad_injection_config_is_reported(ranks_prog: Program) -> None:
    env = ranks_prog.env(SIMCUDA_FAIL_MODE="explode")
    with RankGroup(ranks_prog, "inject", 1, env=env) as group:
        kv = group.ranks[0].finish(timeout=STEP_TIMEOUT_S)
        out = "\n".join(group.ranks[0].seen)
    assert "SIMCUDA_FAIL_MODE='explode' is invalid" in out
    assert "FAIL ncclCommInitRank" in out and "init_done" not in kv


def test_single_process_ranks_and_nonblocking_init() -> None:
    prog = build_program("nccl_single_process", kernels=False, nccl=True)
    proc = subprocess.run([str(prog.exe)], env=prog.env(SIMCUDA_DEVICES="2"), capture_output=True, text=True,
                          timeout=STEP_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kv = parse_kv(proc.stdout)
    assert kv["initall_device1"] == "1"
    assert kv["initall_sum"] == "3,3"  # 1 + 2 on both ranks, issued from one thread in a group
    assert kv["nonblocking_init_0"] == "7" and kv["nonblocking_init_1"] == "7"  # ncclInProgress
    assert kv["nonblocking_ready"] == "0,0"
    assert kv["nonblocking_sum"] == "3,3"
    # Rank 1 of the "lonely" communicator never joins: init stays ncclInProgress, abort unblocks it.
    assert kv["lonely_init"] == "7" and kv["lonely_state"] == "7" and kv["lonely_abort"] == "0"
    assert kv["symbol_value"] == "7" and kv["symbol_is_device"] == "1"
    assert kv["bad_symbol"] == "cudaErrorInvalidSymbol"


def test_allreduce_bench_mode_reports_time(ranks_prog: Program) -> None:
    with RankGroup(ranks_prog, "bench", 2, window_ms=1) as group:  # window = MiB for bench
        results = [rp.finish(timeout=STEP_TIMEOUT_S) for rp in group.ranks]
    for kv in results:
        assert float(kv["ms_per_iter"]) > 0.0
        assert kv["exit_clean"] == "1"


def test_comm_split(ranks_prog: Program) -> None:
    with RankGroup(ranks_prog, "split", 3) as group:
        results = [rp.finish(timeout=STEP_TIMEOUT_S) for rp in group.ranks]
    # color rank % 2 -> {0, 2} and {1}; key -rank puts rank 2 first.
    assert [kv["split_count"] for kv in results] == ["2", "1", "2"]
    assert [kv["split_rank"] for kv in results] == ["1", "0", "0"]
    assert [kv["split_sum"] for kv in results] == ["2", "1", "2"]
    assert all(kv["nocolor_null"] == "1" and kv["exit_clean"] == "1" for kv in results)
