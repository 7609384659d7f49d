"""Issue 15: the one list of what proxy mode does with each CUDA/NCCL symbol, and the doctor's report.

The inventory is generated from the real headers; this keeps the committed file in step with
them, keeps the tables free of typos and overlaps, and checks the report's numbers add up.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jitckpt.proxy_api import coverage, dispositions, forwarding, inventory, trampolines

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "simcuda" / "tools"
NCCL_DEVICE_API = {"ncclCommQueryProperties", "ncclDevCommCreate", "ncclDevCommDestroy", "ncclGetLsaDevicePointer",
                   "ncclGetLsaMultimemDevicePointer", "ncclGetMultimemDevicePointer", "ncclGetPeerDevicePointer",
                   "ncclGinBarrierCreateRequirement", "ncclLLA2ACalcSlots", "ncclLLA2ACreateRequirement",
                   "ncclLsaBarrierCreateRequirement", "ncclTeamLsa", "ncclTeamRail", "ncclTeamRankToLsa",
                   "ncclTeamRankToWorld", "ncclTeamWorld"}


def reference_exports() -> set[str]:
    """What NVIDIA's libcudart.so.13 and libnccl.so.2 export (the version node aside)."""
    return {line.split()[0] for lib in ("libcudart", "libnccl")
            for line in (REFERENCE / f"reference_{lib}_exports.txt").read_text().splitlines()
            if line.strip()} - {"libcudart.so.13"}


