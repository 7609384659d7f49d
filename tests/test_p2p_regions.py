"""Point-to-point calls are regions the runtime times, and stay usable as torch.distributed.pipelining
uses them: ``P2POp(dist.isend, ...)`` checks its op against the c10d module's own isend/irecv, so
those are the same wrappers (found from the fault matrix: every P2POp of a GPipe job raised
"Invalid ``op``" once isend/irecv were wrapped). Two forked gloo ranks, the real hooks."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from forked_ranks import run_ranks


class _Recorder:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def region_enter(self, kind: str) -> int:
        self.kinds.append(kind)
        return len(self.kinds)

    def region_exit(self, token: int, exc: BaseException | None) -> None:
        pass

    def optimizer_pre_step(self) -> None:
        pass

    def optimizer_post_step(self) -> None:
        pass


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    from jitckpt.runtime.collective_hooks import CollectiveHooks

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    original = c10d.isend
    sink = _Recorder()
    hooks = CollectiveHooks(sink)
    hooks.install()
    try:
        got = torch.zeros(3)
        ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank + 1)), 1 - rank),
               dist.P2POp(dist.irecv, got, 1 - rank)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        wrapped = c10d.isend is dist.isend and c10d.isend is not original
    finally:
        hooks.remove()
    Path(out, f"{rank}.json").write_text(json.dumps({"got": got.tolist(), "kinds": sink.kinds, "wrapped": wrapped,
                                                     "restored": c10d.isend is original}))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_pipelinings_p2p_ops_pass_through_the_wrapped_isend_and_irecv_as_regions(tmp_path) -> None:
    assert run_ranks(_rank, str(tmp_path), timeout=60) == [0, 0]
    for r in range(2):
        res = json.loads((tmp_path / f"{r}.json").read_text())
        assert res["got"] == [float(2 - r)] * 3, res  # the peer's tensor
        assert res["wrapped"] and res["restored"], res
        assert "collective" in res["kinds"], res  # batch_isend_irecv and the waits are regions
