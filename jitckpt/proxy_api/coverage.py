"""``jitckpt doctor --api-coverage``: what proxy mode does with each CUDA symbol torch imports.

The denominator is every CUDA-family symbol PyTorch 2.14's CUDA 13.0 wheel imports
(``torch_cu130_imports.txt``, from ``nm -D --undefined-only`` on its libraries). Each symbol gets
one class: ``async``, ``generic`` (forwarded synchronously by the generated layer), ``special``
(hand-written), ``client`` (answered in the client), ``refused`` (with a reason), ``unhandled``
(declared, but its parameters need a hand-written handler nobody listed: refused too),
``undeclared`` (not in the runtime/NCCL headers: refused), ``other library`` (cuBLAS, cuDNN, ...:
not forwarded). ``working`` counts those that run through a proxy today.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from jitckpt.proxy_api import dispositions, inventory

IMPORTS = Path(__file__).resolve().parent / "torch_cu130_imports.txt"
CLASSES = ("async", "generic", "special", "client", "refused", "unhandled", "undeclared", "other library")
# What works through a proxy today. libjit.so has no proxy mode yet: jitckpt-proxy serves 8 calls
# (proxy_server/src/call_protocol.h) to its C++ client, but no application call reaches it.
WORKING: frozenset[str] = frozenset()
_PREFIXES = (("__cuda", "cudart"), ("cuda", "cudart"), ("nccl", "NCCL"), ("cublasLt", "cuBLASLt"),
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
    listed = dispositions.table_of(symbol)
    if listed is not None:
        return SymbolClass(symbol, lib, *listed)
    fn = declared.get(symbol)
    if fn is None:
        return SymbolClass(symbol, lib, "undeclared", "not declared in cuda_runtime_api.h or nccl.h")
    if fn.generic and fn.returns in ("cudaError_t", "ncclResult_t"):
        return SymbolClass(symbol, lib, "generic", "values, handles and plain results")
    kinds = sorted({p.kind for p in fn.params if p.kind not in inventory.GENERIC_KINDS})
    return SymbolClass(symbol, lib, "unhandled", f"needs a hand-written handler ({', '.join(kinds) or fn.returns})")


def imported_symbols() -> list[str]:
    return [line.split("\t")[0] for line in IMPORTS.read_text().splitlines() if line.strip()]


def coverage() -> list[SymbolClass]:
    """Every imported symbol with its class."""
    declared = {f.name: f for funcs in inventory.load().values() for f in funcs}
    return [classify(s, declared) for s in imported_symbols()]


def summary(rows: list[SymbolClass]) -> dict[str, dict[str, int]]:
    """Library -> {class: count, "imported": n, "working": n}."""
    out: dict[str, Counter] = {}
    for r in rows:
        c = out.setdefault(r.library, Counter())
        c["imported"] += 1
        c[r.cls] += 1
        c["working"] += r.symbol in WORKING
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
    for col in ("library", "imported", *CLASSES, "working today"):
        t.add_column(col, justify="left" if col == "library" else "right")
    for lib, c in s.items():
        t.add_row(lib, str(c["imported"]), *(str(c.get(k, 0)) for k in CLASSES), str(c["working"]))
    buf = StringIO()
    console = Console(file=buf, width=170, force_terminal=False)
    console.print(t)
    console.print("working today: libjit.so has no proxy mode yet (issue 15); the jitckpt-proxy process serves "
                  "8 calls to its C++ client only.\nrefused/unhandled/undeclared/other library: such a call "
                  "fails in proxy mode with an error naming the symbol. Details: --verbose.")
    if verbose:
        for r in rows:
            console.print(f"{r.library:10s} {r.cls:14s} {r.symbol:55s} {r.reason}")
    return buf.getvalue()
