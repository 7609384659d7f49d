"""Unit tests of the in-memory snapshot tier: layout, XOR parity, keeper, NaN fallback."""
from __future__ import annotations

import json
import math
import re
import os
import signal
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jitckpt.checkpoint_store import find_latest, write_checkpoint
from jitckpt.snapshot.checksum import DEFAULT_ALGORITHM, Checksum, checksum_of, copy_verified
from jitckpt.snapshot.client import META_KEY, STATE_FILE, SnapshotTaker, meta_blob
from jitckpt.snapshot.keeper_client import KeeperClient, KeeperError
from jitckpt.snapshot.layout import FlatState, rebuild
from jitckpt.snapshot.protection import ProtectionPlan
from jitckpt.snapshot.restore import find_latest_in_memory, reject_snapshot, restore

ROOT = Path(__file__).resolve().parent.parent


def _model_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.BatchNorm1d(13), torch.nn.Linear(13, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 7)).sum().backward()
    opt.step()
    return {"step": 3, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "extra": [torch.tensor(1.5, dtype=torch.float64), (torch.arange(5, dtype=torch.int16), "s")]}


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                           b.view(-1).view(torch.uint8) if b.numel() else b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _flat_bytes(flat: FlatState, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.uint8)
    flat.read_into(0, out)
    return out


def test_layout_round_trip_is_bitwise_and_keeps_state_dict_metadata() -> None:
    state = _model_state()
    flat = FlatState(state)
    back = rebuild(flat.skeleton, _flat_bytes(flat, flat.total).numpy())
    _assert_same(state, back)
    assert back["model"]._metadata == state["model"]._metadata  # load_state_dict reads versions


def test_layout_is_json_and_keeps_plain_leaf_types() -> None:
    state = {"step": 7, 3: {"betas": (0.9, 0.999), "lr": math.inf, "name": None, "on": True},
             "w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    flat = FlatState(state)
    doc = json.loads(flat.skeleton)  # plain JSON: nothing is unpickled on restore
    assert doc["tensors"] == [["bfloat16", [2, 3], 0, 12]]
    back = rebuild(flat.skeleton, _flat_bytes(flat, flat.total).numpy())
    _assert_same(state, back)
    assert type(back[3]["lr"]) is float and type(back[3]["on"]) is bool


def test_layout_refuses_leaves_json_cannot_hold_and_names_their_path() -> None:
    with pytest.raises(TypeError, match=r"state\['opt'\]\[0\] is a builtins.set.*state_fn"):
        FlatState({"opt": [{1, 2}]})
    with pytest.raises(TypeError, match="numpy"):
        FlatState({"rng": torch.zeros(2).numpy()})


def test_rebuild_refuses_a_damaged_layout_instead_of_viewing_out_of_range() -> None:
    flat = FlatState({"w": torch.arange(16.0)})
    data = _flat_bytes(flat, flat.total).numpy()
    doc = json.loads(flat.skeleton)
    doc["tensors"][0][2] = 64  # would read past the end of the buffer
    with pytest.raises(ValueError, match="outside"):
        rebuild(doc, data)
    doc["tensors"][0][:3] = ["float32", [17], 0]  # 17 floats do not fit 64 bytes
    with pytest.raises(ValueError, match="cannot take"):
        rebuild(doc, data)
    with pytest.raises(ValueError, match="not valid JSON"):
        rebuild(b"\x80\x04pickle", data)


def test_layout_reads_ranges_across_tensor_seams_and_pads_with_zeros() -> None:
    flat = FlatState({"a": torch.arange(10, dtype=torch.uint8), "b": torch.arange(3, dtype=torch.uint8)})
    whole = _flat_bytes(flat, flat.total + 16)
    assert whole[:10].tolist() == list(range(10)) and whole[10:64].eq(0).all()
    assert whole[64:67].tolist() == [0, 1, 2] and whole[67:].eq(0).all()
    part = torch.empty(60, dtype=torch.uint8)
    flat.read_into(8, part)
    assert torch.equal(part, whole[8:68])


def test_layout_rejects_non_cpu_tensors_with_a_clear_error() -> None:
    t = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match="CPU tensors only"):
        FlatState({"x": t})


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32"])  # one native call per chunk; piece by piece
def test_copy_flat_copies_and_hashes_any_range_of_the_layout_across_seams_and_gaps(algo) -> None:
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randint(0, 256, (100,), dtype=torch.uint8, generator=g), "e": torch.empty(0),
             "b": torch.randn(7, 3, generator=g), "c": [torch.randn(1000, generator=g, dtype=torch.float64)],
             "d": torch.arange(5, dtype=torch.int16)}
    flat = FlatState(state)
    whole = _flat_bytes(flat, flat.total + 100).numpy()  # read_into: the reference, zeros past the end
    for start, n in [(0, flat.total), (0, 1), (99, 3), (100, 30), (130, 4200), (64, flat.total - 64),
                     (flat.total - 5, 105), (17, flat.total + 83)]:
        dst = np.full(n, 0xAB, dtype=np.uint8)
        h = Checksum(algo)
        h.copy_flat(dst, flat, start, bypass_cache=n > 4096)
        assert np.array_equal(dst, whole[start:start + n]), (start, n)
        assert h.value() == checksum_of(whole[start:start + n], algo), (start, n)


