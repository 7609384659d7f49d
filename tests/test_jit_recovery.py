"""JitRecovery tells the survivors how far the failed rank got, and its waits are bounded: once
this node's workers are gone, a node lost together with its launcher (which never reports its own
workers gone) holds the recovery up for --save-timeout at most, not forever (found as a launcher
left waiting for 1.5 hours after its peer node died)."""
from __future__ import annotations

import time
import types

from jitckpt.cli import build_parser
from jitckpt.launcher.config import LaunchConfig
from jitckpt.launcher.jit_recovery import FailureRecord, JitRecovery


class LostPeerNode:
    """The coordinator's view when node 1 vanished with its launcher (this launcher is the controller)."""

    leads = True

    def decide_restart(self, gen: int) -> None:
        pass

    def shards_covered(self, gen: int) -> bool:
        return True

    def node_done(self, gen: int, *, ok: bool, wait: bool = False) -> bool:
        return False


def test_a_lost_peer_node_holds_the_recovery_for_save_timeout_at_most(tmp_path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    cfg = LaunchConfig.from_args(build_parser().parse_args(
        ["run", "--checkpoint-dir", str(tmp_path), "--save-timeout", "5", str(script)]))
    jit = JitRecovery(cfg=cfg, coord=LostPeerNode(), emit=lambda *a, **k: None, display=None)
    gone = [types.SimpleNamespace(exit_code=-9, rank=r, no_save_path=False) for r in range(2)]
    fresh = FailureRecord(gen=0, kind="signal", rank=1, detail="killed", t_detect=time.time())
    assert not jit.can_proceed(0, gone, fresh)  # the other node may still report: wait
    old = FailureRecord(gen=0, kind="signal", rank=1, detail="killed", t_detect=time.time() - 6)
    assert jit.can_proceed(0, gone, old)


class Channel:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


class Coordinator(LostPeerNode):
    def announce_failure(self, gen: int, info: dict) -> None:
        pass


def _workers(steps: dict) -> list:
    return [types.SimpleNamespace(rank=r, step=s, live=True, exit_ready=False, channel=Channel(),
                                  proc=types.SimpleNamespace(pid=100 + r), no_save_path=False, exit_code=None,
                                  stopped=False)
            for r, s in steps.items()]


def test_survivors_are_told_how_far_the_failed_rank_got_even_before_it_is_known(tmp_path) -> None:
    """When a survivor's collective error reaches the launcher before the failed rank's exit, a rank
    one minibatch behind (its all-reduce of 4 complete, not yet returned) was told no step, took
    its minibatch for futile and might save its start, redoing a minibatch the others finished (a
    likely cause of one clean-clone failure, not confirmed). A rank that began minibatch 5 completed
    every collective of 4, so each survivor is told 5 and rank 0 finishes 4."""
    script = tmp_path / "t.py"
    script.write_text("")
    cfg = LaunchConfig.from_args(build_parser().parse_args(["run", "--checkpoint-dir", str(tmp_path), str(script)]))
    jit = JitRecovery(cfg=cfg, coord=Coordinator(), emit=lambda *a, **k: None, display=None)

    workers = _workers({0: 4, 1: 5, 2: 5})
    jit.on_failure(0, workers, "error", None, "connection reset", reporter=1)
    assert [(m.rank, m.step) for w in workers for m in w.channel.sent] == [(None, 5)] * 3

    workers = _workers({0: 4, 1: 5, 2: 6})  # the failed rank known: its own last report
    jit.on_failure(0, workers, "signal", 2, "killed by SIGKILL")
    assert [(w.rank, m.step) for w in workers for m in w.channel.sent] == [(0, 6), (1, 6)]


class OneNode(Coordinator):
    """One node's coordinator: no shard saved yet; this node's workers gone is every node's."""

    def shards_covered(self, gen: int) -> bool:
        return False

    def node_done(self, gen: int, *, ok: bool, wait: bool = False) -> bool:
        return True


def test_a_worker_with_no_save_path_is_not_waited_for(tmp_path) -> None:
    """Issue 43 item 2: a native program (libjit.so's Hello said it cannot save) is not waited for
    after a failure, and the launcher says why, once; a worker that can save still is, until it
    is gone."""
    script = tmp_path / "t.py"
    script.write_text("")
    cfg = LaunchConfig.from_args(build_parser().parse_args(
        ["run", "--checkpoint-dir", str(tmp_path), "--save-timeout", "120", str(script)]))
    events: list = []
    jit = JitRecovery(cfg=cfg, coord=OneNode(), emit=lambda e, **k: events.append((e, k)), display=None)
    failed, native, python = _workers({0: 3, 1: 3, 2: 3})
    failed.exit_code, failed.live = 2, False
    native.no_save_path = True
    rec = jit.on_failure(0, [failed, native, python], "exit", 0, "exit code 2")
    assert rec.unsaving_ranks == [1]
    assert ("warning", {"rank": 1, "reason": "a native program registered no save path: not waiting for its JIT "
                                             "checkpoint"}) in events
    assert not jit.can_proceed(0, [failed, native, python], rec)  # rank 2 may still save
    python.exit_code = 0  # saved (or gave up), and exited
    assert jit.can_proceed(0, [failed, native, python], rec)
    assert [e for e, _ in events].count("warning") == 1


def test_a_save_path_registered_later_counts() -> None:
    """libjit.so registers a --no-python process at load (no save path); a Python runtime started in
    it afterwards registers one, which stays."""
    from jitckpt.launcher.worker_handle import Worker

    w = Worker(rank=0, local_rank=0, proc=None, channel=None, warm=False)
    assert not w.no_save_path  # not registered yet: nothing is known
    w.registered(False)
    assert w.no_save_path and w.hello
    w.registered(True)
    w.registered(False)
    assert not w.no_save_path
