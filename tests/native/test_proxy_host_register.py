"""cudaHostRegister in proxy mode (issue 15): memory the program allocated, shared with the proxy.

host_register.cu registers a buffer that shares its pages with other data and an 8 MiB malloc'd
buffer, copies through them asynchronously (one copy held back by a kernel until the host has
rewritten the buffer), forks, and unregisters. Direct on simcuda and in proxy mode the program must
see the same: bytes around the registration intact, the late write seen, the child's writes not
seen. Proxy mode refuses, naming why, what it cannot share: a file mapping, a page shared with
another registration. Verified on simcuda only.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from simcuda_progs.simcuda_harness import BUILD, Program, build_program

pytestmark = pytest.mark.native
PROXY = {"LD_PRELOAD": str(BUILD / "lib" / "libjit.so"), "JITCKPT_MODE": "proxy"}
SAME_IN_BOTH = {"kept_after_register": "1", "attr_type": "1",  # cudaMemoryTypeHost
                "register_twice": "cudaErrorHostMemoryAlreadyRegistered", "late_write_seen": "1",
                "big_untouched": "1", "child_ok": "1", "fork_isolated": "1",
                "unregister_twice": "cudaErrorHostMemoryNotRegistered", "kept_after_unregister": "1", "ok": "1"}


@pytest.fixture(scope="module")
def prog() -> Program:
    return build_program("host_register", kernels=True, nccl=False)


def run(prog: Program, **env: str) -> tuple[dict[str, str], str]:
    proc = subprocess.run([str(prog.exe)], env=prog.env(**env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line), proc.stderr


def test_direct_on_simcuda(prog: Program) -> None:
    kv, _ = run(prog)
    assert {k: kv.get(k) for k in SAME_IN_BOTH} == SAME_IN_BOTH
    assert kv["file_register"] == "cudaSuccess"


def test_proxy_mode_shares_registered_pages_with_the_proxy(prog: Program) -> None:
    kv, err = run(prog, **PROXY)
    assert {k: kv.get(k) for k in SAME_IN_BOTH} == SAME_IN_BOTH, err
    # Registering twice fails as CUDA does, and the log says why proxy mode checks pages.
    assert "shares a page with pinned memory" in err
    # What cannot move into shared memory is refused with the reason, not silently copied.
    assert kv["file_register"] == "cudaErrorInvalidValue"
    assert "cudaHostRegister" in err and "part of it is a file mapping" in err


def test_the_programs_fat_binary_goes_to_the_proxy(prog: Program) -> None:
    """Before the first launch the client sends the module: the fat binary nvcc embedded (sized from
    its header, which the proxy checks) and the kernel names, as the proxy on a GPU needs them."""
    _, err = run(prog, JITCKPT_VERBOSE="1", **PROXY)
    sent = re.findall(r"module (\d+) sent to the proxy: a fat binary of (\d+) bytes, (\d+) kernels", err)
    assert len(sent) == 1, err
    module, size, kernels = (int(v) for v in sent[0])
    assert module == 0 and kernels == 2  # wait_for_flag and scale
    sections = subprocess.run(["readelf", "-SW", str(prog.exe)], capture_output=True, text=True, check=True).stdout
    fatbin = re.search(r"\.nv_fatbin\s+PROGBITS\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)", sections)
    assert fatbin, sections
    assert 0 < size <= int(fatbin.group(1), 16)
