"""Driver of the CUDA/NCCL data-parallel program (libdp_train.so) for the interposer tests.

One process per rank. The step runs through ``ctypes.PyDLL``, so the main thread keeps the GIL while
it blocks in cudaStreamSynchronize behind a hung all-reduce, the case libjit.so's GIL hand-off must
handle. On a failure reported by libjit.so, the callback copies the device state to the host (plain
cudaMemcpy, which libjit.so moves to a fresh stream), writes ``<ckpt-dir>/rank<r>.bin`` + ``.json``
and exits with code 75 (jitckpt's EXIT_JIT_SAVED), or 76 if this rank cannot copy its state. On start it resumes from any checkpoint there.

    python dp_train.py --lib-dir D --rank R --world W --id-file F --steps N --ckpt-dir C --out O

With ``--jitckpt`` it is a script for ``jitckpt run`` instead: rank and world come from the launcher's
environment, the NCCL unique id goes through a torch.distributed TCPStore at MASTER_ADDR:MASTER_PORT,
and saving/resuming goes through ``jitckpt.init(save_fn)`` / ``jitckpt.get_checkpoint_path()`` (the
jitckpt runtime registers libjit.so's failure callback itself). ``--fail-gen0 MODE:RANK:AT`` sets
simcuda's failure injection for the first generation only.
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
EXIT_NO_SAVE = 76
ID_WAIT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of one rank."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib-dir", required=True, type=Path, help="directory holding libdp_train.so")
    ap.add_argument("--jitckpt", action="store_true", help="run under `jitckpt run` (see module doc)")
    ap.add_argument("--fail-gen0", default=None, help="with --jitckpt: MODE:RANK:AT simcuda injection, gen 0 only")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--id-file", type=Path, default=None, help="rank 0 writes the NCCL unique id here")
    ap.add_argument("--steps", required=True, type=int)
    ap.add_argument("--ckpt-dir", type=Path, default=None)
    ap.add_argument("--out", required=True, help="final state (float32 bytes); '{rank}' is replaced")
    ap.add_argument("--hang-timeout", type=float, default=None, help="libjit.so hang timeout (s)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--status-out", type=Path, default=None, help="write _native.status() here at the end")
    ap.add_argument("--step-times", type=Path, default=None, help="write each step's seconds here (JSON list)")
    ap.add_argument("--maps-out", type=Path, default=None,
                    help="at the end, write /proc/<pid>/maps of this process (app.maps) and of each child "
                         "(<pid>.maps: the device proxy in proxy mode) into this directory")
    args = ap.parse_args(argv)
    if args.jitckpt:
        args.rank, args.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    elif None in (args.rank, args.world, args.id_file, args.ckpt_dir):
        ap.error("--rank, --world, --id-file and --ckpt-dir are required without --jitckpt")
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


class Model:
    """libdp_train.so through ctypes.PyDLL: calls keep the GIL, also while blocked."""

    def __init__(self, lib_dir: Path) -> None:
        self.lib = ctypes.PyDLL(str(lib_dir / "libdp_train.so"))
        self.lib.dp_step.argtypes = [ctypes.c_longlong]
        self.lib.dp_init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_float, ctypes.c_float]
        self.state = None

    def init(self, rank: int, world: int, uid: bytes, dim: int, batch: int) -> None:
        check(self.lib.dp_init(rank, world, uid, 0, dim, batch, 0.05, 0.9), "dp_init")
        self.state = (ctypes.c_float * self.lib.dp_state_size())()

    def step(self, step: int) -> None:
        check(self.lib.dp_step(step), f"dp_step({step})")

    def get_state(self) -> bytes:
        """Device -> host with plain cudaMemcpy (moved to a fresh stream by libjit.so during a save)."""
        check(self.lib.dp_get_state(self.state), "dp_get_state")
        return bytes(self.state)

    def set_state(self, raw: bytes) -> None:
        ctypes.memmove(self.state, raw, len(raw))
        check(self.lib.dp_set_state(self.state), "dp_set_state")


def run_harness(args: argparse.Namespace) -> int:
    """Own harness: the callback saves <ckpt-dir>/rank<r>.{bin,json} and exits 75."""
    from jitckpt import _native

    model = Model(args.lib_dir)
    if args.hang_timeout is not None:
        _native.configure(mode="observe", hang_timeout=args.hang_timeout)
    model.init(args.rank, args.world, exchange_unique_id(model.lib, args.rank, args.id_file), args.dim, args.batch)

    completed = 0  # optimizer steps applied to the device state
    restored = load_checkpoint(args.ckpt_dir)
    if restored is not None:
        completed, raw = restored
        model.set_state(raw)
        print(f"rank {args.rank}: resumed at step {completed}", flush=True)

    main_thread = threading.main_thread()

    def on_failure(kind: str, detail: str) -> None:
        # Runs on libjit.so's watchdog thread while the main thread is stuck in dp_step.
        t0 = time.monotonic()
        try:
            state = model.get_state()
        except RuntimeError as e:  # e.g. a sticky device error on this rank: a replica must save
            print(f"rank {args.rank}: cannot save after {kind} ({detail}): {e}", flush=True)
            raise SystemExit(EXIT_NO_SAVE)
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        base = args.ckpt_dir / f"rank{args.rank}"
        base.with_suffix(".bin").write_bytes(state)
        meta = {"step": completed, "kind": kind, "detail": detail, "save_s": time.monotonic() - t0,
                "callback_thread_is_main": threading.current_thread() is main_thread,
                "status": _native.status()}
        tmp = base.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, base.with_suffix(".json"))
        print(f"rank {args.rank}: JIT checkpoint at step {completed} ({kind})", flush=True)
        raise SystemExit(EXIT_JIT_SAVED)

    _native.set_failure_callback(on_failure)
    times = []
    for step in range(completed, args.steps):
        t0 = time.perf_counter()
        _native.mark_minibatch(step)
        _native.set_phase("forward")
        model.step(step)
        completed = step + 1
        times.append(time.perf_counter() - t0)
    if args.step_times is not None:
        args.step_times.write_text(json.dumps(times))
    Path(args.out.format(rank=args.rank)).write_bytes(model.get_state())
    if args.status_out is not None:
        args.status_out.write_text(json.dumps(_native.status()))
    if args.maps_out is not None:
        import psutil

        args.maps_out.mkdir(parents=True, exist_ok=True)
        (args.maps_out / "app.maps").write_text(Path("/proc/self/maps").read_text())
        for child in psutil.Process().children():
            (args.maps_out / f"{child.pid}.maps").write_text(Path(f"/proc/{child.pid}/maps").read_text())
    print(f"rank {args.rank}: finished {args.steps} steps", flush=True)
    return 0


def run_under_jitckpt(args: argparse.Namespace) -> int:
    """Script for `jitckpt run`: jitckpt.init(save_fn) + get_checkpoint_path(), TCPStore rendezvous."""
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.fail_gen0 and gen == 0:  # simcuda reads these on its first collective
        mode, rank, at = args.fail_gen0.split(":")
        os.environ.update(SIMCUDA_FAIL_MODE=mode, SIMCUDA_FAIL_RANK=rank, SIMCUDA_FAIL_AT=at)
    import datetime

    import jitckpt
    import torch.distributed as dist
    from jitckpt import _native

    model = Model(args.lib_dir)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), args.world,
                          is_master=args.rank == 0, timeout=datetime.timedelta(seconds=ID_WAIT_S))
    if args.rank == 0:
        buf = ctypes.create_string_buffer(model.lib.dp_unique_id_size())
        check(model.lib.dp_get_unique_id(buf), "dp_get_unique_id")
        store.set("nccl_unique_id", buf.raw)
    uid = store.get("nccl_unique_id")
    model.init(args.rank, args.world, uid, args.dim, args.batch)

    completed = 0

    def save_fn(path: str) -> None:
        Path(path, "state.bin").write_bytes(model.get_state())
        Path(path, "step.json").write_text(json.dumps({"completed": completed}))

    jitckpt.init(save_fn, step_fn=lambda: completed)
    ckpt = jitckpt.get_checkpoint_path()
    if ckpt is not None:
        completed = json.loads(Path(ckpt, "step.json").read_text())["completed"]
        model.set_state(Path(ckpt, "state.bin").read_bytes())
        print(f"rank {args.rank}: resumed at step {completed} from {ckpt}", flush=True)
    # The runtime saves from a helper thread only while the main thread is inside a blocking region;
    # dp_step (all-reduce + device optimizer waiting for it) is that region.
    for step in range(completed, args.steps):
        jitckpt.mark_step(step)  # also tells libjit.so the minibatch
        with jitckpt.blocking_region("dp_step"):
            model.step(step)
        completed = step + 1
    Path(args.out.format(rank=args.rank)).write_bytes(model.get_state())
    print(f"rank {args.rank}: finished {args.steps} steps (native status: {_native.status()['last_error']})",
          flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Train, resuming from a JIT checkpoint if one exists; JIT-save on a libjit.so failure report."""
    args = parse_args(argv)
    return run_under_jitckpt(args) if args.jitckpt else run_harness(args)


if __name__ == "__main__":
    sys.exit(main())
