"""NodeCoordinator (cross-node failure reports through a c10d TCPStore), two nodes in one process.

Run in a subprocess: the TCPStore server thread must not live in the pytest process (forked test
workers would inherit it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from jobs import ROOT

SCENARIO = r'''
import json, select, socket, sys, threading
from jitckpt.cli import build_parser
from jitckpt.launcher.config import LaunchConfig
from jitckpt.launcher.node_coordinator import NodeCoordinator

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]

def cfg(node):
    return LaunchConfig.from_args(build_parser().parse_args(
        ["run", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "t", sys.argv[1]]))

def both(fn):
    ts = [threading.Thread(target=fn, args=(c,)) for c in coords]
    [t.start() for t in ts]; [t.join(30) for t in ts]
    assert not any(t.is_alive() for t in ts), "begin_generation did not return"

def readable(c, timeout):
    return bool(select.select([c.failure_fd()], [], [], timeout)[0])

coords = [NodeCoordinator(cfg(0))]
coords.append(NodeCoordinator(cfg(1)))
c0, c1 = coords
out = {}
try:
    both(lambda c: c.begin_generation(0))
    # Every rank dies at once: node 1 announces its rank's death; node 0 handles its own rank's
    # death and never reads node 1's report of generation 0.
    c1.announce_failure(0, {"kind": "signal", "rank": 1, "detail": "gen0"})
    out["gen0_report_arrived"] = readable(c0, 10)
    both(lambda c: c.begin_generation(1))
    out["stale_report_pending_in_gen1"] = readable(c0, 0.5)
    c1.announce_failure(1, {"kind": "signal", "rank": 1, "detail": "gen1"})
    out["gen1_report_arrived"] = readable(c0, 10)
    out["gen1_report"] = c0.read_remote_failure(1) if out["gen1_report_arrived"] else None
finally:
    for c in coords:
        c.close()
print(json.dumps(out))
'''


def test_a_failure_report_of_an_earlier_generation_is_not_a_new_failure(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    p = subprocess.run([sys.executable, "-c", SCENARIO, str(script)], capture_output=True, text=True,
                       timeout=90, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["gen0_report_arrived"]
    assert not out["stale_report_pending_in_gen1"]  # was: read as a failure of generation 1
    assert out["gen1_report_arrived"]
    assert out["gen1_report"] == {"kind": "signal", "rank": 1, "detail": "gen1"}
