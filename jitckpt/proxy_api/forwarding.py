"""Generates proxy mode's forwarding layer from the inventory and the one list of dispositions.

Run by the native build (``python -m jitckpt.proxy_api.forwarding --out DIR --hooked FILE...``),
never by hand; writes four files:

``proxy_functions.h`` (client and proxy)
    ``FunctionId`` for every forwarded function, its name, and a hash of the inventory the two
    sides were generated from (part of the handshake: a client and a proxy from different builds
    refuse each other by name instead of misreading calls).
``proxy_calls.h`` (libjit.so)
    The signatures of the hand-written special and client calls, taken from the headers.
``proxy_forwarders.cc`` (libjit.so)
    For every cudart/NCCL function: an exported definition that calls the next definition (the
    real library in observe mode, the forwarder below in proxy mode; skipped where libjit.so's
    observe-mode hooks already define the symbol), and a forwarder for proxy mode: generic calls
    are serialized here, special and client calls go to the hand-written ``proxy_call::NAME`` in
    ``interposer/src/proxy_calls.cc``, refused calls fail naming the symbol and the reason (or,
    for a function that returns a value and so has no error channel, log it and abort).
    ``_ptsz``/``_ptds`` twins of libcudart forward to their base function (the null stream
    becoming ``cudaStreamPerThread`` for ``_ptsz``). The ``pnccl`` twin of an NCCL function (its
    name for profiling tools, same signature) calls the next ``pncclX`` in observe mode and
    ``ncclX``'s forwarder in proxy mode.
``proxy_trampolines.cc`` (libjit.so)
    What the real libraries export beyond all that (:mod:`.trampolines`), as trampolines.
``proxy_generic_calls.cc`` (the proxy)
    Decodes each generic call, translates virtual handles and checks device addresses, runs the
    real function, and encodes its results.

Wire format of a generic call's arguments, parameter by parameter: a value as its bytes; a handle
as a u64 virtual handle; a device address (``void*`` of a stream-ordered call in :data:`ASYNC`)
as a u64; a result pointer as a presence byte, then (unless it is a handle) the pointee's bytes;
a struct with C-string members (:data:`~.dispositions.STRING_MEMBERS`: ``ncclConfig_t``) as a
presence byte, the struct with those members cleared (as many bytes as its size member says, the
rest zero), then each string as a presence byte, a u32 length and its bytes. The reply carries each
present result (not those structs: they are read, never written).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path
from typing import Iterable, Optional

from . import dispositions, trampolines
from .inventory import INVENTORY, Function, Param, load, load_enums

STATUS_TYPES = {"cudaError_t": "cudaErrorNotSupported", "ncclResult_t": "ncclInvalidUsage"}
# The inventory's libraries (nccl_device: the host functions nccl_device.h declares) and their sonames.
LIBRARIES = {"cudart": "jitckpt::kCudartSoname", "nccl": "jitckpt::kNcclSoname", "nccl_device": "jitckpt::kNcclSoname"}
# Objects a destroy call ends: the proxy forgets the virtual handle once the call succeeded.
_DESTROYS = re.compile(r"(Destroy|Abort|Unload|FreeArray|FreeMipmappedArray|Release)$")
# A definition of an entry point at the start of a line (``void** __cudaRegisterFatBinary(void* fatCubin) {``).
_HOOK_DEF = re.compile(r"^[A-Za-z_][\w \t\*]*?\b((?:__|p)?(?:cuda|nccl)\w*)\s*\([^;{}]*\)\s*\{", re.M)


def _bare(ptype: str) -> str:
    return ptype.replace("*", "").replace("const ", "").strip()


def _base(ptype: str) -> str:
    """The pointee type of a result pointer (``struct cudaDeviceProp *`` -> ``struct cudaDeviceProp``)."""
    assert ptype.endswith("*"), ptype
    return ptype[:-1].strip()


def _string_offsets(ptype: str) -> str:
    """The offsets of a struct's C-string members (:data:`dispositions.STRING_MEMBERS`), as a C++ array."""
    bare = _bare(ptype)
    return "{" + ", ".join(f"offsetof({bare}, {m})" for m in dispositions.STRING_MEMBERS[bare][0]) + "}"


