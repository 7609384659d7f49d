"""The checks of `make gpu-check` (tests/gpu/gpu_check.py runs each in a process of its own):
``python tests/gpu/checks.py NAME --result FILE`` writes ``{"status": "pass"|"fail"|"skip"|"not yet",
"detail": ..., "numbers": {...}}``. ``JITCKPT_TEST_DEVICE`` says where: ``cuda`` (the real runtime,
driver and NCCL) or ``simcuda``. Every process a check starts has a deadline and is killed by PID."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "native"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench_proxy import MODES, call_latency  # noqa: E402  (direct, observe, proxy: their environments)
DEVICE = os.environ.get("JITCKPT_TEST_DEVICE", "simcuda")
TIMEOUT_S = 60


def run_bounded(cmd: list, timeout: float, **kw: object) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, its output captured; at ``timeout``, or whatever happens,
    its process group is SIGKILLed (a launcher's workers exit when their launcher's channel ends)."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"killed at its {timeout} s deadline"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def result(status: str, detail: str, **numbers: object) -> dict:
    return {"status": status, "detail": detail, "numbers": numbers}


def programs() -> dict:
    """Check 1: an nvcc-built CUDA + NCCL program (streams, pinned memory, send/recv, an
    all-reduce, its own kernels) direct, under observe mode and under proxy mode: the same final
    buffers, bitwise. One rank on a GPU (NCCL refuses two ranks on one device), two on simcuda."""
    from simcuda_progs.simcuda_harness import RankGroup, build_program

    prog = build_program("streams_pinned_sendrecv", kernels=True, nccl=True)
    nranks = 1 if DEVICE == "cuda" else 2
    digests = {}
    for mode in MODES:
        with RankGroup(prog, "ring", nranks, window_ms=5, env=prog.env(**MODES[mode])) as group:
            kvs = [rp.finish(timeout=TIMEOUT_S) for rp in group.ranks]
            codes = [rp.proc.returncode for rp in group.ranks]
            seen = ["\n".join(rp.seen) for rp in group.ranks]
        bad = [r for r, (kv, rc) in enumerate(zip(kvs, codes)) if rc != 0 or kv.get("ok") != "1"]
        if bad:
            return result("fail", f"{mode}: rank {bad[0]} exited {codes[bad[0]]}: {seen[bad[0]][-1500:]}")
        digests[mode] = [kv["digest"] for kv in kvs]
    if not digests["direct"] == digests["observe"] == digests["proxy"]:
        return result("fail", f"final buffers differ: {digests}")
    return result("pass", f"{nranks} rank(s): the same digests direct, observe and proxy ({digests['direct']})")


VMM_BASE = 0x3000_0000_0000  # proxy_server/src/fixed_arena.h: FixedArena::kBase


def _lines(proc: subprocess.Popen, n: int, timeout: float) -> dict:
    """`n` key=value lines the program wrote with one fflush, within `timeout` seconds."""
    import select

    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise TimeoutError(f"no output from pid {proc.pid} within {timeout} s")
    return dict(proc.stdout.readline().strip().split("=", 1) for _ in range(n))


def _proxies(pid: int) -> list:
    import psutil

    return [c for c in psutil.Process(pid).children() if c.name().startswith("jitckpt-proxy")]


def _device_mappings(pid: int) -> list:
    """The lines of /proc/PID/maps that are a driver's or a device's (the GPU's or simcuda's)."""
    text = Path(f"/proc/{pid}/maps").read_text()
    return [line for line in text.splitlines() if any(k in line for k in ("/dev/nvidia", "libcuda.so", "simcuda-vmm"))]


def arena() -> dict:
    """Check 2: the proxy's fixed arena through the driver's VMM API: cudaMalloc's pointers at the
    arena's base; the application maps no device memory and no driver; after the proxy is
    SIGKILLed the new proxy gives the same pointers (the replay checks each), the data is back, and
    the next allocation is where a failure-free proxy puts it."""
    from simcuda_progs.simcuda_harness import build_program

    prog = build_program("arena_addresses", kernels=False, nccl=False)
    proc = subprocess.Popen([str(prog.exe), "wait"], env=prog.env(**MODES["proxy"]), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        kv = _lines(proc, 5, TIMEOUT_S)
        a, c, d = (int(kv[k], 16) for k in "acd")
        if a != VMM_BASE or kv.get("roundtrip") != "1":
            return result("fail", f"cudaMalloc gave {kv['a']}, not the arena's base {hex(VMM_BASE)} "
                          f"(roundtrip={kv.get('roundtrip')}): {proc.stderr.read() if proc.poll() is not None else ''}")
        granule = d - a  # b's freed hole, reused first fit: one granule after a
        app_maps = _device_mappings(proc.pid)
        first = _proxies(proc.pid)
        if len(first) != 1:
            return result("fail", f"{len(first)} proxies under the application")
        proxy_maps = len(_device_mappings(first[0].pid))
        first[0].kill()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        kv = _lines(proc, 2, TIMEOUT_S)
        second = _proxies(proc.pid)
        proc.stdin.write("end\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    if proc.returncode != 0 or kv.get("roundtrip_after") != "1":
        return result("fail", f"after the proxy's kill: exit {proc.returncode}, {kv}: {err[-1500:]}")
    if int(kv["e"], 16) != c + granule or len(second) != 1 or second[0].pid == first[0].pid:
        return result("fail", f"the new proxy's next allocation is {kv['e']}, expected {hex(c + granule)}")
    if app_maps:
        return result("fail", f"the application maps device memory or a driver: {app_maps[:3]}")
    return result("pass", f"pointers at {hex(VMM_BASE)}, granularity {granule >> 20} MiB, the same after a proxy "
                  f"SIGKILL (replayed, data intact); the application maps no driver or device memory "
                  f"(the proxy: {proxy_maps} such mappings)", granularity_mib=granule >> 20)


def transparent_recovery() -> dict:
    """Check 3: the proxy SIGKILLed mid-run (at a third of an undisturbed run): a new proxy, the
    replay, and the final buffers bitwise equal to a failure-free run. One rank. Numbers: the time
    the kill cost the run, against what a restart of the program would redo (the work before the
    kill); on a GPU also the journal's cost (the undisturbed run with it against one without). The
    sticky-error half (a kernel writing out of bounds) is not built: a replay repeats that kernel."""
    import time

    from simcuda_progs.simcuda_harness import build_program, parse_kv

    prog = build_program("streams_pinned_sendrecv", kernels=True, nccl=True)
    cmd = [str(prog.exe), "ring", "0", "1", "", "1500"]
    t0 = time.monotonic()
    ref = run_bounded(cmd, TIMEOUT_S, env=prog.env(**MODES["proxy"]))
    undisturbed = time.monotonic() - t0
    want = parse_kv(ref.stdout)
    if ref.returncode != 0 or want.get("ok") != "1":
        return result("fail", f"the undisturbed run exited {ref.returncode}: {(ref.stdout + ref.stderr)[-1500:]}")
    t1 = time.monotonic()
    proc = subprocess.Popen(cmd, env=prog.env(**MODES["proxy"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + undisturbed / 3
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)  # a clock, not a synchronization: a moment mid-run
        victims = _proxies(proc.pid) if proc.poll() is None else []
        if len(victims) != 1:
            return result("fail", "the run ended (or had no proxy) before the kill")
        killed_at = time.monotonic()
        victims[0].kill()
        out, err = proc.communicate(timeout=TIMEOUT_S)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    got = parse_kv(out)
    if proc.returncode != 0 or got.get("ok") != "1":
        return result("fail", f"after the proxy's kill: exit {proc.returncode}: {(out + err)[-1500:]}")
    keys = ("digest", "digest_sum", "acc_first", "acc_last")
    if any(got.get(k) != want.get(k) for k in keys):
        return result("fail", f"final state differs: {[(k, got.get(k), want.get(k)) for k in keys]}")
    if "took over after replaying" not in err + out:
        return result("fail", f"no replacement proxy was reported: {(out + err)[-1500:]}")
    numbers = {"undisturbed_s": round(undisturbed, 3), "lost_s": round(killed_at - t1 + took - undisturbed, 3),
               # Without the journal the program fails at the kill; started again, it redoes what it had done.
               "restart_redoes_s": round(killed_at - t1, 3)}
    if DEVICE == "cuda":  # the journal's cost, one pair (simulated: bench/bench_transparent_recovery.py)
        t0 = time.monotonic()
        off = run_bounded(cmd, TIMEOUT_S, env=prog.env(**MODES["proxy"], JITCKPT_REPLAY_LIMIT_MB="0"))
        if off.returncode == 0:
            numbers["journal_overhead"] = round(undisturbed / (time.monotonic() - t0) - 1, 4)
    return result("pass", "proxy SIGKILLed a third into the run: a new proxy replayed the calls, final buffers "
                  "bitwise equal to the undisturbed run; the sticky-error case is not built", **numbers)


TORCH_PROBE = r"""
import hashlib, sys, torch
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
dev = torch.device("cuda")
net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).to(dev)
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
g = torch.Generator(device="cpu").manual_seed(1)
for step in range(int(sys.argv[1])):
    x, y = torch.randn(64, 256, generator=g).to(dev), torch.randn(64, 64, generator=g).to(dev)
    loss = torch.nn.functional.mse_loss(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
torch.cuda.synchronize()
h = hashlib.sha256()
for p in net.parameters():
    h.update(p.detach().cpu().numpy().tobytes())
print("digest=" + h.hexdigest()[:16])
"""


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def torch_observe() -> dict:
    """Check 4: a torch training loop on CUDA tensors gives the same digests under observe-mode
    libjit.so as without it."""
    if not _torch_cuda():
        return result("skip", "this torch sees no CUDA device")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
    digests = {}
    for mode in ("direct", "observe"):
        out = run_bounded([sys.executable, "-c", TORCH_PROBE, "30"], TIMEOUT_S, env={**env, **MODES[mode]})
        if out.returncode != 0 or "digest=" not in out.stdout:
            return result("fail", f"{mode}: exited {out.returncode}: {out.stderr[-1500:]}")
        digests[mode] = out.stdout.split("digest=")[1].split()[0]
    if digests["direct"] != digests["observe"]:
        return result("fail", f"digests differ: {digests}")
    return result("pass", f"30 AdamW steps on CUDA: the same digest with and without libjit.so ({digests['direct']}); "
                  "the watchdog on a hanging collective is not checked yet")


def user_level_jit() -> dict:
    """Check 5: two ranks sharing the GPU (DDP over gloo on CUDA tensors), one SIGKILLed at step 6:
    `jitckpt run` resumes from the survivor's JIT checkpoint, bitwise equal to a failure-free run."""
    if not _torch_cuda():
        return result("skip", "this torch sees no CUDA device")
    import torch

    script = str(REPO / "examples" / "train_ddp.py")
    common = ["--device", "cuda", "--steps", "10", "--model", "ln", "--in-dim", "256", "--hidden", "512"]
    with tempfile.TemporaryDirectory(prefix="gpu-check-jit-") as tmp:
        t = Path(tmp)
        runs = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             script, *common, "--no-jitckpt", "--out", str(t / "ref.pt")],
                "jitckpt": [sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2", "--checkpoint-dir",
                            str(t / "ckpt"), "--run-dir", str(t / "run"), script, *common, "--inject", "0:1:6:kill",
                            "--out", str(t / "jit.pt")]}
        for name, cmd in runs.items():
            out = run_bounded(cmd, TIMEOUT_S + 30, cwd=t)
            if out.returncode != 0:
                return result("fail", f"{name} exited {out.returncode}: {(out.stdout + out.stderr)[-1500:]}")
        ref, got = torch.load(t / "ref.pt", weights_only=True), torch.load(t / "jit.pt", weights_only=True)
        events = [json.loads(line) for line in (t / "run" / "events.jsonl").read_text().splitlines()]
    bad = [k for k in ref if not torch.equal(ref[k], got[k])]
    if bad:
        return result("fail", f"final state differs from the failure-free run in {bad[:3]}")
    summary = [e for e in events if e.get("event") == "recovery_summary"]
    if not summary:
        return result("fail", "no recovery_summary event: the kill was not recovered by a JIT checkpoint")
    s = summary[0]
    return result("pass", f"rank 1 SIGKILLed at step 6: bitwise equal to torchrun's run, {s.get('steps_redone')} "
                  "minibatch(es) redone; the side-stream copy is not asserted yet",
                  recovery_s=round(float(s.get("total_s", 0.0)), 3), save_s=round(float(s.get("save_s") or 0.0), 3))


