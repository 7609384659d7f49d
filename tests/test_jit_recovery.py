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
    gone = [types.SimpleNamespace(exit_code=-9, rank=r) for r in range(2)]
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
                                  proc=types.SimpleNamespace(pid=100 + r))
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