def test_layout_takes_parameters_views_and_tensor_subclasses_as_their_values() -> None:
    class Tagged(torch.Tensor):
        pass

    base = torch.arange(12.0).reshape(3, 4)
    state = {"p": torch.nn.Parameter(torch.ones(2, 2)), "view": base[:, 1], "sub": torch.arange(3.0).as_subclass(Tagged),
             "nested": [OrderedDict(w=base)]}
    flat = FlatState(state)
    back = rebuild(flat.skeleton, _flat_bytes(flat, flat.total).numpy())
    assert json.loads(flat.skeleton)["tensors"][1] == ["float32", [3], 64, 12]  # the view's values only
    assert torch.equal(back["view"], base[:, 1]) and torch.equal(back["p"], torch.ones(2, 2))
    assert torch.equal(back["sub"], torch.arange(3.0)) and torch.equal(back["nested"][0]["w"], base)
    with pytest.raises(ValueError, match="sparse"):
        FlatState({"s": torch.eye(3).to_sparse()})


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 3 * 4096 + 5])
def test_copy_verified_copies_and_hashes_every_byte_once(n: int) -> None:
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    for algo in ("crc32", DEFAULT_ALGORITHM):
        dst, value = copy_verified(src, algo, chunk=4096)
        assert torch.equal(dst, src) and value == checksum_of(src.numpy(), algo)
        if n:
            dst[0] ^= 1  # a private copy: the source is untouched
            assert not torch.equal(dst, src)


def _encode(plan: ProtectionPlan, flat: FlatState) -> dict:
    """All objects every rank would write (key -> bytes), as stored by the keepers."""
    objs = {}
    for node in range(plan.m):
        for l in range(plan.r):
            for spec in plan.rank_objects(node, l):
                dst = torch.zeros(spec.size, dtype=torch.uint8)
                tmp = torch.empty(spec.size, dtype=torch.uint8)
                flat.read_into(spec.sources[0][0], dst)
                for off, _ in spec.sources[1:]:
                    flat.read_into(off, tmp)
                    dst ^= tmp
                objs.setdefault(spec.key, dst)
    return objs


