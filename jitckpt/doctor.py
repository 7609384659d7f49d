"""`jitckpt doctor`: what this installation has and can do. The native parts (libjit.so,
jitckpt-proxy, jitckpt._native) and the CUDA/NCCL headers they were built against; which CUDA
runtime and NCCL a process here would load (NVIDIA's, or jitckpt's CPU stand-in simcuda); torch;
the tools later recovery tiers use (CRIU, etcd)."""
from __future__ import annotations

import ctypes
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

from jitckpt.native_libs import native_lib_dir


def _loaded_path(soname: str) -> tuple[Optional[str], Optional[str]]:
    """Where the dynamic loader finds ``soname`` for this process (None, and why not)."""
    try:
        lib = ctypes.CDLL(soname)
    except OSError as e:
        return None, str(e)
    for line in Path("/proc/self/maps").read_text().splitlines():
        if soname in line and "/" in line:
            path = line[line.index("/"):]
            kind = "simcuda (jitckpt's CPU stand-in)" if hasattr(lib, "simcudaGetStickyError") else "NVIDIA's"
            return path, kind
    return None, "loaded, path unknown"


def _native_module() -> dict[str, Any]:
    try:
        from jitckpt import _native  # type: ignore[attr-defined]
    except ImportError as e:
        return {"present": False, "why": str(e)}
    return {"present": True, "path": _native.__file__, "built_with": dict(_native.built_with)}


def _snapshot_checksum() -> dict[str, Any]:
    from jitckpt.snapshot import checksum

    return {"algorithm": checksum.DEFAULT_ALGORITHM,
            "one_pass": checksum._native is not None,  # jitckpt._copy_hash built
            "path": checksum._native.__file__ if checksum._native is not None else None}


def report() -> dict[str, Any]:
    """Everything `jitckpt doctor` says, as data."""
    lib = native_lib_dir()
    # Where libjit.so looks for the proxy (proxy_session.cc): next to it (wheel) or ../bin (build tree).
    proxy = next((p for p in ((lib / "jitckpt-proxy"), (lib.parent / "bin" / "jitckpt-proxy")) if p.is_file()),
                 None) if lib else None
    native: dict[str, Any] = {
        "libjit.so": str(lib / "libjit.so") if lib else None,
        "jitckpt-proxy": str(proxy) if proxy else None,
        "jitckpt._native": _native_module(),
        "jitckpt._copy_hash": _snapshot_checksum(),
    }
    runtime = {}
    for soname in ("libcudart.so.13", "libnccl.so.2"):
        path, kind = _loaded_path(soname)
        runtime[soname] = {"path": path, "kind" if path else "why": kind}
    torch_info: dict[str, Any] = {"present": importlib.util.find_spec("torch") is not None}
    if torch_info["present"]:
        import torch

        torch_info.update(version=torch.__version__, cuda=torch.version.cuda,
                          cuda_available=bool(torch.cuda.is_available()))
    tools = {name: shutil.which(name) for name in ("criu", "etcd")}
    return {"python": sys.version.split()[0], "native": native, "runtime": runtime, "torch": torch_info,
            "tools": tools}


def render(r: dict[str, Any]) -> str:
    """The report as the lines a user reads."""
    n = r["native"]
    mod = n["jitckpt._native"]
    lines = ["jitckpt installation", f"  python {r['python']}"]
    if n["libjit.so"]:
        lines.append(f"  native parts: yes: libjit.so {n['libjit.so']}")
        lines.append(f"    jitckpt-proxy (--transparent): {n['jitckpt-proxy'] or 'missing'}")
    else:
        lines.append("  native parts: NO libjit.so: user-level recovery only (no GPU hang detection, no --transparent); "
                     "reinstall with the CUDA headers (see README)")
    if mod["present"]:
        b = mod["built_with"]
        major, minor = divmod(int(b["cuda_runtime_version"]) // 10, 100)
        lines.append(f"    jitckpt._native: built against CUDA {major}.{minor} headers ({b['cuda_include']}), "
                     f"NCCL {b['nccl_version']} ({b['nccl_include']})")
    else:
        lines.append(f"    jitckpt._native: missing ({mod['why']})")
    ch = n["jitckpt._copy_hash"]
    lines.append("    jitckpt._copy_hash: " + ("yes: snapshot copies and checksums in one native pass"
                                                  if ch["one_pass"] else
                                                  f"missing: snapshots copy with numpy, then checksum ({ch['algorithm']})"))
    for soname, info in r["runtime"].items():
        lines.append(f"  {soname}: " + (f"{info['kind']}, {info['path']}" if info["path"]
                                        else f"not found ({info['why']})"))
    t = r["torch"]
    lines.append("  torch: " + (f"{t['version']} (CUDA {t['cuda'] or 'none: a CPU build'}, "
                                 f"GPU {'available' if t['cuda_available'] else 'not available'})"
                                 if t["present"] else "not installed"))
    for name, path in r["tools"].items():
        lines.append(f"  {name}: {path or 'not found'}")
    return "\n".join(lines) + "\n"


def main(*, as_json: bool) -> int:
    r = report()
    print(json.dumps(r, indent=2) if as_json else render(r), end="\n" if as_json else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(as_json="--json" in sys.argv))
