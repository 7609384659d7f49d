"""`make bench` ends, and leaves nothing running (issue 43 item 6).

A benchmark that timed out used to leave its launcher's workers, and the in-process floor's ranks,
running for good: `subprocess.run(timeout=...)` kills only the process it started. The driver runs
in a child process here, because it makes itself the subreaper of what it starts (pytest must not).
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from jobs import ROOT

BENCH = ROOT / "bench"

# A "benchmark" that starts a worker in a session of its own (as a launcher does) and one that
# it orphans at once (a double fork), writes their PIDs, and then either hangs or exits.
FAKE = textwrap.dedent("""
    import os, subprocess, sys, time
    pids = sys.argv[1]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    if os.fork() == 0:
        orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        open(pids + ".orphan", "w").write(str(orphan.pid))
        os._exit(0)
    os.wait()
    open(pids, "w").write(str(worker.pid))
    if sys.argv[2] == "hang":
        time.sleep(300)
""")

DRIVER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {bench!r})
    import run_all, proc_tree
    from rich.console import Console
    from pathlib import Path
    proc_tree.become_subreaper()
    fake, pids, mode, timeout = sys.argv[1:5]
    bench = run_all.Bench("fake", lambda out: [sys.executable, fake, pids, mode], (), timeout=float(timeout))
    data, error = run_all.run(bench, Path(pids).parent, Console(file=sys.stderr))
    print(json.dumps({{"error": error}}))
""")


def _bench_module(name: str):  # type: ignore[no-untyped-def]
    """A script of bench/ imported as a module (bench/ is not a package)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("mode", ["hang", "exit"])
def test_a_benchmark_leaves_no_process_running_whether_it_times_out_or_ends(tmp_path: Path, mode: str) -> None:
    fake, driver, pids = tmp_path / "fake.py", tmp_path / "driver.py", tmp_path / "pids"
    fake.write_text(FAKE)
    driver.write_text(DRIVER.format(bench=str(BENCH)))
    started: list[int] = []
    try:
        p = subprocess.run([sys.executable, str(driver), str(fake), str(pids), mode, "3"], capture_output=True,
                           text=True, timeout=90)
        started = [int(pids.read_text()), int(Path(str(pids) + ".orphan").read_text())]
        assert p.returncode == 0, p.stderr
        error = json.loads(p.stdout)["error"]
        assert ("timed out after 3 s" in error) if mode == "hang" else ("no result" in error), error
        left = [pid for pid in started if not _gone(pid)]
        assert not left, f"the benchmark's worker and orphan {started}: {left} still running after it ended"
    finally:
        for pid in started:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


def test_an_orphan_that_ends_by_itself_just_after_its_benchmark_is_not_reported_as_left(tmp_path: Path) -> None:
    """multiprocessing's resource tracker outlives ``mp.spawn``'s parent by a moment: it was killed
    and reported as "left running" (bench_restore_ranks --nodes 2 in make bench on a fresh clone)."""
    fake, driver, pids = tmp_path / "fake.py", tmp_path / "driver.py", tmp_path / "pids"
    fake.write_text(textwrap.dedent("""
        import os, subprocess, sys
        if os.fork() == 0:
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], start_new_session=True)
            os._exit(0)
        os.wait()
    """))
    driver.write_text(DRIVER.format(bench=str(BENCH)))
    p = subprocess.run([sys.executable, str(driver), str(fake), str(pids), "exit", "30"], capture_output=True,
                       text=True, timeout=90)
    assert p.returncode == 0, p.stderr
    assert "left" not in p.stderr, p.stderr


@pytest.mark.slow
def test_the_inprocess_floor_ranks_exit_once_they_have_reported() -> None:
    """Their teardown deadlocked in torch (freeing DDP's reducer joins gloo's thread, which waits
    for the GIL) in about one run in three, each costing the floor a 120 s timeout and a retry:
    `make bench`'s recovery benchmark timed out. Five runs, each bounded, none retried."""
    out = _bench_module("inprocess_floor").measure(reps=5, rank_timeout=30)
    assert len(out["samples_s"]) == 5 and out["attempts"] == 5, out


def test_a_log_read_while_it_is_written_leaves_out_its_torn_last_line(tmp_path: Path) -> None:
    """bench_recovery reads the workers' step logs while they append to them: a line half written
    ended `make bench`'s recovery benchmark with a JSONDecodeError on a clean clone."""
    read_log = _bench_module("bench_recovery").read_log
    log = tmp_path / "log.jsonl"
    log.write_text('{"rank": 0, "step": 1}\n{"rank": 1, "st')
    assert read_log(log) == [{"rank": 0, "step": 1}]
    log.write_text('{"rank": 0, "step": 1}\n')
    assert read_log(log) == [{"rank": 0, "step": 1}]
