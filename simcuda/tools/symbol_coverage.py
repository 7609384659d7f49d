#!/usr/bin/env python3
"""Report which CUDA runtime / NCCL symbols imported by PyTorch simcuda exports, and which are stubs.

Reads the dynamic symbol tables of simcuda's libcudart.so.13 and libnccl.so.2 with `readelf`, compares
them with the torch import lists (cu130 wheel), and checks the version node torch binds to
(libcudart.so.13 for cudart, none for NCCL). Stubs are the names in the generated
*_unsupported_api.cpp files. Exit status 1 if any imported symbol is missing or mis-versioned.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def exported(lib: Path) -> dict[str, str]:
    """Defined dynamic symbols of `lib` -> version node ('' when unversioned)."""
    out = subprocess.run(["readelf", "--dyn-syms", "-W", str(lib)], check=True, capture_output=True, text=True).stdout
    syms: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 8 or parts[6] == "UND" or parts[3] not in ("FUNC", "OBJECT"):
            continue
        name, _, version = parts[7].partition("@")
        syms[name] = version.lstrip("@")
    return syms


def wanted(listing: Path) -> list[str]:
    """Symbol names of a reference list (first tab-separated column)."""
    return [ln.split("\t")[0].strip() for ln in listing.read_text().splitlines() if ln.strip()]


def stubs(generated: Path) -> set[str]:
    """Names defined by a generated stub file (empty if the file is absent)."""
    if not generated.exists():
        return set()
    return set(re.findall(r"STUB_API \S+\*? (\w+)\(void\)", generated.read_text()))


def report(title: str, names: list[str], syms: dict[str, str], node: str, stub_names: set[str]) -> int:
    """Print coverage of `names`; return the number of problems."""
    missing = [n for n in names if n not in syms]
    wrong = [n for n in names if n in syms and syms[n] != node]
    stubbed = sorted(n for n in names if n in stub_names)
    real = len(names) - len(missing) - len(stubbed)
    print(f"{title}: {len(names)} imported by torch, {len(names) - len(missing)} exported "
          f"({real} implemented, {len(stubbed)} stubs), {len(missing)} missing, {len(wrong)} wrong version")
    if stubbed:
        print("  stubs: " + " ".join(stubbed))
    for n in missing:
        print(f"  MISSING {n}")
    for n in wrong:
        print(f"  WRONG VERSION {n}@{syms[n] or '(none)'} (want {node or 'unversioned'})")
    return len(missing) + len(wrong)


def main() -> int:
    """Entry point."""
    build = Path(os.environ.get("JITCKPT_BUILD_DIR", HERE.parents[1] / "build" / "native"))
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--build-dir", type=Path, default=build, help="CMake build dir (default: %(default)s)")
    args = ap.parse_args()
    libdir = args.build_dir / "lib" / "simcuda"
    cudart, nccl = libdir / "libcudart.so.13", libdir / "libnccl.so.2"
    for lib in (cudart, nccl):
        if not lib.exists():
            print(f"{lib} not found: build simcuda first (`make native` or cmake --build {args.build_dir})")
            return 2
    gen = args.build_dir / "simcuda" / "src"
    problems = report("cudart", wanted(HERE / "reference_torch_cudart_imports.txt"), exported(cudart),
                      "libcudart.so.13", stubs(gen / "cudart" / "cudart_unsupported_api.cpp"))
    problems += report("nccl", wanted(HERE / "reference_torch_nccl_imports.txt"), exported(nccl), "",
                       stubs(gen / "nccl" / "nccl_unsupported_api.cpp"))
    all_cudart = wanted(HERE / "reference_libcudart_exports.txt")
    have = exported(cudart)
    print(f"all of NVIDIA libcudart.so.13's {len(all_cudart)} exports: "
          f"{sum(1 for n in all_cudart if n in have)} present in simcuda")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
