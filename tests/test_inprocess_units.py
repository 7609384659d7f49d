"""The parts of the in-process recovery (issue 48), each on its own: the script runner that runs a
script again in the same process, and the cut of a process group's connections, on real gloo ranks."""
from __future__ import annotations

import datetime
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from forked_ranks import run_ranks
from jitckpt.runtime.inprocess import ScriptRunner

PROC_TIMEOUT = 60.0

SCRIPT = """
import sys
import torch
probe = sys.modules["jitckpt_probe"]

def step(model, x):
    return model(x).tanh()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
big = torch.zeros(1 << 20)
probe.runs.append({"name": __name__, "argv": list(sys.argv), "code": step.__code__,
                   "big": __import__("weakref").ref(big)})
probe.out.append(torch.compile(step, backend="eager")(model, torch.ones(5, 3)))
"""


class _Probe:
    runs: list = []
    out: list = []


def test_a_script_runs_again_with_the_same_code_and_forgets_its_globals(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    probe = type(sys)("jitckpt_probe")
    probe.runs, probe.out = [], []
    monkeypatch.setitem(sys.modules, "jitckpt_probe", probe)
    runner = ScriptRunner([str(script), "--lr", "0.1"], module=False)
    import torch._dynamo.utils as dynamo_utils

    runner.run()
    frames = dynamo_utils.counters["stats"]["unique_graphs"]
    gc.disable()  # what is freed, is freed by reference counting alone
    try:
        runner.forget()
        assert probe.runs[0]["big"]() is None, "the run's globals outlived forget()"
    finally:
        gc.enable()
    runner.run()
    first, second = probe.runs
    assert first["name"] == second["name"] == "__main__"
    assert first["argv"] == second["argv"] == [str(script), "--lr", "0.1"]
    assert first["code"] is second["code"]  # what dynamo keys its compiled frames on
    # The second run's compiled function is dynamo's cached frame (its guards hold for a new model of
    # torch's own modules): nothing is traced again.
    assert dynamo_utils.counters["stats"]["unique_graphs"] == frames
    assert torch.equal(probe.out[0], probe.out[1])
    runner.forget()


def _cut_rank(rank: int, port: int, root: str) -> None:
    try:
        from jitckpt.runtime import group_sockets

        group_sockets.install()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        dist.barrier()
        if rank == 0:  # blocked in a receive the peer never sends, until the peer cuts its connections
            t0 = time.monotonic()
            try:
                dist.recv(torch.zeros(4), src=1)
                outcome = "received"
            except RuntimeError as e:
                outcome = f"raised after {time.monotonic() - t0:.2f}s: {str(e)[:80]}"
            Path(root, "outcome").write_text(outcome)
        else:
            time.sleep(1.0)  # rank 0 is in its receive by now (a sleep only decides what is tested)
            assert group_sockets.cut() >= 1
            deadline = time.monotonic() + PROC_TIMEOUT / 2
            while not Path(root, "outcome").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def test_cutting_a_groups_connections_fails_the_peers_receive_at_once(tmp_path):
    """destroy_process_group() and gloo's abort() leave the connections open while the group's
    objects live: the peer's receive would wait for gloo's timeout (60 s here)."""
    assert run_ranks(_cut_rank, str(tmp_path), timeout=PROC_TIMEOUT) == [0, 0]
    outcome = (tmp_path / "outcome").read_text()
    assert outcome.startswith("raised after"), outcome
    assert float(outcome.split()[2].rstrip("s:")) < 10.0, outcome