@settings(max_examples=25, deadline=None)
@given(m=st.integers(2, 5), r=st.integers(1, 3), nbytes=st.integers(0, 3000), seed=st.integers(0, 99))
def test_aec_parity_decodes_any_single_lost_node(m: int, r: int, nbytes: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g),
             "f": torch.randn(7, generator=g)}
    flat = FlatState(state)
    plan = ProtectionPlan(scheme="aec", num_nodes=m, ranks_per_node=r, total_bytes=flat.total)
    objs = _encode(plan, flat)
    assert set(objs) == {f"{c}{k}.{l}" for c in "xp" for k in range(m) for l in range(r)}
    assert all(o.numel() == plan.L // r for k, o in objs.items() if k[0] == "p")
    for lost in range(m):
        held = {k: v for k, v in objs.items() if lost not in plan.holders(k)}
        need = plan.fetch_list(set(held))
        assert need is not None and all(k in held for k in need)
        rebuilt = plan.assemble({k: held[k] for k in need})
        _assert_same(state, rebuild(flat.skeleton, rebuilt.numpy()))
    if m >= 3:  # two lost nodes exceed one XOR parity
        held = {k: v for k, v in objs.items() if not ({0, 1} & set(plan.holders(k)))}
        assert plan.fetch_list(set(held)) is None


def test_aec_decode_uses_parity_not_a_copy() -> None:
    flat = FlatState({"w": torch.arange(4000, dtype=torch.int32)})
    plan = ProtectionPlan(scheme="aec", num_nodes=3, ranks_per_node=1, total_bytes=flat.total)
    objs = _encode(plan, flat)
    held = {k: v for k, v in objs.items() if k not in ("x1.0", "p1.0")}
    rebuilt = plan.assemble(held)
    assert torch.equal(rebuilt[:flat.total], _flat_bytes(flat, flat.total))
    corrupt = dict(held, **{"p2.0": held["p2.0"].clone()})
    corrupt["p2.0"][0] ^= 1  # x1's first segment is covered by p2: a flipped parity bit shows up
    assert not torch.equal(plan.assemble(corrupt)[:flat.total], _flat_bytes(flat, flat.total))


def test_arc_recovers_a_lost_node_from_its_predecessor_copy() -> None:
    flat = FlatState(_model_state())
    plan = ProtectionPlan(scheme="arc", num_nodes=3, ranks_per_node=2, total_bytes=flat.total)
    objs = _encode(plan, flat)
    assert plan.holders("x1.0") == [1, 0]
    stored = {n: {s.key for l in range(2) for s in plan.rank_objects(n, l)} for n in range(3)}
    assert stored[0] == {"x0.0", "x0.1", "x1.0", "x1.1"}
    avail = stored[0] | stored[2]  # node 1 lost
    need = plan.fetch_list(avail)
    assert need is not None
    _assert_same(_model_state(), rebuild(flat.skeleton, plan.assemble({k: objs[k] for k in need}).numpy()))
    assert plan.fetch_list(stored[2]) is None  # nodes 0 and 1 lost: x1 had only those two homes


def test_plan_validates_configuration() -> None:
    with pytest.raises(ValueError, match="at least 2 nodes"):
        ProtectionPlan(scheme="aec", num_nodes=1, ranks_per_node=2, total_bytes=10)
    with pytest.raises(ValueError, match="must be one of"):
        ProtectionPlan(scheme="raid6", num_nodes=3, ranks_per_node=1, total_bytes=10)


# Keeper ------------------------------------------------------------------------------------------
def test_keeper_exits_when_its_launcher_is_killed(tmp_path) -> None:
    # The launcher stand-in starts the keeper, reports its pid and is SIGKILLed: no stop() runs.
    sock = str(tmp_path / "k.sock")
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"k = subprocess.Popen([sys.executable, '-m', 'jitckpt.snapshot.keeper', '--socket', {sock!r}],"
         " stdout=subprocess.PIPE, text=True)\n"
         "print(k.stdout.readline().split()[1], flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    keeper_pid = None
    try:
        keeper_pid = int(launcher.stdout.readline())
        keeper = psutil.Process(keeper_pid)
        assert keeper.is_running()
        launcher.kill()
        launcher.wait(timeout=10)
        gone, alive = psutil.wait_procs([keeper], timeout=10)
        assert gone and not alive, "snapshot keeper outlived the process that started it"
        assert not os.path.exists(sock)  # and it removed its socket
    finally:
        launcher.kill()
        if keeper_pid is not None and psutil.pid_exists(keeper_pid):
            os.kill(keeper_pid, signal.SIGKILL)


def test_keeper_keeps_one_complete_and_one_in_progress_and_outlives_its_writer(keeper) -> None:
    sock, proc = keeper
    c = KeeperClient(sock)
    m = c.begin("x0.0", 1, 16)
    m[:16] = bytes(range(16))
    assert c.listing() == []  # in progress is never listed
    c.commit([{"key": "x0.0", "step": 1, "checksum": 7, "algo": "crc32"}])
    m2 = c.begin("x0.0", 2, 16)
    m2[:16] = b"\xff" * 16
    assert [e["step"] for e in c.listing()] == [1]
    c.commit([{"key": "x0.0", "step": 2, "checksum": 8, "algo": "crc32"}])
    c.begin("x0.0", 3, 16)  # reuses step 1's buffer; step 2 stays readable
    assert [e["step"] for e in c.listing()] == [2]
    c.close()  # the writer goes away; memory stays with the keeper
    c = KeeperClient(sock)
    m, info = c.open("x0.0", 2)
    assert m[:16] == b"\xff" * 16 and info.checksum == 8
    with pytest.raises(KeeperError, match="no begin"):
        c.commit([{"key": "x0.0", "step": 9, "checksum": 0, "algo": "crc32"}])
    c.reject(2)
    assert c.listing() == []
    c.begin("x0.0", 2, 16)  # a later run reaching step 2 again may snapshot it afresh
    c.commit([{"key": "x0.0", "step": 2, "checksum": 9, "algo": "crc32"}])
    assert [(e["step"], e["checksum"]) for e in c.listing()] == [(2, 9)]
    c.close()
    proc.kill()
    proc.wait(timeout=10)
    with pytest.raises(KeeperError, match="cannot connect"):
        KeeperClient(sock)


def test_keeper_keeps_a_pinned_version_until_the_next_pinned_one(keeper) -> None:
    """A pinned version (AOR log mode pins the copy steps' snapshots) outlives later versions, which
    still rotate through two buffers; the next pinned commit makes it a regular version again."""
    from jitckpt.snapshot.keeper_client import KeeperClient

    sock, _ = keeper
    c = KeeperClient(sock)

    def put(step: int, pin: bool = False) -> None:
        c.begin("x0.0", step, 64)
        c.commit([{"key": "x0.0", "step": step, "checksum": 0, "algo": "crc32", **({"pin": True} if pin else {})}])

    def steps() -> list:
        return sorted(e["step"] for e in c.listing() if e["key"] == "x0.0")

    try:
        put(4, pin=True)
        for s in (5, 6, 7):
            put(s)
        assert steps() == [4, 6, 7]
        put(8, pin=True)
        assert steps() == [4, 7, 8]  # 4 unpinned: a regular version again, the next one reused
        put(9)
        assert steps() == [7, 8, 9]
        put(10)
        assert steps() == [8, 9, 10]  # 8 pinned: 9 was reused, not 8
        c.discard_newer(3)  # a restore found nothing newer usable: the pin goes too
        assert steps() == []
        put(11)
        put(12)
        assert steps() == [11, 12]
    finally:
        c.close()


def test_keeper_refuses_what_is_not_its_protocol_by_name(keeper) -> None:
    """Typed keeper messages: an unknown type or field is refused, naming it; the keeper serves on."""
    from jitckpt.protocol.keeper_messages import Begin, Ping

    sock, proc = keeper
    c = KeeperClient(sock)
    for raw, match in ((b'{"type": "shutdown"}', "unknown snapshot keeper message type 'shutdown'"),
                       (b'{"type": "begin", "key": "x", "step": 1, "size": 4, "sise": 4}',
                        r"unknown field\(s\) \['sise'\]"),
                       (b"not json", "not a JSON object with a type")):
        c._sock.send(raw)
        reply = json.loads(c._sock.recv(1 << 16))
        assert reply["type"] == "refused" and re.search(match, reply["error"]), reply
    with pytest.raises(KeeperError, match="refused begin: .*size must be > 0"):
        c.request(Begin(key="x", step=1, size=0))
    assert c.request(Ping())[0].pid == proc.pid
    c.close()


def test_keeper_client_names_the_missing_socket() -> None:
    os.environ.pop("JITCKPT_SNAPSHOT_SOCKET", None)
    with pytest.raises(ValueError, match="JITCKPT_SNAPSHOT_SOCKET"):
        KeeperClient()


# Restore tiers (single rank, no process group) ------------------------------------------------------
def _take(sock: str, state: dict, step: int, **kw) -> SnapshotTaker:
    snap = SnapshotTaker(state_fn=lambda: state, socket_path=sock, scheme="none", **kw)
    assert snap.begin(step)
    assert snap.wait() == step
    return snap


def test_memory_restore_is_bitwise_and_newest_tier_wins(keeper, tmp_path) -> None:
    sock, _ = keeper
    state = _model_state()
    snap = _take(sock, state, 5, chunk_bytes=4096)
    assert snap.stats.bytes_copied >= FlatState(state).total
    snap.close()
    ckpt = tmp_path / "ckpt"
    older = _model_state(seed=1)
    write_checkpoint(ckpt, lambda d: torch.save(older, Path(d) / STATE_FILE), kind="periodic", step=4,
                     rank=0, world_size=1, gen=0)
    res = restore(socket_path=sock, ranks_per_node=1, checkpoint_dir=str(ckpt))
    assert (res.source, res.step) == ("memory", 5)
    _assert_same(state, res.state)
    write_checkpoint(ckpt, lambda d: torch.save(older, Path(d) / STATE_FILE), kind="jit", step=6,
                     rank=0, world_size=1, gen=1)
    res = restore(socket_path=sock, ranks_per_node=1, checkpoint_dir=str(ckpt))
    assert (res.source, res.step) == ("disk", 6)  # a newer JIT checkpoint beats the snapshot


def test_memory_restore_reads_only_the_snapshot_objects_not_the_aor_ones(keeper) -> None:
    """The keepers also hold AOR's objects (partitions, bases, gradient rings); the parameter restore
    neither verifies nor trips over them. Found from outside: a gradient ring (its slots carry their
    own checksums, keeper algorithm "inband") at the step a restore fell back to made it refuse
    that step."""
    from jitckpt.snapshot.keeper_client import KeeperClient

    sock, _ = keeper
    state = _model_state()
    for step in (3, 4):
        _take(sock, state, step, chunk_bytes=4096).close()
    c = KeeperClient(sock)
    try:
        for key, step in (("aor.g1", 4), ("aor.z1", 4), ("aor.b1", 3)):
            c.begin(key, step, 64)
            c.commit([{"key": key, "step": step, "checksum": 0, "algo": "inband"}])
    finally:
        c.close()
    res = restore(socket_path=sock, ranks_per_node=1)
    assert (res.source, res.step, res.skipped) == ("memory", 4, []), res.skipped
    _assert_same(state, res.state)


@pytest.mark.parametrize("chunk", [4096, 1 << 20])
@pytest.mark.parametrize("native", [True, False], ids=["native", "pure-python"])
def test_keeper_object_is_the_flat_state_and_its_checksum_is_recomputable(keeper, chunk: int, native: bool,
                                                                         monkeypatch) -> None:
    """The bytes a snapshot leaves in the keeper, and the checksum it commits, checked by an
    independent reader (numpy + the xxhash package), across tensor seams and alignment gaps;
    with jitckpt's native copy + hash and without it (a pure-Python install)."""
    xxhash = pytest.importorskip("xxhash")
    from jitckpt.snapshot import checksum

    if native and checksum._native is None:
        pytest.skip("native module not built (make native)")
    if not native:
        monkeypatch.setattr(checksum, "_native", None)
    sock, _ = keeper
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(300_001, generator=g), "odd": torch.arange(7, dtype=torch.int8),
             "more": torch.randn(70_000, generator=g, dtype=torch.float64)}  # > 256 KiB: streamed
    flat = FlatState(state)
    snap = _take(sock, state, 4, ranks_per_node=1, chunk_bytes=chunk)
    snap.close()
    c = KeeperClient(sock)
    try:
        entry = next(e for e in c.listing() if e["key"] != META_KEY)
        m, info = c.open(entry["key"], 4)
        data = bytes(m[:info.size])
    finally:
        c.close()
    assert data[:flat.total] == _flat_bytes(flat, flat.total).numpy().tobytes()
    assert info.algo == "xxh3_64" and info.checksum == xxhash.xxh3_64(data).intdigest()


