"""What a worker process is, written by each rank to ``<--out>.<rank>.json``: its pid, parent,
session, scheduling policy, I/O priority class, and a draw of numpy's and Python's global random
state (used by tests/test_standbys.py: a worker forked from the standby template must be a
process of its own, as a fresh one is)."""
import ctypes
import json
import os
import platform
import random
import sys

import numpy as np

rank = int(os.environ["RANK"])
number = {"x86_64": 252, "aarch64": 31}.get(platform.machine())  # ioprio_get
ioprio = ctypes.CDLL(None).syscall(number, 1, 0) if number else -1
out = sys.argv[sys.argv.index("--out") + 1]  # the tests' run_job gives --out PATH
with open(f"{out}.{rank}.json", "w") as f:
    parent = open(f"/proc/{os.getppid()}/cmdline").read().replace("\0", " ").strip()
    json.dump({"pid": os.getpid(), "parent": parent, "sid": os.getsid(0),
               "sched_other": os.sched_getscheduler(0) == os.SCHED_OTHER, "ioprio_class": ioprio >> 13,
               "numpy": float(np.random.rand()), "random": random.random()}, f)
