"""Every function the CUDA runtime and NCCL headers declare, and what its parameters are.

Generated from the real headers (the CUDA toolkit's ``cuda_runtime_api.h``, the
``nvidia-nccl-cu13`` wheel's ``nccl.h`` and ``nccl_device.h``), preprocessed by the C++ compiler so
that macros are gone, into ``cuda_api_inventory.json`` next to this module: the doctor and the
code generator read the file, so neither needs the headers at run time. Three libraries:
``cudart``, ``nccl`` (``nccl.h``) and ``nccl_device`` (the host functions of NCCL's device API that
``nccl_device.h`` adds, exported by libnccl.so.2 like the rest). Regenerate with
``python -m jitckpt.proxy_api.inventory --write``.

Each parameter gets a kind from its type alone: ``value`` (scalars, enums, structs by value),
``handle`` (a pointer typedef to an opaque struct: streams, events, communicators, ...),
``out`` (a pointer to a value or handle the call fills), ``string``, ``memory`` (``void*``: device
or host bytes, whose size the prototype does not say), ``in_struct`` (a pointer to const data: a
struct or an array), ``out_pointer`` (``T**``), ``callback`` (a function pointer). A function whose
parameters are all ``value``, ``handle`` or ``out`` can be forwarded by generated code.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
INVENTORY = HERE / "cuda_api_inventory.json"
GENERIC_KINDS = frozenset({"value", "handle", "out"})
_HANDLE_TYPEDEF = re.compile(r"typedef\s+struct\s+\w+\s*\*\s*(\w+)\s*;")
# ``extern "C"`` as nccl_device.h writes it (NCCL_EXTERN_C) on each declaration; a declaration with an
# attribute (``__CUDA_DEPRECATED``, ``inline __attribute__((always_inline))``) does not match, so the
# deprecated runtime functions and the header-inline NCCL helpers stay out.
_FUNC_START = re.compile(r"(?:^|[;}\n])\s*(?:extern\s+(?:\"C\"\s+)?)?"
                         r"([A-Za-z_][\w\s\*]*?)\s*\b((?:__)?(?:cuda|nccl)\w*)\s*\(")


@dataclass(frozen=True)
class Param:
    type: str
    name: str
    kind: str


@dataclass(frozen=True)
class Function:
    name: str
    returns: str
    params: tuple[Param, ...]

    @property
    def generic(self) -> bool:
        """Forwardable by generated code: every parameter is a value, a handle or a plain result."""
        return all(p.kind in GENERIC_KINDS for p in self.params)


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [p.strip() for p in out if p.strip() and p.strip() != "void"]


def _param(text: str, handles: set[str]) -> Param:
    text = re.sub(r"\s*=.*$", "", text)  # C++ default arguments
    if "(" in text:
        return Param(type=text, name="", kind="callback")
    m = re.match(r"^(.*?)([A-Za-z_]\w*)?\s*(\[\s*\w*\s*\])?$", text)
    base, name = (m.group(1) or "").strip(), m.group(2) or ""
    if not base or base.endswith(("struct", "enum", "unsigned", "const")) or name in ("int", "char", "long", "short"):
        base, name = text, ""  # an unnamed parameter
    ptype = re.sub(r"\s+", " ", base.replace("*", " * ")).strip()
    if m.group(3):
        ptype += " *"
    stars = ptype.count("*")
    bare = ptype.replace("*", "").replace("const", "").replace("struct", "").replace("enum", "").strip()
    const = ptype.startswith("const") or ptype.endswith("const *")  # ``T const *`` (nccl_device.h)
    if stars == 0:
        kind = "handle" if bare in handles else "value"
    elif stars >= 2:
        kind = "out_pointer"
    elif bare == "char":
        kind = "string"
    elif bare == "void":
        kind = "memory"
    elif const:
        kind = "in_struct"
    else:
        kind = "out"
    return Param(type=ptype, name=name, kind=kind)


def parse(preprocessed: str) -> list[Function]:
    """The ``cuda*``/``nccl*`` functions declared in preprocessed header text (not ``pnccl*``)."""
    handles = set(_HANDLE_TYPEDEF.findall(preprocessed))
    found: dict[str, Function] = {}
    for m in _FUNC_START.finditer(preprocessed):
        returns, name = re.sub(r"\s+", " ", m.group(1)).strip(), m.group(2)
        if returns.startswith(("typedef", "return")) or not returns:
            continue
        depth, i = 1, m.end()
        while depth and i < len(preprocessed):
            depth += {"(": 1, ")": -1}.get(preprocessed[i], 0)
            i += 1
        if not preprocessed[i:].lstrip().startswith(";"):
            continue  # a definition or a macro use, not a declaration
        params = tuple(_param(p, handles) for p in _split_params(preprocessed[m.end():i - 1]))
        found.setdefault(name, Function(name=name, returns=returns.replace("extern ", ""), params=params))
    return sorted(found.values(), key=lambda f: f.name)


_ENUM = re.compile(r"(typedef\s+)?enum\s+(\w*)\s*(?::\s*\w+\s*)?\{([^{}]*)\}\s*(\w*)\s*;")


def parse_enums(preprocessed: str) -> dict[str, list[str]]:
    """Enumerator names of every enum type (``enum cudaDeviceAttr``, ``typedef enum {...} ncclDataType_t``)."""
    found: dict[str, list[str]] = {}
    for m in _ENUM.finditer(preprocessed):
        names = [re.split(r"\s*=", e.strip())[0] for e in m.group(3).split(",") if e.strip()]
        for type_name in {m.group(2), m.group(4) if m.group(1) else ""} - {""}:
            found[type_name] = names
    return dict(sorted(found.items()))


def _preprocess(header: str, includes: list[str], prelude: str = "") -> str:
    cmd = [os.environ.get("CXX", "c++"), "-E", "-P", "-x", "c++", *[f"-I{d}" for d in includes], "-"]
    return subprocess.run(cmd, input=f"{prelude}#include <{header}>\n", capture_output=True, text=True,
                          check=True, timeout=60).stdout


def header_dirs() -> Optional[tuple[str, str]]:
    """(CUDA include dir, nccl.h dir), or None when either is missing."""
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    try:
        import nvidia.nccl  # type: ignore[import-not-found]

        nccl = Path(list(nvidia.nccl.__path__)[0]) / "include"
    except ImportError:
        return None
    if not (cuda / "cuda_runtime_api.h").exists() or not (nccl / "nccl.h").exists():
        return None
    return str(cuda), str(nccl)


def from_headers(cuda_include: str, nccl_include: str) -> dict[str, list[Function]]:
    """The inventory, read from the headers now."""
    nccl = [f for f in parse(_preprocess("nccl.h", [cuda_include, nccl_include])) if f.name.startswith("nccl")]
    in_nccl_h = {f.name for f in nccl}
    # nccl_device.h needs cuda_runtime.h first (it is written for nvcc, which includes it implicitly).
    device = parse(_preprocess("nccl_device.h", [cuda_include, nccl_include], "#include <cuda_runtime.h>\n"))
    return {"cudart": parse(_preprocess("cuda_runtime_api.h", [cuda_include])), "nccl": nccl,
            "nccl_device": [f for f in device if f.name.startswith("nccl") and f.name not in in_nccl_h]}


def enums_from_headers(cuda_include: str, nccl_include: str) -> dict[str, list[str]]:
    """The enum types of both headers, read now: what the proxy checks enum arguments against."""
    return {**parse_enums(_preprocess("cuda_runtime_api.h", [cuda_include])),
            **parse_enums(_preprocess("nccl.h", [cuda_include, nccl_include]))}


def to_json(inv: dict[str, list[Function]], enums: dict[str, list[str]]) -> str:
    out: dict = {lib: [asdict(f) for f in funcs] for lib, funcs in inv.items()}
    out["enums"] = dict(sorted(enums.items()))
    return json.dumps(out, indent=1) + "\n"


def load() -> dict[str, list[Function]]:
    """The committed inventory."""
    raw = json.loads(INVENTORY.read_text())
    return {lib: [Function(name=f["name"], returns=f["returns"],
                           params=tuple(Param(**p) for p in f["params"])) for f in funcs]
            for lib, funcs in raw.items() if lib != "enums"}


def load_enums() -> dict[str, list[str]]:
    """The committed enum types: name -> enumerator names."""
    return json.loads(INVENTORY.read_text()).get("enums", {})


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jitckpt.proxy_api.inventory",
                                 description="regenerate cuda_api_inventory.json from the headers")
    ap.add_argument("--write", action="store_true", help="write the file (default: print it)")
    args = ap.parse_args(argv)
    dirs = header_dirs()
    if dirs is None:
        print("error: needs the CUDA toolkit's headers (CUDA_HOME) and the nvidia-nccl-cu13 wheel",
              file=sys.stderr)
        return 2
    text = to_json(from_headers(*dirs), enums_from_headers(*dirs))
    if args.write:
        INVENTORY.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
