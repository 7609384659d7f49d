"""``jitckpt doctor --api-coverage``: what proxy mode does with each CUDA symbol torch imports.

The denominator is every CUDA-family symbol PyTorch 2.14's CUDA 13.0 wheel imports
(``torch_cu130_imports.txt``, from ``nm -D --undefined-only`` on its libraries). Each symbol gets
the class the generated forwarding layer gives it (:func:`jitckpt.proxy_api.forwarding.disposition`):
``async`` (enqueued without a reply), ``generic`` (forwarded synchronously by generated code),
``special`` (hand-written), ``client`` (answered in the client), ``refused`` (fails with an error
naming the symbol and the reason; a symbol the headers do not declare is refused by libjit.so's
trampoline for it, :mod:`jitckpt.proxy_api.trampolines`), ``other library`` (cuBLAS, cuDNN, ...:
not forwarded). ``forwarded`` counts the symbols proxy mode runs in the proxy: async, generic,
special, client.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from jitckpt.proxy_api import forwarding, inventory, trampolines

IMPORTS = Path(__file__).resolve().parent / "torch_cu130_imports.txt"
CLASSES = ("async", "generic", "special", "client", "refused", "other library")
FORWARDED = frozenset({"async", "generic", "special", "client"})
# nvcc's registration and launch ABI, kept in the client by interposer/src/kernel_registration.cc.
REGISTRATION_ABI = {
    **{n: "nvcc's registration ABI, kept in the client; kernels are registered with the proxy by name"
       for n in ("__cudaRegisterFatBinary", "__cudaRegisterFatBinaryEnd", "__cudaUnregisterFatBinary",
                 "__cudaInitModule", "__cudaRegisterFunction", "__cudaPushCallConfiguration",
                 "__cudaPopCallConfiguration", "__cudaGetKernel", "__cudaLaunchKernel", "__cudaLaunchKernel_ptsz")},
}
PROFILER = {n: "profiler marker (cuda_profiler_api.h): a no-op in proxy mode" for n in ("cudaProfilerStart",
                                                                                     "cudaProfilerStop")}
REFUSED_ABI = {n: "__device__/__managed__ variables are not forwarded yet" for n in ("__cudaRegisterVar",
                                                                                   "__cudaRegisterManagedVar")}
_PREFIXES = (("__cuda", "cudart"), ("cuda", "cudart"), ("nccl", "NCCL"), ("pnccl", "NCCL"), ("cublasLt", "cuBLASLt"),
             ("cublas", "cuBLAS"), ("cudnn", "cuDNN"), ("cusparseLt", "cuSPARSELt"), ("cusparse", "cuSPARSE"),
             ("cusolver", "cuSOLVER"), ("cufft", "cuFFT"), ("cuFile", "cuFile"), ("nvrtc", "NVRTC"),
             ("nvshmem", "NVSHMEM"), ("cupti", "CUPTI"), ("cu", "driver"))


@dataclass(frozen=True)
class SymbolClass:
    symbol: str
    library: str
    cls: str
    reason: str


def library_of(symbol: str) -> str:
    for prefix, lib in _PREFIXES:
        if symbol.startswith(prefix):
            return lib
    return "other"


def classify(symbol: str, declared: dict[str, inventory.Function]) -> SymbolClass:
    """The class of one symbol and why."""
    lib = library_of(symbol)
    if lib not in ("cudart", "NCCL"):
        return SymbolClass(symbol, lib, "other library", f"{lib} is not forwarded by proxy mode")
    if symbol in REGISTRATION_ABI:
        return SymbolClass(symbol, lib, "special", REGISTRATION_ABI[symbol])
    if symbol in PROFILER:
        return SymbolClass(symbol, lib, "client", PROFILER[symbol])
    if symbol in REFUSED_ABI:
        return SymbolClass(symbol, lib, "refused", REFUSED_ABI[symbol])
    base = symbol[:-5] if symbol.endswith(("_ptsz", "_ptds")) else symbol
    base = base[1:] if base.startswith("pnccl") else base  # NCCL's profiling name: its nccl twin's class
    fn = declared.get(symbol) or declared.get(base)
    if fn is None:  # exported by the real library (tests/test_proxy_api.py checks): a trampoline
        group, why = trampolines.group_of(symbol)
        return SymbolClass(symbol, lib, "refused", f"not declared in the headers ({group}: {why}): libjit.so's "
                                                   "trampoline refuses it")
    return SymbolClass(symbol, lib, *forwarding.disposition(fn))


def imported_symbols() -> list[str]:
    return [line.split("\t")[0] for line in IMPORTS.read_text().splitlines() if line.strip()]


def coverage() -> list[SymbolClass]:
    """Every imported symbol with its class."""
    declared = {f.name: f for funcs in inventory.load().values() for f in funcs}
    return [classify(s, declared) for s in imported_symbols()]


def summary(rows: list[SymbolClass]) -> dict[str, dict[str, int]]:
    """Library -> {class: count, "imported": n, "forwarded": n}."""
    out: dict[str, Counter] = {}
    for r in rows:
        c = out.setdefault(r.library, Counter())
        c["imported"] += 1
        c[r.cls] += 1
        c["forwarded"] += r.cls in FORWARDED
    return {lib: dict(c) for lib, c in sorted(out.items(), key=lambda kv: -kv[1]["imported"])}


def render(rows: list[SymbolClass], *, as_json: bool = False, verbose: bool = False) -> str:
    """The report as text (a table) or JSON."""
    s = summary(rows)
    if as_json:
        return json.dumps({"summary": s, "symbols": [r.__dict__ for r in rows] if verbose else None}, indent=1)
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    t = Table(title="proxy mode: the CUDA symbols PyTorch 2.14 (CUDA 13.0) imports")
    for col in ("library", "imported", *CLASSES, "forwarded"):
        t.add_column(col, justify="left" if col == "library" else "right")
    for lib, c in s.items():
        t.add_row(lib, str(c["imported"]), *(str(c.get(k, 0)) for k in CLASSES), str(c.get("forwarded", 0)))
    buf = StringIO()
    console = Console(file=buf, width=170, force_terminal=False)
    console.print(t)
    console.print("forwarded: run in the proxy under LD_PRELOAD=libjit.so JITCKPT_MODE=proxy (verified on simcuda with "
                  "nvcc-built CUDA+NCCL programs; the generated layer forwards the rest without a test each).\n"
                  "refused: fails with an error naming the symbol (or, returning no status, aborts naming it). "
                  "other library: not forwarded. Details: --verbose.")
    if verbose:
        for r in rows:
            console.print(f"{r.library:10s} {r.cls:14s} {r.symbol:55s} {r.reason}")
    return buf.getvalue()
