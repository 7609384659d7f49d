"""simcuda's libcudart.so.13 under real nvcc-built programs: ABI, kernels, memory, streams, errors.

Verified on simcuda only (no GPU here). Programs live in tests/native/simcuda_progs/.
"""
from __future__ import annotations

import subprocess

import pytest

from simcuda_progs.simcuda_harness import SANITIZER_RUNTIME, SIMCUDA_LIBS, Program, build_program, parse_kv

pytestmark = pytest.mark.native
RUN_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def roundtrip() -> Program:
    return build_program("kernel_roundtrip", kernels=True, nccl=False)


@pytest.fixture(scope="module")
def streams() -> Program:
    return build_program("streams_events", kernels=True, nccl=False)


def run(prog: Program, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # subprocess.run kills the child (by PID) when the timeout expires.
    return subprocess.run([str(prog.exe), *args], env=prog.env(**env), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def dynsyms(path: str) -> str:
    return subprocess.run(["readelf", "--dyn-syms", "-W", path], capture_output=True, text=True, check=True).stdout


def test_library_identity_matches_nvidia(roundtrip: Program) -> None:
    """SONAME and the libcudart.so.13 version node that nvcc-built binaries require."""
    lib = SIMCUDA_LIBS / "libcudart.so.13"
    dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "Library soname: [libcudart.so.13]" in dyn
    ours = dynsyms(str(lib))
    needed = [word for line in dynsyms(str(roundtrip.exe)).splitlines() for word in line.split()
              if word.endswith("@libcudart.so.13")]
    assert "__cudaLaunchKernel@libcudart.so.13" in needed
    for sym in needed:
        name = sym.split("@")[0]
        assert f"{name}@@libcudart.so.13" in ours, f"{name} not exported with version libcudart.so.13"
    # Internal C++ symbols stay hidden.
    assert "_ZN7simcuda" not in ours


def test_kernel_launch_and_memcpy_roundtrip(roundtrip: Program) -> None:
    proc = run(roundtrip)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kv = parse_kv(proc.stdout)
    assert kv["axpy_mismatches"] == "0"
    assert kv["fill_mismatches"] == "0"  # template kernel fill<int>
    assert kv["histogram"] == "250,250,250,250" and kv["atomic_total"] == "500"  # atomics
    assert kv["memset_zero"] == "1" and kv["d2d_ok"] == "1"
    assert kv["attr_device"] == "1" and kv["attr_pinned"] == "1" and kv["attr_host"] == "1"
    assert kv["host_as_device"] == "cudaErrorInvalidValue"
    assert kv["last_error"] == "cudaErrorInvalidValue"
    assert kv["last_error_cleared"] == "cudaSuccess"  # non-sticky: cleared by cudaGetLastError
    assert kv["out_of_range"] == "cudaErrorInvalidValue"
    assert kv["bad_config"] == "cudaErrorInvalidConfiguration"
    assert kv["after_bad_config"] == "cudaSuccess"
    assert kv["device_count"] == "1" and kv["cc"] == "9.0"
    assert kv["set_bad_device"] == "cudaErrorInvalidDevice"
    assert kv["double_free"] == "cudaErrorInvalidValue"
    assert kv["done"] == "1"


def test_per_thread_default_stream_build() -> None:
    """nvcc --default-stream per-thread binds the _ptsz/_ptds entry points; same results."""
    prog = build_program("kernel_roundtrip", kernels=True, nccl=False, nvcc_flags=("--default-stream", "per-thread"))
    assert "cudaMemcpy_ptds@libcudart.so.13" in dynsyms(str(prog.exe))
    proc = run(prog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kv = parse_kv(proc.stdout)
    assert kv["axpy_mismatches"] == "0" and kv["histogram"] == "250,250,250,250" and kv["done"] == "1"


def test_device_count_from_env(roundtrip: Program) -> None:
    kv = parse_kv(run(roundtrip, SIMCUDA_DEVICES="3").stdout)
    assert kv["device_count"] == "3"
    assert kv["set_bad_device"] == "cudaErrorInvalidDevice"


def test_bad_device_env_is_reported(roundtrip: Program) -> None:
    proc = run(roundtrip, SIMCUDA_DEVICES="lots")
    assert "SIMCUDA_DEVICES='lots' is invalid" in proc.stderr
    assert "cudaErrorInitializationError" in proc.stdout  # every call fails instead of guessing


def test_missing_kernel_library_fails_the_launch(roundtrip: Program) -> None:
    env = {k: v for k, v in roundtrip.env().items() if k != "SIMCUDA_KERNEL_LIB"}
    proc = subprocess.run([str(roundtrip.exe)], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 1
    assert "FAIL cudaGetLastError(): cudaErrorNoKernelImageForDevice" in proc.stdout


def test_missing_kernels_can_be_skipped(roundtrip: Program) -> None:
    env = {k: v for k, v in roundtrip.env(SIMCUDA_MISSING_KERNEL="skip").items() if k != "SIMCUDA_KERNEL_LIB"}
    proc = subprocess.run([str(roundtrip.exe)], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    kv = parse_kv(proc.stdout)
    assert kv["axpy_mismatches"] == "999"  # the launch succeeded but did nothing (y[0] = 0*2+1 anyway)
    assert kv["done"] == "1"


def test_streams_are_asynchronous_and_events_order_work(streams: Program) -> None:
    proc = run(streams, "async")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kv = parse_kv(proc.stdout)
    # Enqueueing behind a blocked stream returned to the host; the stream and its event are pending.
    assert kv["host_returned_while_stream_blocked"] == "1"
    assert kv["stream_a_query"] == "cudaErrorNotReady"
    assert kv["event_a_query"] == "cudaErrorNotReady"
    # cudaStreamWaitEvent holds stream b; the legacy stream waits for blocking stream a; c does not.
    assert kv["stream_b_query_before"] == "cudaErrorNotReady"
    assert kv["legacy_query_before"] == "cudaErrorNotReady"
    assert kv["nonblocking_c_done_while_a_blocked"] == "cudaSuccess"
    # b's copy ran after a's memset(2) and kernel(+1): 0x02020202 + 1.
    assert kv["cross_stream_value"] == str(0x02020203)
    assert kv["event_a_after"] == "cudaSuccess" and kv["legacy_query_after"] == "cudaSuccess"
    assert kv["elapsed_not_ready"] == "cudaErrorNotReady"
    assert kv["elapsed_ms_ge_19"] == "1"
    assert kv["elapsed_untimed"] == "cudaErrorInvalidResourceHandle"
    assert kv["per_thread_value"] == str(0x02020203)
    assert kv["h2d_pageable_staged"] == "1"  # the source could be reused as soon as the call returned
    assert kv["priority_range"] == "0..-5" and kv["priority_kept"] == "1"
    assert kv["flags_nonblocking"] == "1"
    assert kv["destroyed_stream_query"] == "cudaErrorInvalidResourceHandle"
    assert kv["after_invalid"] == "cudaErrorInvalidResourceHandle"
    assert kv["still_works"] == "cudaSuccess"
    assert kv["done"] == "1"


def test_device_fault_is_sticky(streams: Program) -> None:
    proc = run(streams, "sticky")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kv = parse_kv(proc.stdout)
    # The launch is accepted; the fault arrives asynchronously (possibly already by this query).
    assert kv["launch"] in ("cudaSuccess", "cudaErrorIllegalAddress")
    for key in ("sync", "get_last_1", "get_last_2", "malloc_after", "memcpy_after", "stream_create_after"):
        assert kv[key] == "cudaErrorIllegalAddress", key
    assert kv["error_string"] == "an illegal memory access was encountered"


@pytest.fixture(scope="module")
def arena() -> Program:
    return build_program("arena_addresses", kernels=False, nccl=False)


def test_fixed_arena_gives_the_same_pointers_in_every_process(arena: Program) -> None:
    """SIMCUDA_ARENA_BASE: a restarted device proxy must hand out the pointers the application
    already holds (issue 15); allocation is deterministic, so the same calls give the same ones."""
    if "tsan" in SANITIZER_RUNTIME:
        pytest.skip("ThreadSanitizer keeps that address range for its shadow memory")
    base = "0x300000000000"
    runs = [run(arena, SIMCUDA_ARENA_BASE=base) for _ in range(2)]
    outs = [parse_kv(r.stdout) for r in runs]
    assert all(r.returncode == 0 for r in runs), runs[0].stdout + runs[0].stderr
    assert outs[0] == outs[1]
    assert int(outs[0]["a"], 16) == int(base, 16) and outs[0]["roundtrip"] == "1"
    # The freed 1 MiB hole is reused first-fit: d lands where b was (one page after a).
    assert int(outs[0]["d"], 16) == int(base, 16) + 4096
    default = parse_kv(run(arena).stdout)
    assert int(default["a"], 16) != int(base, 16)  # without the variable: wherever mmap puts it


@pytest.mark.parametrize("value, message", [
    ("0x300000000123", "SIMCUDA_ARENA_BASE='0x300000000123' is invalid"),
    ("banana", "SIMCUDA_ARENA_BASE='banana' is invalid"),
    # The top 64 GiB of user space hold the stack: the range is taken, never overwritten.
    ("0x7ff000000000", "cannot reserve 64 GiB of device address space at 0x7ff000000000"),
])
def test_a_bad_or_taken_arena_base_fails_every_call_clearly(arena: Program, value: str, message: str) -> None:
    proc = run(arena, SIMCUDA_ARENA_BASE=value)
    assert message in proc.stderr, proc.stderr
    assert parse_kv(proc.stdout)["malloc"] == "cudaErrorInitializationError" and proc.returncode == 1


@pytest.fixture(scope="module")
def vmm() -> Program:
    return build_program("vmm_driver", kernels=False, nccl=False)


def test_driver_vmm_entry_points_reserve_map_and_free_device_memory(vmm: Program) -> None:
    """simcuda's libcuda.so.1, reached through cudaGetDriverEntryPointByVersion as a device proxy
    reaches it (issue 46): a range at a chosen address (a hint, as on a GPU: taken, it lands
    elsewhere), physical memory charged to the device, mapped, made accessible, used by the
    runtime's copies, refused by cudaFree, unmapped whole and refunded."""
    proc = run(vmm)
    kv = parse_kv(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok, invalid = "0", "1"  # CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE
    assert (kv["unknown_status"], kv["unknown_null"], kv["unknown_error"]) == ("1", "1", "cudaSuccess")
    assert kv["old_version_status"] == "2"  # cudaDriverEntryPointVersionNotSufficent
    assert kv["found"] == "1" and kv["granularity"] == str(2 << 20)
    assert kv["reserve_result"] == ok and kv["reserve_at_hint"] == "1"
    assert kv["second_reserve_result"] == ok and kv["second_elsewhere"] == "1"
    assert kv["unaligned_reserve_result"] == invalid
    assert kv["create_result"] == ok and kv["create_charged"] == "1"
    assert kv["map_outside_result"] == invalid and kv["map_result"] == ok and kv["map_overlap_result"] == invalid
    assert kv["type_before_access"] == "0"  # mapped but not accessible: not device memory yet
    assert kv["access_result"] == ok and kv["release_result"] == ok
    assert (kv["type"], kv["device"]) == ("2", "0")  # cudaMemoryTypeDevice on device 0
    assert kv["roundtrip"] == "1"
    assert kv["cudafree_mapped"] == "cudaErrorInvalidValue"
    assert kv["free_range_mapped_result"] == invalid and kv["unmap_part_result"] == invalid
    assert kv["unmap_result"] == ok and kv["refunded"] == "1" and kv["type_after_unmap"] == "0"
    assert kv["free_range_result"] == ok and kv["reserve_again_at_hint"] == "1"