def test_restored_state_is_private_while_new_snapshots_reuse_the_keeper(keeper) -> None:
    """Writing the restored tensors leaves the keeper's copy intact, and later snapshots (which
    recycle keeper buffers) never change them."""
    sock, _ = keeper
    state = {"w": torch.arange(4096.0), "m": torch.ones(3000)}
    _take(sock, state, 1).close()
    res = restore(socket_path=sock, ranks_per_node=1)
    assert (res.source, res.step) == ("memory", 1)
    got = res.state
    got["m"].add_(1.0)  # the optimizer's first step writes its state in place
    again = restore(socket_path=sock, ranks_per_node=1)  # checksums still verify: keeper untouched
    assert again.step == 1 and torch.equal(again.state["m"], torch.ones(3000))
    newer = {"w": torch.full((4096,), -1.0), "m": torch.zeros(3000)}
    snap = SnapshotTaker(state_fn=lambda: newer, socket_path=sock, scheme="none")
    for step in (2, 3, 4):  # three snapshots cycle every buffer the keeper would reuse
        assert snap.begin(step) and snap.wait() == step
    snap.close()
    assert torch.equal(got["w"], torch.arange(4096.0)) and torch.equal(got["m"], torch.full((3000,), 2.0))
    assert torch.equal(again.state["w"], torch.arange(4096.0))
    assert restore(socket_path=sock, ranks_per_node=1).step == 4


