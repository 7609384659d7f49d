"""What torchrun gives a worker and a user, jitckpt run gives too (issue 18): every torchrun flag is
known (those that cannot apply are refused, naming why), the log directory layout of --log-dir,
--tee and --local-ranks-filter, the error file that ``@record`` writes, torchrun's OMP_NUM_THREADS
warning, and process titles that tell the ranks apart."""
from __future__ import annotations

import argparse
import json
import re
import socket
import sys
from pathlib import Path

import pytest

from jitckpt.cli import build_parser
from jitckpt.launcher.config import LaunchConfig, refuse_torchrun_flags
from jobs import run_bounded

SCRIPT = '''
import os, sys
import setproctitle
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    rank = int(os.environ["RANK"])
    print(f"hello from rank {rank}", flush=True)
    print(f"to stderr from rank {rank}", file=sys.stderr, flush=True)
    with open(f"seen{rank}.json", "w") as f:
        json_text = {"title": setproctitle.getproctitle(), "omp": os.environ["OMP_NUM_THREADS"],
                     "port": os.environ["MASTER_PORT"], "role": os.environ["ROLE_NAME"],
                     "error_file": os.environ["TORCHELASTIC_ERROR_FILE"]}
        import json; json.dump(json_text, f)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()  # rank 0 has written its output before rank 1 fails the job
    if rank == 1:
        raise RuntimeError("boom from rank 1")

main()
'''


def _torchrun_actions() -> list[argparse.Action]:
    from torch.distributed.run import get_args_parser

    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


