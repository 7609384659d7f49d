"""Driver of the CUDA/NCCL data-parallel program (libdp_train.so) for the interposer tests.

One process per rank. The step runs through ``ctypes.PyDLL``, so the main thread keeps the GIL while
it blocks in cudaStreamSynchronize behind a hung all-reduce, the case libjit.so's GIL hand-off must
handle. On a failure reported by libjit.so, the callback copies the device state to the host (plain
cudaMemcpy, which libjit.so moves to a fresh stream), writes ``<ckpt-dir>/rank<r>.bin`` + ``.json``
and exits with code 75 (jitckpt's EXIT_JIT_SAVED). On start it resumes from any checkpoint there.

    python dp_train.py --lib-dir D --rank R --world W --id-file F --steps N --ckpt-dir C --out O
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

EXIT_JIT_SAVED = 75
ID_WAIT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of one rank."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib-dir", required=True, type=Path, help="directory holding libdp_train.so")
    ap.add_argument("--rank", required=True, type=int)
    ap.add_argument("--world", required=True, type=int)
    ap.add_argument("--id-file", required=True, type=Path, help="rank 0 writes the NCCL unique id here")
    ap.add_argument("--steps", required=True, type=int)
    ap.add_argument("--ckpt-dir", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="final state (float32 bytes)")
    ap.add_argument("--hang-timeout", type=float, default=None, help="libjit.so hang timeout (s)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--status-out", type=Path, default=None, help="write _native.status() here at the end")
    args = ap.parse_args(argv)
    if not 0 <= args.rank < args.world:
        ap.error(f"--rank {args.rank} must be in [0, --world {args.world})")
    if args.steps <= 0 or args.dim <= 0 or args.batch <= 0:
        ap.error("--steps, --dim and --batch must be positive")
    return args


def exchange_unique_id(lib: ctypes.PyDLL, rank: int, id_file: Path) -> bytes:
    """Rank 0 creates the NCCL unique id and publishes it atomically; the others read it."""
    size = lib.dp_unique_id_size()
    if rank == 0:
        buf = ctypes.create_string_buffer(size)
        check(lib.dp_get_unique_id(buf), "dp_get_unique_id")
        tmp = id_file.with_suffix(".tmp")
        tmp.write_bytes(buf.raw)
        os.replace(tmp, id_file)
        return buf.raw
    deadline = time.monotonic() + ID_WAIT_S
    while not id_file.exists():  # bounded rendezvous on a file written by rank 0
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: {id_file} not written by rank 0 within {ID_WAIT_S}s")
        time.sleep(0.01)
    return id_file.read_bytes()


def check(rc: int, what: str) -> None:
    """Raise on a non-zero return code of the C API."""
    if rc != 0:
        raise RuntimeError(f"{what} failed with code {rc}")


def load_checkpoint(ckpt_dir: Path) -> tuple[int, bytes] | None:
    """Newest JIT checkpoint of any rank (replicas hold the same state; verified here)."""
    metas = sorted(ckpt_dir.glob("rank*.json"))
    if not metas:
        return None
    found = []
    for meta_path in metas:
        meta = json.loads(meta_path.read_text())
        found.append((meta["step"], meta_path.with_suffix(".bin").read_bytes()))
    step, state = max(found, key=lambda f: f[0])
    for other_step, other_state in found:
        if other_step == step and other_state != state:
            raise SystemExit(f"replica checkpoints at step {step} differ: the save was inconsistent")
    return step, state


def main(argv: list[str] | None = None) -> int:
    """Train, resuming from a JIT checkpoint if one exists; JIT-save on a libjit.so failure report."""
    args = parse_args(argv)
    from jitckpt import _native

    lib = ctypes.PyDLL(str(args.lib_dir / "libdp_train.so"))  # PyDLL: calls keep the GIL
    lib.dp_step.argtypes = [ctypes.c_longlong]
    lib.dp_init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                            ctypes.c_int, ctypes.c_float, ctypes.c_float]
    if args.hang_timeout is not None:
        _native.configure(mode="observe", hang_timeout=args.hang_timeout)
    uid = exchange_unique_id(lib, args.rank, args.id_file)
    check(lib.dp_init(args.rank, args.world, uid, 0, args.dim, args.batch, 0.05, 0.9), "dp_init")
    n = lib.dp_state_size()
    state = (ctypes.c_float * n)()

    completed = 0  # optimizer steps applied to the device state
    restored = load_checkpoint(args.ckpt_dir)
    if restored is not None:
        completed, raw = restored
        ctypes.memmove(state, raw, len(raw))
        check(lib.dp_set_state(state), "dp_set_state")
        print(f"rank {args.rank}: resumed at step {completed}", flush=True)

    main_thread = threading.main_thread()

    def on_failure(kind: str, detail: str) -> None:
        # Runs on libjit.so's watchdog thread while the main thread is stuck in dp_step.
        t0 = time.monotonic()
        check(lib.dp_get_state(state), "dp_get_state")
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        base = args.ckpt_dir / f"rank{args.rank}"
        base.with_suffix(".bin").write_bytes(bytes(state))
        meta = {"step": completed, "kind": kind, "detail": detail, "save_s": time.monotonic() - t0,
                "callback_thread_is_main": threading.current_thread() is main_thread,
                "status": _native.status()}
        tmp = base.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, base.with_suffix(".json"))
        print(f"rank {args.rank}: JIT checkpoint at step {completed} ({kind})", flush=True)
        raise SystemExit(EXIT_JIT_SAVED)

    _native.set_failure_callback(on_failure)
    for step in range(completed, args.steps):
        _native.mark_minibatch(step)
        _native.set_phase("forward")
        check(lib.dp_step(step), f"dp_step({step})")
        completed = step + 1
    check(lib.dp_get_state(state), "dp_get_state")
    args.out.write_bytes(bytes(state))
    if args.status_out is not None:
        args.status_out.write_text(json.dumps(_native.status()))
    print(f"rank {args.rank}: finished {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
