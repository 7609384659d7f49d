"""Recovery time against the job's size: the restart path against the in-process path (issue 48).

A model, not a measurement: every constant below is cited, and where a source gives one point
the scaling around it is an assumption, said so. All times in seconds, sizes in bytes.

* Restart path (every rank): detection, a new process (interpreter, torch, the CUDA context), NCCL's
  kernel load in that process, a new communicator of N ranks, the rank's state loaded from storage,
  the model compiled again.
* In-process path: detection, the broken communicator aborted, then either a new communicator of N
  ranks (re-init: the survivors' processes already loaded NCCL's kernels) or ``ncclCommShrink`` +
  grow (NCCL >= 2.27 / 2.29), one replacement rank receiving its state from a replica over the
  network, and that rank's compile from a warm cache (a warm standby has loaded torch, NCCL's kernels
  and the CUDA context ahead, as jitckpt's standbys import torch ahead). No measurement of
  ``ncclCommGrow`` was found: a grow is assumed to cost what a shrink of the same size does.

Sources (``shared/reference/recovery-landscape.md``):

* NCCL init: 55 s on 8x B200, 52 s of it loading kernels (nccl #1646); 2.5 min "above certain K
  GPUs" (Meta, nccl #1156, 2024). Assumed: that point is 4,096 GPUs, and the rest of an init grows
  linearly in N between the two points (the bootstrap's all-gather of addresses is linear).
* ncclCommShrink: 1.53 / 1.38 / 1.44 / 1.67 / 2.03 / 2.02 s at 32 / 64 / 128 / 256 / 512 / 1,024
  GPUs (NVIDIA-NeMo/RL PR #3186); extrapolated with a least-squares line in log2(N).
* The other constants are this repository's measurements or a user's inputs (``compile_s``, the
  state per GPU, the bandwidths), with defaults for an 8-GPU H100/H200 node: 10 GB of state per GPU
  (e.g. a 70 B model's bf16 weights, fp32 master copy and Adam moments, 14 bytes a parameter, over
  98 GPUs), storage read at 2 GB/s per GPU (a share of a node's NVMe RAID0, 7-12 GB/s per drive),
  state from a replica at 25 GB/s (one 200 Gb/s NIC per GPU).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# (GPUs, seconds) of ncclCommShrink, NVIDIA-NeMo/RL PR #3186.
SHRINK_POINTS = ((32, 1.53), (64, 1.38), (128, 1.44), (256, 1.67), (512, 2.03), (1024, 2.02))
NCCL_KERNEL_LOAD_S = 52.0   # of a 55 s init on 8x B200 (nccl #1646)
NCCL_INIT_8_S = 3.0         # the rest of that init
NCCL_INIT_AT_SCALE_S = 150.0  # "2.5 min above certain K GPUs" (nccl #1156)
NCCL_AT_SCALE_GPUS = 4096   # assumed for "certain K"


def _shrink_fit() -> tuple[float, float]:
    xs = [math.log2(n) for n, _ in SHRINK_POINTS]
    ys = [s for _, s in SHRINK_POINTS]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def nccl_init_s(n_gpus: int) -> float:
    """A new communicator of ``n_gpus`` ranks in processes that already loaded NCCL's kernels."""
    per_gpu = (NCCL_INIT_AT_SCALE_S - NCCL_INIT_8_S) / (NCCL_AT_SCALE_GPUS - 8)
    return NCCL_INIT_8_S + per_gpu * max(0, n_gpus - 8)


def nccl_shrink_s(n_gpus: int) -> float:
    """ncclCommShrink of an ``n_gpus``-rank communicator (the fit of :data:`SHRINK_POINTS`)."""
    a, b = _shrink_fit()
    return max(min(s for _, s in SHRINK_POINTS), a + b * math.log2(max(n_gpus, 2)))


@dataclass(frozen=True, kw_only=True)
class RecoveryInputs:
    """What the model needs besides the job's size; validated at construction."""

    detect_s: float = 1.0            # an error seen at once; a hang costs its timeout instead
    process_start_s: float = 15.0    # interpreter + import torch + CUDA context (jitckpt's warm standbys avoid it)
    state_bytes_per_gpu: float = 10e9
    storage_gbps: float = 2.0        # GB/s one GPU reads its checkpoint at
    replica_gbps: float = 25.0       # GB/s one replacement receives its state from a replica at
    compile_s: float = 60.0          # one rank's compile from a warm cache (0: not compiled)
    abort_s: float = 1.0             # ncclCommAbort of the broken communicator

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("storage_gbps", "replica_gbps"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name} must be > 0 (GB/s)")


@dataclass(frozen=True)
class RecoveryRow:
    """Failure to training resumed, in seconds, for one job size."""

    n_gpus: int
    restart_s: float
    inprocess_reinit_s: float
    inprocess_shrink_s: float


def evaluate(inputs: RecoveryInputs, n_gpus: list[int]) -> list[RecoveryRow]:
    """The model's rows for each job size."""
    p = inputs
    load = p.state_bytes_per_gpu / (p.storage_gbps * 1e9)
    receive = p.state_bytes_per_gpu / (p.replica_gbps * 1e9)
    rows = []
    for n in n_gpus:
        if n < 2:
            raise ValueError(f"a job of {n} GPU(s) has no survivor: give N >= 2")
        restart = p.detect_s + p.process_start_s + NCCL_KERNEL_LOAD_S + nccl_init_s(n) + load + p.compile_s
        common = p.detect_s + p.abort_s + receive + p.compile_s
        rows.append(RecoveryRow(n, restart, common + nccl_init_s(n), common + 2 * nccl_shrink_s(n)))
    return rows


def plot(inputs: RecoveryInputs, n_gpus: list[int], out: str) -> None:
    """A PNG of the three paths' recovery time against N (both axes log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    lo, hi = min(n_gpus), max(n_gpus)
    ns = sorted({int(round(lo * (hi / lo) ** (i / 100))) for i in range(101)} | set(n_gpus))
    rows = evaluate(inputs, ns)
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, label, style in (("restart_s", "restart every rank (new processes, NCCL init, load)", "-"),
                              ("inprocess_reinit_s", "in-process: abort + re-init, one rank receives", "--"),
                              ("inprocess_shrink_s", "in-process: abort + shrink + grow, one rank receives", ":")):
        ax.plot(ns, [getattr(r, key) for r in rows], style, lw=2, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.set_xlabel("N, GPUs in the job (log scale)")
    ax.set_ylabel("failure to training resumed (s, log scale)")
    ax.set_title("Recovery time against job size (a model: jitckpt/observability/recovery_model.py)", fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