# What a generated call is to the replay journal (interposer/src/replay_journal.cc) and to a fenced
# proxy, worked out here once from the signature and the dispositions (the C++ reads the table):
# CREATES mints a virtual handle (journaled, replayed in order, its handles compared: a getter
# that returns a handle too); STATELESS only reads state (a query, a getter, a synchronize, an
# elapsed time: not journaled, and it runs while the proxy is fenced); WORK is device work a
# minibatch's replay makes again; ORDERED must keep its order across the application's threads in
# the journal (what allocates or frees memory or makes a handle, outside NCCL).
KIND_BITS = {"creates": 1, "stateless": 2, "work": 4, "ordered": 8}
_READS_ONLY = re.compile(r"Query|Get|Synchronize|ElapsedTime")
_GROUP_CALLS = ("ncclGroupStart", "ncclGroupEnd")


def call_kinds(f: Function, handles: set[str]) -> set[str]:
    """The journal's kinds of a generically forwarded function (:data:`KIND_BITS`)."""
    kinds = set()
    if any(p.kind == "out" and _bare(p.type) in handles for p in f.params):
        kinds.add("creates")
    # ncclGetUniqueId is journaled: a replay maps the old id to the new one.
    if "creates" not in kinds and _READS_ONLY.search(f.name) and f.name != "ncclGetUniqueId":
        kinds.add("stateless")
    if (f.name in dispositions.ASYNC and f.name not in _GROUP_CALLS) or f.name in dispositions.DEVICE_WORK:
        kinds.add("work")
    if not f.name.startswith("nccl") and ("creates" in kinds or f.name.startswith("cudaFree")):
        kinds.add("ordered")
    return kinds


def handle_types(inv: dict[str, list[Function]]) -> set[str]:
    return {_bare(p.type) for funcs in inv.values() for f in funcs for p in f.params if p.kind == "handle"}


def forwarded_generically(f: Function) -> bool:
    """Serialized by generated code: every parameter a value, handle or result, or a device address
    of a stream-ordered call."""
    if f.returns not in STATUS_TYPES:
        return False
    kinds = {"value", "handle", "out"} | ({"memory"} if f.name in dispositions.ASYNC else set())
    return all(p.kind in kinds for p in f.params)


def disposition(f: Function) -> tuple[str, str]:
    """(class, reason): async/generic (generated), special/client (hand-written) or refused."""
    listed = dispositions.table_of(f.name)
    if listed is not None:
        cls, why = listed
        if cls == "async" and not forwarded_generically(f):
            raise ValueError(f"{f.name} is listed as asynchronous but its parameters need a hand-written handler")
        return listed
    for p in f.params:
        struct = p.type.replace("const ", "").replace("*", "").strip()
        if struct in dispositions.POINTER_STRUCTS:
            return "refused", f"not forwarded yet: {struct}: {dispositions.POINTER_STRUCTS[struct]}"
    if forwarded_generically(f):
        return "generic", "values, handles and results"
    return "refused", "not forwarded yet (needs a hand-written handler)"


def _names(f: Function) -> list[str]:
    return [p.name or f"a{i}" for i, p in enumerate(f.params)]


def _decl(f: Function, name: Optional[str] = None) -> str:
    params = ", ".join(f"{p.type} {n}" for p, n in zip(f.params, _names(f))) or "void"
    return f"{f.returns} {name or f.name}({params})"


def _ptsz_twins(f: Function, exports: set[str]) -> list[str]:
    return [f.name + s for s in ("_ptsz", "_ptds") if f.name + s in exports]


def _pnccl_twin(f: Function, exports: set[str]) -> list[str]:
    return ["p" + f.name] if f.name.startswith("nccl") and "p" + f.name in exports else []


# Enum arguments are checked against the header's enumerators, except these (values made at run time).
_OPEN_ENUMS = {"ncclRedOp_t"}


def _enum_of(ptype: str, enums: dict[str, list[str]]) -> Optional[str]:
    bare = ptype.replace("const ", "").replace("enum ", "").strip()
    return bare if bare in enums else None


