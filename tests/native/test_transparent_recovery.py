"""Transparent recovery in proxy mode (issue 16), the part built so far: when a process's device
proxy dies, or its device gets a sticky error, libjit.so starts a new proxy and replays the calls
the process made (interposer/src/replay_journal.cc); the program sees a pause, keeps its PID and
its pointers and handles, and ends bitwise where a failure-free run ends.

The program is streams_pinned_sendrecv.cu on one rank (three streams, events, pinned buffers reused
every step, kernels, an NCCL communicator of one rank with grouped send/recv and an all-reduce); it
checks every step against its own host reference (ok=1). Verified on simcuda only.
"""
from __future__ import annotations

import random
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from simcuda_progs.simcuda_harness import BUILD, Program, build_program, parse_kv

pytestmark = pytest.mark.native
LIBJIT = BUILD / "lib" / "libjit.so"
PROXY = {"LD_PRELOAD": str(LIBJIT), "JITCKPT_MODE": "proxy"}
TIMEOUT_S = 120
STEPS = 1500


@pytest.fixture(scope="module")
def prog() -> Program:
    return build_program("streams_pinned_sendrecv", kernels=True, nccl=True)


@pytest.fixture(scope="module")
def reference(prog: Program) -> dict[str, str]:
    proc = subprocess.run([str(prog.exe), "ring", "0", "1", "", str(STEPS)], env=prog.env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    kv = parse_kv(proc.stdout)
    assert proc.returncode == 0 and kv.get("ok") == "1", proc.stdout + proc.stderr
    return kv


def start(prog: Program, *extra: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([str(prog.exe), "ring", "0", "1", "", str(STEPS), *extra], env=prog.env(**PROXY, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, dict[str, str], str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode, parse_kv(out), out + err


def read_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The next line of `proc`'s stdout, waiting at most `timeout` seconds."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output from pid {proc.pid} within {timeout} s"
    return proc.stdout.readline().strip()


def proxies_of(pid: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(pid).children() if c.name().startswith("jitckpt-proxy")]
    except psutil.NoSuchProcess:
        return []


def assert_same_result(kv: dict[str, str], reference: dict[str, str], out: str) -> None:
    assert kv.get("ok") == "1", out
    for key in ("digest", "digest_sum", "acc_first", "acc_last", "event_not_success"):
        assert kv[key] == reference[key], (key, out)


def test_a_proxy_killed_at_random_moments_is_replaced_and_the_run_ends_bitwise(prog: Program,
                                                                                 reference: dict) -> None:
    t0 = time.monotonic()
    rc, kv, out = finish(start(prog))
    undisturbed = time.monotonic() - t0
    assert rc == 0, out
    assert_same_result(kv, reference, out)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for attempt in range(3):
        delay = rng.uniform(0.05, 0.4) * undisturbed  # anywhere in the first 40 % of the run
        proc = start(prog)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)  # polling a clock, not synchronizing: the moment is meant to be random
        victims = proxies_of(proc.pid)
        assert len(victims) == 1 and proc.poll() is None, (seed, attempt, "the run ended before the kill")
        victims[0].kill()
        rc, kv, out = finish(proc)
        assert rc == 0, (seed, attempt, delay, out)
        assert_same_result(kv, reference, out)
        m = re.search(r"jitckpt-proxy \(pid (\d+)\) was killed by signal 9.*\n.*recovered: jitckpt-proxy pid (\d+) "
                      r"took over after replaying (\d+) calls", out)
        assert m and int(m.group(1)) == victims[0].pid and int(m.group(2)) != victims[0].pid, (seed, out)


def test_a_stopped_proxy_is_found_by_the_watchdog_killed_and_replaced(prog: Program, reference: dict) -> None:
    """SIGSTOP on the proxy: every call of the program waits on it, and so would the watchdog's
    queries, but those never wait for device work: unanswered within the hang timeout (1 s here),
    the proxy is taken as hung, killed, and replaced (no minibatch marks: the whole run replayed)."""
    import os
    import signal

    proc = start(prog, JITCKPT_HANG_TIMEOUT="1")
    try:
        # Once collectives have run: the watchdog polls their events and the communicator (before
        # the first one it has nothing to ask, and a stopped proxy is not found: a documented limit).
        assert read_line(proc).startswith("uid=")
        assert read_line(proc) == "init_done=1"
        deadline = time.monotonic() + random.uniform(0.1, 0.3)
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)  # polling a clock, not synchronizing: the moment is meant to be random
        victims = proxies_of(proc.pid)
        assert len(victims) == 1
        os.kill(victims[0].pid, signal.SIGSTOP)
        rc, kv, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for p in proxies_of(proc.pid) + ([victims[0]] if "victims" in locals() and victims else []):
            try:  # a stopped proxy cannot see its client go: it is killed here, by PID
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert rc == 0, out
    assert_same_result(kv, reference, out)
    assert re.search(rf"jitckpt-proxy \(pid {victims[0].pid}\) did not answer the watchdog's \w+ within 1.0 s \(hung or "
                     r"stopped\); it was killed; starting a new jitckpt-proxy", out), out
    assert "recovered: jitckpt-proxy pid" in out and "(every call since the first: no minibatch marks)" in out, out


def test_a_stopped_proxy_of_a_program_without_nccl_is_found_by_the_watchdog(planted: Program) -> None:
    """Without collectives the watchdog has no event to ask about; it asks the proxy something
    (cudaGetDevice) because a call of the program has waited a hang timeout. The planted program
    marks its minibatches, so the stopped proxy's memory held its parameters: it is killed, and
    the program fails with that reason instead of waiting forever."""
    import os
    import signal

    env = planted.env(**PROXY, JITCKPT_HANG_TIMEOUT="1", JITCKPT_VALIDATE_AT="0")  # no scratch proxy
    proc = subprocess.Popen([str(planted.exe), "100000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    victims: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while not victims and time.monotonic() < deadline and proc.poll() is None:
            victims = proxies_of(proc.pid)
            time.sleep(0.005)  # polling for the proxy to appear, bounded by the deadline
        assert len(victims) == 1
        time.sleep(random.uniform(0.05, 0.3))  # a random moment of training (not synchronization)
        os.kill(victims[0].pid, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for p in victims:
            try:  # a stopped proxy cannot see its client go: it is killed here, by PID
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert proc.returncode != 0, out
    assert re.search(rf"jitckpt-proxy \(pid {victims[0].pid}\) did not answer the watchdog's cudaGetDevice within "
                     r"1.0 s \(hung or stopped\); it was killed", out), out
    assert "the parameters and optimizer state were in the lost proxy's device memory" in out, out


@pytest.mark.parametrize("mode", ["sticky", "crash", "error"])
def test_a_transient_device_fault_is_recovered_without_the_program_seeing_it(prog: Program, reference: dict,
                                                                              tmp_path: Path, mode: str) -> None:
    """sticky: the proxy's context gets cudaErrorIllegalAddress (every later call returns it);
    crash: the proxy process kills itself when its stream reaches the faulty collective; error: the
    collective returns ncclSystemError and the communicator's asynchronous error is set."""
    marker = tmp_path / "fault-fired"
    rc, kv, out = finish(start(prog, SIMCUDA_FAIL_MODE=mode, SIMCUDA_FAIL_AT="40", SIMCUDA_FAIL_ONCE=str(marker)))
    assert marker.exists(), "the fault was not injected"
    assert rc == 0, out
    assert_same_result(kv, reference, out)
    cause = {"sticky": "sticky error cudaErrorIllegalAddress", "crash": "was killed by signal 9",
             "error": "NCCL failed: unhandled system error"}[mode]
    assert cause in out and "recovered: jitckpt-proxy pid" in out, out


def test_with_minibatch_marks_an_nccl_failure_replays_only_its_minibatch(prog: Program, reference: dict,
                                                                      tmp_path: Path) -> None:
    """The program marks each step and its optimizer part (`marks`): at a random NCCL operation
    (a grouped send or recv, or the all-reduce) NCCL fails; the buffers of the step's start are
    saved from the old proxy, restored into the new one, and only that step's calls are replayed,
    the failed call among them. (test_minibatch_replay.py does the same with dp_train.)"""
    at = random.randrange(10, 3 * STEPS - 10)  # send, recv and all-reduce: 3 operations a step
    marker = tmp_path / "fault-fired"
    rc, kv, out = finish(start(prog, "marks", SIMCUDA_FAIL_MODE="error", SIMCUDA_FAIL_AT=str(at),
                               SIMCUDA_FAIL_ONCE=str(marker)))
    assert marker.exists(), "the fault was not injected"
    assert rc == 0, (at, out)
    assert_same_result(kv, reference, out)
    m = re.search(r"recovered: jitckpt-proxy pid \d+ took over after replaying (\d+) calls \((\d+) of this minibatch\)",
                  out)
    assert m, (at, out)
    # One step makes about 25 calls; without marks the journal would hold every step's.
    assert 0 < int(m.group(2)) <= 30 and int(m.group(1)) < 120, (at, out)


def test_a_fault_that_comes_back_in_the_replay_fails_the_program_with_the_reason(prog: Program,
                                                                                 tmp_path: Path) -> None:
    """Without SIMCUDA_FAIL_ONCE every proxy faults at the same call: a deterministic fault, which
    a replay cannot get past. The program gets the error, and stderr says why recovery gave up."""
    rc, kv, out = finish(start(prog, SIMCUDA_FAIL_MODE="sticky", SIMCUDA_FAIL_AT="40"))
    assert rc in (2, 3) and "FAIL " in out and kv.get("ok") is None, out  # a CUDA or an NCCL call failed
    # Found at a replayed call or at the synchronize that ends the replay, whichever comes first.
    assert re.search(r"transparent recovery failed: (replaying call \d+ \(\w+\)|the replayed work failed again): "
                     r"the device got the sticky error cudaErrorIllegalAddress", out), out


def test_without_the_journal_a_lost_proxy_fails_the_program_as_before(prog: Program) -> None:
    rc, kv, out = finish(start(prog, JITCKPT_REPLAY_LIMIT_MB="0", SIMCUDA_FAIL_MODE="crash", SIMCUDA_FAIL_AT="40"))
    assert rc != 0 and kv.get("ok") is None, out
    assert "transparent recovery failed: the replay journal is off (JITCKPT_REPLAY_LIMIT_MB=0)" in out, out


def test_a_journal_past_its_limit_turns_recovery_off_and_says_so(prog: Program) -> None:
    rc, kv, out = finish(start(prog, JITCKPT_REPLAY_LIMIT_MB="1"))
    assert rc == 0 and kv.get("ok") == "1", out  # the run itself is not affected
    assert out.count("transparent recovery is off for this process: the replay journal reached its limit of 1 MiB "
                     "(JITCKPT_REPLAY_LIMIT_MB)") == 1, out


def test_a_rank_whose_communicator_has_peers_elsewhere_is_not_replayed_alone(prog: Program) -> None:
    """Rebuilding a communicator with peers in other processes needs them and a store to meet in
    (`jitckpt run --transparent` serves one): run without it, the rank whose proxy died fails with
    that reason instead of replaying into a rendezvous nobody joins."""
    steps = "100000"  # long enough to be killed mid-run; both ranks are stopped by the test
    env = prog.env(**PROXY)
    rank0 = subprocess.Popen([str(prog.exe), "ring", "0", "2", "", steps], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    rank1 = None
    try:
        uid = read_line(rank0)  # "uid=<hex>", printed before anything else
        assert uid.startswith("uid="), uid
        rank1 = subprocess.Popen([str(prog.exe), "ring", "1", "2", uid[4:], steps], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # After the communicator exists (a proxy lost before that is replaced: nothing to rebuild).
        assert read_line(rank1) == "init_done=1"
        victims = proxies_of(rank1.pid)
        assert len(victims) == 1
        victims[0].kill()
        out, _ = rank1.communicate(timeout=TIMEOUT_S)
        assert rank1.returncode != 0, out
        assert ("transparent recovery failed: this process has an NCCL communicator with peers in other processes, "
                "and no way to rebuild it with them (the launcher's store: run the job with `jitckpt run "
                "--transparent`)" in out), out
    finally:
        for p in (rank0, rank1):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


VMM_BASE = 0x3000_0000_0000  # proxy_server/src/fixed_arena.h: FixedArena::kBase
GRANULE = 2 << 20  # the driver's allocation granularity (2 MiB on simcuda, as on a GPU)


def vmm_mapped(pid: int, address: int) -> bool:
    """Whether `address` is in one of simcuda's driver mappings (a memfd) in process `pid`."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return "memfd:simcuda-vmm" in line
    return False


def flushed_lines(proc: subprocess.Popen, n: int) -> dict[str, str]:
    """`n` key=value lines the program wrote with one fflush (one write: buffered together once
    the first has come, within read_line's deadline)."""
    lines = [read_line(proc)] + [proc.stdout.readline().strip() for _ in range(n - 1)]
    assert all("=" in line for line in lines), (lines, proc.poll())  # the program failed (its exit code)
    return dict(line.split("=", 1) for line in lines)


def test_a_new_proxy_hands_out_the_same_pointers_from_its_vmm_arena() -> None:
    """The proxy's device memory is its fixed arena through the driver's VMM calls (issue 46), not
    simcuda's SIMCUDA_ARENA_BASE (set here to another address, which the proxy ignores): cudaMalloc
    gives pointers at the arena's base, first fit at the driver's granularity, mapped (memfds) in
    the proxy and not in the application; after the proxy is SIGKILLed, the new one maps the same
    pointers (the replay checks each), the data is there, and the next allocation is where a
    failure-free proxy puts it."""
    arena = build_program("arena_addresses", kernels=False, nccl=False)
    proc = subprocess.Popen([str(arena.exe), "wait"], env=arena.env(**PROXY, SIMCUDA_ARENA_BASE="0x200000000000"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kv = flushed_lines(proc, 5)
        a, c, d = (int(kv[k], 16) for k in "acd")
        assert kv["roundtrip"] == "1" and a == VMM_BASE, kv
        assert c == a + 2 * GRANULE and d == a + GRANULE, kv  # d reuses b's freed granule, first fit
        first = proxies_of(proc.pid)
        assert len(first) == 1
        assert all(vmm_mapped(first[0].pid, p) for p in (a, c, d))
        assert not vmm_mapped(first[0].pid, 0x2000_0000_0000) and not vmm_mapped(proc.pid, a)
        first[0].kill()  # a zombie until the application reaps it: its next call finds it gone
        proc.stdin.write("go\n")
        proc.stdin.flush()
        kv = flushed_lines(proc, 2)
        assert kv["roundtrip_after"] == "1" and int(kv["e"], 16) == a + 3 * GRANULE, kv
        second = proxies_of(proc.pid)
        assert len(second) == 1 and second[0].pid != first[0].pid
        assert all(vmm_mapped(second[0].pid, p) for p in (a, c, d, a + 3 * GRANULE))
        proc.stdin.write("end\n")
        proc.stdin.flush()
        rc, _, out = finish(proc)
        assert rc == 0, out
        assert f"jitckpt-proxy (pid {first[0].pid}) was killed by signal 9" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_without_the_driver_vmm_calls_the_proxy_allocates_with_cudamalloc_and_says_so(tmp_path: Path) -> None:
    """A driver without the VMM entry points (here: simcuda's runtime without its libcuda.so.1) does
    not break the job: the proxy allocates with cudaMalloc, and says that a replay after a proxy
    restart would find other pointers."""
    import shutil

    from simcuda_progs.simcuda_harness import DEVICE, SIMCUDA_LIBS

    if DEVICE == "cuda":
        pytest.skip("simcuda's libraries only")
    for lib in ("libcudart.so.13", "libnccl.so.2"):
        shutil.copy(SIMCUDA_LIBS / lib, tmp_path / lib)
    arena = build_program("arena_addresses", kernels=False, nccl=False)
    proc = subprocess.run([str(arena.exe)], env={**arena.env(**PROXY), "LD_LIBRARY_PATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    kv = parse_kv(proc.stdout)
    assert proc.returncode == 0 and kv["roundtrip"] == "1", proc.stdout + proc.stderr
    assert int(kv["a"], 16) != VMM_BASE
    assert "the driver has no cuMemAddressReserve" in proc.stderr, proc.stderr
    assert proc.stderr.count("device memory comes from cudaMalloc, not a fixed arena") == 1, proc.stderr


def test_threads_keep_their_device_stream_and_buffer_across_a_replaced_proxy() -> None:
    """Four threads, each on its own channel with its own current device (of two), stream and
    buffer: after the proxy is killed, each thread's channel is the new proxy's channel of the same
    index, replayed in the order the calls were made."""
    threads = build_program("threads_recovery", kernels=True, nccl=False)
    env = threads.env(**PROXY, SIMCUDA_DEVICES="2")
    t0 = time.monotonic()
    clean = subprocess.run([str(threads.exe), "4", "1500"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    undisturbed = time.monotonic() - t0
    assert clean.returncode == 0 and "ok=1" in clean.stdout, clean.stdout + clean.stderr
    proc = subprocess.Popen([str(threads.exe), "4", "1500"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + random.uniform(0.2, 0.5) * undisturbed
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)  # polling a clock: the moment is meant to be random
    victims = proxies_of(proc.pid)
    assert len(victims) == 1 and proc.poll() is None, "the run ended before the kill"
    victims[0].kill()
    rc, kv, out = finish(proc)
    assert rc == 0 and kv.get("ok") == "1" and kv.get("bad") == "0", out
    assert "recovered: jitckpt-proxy pid" in out, out


def test_jitckpt_run_records_a_transparent_recovery_and_report_shows_its_breakdown(prog: Program,
                                                                                    tmp_path: Path) -> None:
    """Under `jitckpt run --transparent` the worker's proxy is killed by simcuda's crash fault: the
    worker is not restarted, the event log gets a transparent_recovery record with the breakdown
    (new proxy, replay, synchronize), and `jitckpt report` shows it."""
    import json
    import sys

    from simcuda_progs.simcuda_harness import REPO

    env = {k: v for k, v in prog.env().items() if not k.startswith("JITCKPT_")}
    env.update(PYTHONPATH=str(REPO), SIMCUDA_FAIL_MODE="crash", SIMCUDA_FAIL_AT="40",
               SIMCUDA_FAIL_ONCE=str(tmp_path / "fault-fired"))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "1", "--transparent", "--no-python",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(run), "--max-restarts", "0",
           "--status-interval", "0", str(prog.exe), "ring", "env", "env", str(tmp_path / "uid"), "200"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ok=1" in out, out
    assert (tmp_path / "fault-fired").exists(), "the fault was not injected"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    assert [e["event"] for e in events].count("worker_start") == 1, "the worker was restarted"
    recs = [e for e in events if e["event"] == "transparent_recovery"]
    assert len(recs) == 1, events
    rec = recs[0]
    assert rec["recovered"] is True and rec["rank"] == 0 and rec["gen"] == 0 and rec["calls"] > 0, rec
    assert "was killed by signal 9" in rec["cause"], rec
    parts = rec["new_proxy_s"] + rec["replay_s"] + rec["synchronize_s"]
    assert 0 < parts <= rec["total_s"] + 1e-6, rec
    report = subprocess.run([sys.executable, "-m", "jitckpt", "report", str(run)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "Transparent recoveries" in report.stdout and "recovered" in report.stdout, report.stdout
    assert re.search(r"transparent recoveries \(no restart\) +1 of 1", report.stdout), report.stdout
    started = min(e["t"] for e in events)
    assert 0 <= rec["t"] - started < TIMEOUT_S, (rec["t"], started)  # the same clock as the launcher's


@pytest.fixture(scope="module")
def planted() -> Program:
    return build_program("planted_nondeterminism", kernels=True, nccl=False)


def test_replay_validation_passes_a_deterministic_program(planted: Program) -> None:
    """At minibatch 5 (and every JITCKPT_VALIDATE_EVERY after) the journal is replayed into a scratch
    proxy on the buffers of the minibatch's start and every device buffer compared with the live
    proxy's: the same bytes, and the run is bitwise the direct one."""
    direct = subprocess.run([str(planted.exe), "20"], env=planted.env(), capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    clean = subprocess.run([str(planted.exe), "20"], env=planted.env(**PROXY, JITCKPT_VALIDATE_EVERY="10"),
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert clean.returncode == 0 and parse_kv(clean.stdout)["digest"] == parse_kv(direct.stdout)["digest"], clean
    for minibatch in (5, 15):
        assert re.search(rf"replay validation at minibatch {minibatch}: replaying its \d+ calls on the buffers of its "
                         r"start gave all [\d.]+ MiB of device buffers bitwise", clean.stderr), clean.stderr


def test_replay_validation_catches_a_buffer_changed_in_place_before_the_optimizer_step(planted: Program) -> None:
    """A running statistic updated in place in the forward part (BatchNorm's kind) replays bitwise from
    the minibatch's start, but not from the buffers a failure before the optimizer step would find:
    a recovery would update it twice. Validation replays from both and turns recovery off, naming it;
    the program goes on unharmed."""
    direct = subprocess.run([str(planted.exe), "20", "inplace"], env=planted.env(), capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    run = subprocess.run([str(planted.exe), "20", "inplace"], env=planted.env(**PROXY), capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0 and parse_kv(run.stdout)["digest"] == parse_kv(direct.stdout)["digest"], run
    assert re.search(r"replay validation at minibatch 5 failed: replayed on the buffers of its start as a failure "
                     r"before the optimizer step would find them, the allocation at 0x[0-9a-f]+ \(4000 bytes\) differs "
                     r"from byte \d+ on \(the minibatch changes buffers that outlive it in place", run.stderr), run.stderr


def test_replay_validation_catches_a_planted_nondeterminism_and_turns_recovery_off(planted: Program,
                                                                                  tmp_path: Path) -> None:
    """The planted program's forward kernel reads a counter in mapped pinned memory that the host
    bumps without a CUDA call: the replay reads another value, validation says where the buffers
    differ, transparent recovery is turned off (event log and report too), and the program itself
    goes on unharmed. Under `jitckpt run --transparent`."""
    import json
    import sys

    from simcuda_progs.simcuda_harness import REPO

    env = {k: v for k, v in planted.env().items() if not k.startswith("JITCKPT_")}
    env["PYTHONPATH"] = str(REPO)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "1", "--transparent", "--no-python",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(run), "--max-restarts", "0",
           "--status-interval", "0", str(planted.exe), "20", "plant"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ok=1" in out, out
    assert re.search(r"transparent recovery is off for this process: replay validation at minibatch 5 failed: the "
                     r"allocation at 0x[0-9a-f]+ \(4000 bytes\) differs from byte \d+ on", out), out
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    checks = [e for e in events if e["event"] == "transparent_validation"]
    assert len(checks) == 1 and checks[0]["matched"] is False and checks[0]["minibatch"] == 5, checks
    # The launcher's console says it too (its own line, read from the event log).
    assert re.search(r"\[jitckpt [\d:]+\] rank 0: replay validation at minibatch 5 found a difference \(.*\); transparent "
                     r"recovery is off for it", proc.stderr), proc.stderr
    report = subprocess.run([sys.executable, "-m", "jitckpt", "report", str(run)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert re.search(r"replay validations \(failed\) +1 \(1\)", report.stdout), report.stdout
