"""JitRecovery's waits are bounded: once this node's workers are gone, a node lost together with
its launcher (which never reports its own workers gone) holds the recovery up for --save-timeout
at most, not forever (found as a launcher left waiting for 1.5 hours after its peer node died)."""
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