def generate(inv: dict[str, list[Function]], hooked: set[str], exports: set[str],
             enums: Optional[dict[str, list[str]]] = None) -> dict[str, str]:
    enums = enums or {}
    funcs = [f for lib in LIBRARIES for f in inv.get(lib, [])]
    handles = handle_types(inv)
    digest = hashlib.sha256(INVENTORY.read_bytes() + repr(sorted(
        (f.name, disposition(f)[0]) for f in funcs)).encode()).hexdigest()[:16]
    generic = [f for f in funcs if disposition(f)[0] in ("generic", "async")]
    ids = {f.name: i for i, f in enumerate(generic)}

    h = ["// Generated by jitckpt/proxy_api/forwarding.py; do not edit.", "#pragma once", "#include <cstdint>", "",
         "namespace jitckpt::proxy {", "",
         f"inline constexpr uint64_t kInventoryHash = 0x{digest}ull;",
         f"inline constexpr uint32_t kFunctionCount = {len(generic)};",
         "enum class FunctionId : uint32_t {"]
    h += [f"  k_{f.name} = {ids[f.name]}," for f in generic]
    h += ["};", "", "inline const char* function_name(uint32_t id) {", "  static const char* const names[] = {"]
    h += [f'    "{f.name}",' for f in generic]
    h += ["  };", "  return id < kFunctionCount ? names[id] : nullptr;", "}", "",
          "// What each call is to the replay journal and to a fenced proxy (forwarding.py: call_kinds).",
          "enum FunctionKind : uint8_t {"]
    h += [f"  kCall{k.capitalize()} = {bit}," for k, bit in KIND_BITS.items()]
    h += ["};", "inline uint8_t function_kinds(uint32_t id) {", "  static const uint8_t kinds[] = {"]
    h += [f"    {sum(KIND_BITS[k] for k in call_kinds(f, handles))},  // {f.name}" for f in generic]
    h += ["  };", "  return id < kFunctionCount ? kinds[id] : 0;", "}", "",
          "}  // namespace jitckpt::proxy", ""]

    d = ["// Generated by jitckpt/proxy_api/forwarding.py; do not edit. The hand-written calls of proxy",
         "// mode (interposer/src/proxy_calls.cc): their signatures, taken from the headers.", "#pragma once",
         "#include <cuda_runtime_api.h>", "#include <nccl.h>", "", "namespace jitckpt::proxy_mode::proxy_call {"]
    d += [_decl(f) + ";" for f in funcs if disposition(f)[0] in ("special", "client")]
    d += ["}  // namespace jitckpt::proxy_mode::proxy_call", ""]

    c = ["// Generated by jitckpt/proxy_api/forwarding.py from cuda_api_inventory.json and dispositions.py;",
         "// do not edit.", '#include <cstring>', "", '#include "proxy_calls.h"', '#include "proxy_forwarding.h"',
         '#include "real_api.h"', ""]
    if inv.get("nccl_device"):
        c += ["// NVIDIA's nccl_device.h defines static helpers a host compiler sees unused.",
              "#pragma GCC diagnostic push", '#pragma GCC diagnostic ignored "-Wunused-function"',
              "#include <nccl_device.h>", "#pragma GCC diagnostic pop", ""]
    c += ["namespace jitckpt::proxy_mode {", "namespace {", ""]
    table: list[tuple[str, str]] = []
    for f in funcs:
        cls, why = disposition(f)
        names = _names(f)
        args = ", ".join(names)
        fwd = f"fwd_{f.name}"
        if cls in ("generic", "async"):
            c.append(f"{_decl(f, fwd)} {{")
            c.append(f"  CallWriter w(proxy::FunctionId::k_{f.name}, {'true' if cls == 'async' else 'false'});")
            for p, n in zip(f.params, names):
                if p.kind == "value":
                    c.append(f"  w.value({n});")
                elif p.kind == "handle":
                    c.append(f"  w.handle({n});")
                elif p.kind == "memory":
                    c.append(f"  w.address({n});")
                elif _bare(p.type) in handles:
                    c.append(f"  w.result_handle({n});")
                elif _bare(p.type) in dispositions.STRING_MEMBERS:
                    c.append(f"  w.with_strings({n}, {_string_offsets(p.type)}, {n} ? {n}->"
                             f"{dispositions.STRING_MEMBERS[_bare(p.type)][1]} : 0);")
                else:
                    c.append(f"  w.result({n});")
            c.append(f'  Reply r = w.send("{f.name}");')
            for p, n in zip(f.params, names):
                if p.kind == "out" and _bare(p.type) not in dispositions.STRING_MEMBERS:
                    c.append(f"  r.result({n});")
            c.append(f"  return r.status<{f.returns}>();")
            c.append("}")
        elif cls == "refused":
            for name in [f.name, *_pnccl_twin(f, exports)]:  # each refusal names the symbol called
                c.append(f"{_decl(f, f'fwd_{name}')} {{")
                for n in names:
                    c.append(f"  (void){n};")
                if f.returns in STATUS_TYPES:
                    c.append(f'  return refuse<{f.returns}>("{name}", "{why}");')
                else:  # no error channel: a made-up value would be used silently
                    c.append(f'  refuse_and_abort("{name}", "{why}");')
                c.append("}")
        else:
            fwd = f"proxy_call::{f.name}"
        table.append((f.name, fwd))
        pnccl_fwd = "fwd_p" + f.name if cls == "refused" else fwd
        table += [(twin, pnccl_fwd) for twin in _pnccl_twin(f, exports)]
        for twin in _ptsz_twins(f, exports):
            tw = f"fwd_{twin}"
            mapped = ", ".join(
                f"per_thread_stream({n})" if twin.endswith("_ptsz") and _bare(p.type) == "cudaStream_t"
                and p.kind == "handle" else n for p, n in zip(f.params, names))
            c.append(f"{_decl(f, tw)} {{ return {fwd}({mapped}); }}")
            table.append((twin, tw))
        c.append("")
    c += ["}  // namespace", "",
          "void* forwarder(const char* name) {",
          "  struct Entry { const char* name; void* fn; };",
          "  static const Entry entries[] = {"]
    c += [f'    {{"{n}", reinterpret_cast<void*>(&{fn})}},' for n, fn in sorted(table)]
    c += ["  };",
          "  size_t lo = 0, hi = sizeof entries / sizeof entries[0];",
          "  while (lo < hi) {  // sorted by name",
          "    size_t mid = (lo + hi) / 2;",
          "    int cmp = std::strcmp(entries[mid].name, name);",
          "    if (cmp == 0) return entries[mid].fn;",
          "    if (cmp < 0) lo = mid + 1; else hi = mid;",
          "  }",
          "  return nullptr;",
          "}", "",
          "}  // namespace jitckpt::proxy_mode", "",
          "// The exported entry points that libjit.so's observe-mode hooks do not define: each calls the",
          "// next definition, the real library's in observe mode and the forwarder above in proxy mode.",
          '#pragma GCC visibility push(default)', 'extern "C" {']
    for lib, soname in LIBRARIES.items():
        for f in inv.get(lib, []):
            for name in [f.name, *_ptsz_twins(f, exports), *_pnccl_twin(f, exports)]:
                if name in hooked:
                    continue
                names = _names(f)
                c.append(f"{_decl(f, name)} {{")
                c.append(f'  static jitckpt::NextSymbol<{f.returns} (*)({", ".join(p.type for p in f.params)})> '
                         f'jitckpt_next{{"{name}", {soname}}};')
                c.append("  auto jitckpt_fn = jitckpt_next.get();")
                if f.returns in STATUS_TYPES:
                    c.append(f"  if (jitckpt_fn == nullptr) return jitckpt::proxy_mode::missing<{f.returns}>(\"{name}\");")
                else:
                    c.append(f'  if (jitckpt_fn == nullptr) jitckpt::proxy_mode::missing_and_abort("{name}");')
                c.append(f"  return jitckpt_fn({', '.join(names)});")
                c.append("}")
    c += ['}  // extern "C"', '#pragma GCC visibility pop', ""]
    defined = hooked | {n for f in funcs for n in (f.name, *_ptsz_twins(f, exports), *_pnccl_twin(f, exports))}

    used_enums = sorted({e for f in generic for prm in f.params if prm.kind == "value"
                         for e in [_enum_of(prm.type, enums)] if e and e not in _OPEN_ENUMS})
    p = ["// Generated by jitckpt/proxy_api/forwarding.py from cuda_api_inventory.json and dispositions.py;",
         "// do not edit.", '#include <cuda_runtime_api.h>\n#include <nccl.h>\n\n#include "generic_call.h"', "", "namespace jitckpt::proxy {", "",
         "namespace {", "// An enum argument must be one of its type's enumerators: the runtime is not handed a value",
         "// its header does not define."]
    for e in used_enums:
        p.append(f"bool valid_{e}(long long v) {{")
        p.append(f"  static const long long values[] = {{{', '.join(enums[e])}}};")
        p.append("  for (long long x : values) if (x == v) return true;")
        p.append("  return false;")
        p.append("}")
    p += ["}  // namespace", "",
         "void run_generic(uint32_t id, ArgReader& a, GenericReply& r, HandleTable& handles, "
         "const AddressBook& memory) {",
         "  switch (static_cast<FunctionId>(id)) {"]
    for f in generic:
        names = _names(f)
        p.append(f"    case FunctionId::k_{f.name}: {{")
        call_args = []
        for i, (prm, n) in enumerate(zip(f.params, names)):
            v = f"v{i}"
            enum = _enum_of(prm.type, enums) if prm.kind == "value" else None
            if enum:
                # Read as the integer it travels as; no enum object ever holds an undefined value.
                p.append(f"      std::underlying_type_t<std::remove_const_t<{prm.type}>> {v}{{}};")
                p.append(f"      if (!a.value(&{v})) break;")
                if enum not in _OPEN_ENUMS:
                    p.append(f'      if (!valid_{enum}({v})) {{ a.invalid("{n}", {v}); break; }}')
                call_args.append(f"static_cast<std::remove_const_t<{prm.type}>>({v})")
            elif prm.kind == "value":
                p.append(f"      std::remove_const_t<{prm.type}> {v}{{}};")
                p.append(f"      if (!a.value(&{v})) break;")
                call_args.append(v)
            elif prm.kind == "handle":
                p.append(f"      std::remove_const_t<{prm.type}> {v}{{}};")
                p.append(f'      uint64_t {v}_virtual = 0;')
                p.append(f'      if (!a.handle(&{v}, &{v}_virtual, handles, "{n}")) break;')
                call_args.append(v)
            elif prm.kind == "memory":
                p.append(f"      {prm.type} {v} = nullptr;")
                p.append(f'      if (!a.address(&{v}, memory, "{n}")) break;')
                call_args.append(v)
            else:
                p.append(f"      {_base(prm.type)} {v}{{}};")
                p.append(f"      bool {v}_present = false;")
                if _bare(prm.type) in handles:
                    p.append(f"      if (!a.result_handle(&{v}_present)) break;")
                elif _bare(prm.type) in dispositions.STRING_MEMBERS:
                    p.append(f"      std::string {v}_strings[{len(dispositions.STRING_MEMBERS[_bare(prm.type)][0])}];")
                    p.append(f'      if (!a.with_strings(&{v}, &{v}_present, {_string_offsets(prm.type)}, '
                             f'{v}_strings, "{n}")) break;')
                else:
                    p.append(f"      if (!a.result(&{v}, &{v}_present)) break;")
                call_args.append(f"{v}_present ? &{v} : nullptr")
        p.append("      if (!a.finished()) break;")
        p.append(f"      const auto status = {f.name}({', '.join(call_args)});")
        p.append("      r.status = static_cast<int32_t>(status);")
        for i, prm in enumerate(f.params):
            if prm.kind == "out" and _bare(prm.type) not in dispositions.STRING_MEMBERS:
                if _bare(prm.type) in handles:
                    p.append(f"      if (v{i}_present) r.result_handle(handles.mint(v{i}, status == 0));")
                else:
                    p.append(f"      if (v{i}_present) r.result(v{i});")
        if _DESTROYS.search(f.name):
            first = next((i for i, prm in enumerate(f.params) if prm.kind == "handle"), None)
            if first is not None:
                p.append(f"      if (status == 0) handles.forget(v{first}_virtual);")
        p.append("      return;")
        p.append("    }")
    p += ["  }",
          "  a.fail_if_ok(\"unknown generic call\");",
          "}", "", "}  // namespace jitckpt::proxy", ""]
    return {"proxy_functions.h": "\n".join(h), "proxy_calls.h": "\n".join(d), "proxy_forwarders.cc": "\n".join(c),
            "proxy_generic_calls.cc": "\n".join(p),
            "proxy_trampolines.cc": trampolines.generate(trampolines.unforwarded(exports, defined))}


def hooked_names(files: Iterable[str]) -> set[str]:
    """Entry points libjit.so's hand-written files define (observe-mode hooks, nvcc's ABI, ...)."""
    return {m for path in files for m in _HOOK_DEF.findall(Path(path).read_text())}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jitckpt.proxy_api.forwarding", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the generated files")
    ap.add_argument("--hooked", nargs="*", default=[], help="libjit.so source files that define entry points by hand")
    ap.add_argument("--exports", nargs="*", default=[], help="lists of a real library's exported symbols")
    args = ap.parse_args(argv)
    exports = {line.split()[0] for path in args.exports for line in Path(path).read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    files = generate(load(), hooked_names(args.hooked), exports, load_enums())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = out / name
        if not path.exists() or path.read_text() != text:  # unchanged files keep their mtime
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