def numbers() -> dict:
    """Check 6: per-call latency of the CUDA runtime as an nvcc program sees it, direct, observe
    and proxy (a synchronous call, an event record, a kernel launch), medians in ns
    (bench/bench_proxy.py's measurement)."""
    rows = call_latency(5000, 1)
    flat = {f"{m} {k}": round(row[k]) for m, row in rows.items() for k in ("sync_ns", "event_record_ns", "launch_ns")}
    where = "measured on this GPU" if DEVICE == "cuda" else "simcuda"
    return result("pass", f"call latencies ({where}): medians in ns, below", **flat)


CHECKS: dict[str, Callable[[], dict]] = {f.__name__: f for f in (programs, arena, transparent_recovery, torch_observe,
                                                                 user_level_jit, numbers)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(CHECKS))
    ap.add_argument("--result", type=Path, required=True)
    args = ap.parse_args()
    try:
        res = CHECKS[args.name]()
    except BaseException as e:  # noqa: BLE001 - a check's error is its result, with its type
        import traceback

        traceback.print_exc()
        if type(e).__name__ == "Skipped":  # the harness's pytest.skip: a tool missing, named
            res = result("skip", str(e))
        else:
            res = result("fail", f"{type(e).__name__}: {e}"[:1500])
    args.result.write_text(json.dumps(res))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