def test_committed_inventory_matches_the_headers():
    dirs = inventory.header_dirs()
    if dirs is None:
        pytest.skip("needs the CUDA toolkit headers and the nvidia-nccl-cu13 wheel")
    pinned = re.search(r"NCCL_SPEC\s*\?=\s*nvidia-nccl-cu13==(\S+)", (REPO / "Makefile").read_text()).group(1)
    header = (Path(dirs[1]) / "nccl.h").read_text()
    found = ".".join(re.search(rf"#define NCCL_{k} (\d+)", header).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    if found != pinned:  # e.g. a venv with another torch, which brings its own NCCL wheel
        pytest.skip(f"the inventory is read from nccl.h {pinned} (Makefile NCCL_SPEC); this nccl.h is {found}")
    fresh = inventory.to_json(inventory.from_headers(*dirs), inventory.enums_from_headers(*dirs))
    assert fresh == inventory.INVENTORY.read_text(), (
        "cuda_api_inventory.json is stale: python -m jitckpt.proxy_api.inventory --write")


def test_the_inventory_reads_signatures_right():
    fns = {f.name: f for funcs in inventory.load().values() for f in funcs}
    assert len(fns) > 300
    kinds = lambda name: [p.kind for p in fns[name].params]  # noqa: E731
    assert kinds("cudaMalloc") == ["out_pointer", "value"]
    assert kinds("cudaStreamCreateWithFlags") == ["out", "value"] and fns["cudaStreamCreateWithFlags"].generic
    assert kinds("cudaMemcpyAsync") == ["memory", "memory", "value", "value", "handle"]
    assert kinds("ncclAllReduce") == ["memory", "memory", "value", "value", "value", "handle", "handle"]
    assert fns["cudaGetErrorString"].returns == "const char*"
    assert kinds("ncclGroupStart") == []
    # nccl_device.h: ``extern "C"`` declarations, ``T const*`` parameters, struct and int results.
    assert {f.name for f in inventory.load()["nccl_device"]} == NCCL_DEVICE_API
    assert kinds("ncclDevCommCreate") == ["handle", "in_struct", "out"]
    assert fns["ncclTeamWorld"].returns == "ncclTeam_t" and fns["ncclLLA2ACalcSlots"].returns == "int"


def test_tables_are_disjoint_and_name_real_symbols():
    tables = [dispositions.ASYNC, dispositions.SPECIAL, dispositions.CLIENT, dispositions.REFUSED]
    names = [n for t in tables for n in t]
    assert len(names) == len(set(names)), "a symbol is in two tables"
    declared = {f.name for funcs in inventory.load().values() for f in funcs}
    imported = set(coverage.imported_symbols())
    unknown = [n for n in names if n not in declared and n not in imported and not n.endswith(("_ptsz", "_ptds"))]
    assert not unknown, f"not declared in the headers nor imported by torch (typos?): {unknown}"
    assert all(reason for t in tables for reason in t.values())


@pytest.mark.parametrize("symbol, cls", [
    ("cudaMalloc", "special"), ("cudaLaunchKernel", "special"), ("ncclAllReduce", "async"),
    ("cudaEventRecord", "async"), ("cudaMemcpyAsync_ptsz", "special"), ("cudaStreamSynchronize", "generic"),
    ("cudaGetDevice", "generic"), ("cudaGetErrorString", "client"), ("cudaMallocManaged", "refused"),
    ("__cudaRegisterFatBinary", "special"), ("cublasSgemm_v2", "other library"),
    ("ncclGetPeerDevicePointer", "refused"), ("ncclTeamWorld", "refused"), ("pncclAllReduce", "async"),
    ("pncclMemAlloc", "refused"), ("cudaDeviceGetSharedMemConfig", "refused"), ("ncclResetDebugInit", "refused"),
])
def test_symbols_get_their_class(symbol, cls):
    declared = {f.name: f for funcs in inventory.load().values() for f in funcs}
    got = coverage.classify(symbol, declared)
    assert got.cls == cls and got.reason


def test_doctor_reports_every_imported_symbol_once():
    out = subprocess.run([sys.executable, "-m", "jitckpt", "doctor", "--api-coverage", "--json", "--verbose"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    total = sum(c["imported"] for c in report["summary"].values())
    assert total == len(coverage.imported_symbols()) == len(report["symbols"]) == 761
    assert report["summary"]["cudart"]["imported"] == 106 and report["summary"]["NCCL"]["imported"] == 51
    for lib, c in report["summary"].items():
        assert sum(c.get(k, 0) for k in coverage.CLASSES) == c["imported"], lib
        assert c.get("forwarded", 0) == sum(c.get(k, 0) for k in coverage.FORWARDED), lib
    # What the nvcc test programs run through the proxy (tests/native/test_proxy_*.py) is forwarded.
    assert report["summary"]["cudart"]["forwarded"] >= 50 and report["summary"]["NCCL"]["forwarded"] >= 30
    assert report["summary"]["cuBLAS"].get("forwarded", 0) == 0
    table = subprocess.run([sys.executable, "-m", "jitckpt", "doctor", "--api-coverage"], capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0 and "cudart" in table.stdout and "forwarded" in table.stdout


def test_doctor_without_a_question_says_what_the_installation_has():
    out = subprocess.run([sys.executable, "-m", "jitckpt", "doctor"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "jitckpt installation"
    for what in ("native parts:", "jitckpt._copy_hash:", "libcudart.so.13:", "libnccl.so.2:", "torch:", "criu:", "etcd:"):
        assert any(line.strip().startswith(what) for line in lines), (what, out.stdout)


def test_the_generated_layer_covers_every_declared_function(tmp_path):
    """Every declared function gets a forwarder (generic, hand-written or a refusal), and every
    asynchronous one is generated: the build's generator runs the same code."""
    from jitckpt.proxy_api import forwarding

    files = forwarding.generate(inventory.load(), set(), set())
    declared = [f for funcs in inventory.load().values() for f in funcs]
    table = files["proxy_forwarders.cc"]
    for f in declared:
        assert f'{{"{f.name}", ' in table, f.name
    for name in dispositions.ASYNC:
        assert f"k_{name} =" in files["proxy_functions.h"], name
    hand = files["proxy_calls.h"]
    assert all(f" {n}(" in hand for n in (*dispositions.SPECIAL, *dispositions.CLIENT))


def test_refusals_without_an_error_channel_abort():
    """A refused function returning a value (not a status) logs and aborts; the rest return an error."""
    files = forwarding.generate(inventory.load(), set(), set())
    fwd = files["proxy_forwarders.cc"]
    assert 'refuse_and_abort("ncclTeamWorld", ' in fwd and 'refuse_and_abort("ncclLLA2ACalcSlots", ' in fwd
    assert 'return refuse<ncclResult_t>("ncclDevCommCreate", ' in fwd
    assert "#include <nccl_device.h>" in fwd
    declared = [f for funcs in inventory.load().values() for f in funcs]
    aborting = {f.name for f in declared if forwarding.disposition(f)[0] == "refused"
                and f.returns not in forwarding.STATUS_TYPES}
    assert aborting == {"ncclTeamWorld", "ncclTeamLsa", "ncclTeamRail", "ncclTeamRankToWorld", "ncclTeamRankToLsa",
                        "ncclLLA2ACalcSlots"}


def test_pnccl_twins_go_where_their_nccl_twins_go():
    exports = reference_exports()
    files = forwarding.generate(inventory.load(), set(), exports)
    fwd = files["proxy_forwarders.cc"]
    assert '{"pncclAllReduce", reinterpret_cast<void*>(&fwd_ncclAllReduce)}' in fwd
    assert '{"pncclGetVersion", reinterpret_cast<void*>(&proxy_call::ncclGetVersion)}' in fwd
    # A refusal names the symbol called.
    assert '{"pncclMemAlloc", reinterpret_cast<void*>(&fwd_pncclMemAlloc)}' in fwd
    assert 'return refuse<ncclResult_t>("pncclMemAlloc", ' in fwd
    assert 'jitckpt_next{"pncclAllReduce", jitckpt::kNcclSoname}' in fwd


def hand_written() -> set[str]:
    """The entry points libjit.so defines by hand (the build passes the same files)."""
    src = Path(__file__).resolve().parents[1] / "interposer" / "src"
    return forwarding.hooked_names(src / f for f in ("cuda_hooks.cc", "nccl_hooks.cc", "kernel_registration.cc",
                                                     "profiler_markers.cc"))


def trampolined() -> list[tuple[str, str]]:
    """(symbol, group) of every trampoline the build generates."""
    files = forwarding.generate(inventory.load(), hand_written(), reference_exports())
    return re.findall(r'^    \{"(\w+)", "not forwarded \(([^:]+):', files["proxy_trampolines.cc"], re.M)


def test_trampolines_cover_the_rest_of_the_exports():
    """What the real libraries export beyond the declared functions, their twins and libjit.so's
    hand-written entry points gets a trampoline, each with its group; nothing declared does."""
    exports, hooked = reference_exports(), hand_written()
    files = forwarding.generate(inventory.load(), hooked, exports)
    listed = trampolined()
    names = {n for n, _ in listed}
    declared = {f.name for funcs in inventory.load().values() for f in funcs}
    assert names and not names & declared and not names & hooked
    assert {"cudaDeviceGetSharedMemConfig", "cudaGLSetGLDevice", "__cudaGetProcAddress", "ncclResetDebugInit",
            "pncclResetDebugInit", "cudaGetDriverEntryPoint_ptsz"} <= names
    assert {g for _, g in listed} == {"internal ABI", "graphics interop", "deprecated", "NCCL device API",
                                      "NCCL debug internals"}
    code = files["proxy_trampolines.cc"]
    for name in names:
        assert code.count(f"\n{name}:\n") == 2, name  # x86-64 and aarch64
    assert "__cudaRegisterFatBinary" in hooked and "cudaProfilerStart" in hooked  # hand-written, not trampolined
    assert trampolines.group_of("pncclResetDebugInit") == trampolines.group_of("ncclResetDebugInit")


def test_deprecated_trampolines_are_deprecated_in_the_header():
    """The "deprecated" group's reason is checked against cuda_runtime_api.h itself."""
    dirs = inventory.header_dirs()
    if dirs is None:
        pytest.skip("needs the CUDA toolkit headers and the nvidia-nccl-cu13 wheel")
    header = (Path(dirs[0]) / "cuda_runtime_api.h").read_text()
    deprecated = [n for n, group in trampolined() if group == "deprecated"]
    assert deprecated
    for name in {re.sub(r"_pt[sd][sz]$", "", n) for n in deprecated}:
        assert re.search(rf"__CUDA_DEPRECATED[^;]*\b{name}\(", header), name


def test_every_cuda_symbol_torch_imports_is_exported_by_the_real_libraries():
    """So the doctor's "refused" for an undeclared one is right: libjit.so has a trampoline for it."""
    imported = {s for s in coverage.imported_symbols() if coverage.library_of(s) in ("cudart", "NCCL")}
    assert imported and not imported - reference_exports()


def test_the_docs_quote_no_forwarding_figure_the_command_does_not_compute():
    """Issue 43 item 7: the README said cudart 63/106 forwarded while the command computed 64/106.
    A figure of what proxy mode forwards ("cudart N/M ... forwarded") in any page must be the one
    ``jitckpt doctor --api-coverage`` computes (the pages name the command rather than copy it)."""
    repo = Path(__file__).resolve().parents[1]
    counts = coverage.summary(coverage.coverage())
    names = {lib.lower(): lib for lib in counts}
    quoted = []
    for page in [repo / "README.md", *sorted((repo / "docs").glob("*.md")), *sorted(repo.glob("*/README.md"))]:
        for line in page.read_text().splitlines():
            if "forward" not in line:
                continue
            for lib, n, m in re.findall(r"\b(\w+) (\d+)/(\d+)\b", line):
                if lib.lower() in names:
                    quoted.append((page.name, names[lib.lower()], int(n), int(m)))
    wrong = [(page, lib, f"{n}/{m}", f"{counts[lib].get('forwarded', 0)}/{counts[lib]['imported']}")
             for page, lib, n, m in quoted
             if (n, m) != (counts[lib].get("forwarded", 0), counts[lib]["imported"])]
    assert not wrong, f"(page, library, quoted, computed): {wrong}"


@pytest.mark.parametrize("symbol, kinds", [
    ("cudaStreamCreateWithFlags", {"creates", "ordered"}),
    # A getter that hands out a handle is replayed in order as what creates one (issue 46): were it
    # left out of the journal, a new proxy's next handle would be another.
    ("cudaDeviceGetDefaultMemPool", {"creates", "ordered"}),
    ("ncclCommInitRankConfig", {"creates"}), ("ncclCommSplit", {"creates"}),
    ("cudaStreamQuery", {"stateless"}), ("cudaStreamSynchronize", {"stateless"}), ("cudaGetDevice", {"stateless"}),
    ("ncclGetUniqueId", set()),  # journaled: a replay maps the old id to the new one
    ("ncclAllReduce", {"work"}), ("cudaMemsetAsync", {"work"}), ("cudaStreamWaitEvent", {"work"}),
    ("ncclGroupStart", set()), ("cudaSetDevice", set()), ("cudaFreeArray", {"ordered"}),
])
def test_the_journal_kinds_of_a_generated_call_come_from_the_generator(symbol, kinds):
    inv = inventory.load()
    f = {f.name: f for funcs in inv.values() for f in funcs}[symbol]
    assert forwarding.call_kinds(f, forwarding.handle_types(inv)) == kinds


def test_the_generated_table_carries_each_calls_kinds():
    files = forwarding.generate(inventory.load(), set(), set(), inventory.load_enums())
    header = files["proxy_functions.h"]
    bits = forwarding.KIND_BITS
    assert f"    {bits['creates'] | bits['ordered']},  // cudaDeviceGetDefaultMemPool" in header
    assert f"    {bits['work']},  // ncclAllReduce" in header
    assert "inline uint8_t function_kinds(uint32_t id)" in header


@pytest.mark.parametrize("symbol, reason", [
    ("cudaMalloc3D", "struct cudaPitchedPtr: its device pointer is memory the proxy's arena did not hand out"),
    ("cudaMemset3DAsync", "struct cudaPitchedPtr"),
    ("cudaGraphKernelNodeGetParams", "struct cudaKernelNodeParams: its host function and argument pointers"),
    ("cudaGraphInstantiateWithParams", "cudaGraphInstantiateParams: its graph-node handles are not translated"),
    ("cudaGraphGetEdges", "an array of graph nodes (or edges) and its count"),
    ("cudaGraphicsMapResources", "an array of graphics resources and its count"),
])
def test_what_the_generic_rule_would_marshal_wrong_is_refused_naming_why(symbol, reason):
    f = {f.name: f for funcs in inventory.load().values() for f in funcs}[symbol]
    cls, why = forwarding.disposition(f)
    assert cls == "refused" and reason in why, why
