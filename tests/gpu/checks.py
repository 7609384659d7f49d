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


def arena() -> dict:
    """Check 2: the device arena through the driver's VMM API (the same pointers across a proxy
    restart, device memory not mapped in the application). Not built yet."""
    return result("not yet", "the proxy's fixed arena is simcuda's (SIMCUDA_ARENA_BASE); the VMM arena "
                  "(cuMemAddressReserve/cuMemCreate/cuMemMap) is not built, so nothing here can show it")


def transparent_recovery() -> dict:
    """Check 3: a proxy SIGKILLed mid-run and a sticky error, recovered by replay. It needs the
    fixed arena on a GPU (check 2); on simcuda the tests/native suite shows it."""
    if DEVICE == "cuda":
        return result("not yet", "needs the VMM arena (check 2): a new proxy would hand out other device pointers")
    return result("skip", "simulated: tests/native/test_transparent_recovery.py shows it on simcuda (make test)")


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