def test_nan_snapshot_falls_back_to_disk_and_is_never_retried(keeper, tmp_path) -> None:
    sock, _ = keeper
    bad = _model_state()
    bad["model"]["0.weight"][0, 0] = math.nan
    _take(sock, bad, 9).close()
    ckpt = tmp_path / "ckpt"
    good = _model_state(seed=2)
    write_checkpoint(ckpt, lambda d: torch.save(good, Path(d) / STATE_FILE), kind="snapshot", step=7,
                     rank=0, world_size=1, gen=0)
    res = restore(socket_path=sock, ranks_per_node=1, checkpoint_dir=str(ckpt))
    assert (res.source, res.step) == ("disk", 7)
    assert any("NaN" in why for _, why in res.skipped)
    _assert_same(good, res.state)
    again = restore(socket_path=sock, ranks_per_node=1, checkpoint_dir=str(ckpt))
    assert (again.source, again.step) == ("disk", 7)
    assert not any("NaN" in why for _, why in again.skipped)  # step 9 is not even considered


def test_nan_everywhere_gives_no_state_instead_of_looping(keeper, tmp_path) -> None:
    sock, _ = keeper
    bad = {"w": torch.tensor([math.inf])}
    _take(sock, bad, 3).close()
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, lambda d: torch.save(bad, Path(d) / STATE_FILE), kind="snapshot", step=2,
                     rank=0, world_size=1, gen=0)
    res = restore(socket_path=sock, ranks_per_node=1, checkpoint_dir=str(ckpt))
    assert (res.source, res.state) == ("none", None)
    assert len(res.skipped) >= 2


def test_reject_snapshot_after_a_diverged_resume(keeper) -> None:
    sock, _ = keeper
    _take(sock, {"w": torch.ones(3)}, 4).close()
    assert restore(socket_path=sock, ranks_per_node=1).step == 4
    reject_snapshot(4, socket_path=sock)
    assert restore(socket_path=sock, ranks_per_node=1).source == "none"


def test_corrupt_object_is_not_used(keeper) -> None:
    sock, _ = keeper
    _take(sock, {"w": torch.arange(100.0)}, 1).close()
    c = KeeperClient(sock)
    m, _ = c.open("x0.0", 1)
    m[0] ^= 0xFF  # memory corruption after commit
    c.close()
    res = restore(socket_path=sock, ranks_per_node=1)
    assert res.source == "none"


def test_corrupt_newest_step_falls_back_to_the_older_copy_in_memory(keeper) -> None:
    sock, _ = keeper
    states = {1: {"w": torch.arange(100.0)}, 2: {"w": torch.arange(100.0) * 2}}
    snap = SnapshotTaker(state_fn=lambda: states[step], socket_path=sock, scheme="none")
    for step in (1, 2):
        assert snap.begin(step) and snap.wait() == step
    snap.close()
    c = KeeperClient(sock)
    m, _ = c.open("x0.0", 2)
    m[8] ^= 0x01
    c.close()
    res = restore(socket_path=sock, ranks_per_node=1)
    assert (res.source, res.step) == ("memory", 1)  # older steps are verified only when needed
    _assert_same(states[1], res.state)


def _trainer(seed: int, *, stepped: bool = True) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.BatchNorm1d(13), torch.nn.Linear(13, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if stepped:
        model(torch.randn(5, 7)).sum().backward()
        opt.step()
    return model, opt


def _live(model, opt) -> dict:
    return {"step": 0, "model": model.state_dict(), "optimizer": opt.state_dict()}


@pytest.mark.parametrize("stepped", [True, False], ids=["optimizer-state-live", "fresh-optimizer"])
def test_restore_into_the_live_tensors_copies_once_and_load_state_dict_copies_nothing(keeper, stepped) -> None:
    """Issue 19: one rank's restore copies the snapshot straight into the model's parameters and
    the optimizer's state (verified in the same pass); loading the result changes no tensor
    again. A fresh optimizer (no state yet) gets new tensors for its state."""
    sock, _ = keeper
    model, opt = _trainer(0)
    state = _live(model, opt)
    state["step"] = 11
    _take(sock, state, 11).close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    other, other_opt = _trainer(5, stepped=stepped)
    params = [p.data_ptr() for p in other.parameters()]
    own_moments = [s["exp_avg"].data_ptr() for s in other_opt.state.values()]
    res = restore(socket_path=sock, ranks_per_node=1, into=_live(other, other_opt))
    assert (res.source, res.step) == ("memory", 11) and res.state["step"] == 11
    # Already in the parameters before any load_state_dict: the state holds the live tensors.
    assert all(torch.equal(other.state_dict()[k], v) for k, v in expected.items())
    assert [res.state["model"][k].data_ptr() for k in ("0.weight", "0.bias", "2.weight", "2.bias")] == [
        params[0], params[1], params[4], params[5]]
    other.load_state_dict(res.state["model"])
    other_opt.load_state_dict(res.state["optimizer"])
    assert [p.data_ptr() for p in other.parameters()] == params
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(other_opt.state.values(), moments))
    if stepped:  # the optimizer kept its own tensors, now holding the snapshot's values
        assert [s["exp_avg"].data_ptr() for s in other_opt.state.values()] == own_moments


