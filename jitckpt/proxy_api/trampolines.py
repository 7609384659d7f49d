"""The symbols libcudart.so.13 and libnccl.so.2 export that no header the inventory reads declares.

The forwarding layer (:mod:`.forwarding`) defines every declared function, its ``_ptsz``/``_ptds``
twins and its ``pnccl`` twin; libjit.so defines nvcc's registration ABI by hand. Whatever else the
real libraries export (``simcuda/tools/reference_lib*_exports.txt``) is listed here with its group
and why it is not forwarded, and libjit.so exports a trampoline for each (``proxy_trampolines.cc``):
the exported symbol tail-jumps through a slot of its own without touching its arguments, so it
needs no signature. A slot starts at a resolver that, on the first call, points it at the real
library's definition in observe mode or at a refusal naming the symbol in proxy mode, so no call
reaches the application's own libcudart/libnccl unseen in proxy mode.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

# (pattern on the name without a ``p`` profiling prefix, group, why it is not forwarded), first match.
_GROUPS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"^__cuda"), "internal ABI", "a runtime-internal entry point, declared in no public header"),
    (re.compile(r"^cuda.*(GL|EGL|Egl|VDPAU)"), "graphics interop",
     "cuda_gl_interop.h and its kin need the OpenGL/EGL/VDPAU headers"),
    (re.compile(r"^cuda"), "deprecated", "__CUDA_DEPRECATED in cuda_runtime_api.h, which the inventory leaves out"),
    (re.compile(r"^nccl(Gin|LLA2A|Lsa|Dev|Team)"), "NCCL device API", "declared by nccl_device.h only for Windows"),
    (re.compile(r"^ncclResetDebugInit"), "NCCL debug internals",
     "nccl.h declares ncclResetDebugInit (deprecated) only under NCCL_OS_LINUX, the Internal one not at all"),
    (re.compile(r"^nccl"), "NCCL internal", "not declared in nccl.h or nccl_device.h (NCCL-internal or OS-specific)"),
)
_PREFIXES = ("cuda", "__cuda", "nccl", "pnccl")


@dataclass(frozen=True)
class Unforwarded:
    name: str
    library: str  # "cudart" or "nccl": which status its refusal returns
    group: str
    reason: str


def group_of(name: str) -> tuple[str, str]:
    """(group, reason) of an exported symbol no header declares."""
    bare = name[1:] if name.startswith("pnccl") else name
    for pattern, group, why in _GROUPS:
        if pattern.search(bare):
            return group, why
    raise ValueError(f"{name} is not a CUDA runtime or NCCL symbol")


def unforwarded(exports: Iterable[str], defined: set[str]) -> list[Unforwarded]:
    """Every exported CUDA runtime/NCCL symbol that libjit.so does not define otherwise, by name."""
    out = []
    for name in sorted(set(exports) - defined):
        if name.startswith(_PREFIXES):
            group, why = group_of(name)
            out.append(Unforwarded(name, "cudart" if "cuda" in name[:6] else "nccl", group, why))
    return out


def _x86_64(entries: list[Unforwarded]) -> list[str]:
    a = []
    for i, u in enumerate(entries):
        a += [f".globl {u.name}", f".type {u.name}, @function", ".p2align 4", f"{u.name}:",
              "  endbr64",  # an indirect-branch target (PLT, dlsym) under CET
              f"  jmp *.Ljitckpt_slots+{8 * i}(%rip)", f".size {u.name}, .-{u.name}",
              f".Ljitckpt_resolve_{i}:", "  endbr64", f"  movl ${i}, %r11d", "  jmp .Ljitckpt_resolve_common"]
    saved = ["%rdi", "%rsi", "%rdx", "%rcx", "%r8", "%r9", "%rax", "%r10"]  # arguments, vector count, chain
    a += [".p2align 4", ".Ljitckpt_resolve_common:", ".cfi_startproc", "  pushq %rbp", ".cfi_def_cfa_offset 16",
          ".cfi_offset %rbp, -16", "  movq %rsp, %rbp", ".cfi_def_cfa_register %rbp", "  subq $192, %rsp"]
    a += [f"  movq {r}, {8 * k}(%rsp)" for k, r in enumerate(saved)]
    a += [f"  movdqa %xmm{k}, {64 + 16 * k}(%rsp)" for k in range(8)]
    a += ["  movl %r11d, %edi", "  call jitckpt_trampoline_resolve", "  movq %rax, %r11"]
    a += [f"  movdqa {64 + 16 * k}(%rsp), %xmm{k}" for k in range(8)]
    a += [f"  movq {8 * k}(%rsp), {r}" for k, r in enumerate(saved)]
    a += ["  leave", ".cfi_def_cfa %rsp, 8", "  jmp *%r11", ".cfi_endproc"]
    return a


def _aarch64(entries: list[Unforwarded]) -> list[str]:
    a = []
    for i, u in enumerate(entries):
        a += [f".globl {u.name}", f".type {u.name}, %function", ".p2align 2", f"{u.name}:",
              "  hint #34",  # bti c: an indirect-branch target under BTI, a no-op elsewhere
              f"  adrp x16, .Ljitckpt_slots+{8 * i}", f"  ldr x16, [x16, #:lo12:.Ljitckpt_slots+{8 * i}]",
              "  br x16", f".size {u.name}, .-{u.name}",
              f".Ljitckpt_resolve_{i}:", "  hint #34", f"  mov w17, #{i}", "  b .Ljitckpt_resolve_common"]
    pairs = [("x0", "x1", 16), ("x2", "x3", 32), ("x4", "x5", 48), ("x6", "x7", 64)]
    vectors = [("q0", "q1", 96), ("q2", "q3", 128), ("q4", "q5", 160), ("q6", "q7", 192)]
    a += [".p2align 2", ".Ljitckpt_resolve_common:", ".cfi_startproc", "  stp x29, x30, [sp, #-224]!",
          ".cfi_def_cfa_offset 224", ".cfi_offset x29, -224", ".cfi_offset x30, -216", "  mov x29, sp"]
    a += [f"  stp {r1}, {r2}, [sp, #{off}]" for r1, r2, off in pairs + vectors]
    a += ["  str x8, [sp, #80]",  # the indirect result register
          "  mov w0, w17", "  bl jitckpt_trampoline_resolve", "  mov x16, x0", "  ldr x8, [sp, #80]"]
    a += [f"  ldp {r1}, {r2}, [sp, #{off}]" for r1, r2, off in pairs + vectors]
    a += ["  ldp x29, x30, [sp], #224", ".cfi_def_cfa_offset 0", ".cfi_restore x29", ".cfi_restore x30",
          "  br x16", ".cfi_endproc"]
    return a


def _assembly(entries: list[Unforwarded], arch: list[str]) -> list[str]:
    """One top-level asm block: the trampolines, their resolvers, then the slots."""
    slots = [".pushsection .data.rel,\"aw\"", ".p2align 3", ".globl jitckpt_trampoline_slots",
             ".hidden jitckpt_trampoline_slots", "jitckpt_trampoline_slots:", ".Ljitckpt_slots:"]
    slots += [f"  .8byte .Ljitckpt_resolve_{i}" for i in range(len(entries))]
    body = [".pushsection .text", *arch, ".popsection", *slots, ".popsection"]
    return ['asm(R"(', *body, ')");']


def generate(entries: list[Unforwarded]) -> str:
    """``proxy_trampolines.cc``: the trampolines, their slots and resolver, the refusals."""
    indices = range(len(entries))
    c = ["// Generated by jitckpt/proxy_api/trampolines.py from the reference export lists; do not edit.",
         "// The symbols libcudart.so.13 / libnccl.so.2 export that no header the inventory reads declares,",
         "// each with why it is not forwarded. libjit.so exports each as a trampoline that tail-jumps",
         "// through its slot, arguments untouched (so it needs no signature). A slot starts at a resolver",
         "// that saves the argument registers, asks jitckpt_trampoline_resolve for the definition, and",
         "// jumps there: the real library's in observe mode (found on first use, as NextSymbol does,",
         "// because libcudart is often dlopen()ed after libjit.so), a refusal naming the symbol in",
         "// proxy mode. The refusals ignore their arguments and return cudaErrorNotSupported or",
         "// ncclInvalidUsage in the return register: the deprecated, interop and NCCL functions return a",
         "// status or nothing (by their declarations). The internal entry points are declared nowhere",
         "// public (simcuda's stubs take them to return nothing or a pointer): a caller of a refused one",
         "// may misread the status, but the refusal is logged naming it.",
         "#include <cstddef>", "", '#include "proxy_forwarding.h"', '#include "real_api.h"', "",
         "namespace jitckpt::proxy_mode {", "namespace {", "",
         "struct Unforwarded {", "  const char* name;", "  const char* why;", "  bool cuda;  // else NCCL", "};", "",
         "constexpr Unforwarded kUnforwarded[] = {"]
    c += [f'    {{"{u.name}", "not forwarded ({u.group}: {u.reason})", {str(u.library == "cudart").lower()}}},'
          for u in entries]
    c += ["};", "",
          "template <size_t I>", "int refuse_unforwarded() {",
          "  const Unforwarded& u = kUnforwarded[I];",
          "  if (u.cuda) return refuse<cudaError_t>(u.name, u.why);",
          "  return refuse<ncclResult_t>(u.name, u.why);", "}",
          "template <size_t I>", "int missing_unforwarded() {",
          "  const Unforwarded& u = kUnforwarded[I];",
          "  if (u.cuda) return missing<cudaError_t>(u.name);",
          "  return missing<ncclResult_t>(u.name);", "}", "",
          "using Untyped = int (*)();",
          "constexpr Untyped kRefusals[] = {" + ", ".join(f"&refuse_unforwarded<{i}>" for i in indices) + "};",
          "constexpr Untyped kMissing[] = {" + ", ".join(f"&missing_unforwarded<{i}>" for i in indices) + "};",
          "",
          "}  // namespace",
          "}  // namespace jitckpt::proxy_mode", "",
          'extern "C" {',
          "// One slot per trampoline, in the assembly below. Not the global mutable state the project rules",
          "// out: like the GOT under lazy binding, each slot is written at most once, from its resolver to",
          "// the definition the mode gives, and never read by anything but its trampoline.",
          "extern __attribute__((visibility(\"hidden\"))) void* jitckpt_trampoline_slots[];",
          "",
          "__attribute__((visibility(\"hidden\"))) void* jitckpt_trampoline_resolve(unsigned index) {",
          "  using namespace jitckpt::proxy_mode;",
          "  const Unforwarded& u = kUnforwarded[index];",
          "  void* fn = session().enabled() ? reinterpret_cast<void*>(kRefusals[index])",
          "                                 : jitckpt::resolve_real_symbol(u.name, u.cuda ? jitckpt::kCudartSoname",
          "                                                                               : jitckpt::kNcclSoname);",
          "  // Not kept when missing: a library dlopen()ed later may define it.",
          "  if (fn == nullptr) return reinterpret_cast<void*>(kMissing[index]);",
          "  __atomic_store_n(&jitckpt_trampoline_slots[index], fn, __ATOMIC_RELEASE);",
          "  return fn;",
          "}",
          '}  // extern "C"', "",
          "#if defined(__x86_64__)"]
    c += _assembly(entries, _x86_64(entries))
    c += ["#elif defined(__aarch64__)"]
    c += _assembly(entries, _aarch64(entries))
    c += ["#else", '#error "libjit.so trampolines are written for x86-64 and aarch64"', "#endif", ""]
    return "\n".join(c)