def _value(action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    return [str(action.default) if isinstance(action.default, (str, int, float)) and action.default != ""
            else "1"]


def test_every_torchrun_flag_is_known_and_its_default_accepted() -> None:
    """torch's own parser is the list: a flag torch adds fails this test until jitckpt decides.
    Given torchrun's default value, no flag is refused."""
    parser = build_parser()
    for action in _torchrun_actions():
        for flag in action.option_strings:
            args = parser.parse_args(["run", flag, *_value(action), "train.py"])
            if action.nargs != 0 and isinstance(action.default, (str, int, float)) and action.default != "":
                refuse_torchrun_flags(args)


@pytest.mark.parametrize("argv, needle", [
    (["--start-method", "fork"], "--start-method fork: workers are always fresh processes"),
    (["--rdzv-backend", "etcd-v2"], "--rdzv-backend etcd-v2 needs --rdzv-endpoint HOST:PORT of etcd"),
    (["--numa-binding", "node"], "--numa-binding node: not supported"),
    (["--signals-to-handle", "SIGUSR1"], "--signals-to-handle SIGUSR1: jitckpt handles SIGTERM and SIGINT"),
    (["--shutdown-timeout", "5"], "--shutdown-timeout 5: on a preemption the workers get --save-timeout"),
    (["--event-log-handler", "console"], "--event-log-handler console: jitckpt writes its events"),
    (["--virtual-local-rank"], "--virtual-local-rank True: not supported"),
    (["--rdzv-conf", "read_timeout=5"], "--rdzv-conf read_timeout: not supported"),
    (["--local-ranks-filter", "0,x"], "--local-ranks-filter '0,x': expected comma-separated local ranks"),
    (["--tee", "4"], "--tee '4': expected 0 (none), 1 (stdout), 2 (stderr), 3 (both)"),
])
def test_flags_that_cannot_apply_are_refused_naming_why(tmp_path: Path, argv: list, needle: str) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    args = build_parser().parse_args(["run", "--checkpoint-dir", str(tmp_path), *argv, str(script)])
    with pytest.raises(ValueError) as err:
        LaunchConfig.from_args(args)
    assert needle in str(err.value)


def test_rdzv_conf_timeout_bounds_the_nodes_wait(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    args = build_parser().parse_args(["run", "--checkpoint-dir", str(tmp_path), "--rdzv-conf", "join_timeout=42",
                                      str(script)])
    assert LaunchConfig.from_args(args).rdzv_timeout == 42.0


def test_log_dir_tee_filter_role_record_port_omp_and_titles(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "rec.py"
    script.write_text(SCRIPT)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # torchrun warns only when it sets it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = tmp_path / "logs"
    rc, out = run_bounded([sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2", "--max-restarts", "0",
                           "--checkpoint-dir", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run"),
                           "--rdzv-id", "job1", "--log-dir", str(logs), "--tee", "3", "--local-ranks-filter", "0",
                           "--role", "trainer", "--master-port", str(port), "--status-interval", "0", str(script)],
                          cwd=tmp_path, timeout=120)
    assert rc == 1, out[-3000:]
    attempt = logs / "job1" / "attempt_0"
    for rank in (0, 1):  # torchrun's layout; the files keep every rank's output
        assert (attempt / str(rank) / "stdout.log").read_text() == f"hello from rank {rank}\n"
        assert f"to stderr from rank {rank}" in (attempt / str(rank) / "stderr.log").read_text()
    # The console shows rank 0 only, with torchrun's prefix.
    assert "[trainer0]:hello from rank 0" in out and "[trainer0]:to stderr from rank 0" in out, out[-3000:]
    assert "hello from rank 1" not in out
    # @record wrote rank 1's exception where TORCHELASTIC_ERROR_FILE pointed, in torchrun's format.
    error = json.loads((attempt / "1" / "error.json").read_text())
    assert error["message"]["message"] == "RuntimeError: boom from rank 1", error
    assert not (attempt / "0" / "error.json").exists()
    # torchrun's warning, once, when it sets OMP_NUM_THREADS for the user.
    assert out.count("Setting OMP_NUM_THREADS environment variable for each process to be 1") == 1, out[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen{rank}.json").read_text())
        assert seen == {"title": f"jitckpt rank {rank}/2 gen 0", "omp": "1", "port": str(port), "role": "trainer",
                        "error_file": str(attempt / str(rank) / "error.json")}


def test_console_says_where_the_run_is_and_ends_with_a_verdict(tmp_path: Path) -> None:
    from jobs import run_job

    res = run_job(tmp_path, nproc=2, script_args=["--steps", "12", "--inject", "0:1:5:kill"])
    assert res.rc == 0, res.out[-3000:]
    lines = res.out.splitlines()
    start = next(line for line in lines if " job " in line and "run directory" in line)
    assert re.match(r"\[jitckpt \d\d:\d\d:\d\d\] job \S+: run directory .*run, checkpoints in .*ckpt$", start), start
    end = [line for line in lines if "job finished (exit code 0)" in line]
    assert len(end) == 1 and end[0] == lines[-1], lines[-5:]
    assert re.search(r"at step 12, 1 failure, [\d.]+ s in recovery, 1 minibatch redone; `jitckpt report ", end[0]), end
    # Worker lines carry the same prefix and their rank.
    assert any(re.match(r"\[jitckpt \d\d:\d\d:\d\d rank 0\] JIT checkpoint of step 5 saved", line) for line in lines)


def test_redirects_tee_and_filter_give_torchruns_destinations(tmp_path: Path) -> None:
    """-r without -t: files only; -t: files, tailed on the console; --local-ranks-filter: ranks left
    out of the console go to /dev/null unless redirected; per-rank maps as torchrun's 0:1,1:2."""
    import os

    from jitckpt.launcher.worker_logs import WorkerLogs

    script = tmp_path / "t.py"
    script.write_text("")

    def logs(*argv: str) -> WorkerLogs:
        args = build_parser().parse_args(["run", "--checkpoint-dir", str(tmp_path), "--rdzv-id", "j",
                                          "--nproc-per-node", "2", "--log-dir", str(tmp_path / "l"), *argv,
                                          str(script)])
        return WorkerLogs(LaunchConfig.from_args(args), tmp_path / "run")

    d = tmp_path / "l" / "j" / "attempt_0"
    got = logs("-r", "1").attempt(0, [0, 1])
    assert (got[0].stdout, got[0].stderr) == (str(d / "0" / "stdout.log"), None)
    assert got[1].error_file == str(d / "1" / "error.json") and (d / "1").is_dir()
    got = logs("-r", "0:2,1:3", "--local-ranks-filter", "1").attempt(0, [0, 1])
    assert (got[0].stdout, got[0].stderr) == (os.devnull, str(d / "0" / "stderr.log"))
    assert (got[1].stdout, got[1].stderr) == (str(d / "1" / "stdout.log"), str(d / "1" / "stderr.log"))
    w = logs("-t", "3")
    try:
        got = w.attempt(3, [1])  # a replacement of local rank 1 in generation 3
        assert got[1].stdout == str(tmp_path / "l" / "j" / "attempt_3" / "1" / "stdout.log")
        assert len(w._tails) == 2  # stdout and stderr tailed
    finally:
        w.stop()
    assert logs().attempt(0, [0])[0].stdout is None  # nothing asked: this console, as torchrun


def test_nodes_sharing_a_log_directory_keep_their_own_worker_logs(tmp_path):
    """Two nodes' launchers with one run directory (a shared filesystem, the default layout under
    a shared --checkpoint-dir): each node's attempt has its own directory, so one node starting an
    attempt neither empties the other's logs nor fails on its directory existing (found from
    outside: a 3-node job's launcher died with FileExistsError on logs/attempt_0/0)."""
    from jitckpt.launcher.worker_logs import WorkerLogs

    script = tmp_path / "t.py"
    script.write_text("")

    def node(rank: int) -> WorkerLogs:
        args = build_parser().parse_args(["run", "--checkpoint-dir", str(tmp_path), "--rdzv-id", "j", "--nnodes", "2",
                                          "--node-rank", str(rank), "--rdzv-endpoint", "127.0.0.1:29400", "-r", "3",
                                          str(script)])
        return WorkerLogs(LaunchConfig.from_args(args), tmp_path / "run")

    first = node(0).attempt(0, [0])[0]
    Path(first.stdout).write_text("node 0's output\n")
    second = node(1).attempt(0, [0])[0]
    assert first.stdout == str(tmp_path / "run" / "logs" / "node0" / "attempt_0" / "0" / "stdout.log")
    assert second.stdout == str(tmp_path / "run" / "logs" / "node1" / "attempt_0" / "0" / "stdout.log")
    assert Path(first.stdout).read_text() == "node 0's output\n"


SLOTS_SCRIPT = '''
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([1 << dist.get_rank()])
dist.all_reduce(t)
Path(f"started{dist.get_rank()}").write_text(f"{os.environ['GROUP_RANK']} {int(t)}")
deadline = time.monotonic() + 120
while not Path("go").exists() and time.monotonic() < deadline:  # the test says when to end
    time.sleep(0.05)
dist.barrier()
'''


# etcd: slow (the c10d case covers the slots in the fast suite).
@pytest.mark.parametrize("backend", ["c10d", pytest.param("etcd-v2", marks=pytest.mark.slow)])
def test_launchers_without_node_rank_take_their_slots_in_the_rendezvous(tmp_path, request, backend):
    """torchrun's rendezvous needs no --node-rank: the launchers take free slots (c10d: the one that
    can serve the store at --rdzv-endpoint is node 0; etcd: in any order). test_node_loss's slow
    c10d test: a replacement takes a gone launcher's slot, and one launcher too many stops, naming
    why."""
    import subprocess
    import time

    from jobs import ROOT, kill_tree

    (tmp_path / "t.py").write_text(SLOTS_SCRIPT)
    if backend == "c10d":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    else:
        from etcd_cluster import EtcdCluster

        cluster = EtcdCluster(tmp_path / "etcd")
        request.addfinalizer(cluster.close)
        endpoint = cluster.endpoint(0)
    cmd = [sys.executable, "-m", "jitckpt", "run", "--nnodes", "2", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
           "--rdzv-id", "slots", "--checkpoint-dir", str(tmp_path / "ck"), "--status-interval", "0", "t.py"]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    procs = []
    try:
        for _ in range(2):
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"started{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate(timeout=30)[0][-3000:] for p in procs if p.poll() is not None]
            time.sleep(0.1)
        # One world of two ranks, one per slot: group ranks 0 and 1, and the all-reduce saw both.
        seen = sorted((tmp_path / f"started{r}").read_text() for r in range(2))
        assert seen == ["0 3", "1 3"], seen
        (tmp_path / "go").write_text("")
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            kill_tree(p.pid)