def test_restore_into_a_corrupt_snapshot_falls_back_to_disk_or_refuses_to_go_on(keeper, tmp_path) -> None:
    """A checksum mismatch found while copying into the live tensors: they hold partial data, so
    the disk tier's state is loaded, and with no disk tier restore raises instead of returning
    nothing (a job would train on from half-written parameters)."""
    sock, _ = keeper
    model, opt = _trainer(0)
    _take(sock, _live(model, opt), 4).close()
    c = KeeperClient(sock)
    m, _ = c.open("x0.0", 4)
    m[len(m) // 2] ^= 0x10
    c.close()
    other, other_opt = _trainer(1)
    with pytest.raises(RuntimeError, match="partial data.*fails its checksum"):
        restore(socket_path=sock, ranks_per_node=1, into=_live(other, other_opt))
    ckpt = tmp_path / "ckpt"
    good = _live(*_trainer(2))
    write_checkpoint(ckpt, lambda d: torch.save(good, Path(d) / STATE_FILE), kind="jit", step=3, rank=0,
                     world_size=1, gen=0)
    res = restore(socket_path=sock, ranks_per_node=1, checkpoint_dir=str(ckpt), into=_live(other, other_opt))
    assert (res.source, res.step) == ("disk", 3)
    _assert_same(good, res.state)


def test_restore_into_rejects_a_nan_snapshot_and_takes_the_older_step(keeper) -> None:
    sock, _ = keeper
    states = {1: {"w": torch.arange(100.0), "n": 1}, 2: {"w": torch.full((100,), math.nan), "n": 2}}
    snap = SnapshotTaker(state_fn=lambda: states[step], socket_path=sock, scheme="none")
    for step in (1, 2):
        assert snap.begin(step) and snap.wait() == step
    snap.close()
    live = {"w": torch.zeros(100), "n": 0}
    res = restore(socket_path=sock, ranks_per_node=1, into=live)
    assert (res.source, res.step) == ("memory", 1) and res.state["w"] is live["w"]
    assert torch.equal(live["w"], torch.arange(100.0)) and res.state["n"] == 1
    assert any("NaN" in why for _, why in res.skipped)


def test_restore_into_finds_nan_in_any_tensor_and_takes_the_older_step(keeper) -> None:
    """The NaN/Inf check runs beside the copy, per tensor: a NaN in the last tensor of the layout
    (after clean ones, a bfloat16 and an integer one) is found as surely as in the first."""
    sock, _ = keeper
    clean = {"a": torch.arange(5000.0), "b": torch.ones(300, dtype=torch.bfloat16), "i": torch.arange(7)}
    bad = {**clean, "z": torch.ones(40000)}
    bad["z"][-1] = math.inf
    states = {1: {**clean, "z": torch.zeros(40000)}, 2: bad}
    snap = SnapshotTaker(state_fn=lambda: states[step], socket_path=sock, scheme="none")
    for step in (1, 2):
        assert snap.begin(step) and snap.wait() == step
    snap.close()
    live = {"a": torch.zeros(5000), "b": torch.zeros(300, dtype=torch.bfloat16), "i": torch.zeros(7, dtype=torch.int64),
            "z": torch.full((40000,), 3.0)}
    res = restore(socket_path=sock, ranks_per_node=1, into=live)
    assert (res.source, res.step) == ("memory", 1) and res.state["z"] is live["z"]
    assert torch.equal(live["z"], torch.zeros(40000)) and torch.equal(live["a"], clean["a"])
    assert any("NaN" in why for _, why in res.skipped)


def test_premapper_maps_each_keeper_buffer_once_and_a_restore_through_it_maps_nothing(keeper) -> None:
    """Issue 19: a warm standby maps the keeper's buffers while idle. The keeper rewrites the same
    two buffers per object, so later snapshots need no new mapping, and a restore through the
    standby's client maps nothing (mapped_ahead) yet loads the newest step bitwise."""
    import time

    from jitckpt.snapshot.premap import Premapper

    sock, _ = keeper
    model, opt = _trainer(0)
    state = _live(model, opt)
    step = 0
    snap = SnapshotTaker(state_fn=lambda: {**state, "step": step}, socket_path=sock, scheme="none")
    settled: list = []
    premapper = Premapper(sock, interval=0.01, fast=0.01, on_settled=lambda: settled.append(premapper.rounds))

    def snapshot_and_premap(n: int) -> None:
        nonlocal step
        step = n
        assert snap.begin(n) and snap.wait() == n
        rounds, deadline = premapper.rounds, time.monotonic() + 10
        while premapper.rounds < rounds + 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the premapper's round count, bounded by the deadline
        assert premapper.rounds >= rounds + 2

    try:
        snapshot_and_premap(1)
        assert not settled  # one buffer of each object so far
        snapshot_and_premap(2)  # the second buffer of each object
        client = premapper.stop()
        assert len(settled) == 1  # told once, when both were mapped (a standby's title says so)
    finally:
        premapper.stop()
    assert client is not None
    try:
        mapped = client.mappings_made
        assert mapped == 4 and client.mapped_both_buffers(), mapped  # metadata + data, two buffers each
        step = 3
        assert snap.begin(3) and snap.wait() == 3  # rewrites step 1's buffers
        snap.close()
        assert client.premap() == 0  # the same buffers: nothing new to map
        other, other_opt = _trainer(1)
        res = restore(socket_path=sock, ranks_per_node=1, into=_live(other, other_opt), keeper=client)
        assert (res.source, res.step, res.mapped_ahead) == ("memory", 3, True), res.skipped
        assert client.mappings_made == mapped
        _assert_same({**state, "step": 3}, res.state)
        assert client.listing()  # the caller's client is not closed by restore()
    finally:
        client.close()
    res = restore(socket_path=sock, ranks_per_node=1, into=_live(*_trainer(2)))
    assert (res.source, res.step, res.mapped_ahead) == ("memory", 3, False)


def test_the_metadata_object_keeps_its_size_while_its_numbers_change_length() -> None:
    """Its size is whole pages: a step or a learning rate one digit longer leaves it in the same
    keeper buffer (a new size would be a new buffer, which no warm standby has mapped)."""
    from jitckpt.snapshot.client import META_ALIGN, parse_meta

    def blob(step: int, lr: float) -> bytes:
        flat = FlatState({"w": torch.zeros(3), "lr": lr})
        return meta_blob(step, ProtectionPlan(scheme="none", num_nodes=1, ranks_per_node=1, total_bytes=flat.total),
                         flat)

    a, b = blob(9, 0.1), blob(10, 0.012345678901234)
    assert len(a) == len(b) and len(a) % META_ALIGN == 0
    assert parse_meta(b)["step"] == 10 and parse_meta(a)["step"] == 9  # the padding is JSON whitespace


def test_a_buffer_too_small_for_an_objects_newest_version_does_not_count_as_mapped_ahead(keeper) -> None:
    """A first step's object is smaller than the later ones (no optimizer state yet): its buffer is
    never used again, so two buffers of that object mapped are not yet both of those in use (a
    standby that said "mapped ahead" then mapped at its restore, one test run in three)."""
    sock, _ = keeper
    client = KeeperClient(sock)
    try:
        _take(sock, {"w": torch.arange(100.0)}, 1).close()  # small: step 1's buffer
        client.premap()
        _take(sock, {"w": torch.arange(1000.0)}, 2).close()  # larger: a new buffer
        client.premap()
        assert not client.mapped_both_buffers()  # step 1's data buffer is too small to count
        _take(sock, {"w": torch.arange(1000.0) * 2}, 3).close()  # the second buffer of the new size
        client.premap()
        assert client.mapped_both_buffers()
        _take(sock, {"w": torch.arange(1000.0) * 3}, 4).close()  # rewrites one of those two
        assert client.premap() == 0
    finally:
        client.close()


def test_open_listed_needs_no_round_trip_for_buffers_mapped_ahead(keeper) -> None:
    """A restore through a warm standby's client opens the listed objects from its own mappings:
    it still reads them after the keeper is gone, and only an object it never mapped needs the
    keeper (then a KeeperError)."""
    sock, proc = keeper
    _take(sock, {"w": torch.arange(1000.0)}, 1).close()
    client = KeeperClient(sock)
    try:
        client.premap()
        _take(sock, {"w": torch.arange(1000.0) * 3}, 2).close()  # listed, not mapped yet
        listing = client.listing()
        proc.kill()
        proc.wait(timeout=10)
        old = [e for e in listing if e["step"] == 1]
        opened = client.open_listed(old)
        assert [g.checksum for _, g in opened] == [e["checksum"] for e in old]
        for (m, _), e in zip(opened, old):  # the bytes themselves, from the mappings
            assert checksum_of(memoryview(m)[:e["size"]], e["algo"]) == e["checksum"]
        with pytest.raises(KeeperError):
            client.open_listed([e for e in listing if e["step"] == 2])
    finally:
        client.close()


def test_keeper_buffers_only_grow_so_a_mapping_outlives_smaller_objects() -> None:
    """The metadata object's size changes from step to step: its buffer keeps its id (a reader's
    mapping stays valid) unless an object no longer fits."""
    from jitckpt.snapshot.keeper import SnapshotKeeper

    k = SnapshotKeeper(node=0)
    ids = []
    for step, size in enumerate((100, 90, 100, 80, 120, 110)):
        b = k.begin("meta", step, size)
        assert b.size == size and b.capacity >= size and os.fstat(b.fd).st_size == b.capacity
        k.commit([{"key": "meta", "step": step, "checksum": 0, "algo": "crc32"}])
        ids.append(b.buf_id)
    # Two buffers alternate: steps 0, 2, 4 in one (100, 100, 120: grown at step 4), 1, 3, 5 in the
    # other (90, 80, 110: grown at step 5).
    assert ids[0] == ids[2] != ids[4] and ids[1] == ids[3] != ids[5], ids
    assert {e["step"]: e["size"] for e in k.listing()} == {4: 120, 5: 110}


def test_premapper_waits_for_a_keeper_that_is_not_up_yet(tmp_path) -> None:
    from jitckpt.snapshot.premap import Premapper

    with pytest.raises(ValueError, match="fast"):
        Premapper(str(tmp_path / "k.sock"), interval=0.01, fast=0.1)
    premapper = Premapper(str(tmp_path / "none.sock"), fast=0.01)
    assert premapper.stop() is None and premapper.rounds == 0


def test_open_many_is_one_round_trip_and_a_refusal_leaks_no_descriptor(keeper) -> None:
    sock, _ = keeper
    _take(sock, {"w": torch.arange(100.0)}, 1).close()
    c = KeeperClient(sock)
    try:
        (meta, _), (data, info) = c.open_many([META_KEY, "x0.0"], 1, sequential=("x0.0",))
        assert checksum_of(memoryview(data)[:400], info.algo) is not None and len(meta) > 0
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(KeeperError, match="refused"):
            c.open_many(["x0.0", "nope", META_KEY], 1)
        assert len(os.listdir("/proc/self/fd")) == before
        assert c.listing()  # the connection is still in step: every reply was read
    finally:
        c.close()


def test_disk_flush_goes_through_the_shared_checkpoint_format(keeper, tmp_path) -> None:
    sock, _ = keeper
    state = {"step": 2, "w": torch.arange(10.0)}
    snap = SnapshotTaker(state_fn=lambda: state, socket_path=sock, scheme="none", flush_every=1,
                         flush_dir=str(tmp_path / "ckpt"))
    assert snap.begin(2) and snap.wait() == 2
    snap.close()
    assert snap.stats.flushed == [2]
    path, meta = find_latest(tmp_path / "ckpt")
    assert (meta.kind, meta.step) == ("snapshot", 2)
    _assert_same(state, torch.load(path / STATE_FILE, weights_only=True))


def test_taker_validates_configuration(keeper) -> None:
    sock, _ = keeper
    with pytest.raises(ValueError, match="needs >= 2 nodes"):
        SnapshotTaker(state_fn=dict, socket_path=sock, scheme="aec")
    with pytest.raises(ValueError, match="flush_dir"):
        SnapshotTaker(state_fn=dict, socket_path=sock, scheme="none", flush_every=2)


def test_find_latest_in_memory_decodes_a_lost_keeper_without_a_process_group(tmp_path) -> None:
    """Three keepers hold an AEC-protected snapshot; one is killed; the state comes back bitwise."""
    procs, socks = [], {}
    try:
        for n in range(3):
            socks[n] = str(tmp_path / f"k{n}.sock")
            p = subprocess.Popen([sys.executable, "-m", "jitckpt.snapshot.keeper", "--socket", socks[n],
                                  "--max-lifetime", "120"], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            procs.append(p)
            assert p.stdout.readline().startswith("ready")
        state = _model_state()
        flat = FlatState(state)
        plan = ProtectionPlan(scheme="aec", num_nodes=3, ranks_per_node=1, total_bytes=flat.total)
        objs = _encode(plan, flat)
        meta = meta_blob(6, plan, flat)
        for n in range(3):
            c = KeeperClient(socks[n])
            items = []
            for spec in plan.rank_objects(n, 0):
                data = objs[spec.key].numpy().tobytes()
                c.begin(spec.key, 6, spec.size)[:] = data
                items.append({"key": spec.key, "step": 6, "checksum": checksum_of(data), "algo": DEFAULT_ALGORITHM})
            c.begin(META_KEY, 6, len(meta))[:] = meta
            items.append({"key": META_KEY, "step": 6, "checksum": checksum_of(meta), "algo": DEFAULT_ALGORITHM})
            c.commit(items)
            c.close()
        procs[1].kill()
        procs[1].wait(timeout=10)
        skipped: list = []
        step, back = find_latest_in_memory(socks, num_nodes=3, ranks_per_node=1, skipped=skipped)
        assert step == 6 and any(what == "node 1" for what, _ in skipped)
        _assert_same(state, back)
        procs[2].kill()
        procs[2].wait(timeout=10)
        assert find_latest_in_memory(socks, num_nodes=3, ranks_per_node=1) is None  # two nodes lost
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def _share_worker(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from jitckpt.snapshot.uniform import share_rank0

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    buffers = OrderedDict(mean=torch.full((3,), float(rank)), count=torch.tensor(10 + rank))
    buffers._metadata = {"": {"version": 1}}
    live = [buffers["mean"], buffers["count"]]
    rng = {"torch": torch.tensor([rank] * 5, dtype=torch.uint8), "python": (3, rank),
           "numpy": ("MT", torch.tensor([rank, 7], dtype=torch.int32))}
    got_buffers, got_rng, step = share_rank0([buffers, rng, 5])
    result = {
        "mean": got_buffers["mean"].tolist(), "count": int(got_buffers["count"]),
        "count_dtype": str(got_buffers["count"].dtype), "metadata": getattr(got_buffers, "_metadata", None),
        "ordered": isinstance(got_buffers, OrderedDict), "torch": got_rng["torch"].tolist(),
        "python": list(got_rng["python"]), "numpy": got_rng["numpy"][1].tolist(), "step": step,
        "live_untouched": live[0].tolist() == [float(rank)] * 3 and int(live[1]) == 10 + rank,
    }
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_share_rank0_gives_every_rank_rank0s_tensors_and_keeps_the_rest(tmp_path) -> None:
    """The per-rank parts of a snapshot (jitckpt.snapshot.uniform): tensors of any dtype and size
    (unaligned ones next to each other) become rank 0's on both ranks, in new tensors; other
    leaves and containers (an OrderedDict with its metadata, tuples) stay as they were."""
    from forked_ranks import run_ranks

    assert run_ranks(_share_worker, str(tmp_path), timeout=60) == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert (r["mean"], r["count"], r["count_dtype"], r["torch"], r["numpy"]) == (
            [0.0] * 3, 10, "torch.int64", [0] * 5, [0, 7])
        assert r["ordered"] and r["metadata"] == {"": {"version": 1}} and r["step"] == 5
        assert r["live_untouched"]
    assert (r0["python"], r1["python"]) == ([3, 0], [3, 1])  # not a tensor: each rank's own


def test_the_tier_names_what_it_found_but_could_not_use(keeper, tmp_path) -> None:
    """A NaN snapshot is the only state: resolve() gives nothing and says what it rejected (the
    trainer then reports a fresh start), while an empty keeper rejects nothing."""
    from jitckpt.snapshot.tier import SnapshotTier

    sock, _ = keeper

    def tier() -> SnapshotTier:
        return SnapshotTier(socket_path=sock, every=1, protection="none", flush_every=0, ranks_per_node=1,
                            checkpoint_dir=str(tmp_path / "ckpt"), gen=0)

    empty = tier()
    assert empty.resolve() is None and empty.rejected == []
    snap = SnapshotTaker(state_fn=lambda: {"step": 3, "w": torch.tensor([1.0, math.nan])}, socket_path=sock,
                         scheme="none", ranks_per_node=1)
    assert snap.begin(3) and snap.wait() == 3
    snap.close()
    bad = tier()
    assert bad.resolve() is None and bad.rejected == ["memory step 3: restored state has NaN/Inf"]
