"""After a failure, each shard of a DTensor job written once, in parts, by its surviving replicas.

The ``R`` replicas of a shard each hold every R-th of its tensors as their *part* (as DCP spreads
replicated chunks over replicas). After a failure a survivor writes its own part, then each other
part of its shard that it is responsible for: a part goes to the first replica, from its owner on
in replica order, that is not known lost. A part whose writer is on this node (its files land in
the same checkpoint directory) is waited for until it is committed; the wait ends early when that
writer is reported lost, and at a deadline (a hang, a second failure) this rank writes the part
itself. A part whose writer is on another node is written here too, as that node's files may not
be visible. So the lost rank's partner writes the whole shard, every other shard is written once
between its replicas, and no part goes unwritten while a replica of it survives; a duplicate costs
time only (the first copy the reader verifies is used)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from jitckpt.checkpoint_store import CheckpointError, list_candidates, read_meta


def part_committed(root: str | os.PathLike, *, kind: str, gen: int, step: int, shard_id: int,
                   num_shards: int) -> bool:
    """Whether a checkpoint of part ``shard_id`` of ``num_shards`` of ``step`` is committed in ``root``."""
    for c in list_candidates(Path(root)):
        if c.kind != kind or c.gen != gen or c.step != step:
            continue
        try:
            meta = read_meta(c.path)
        except CheckpointError:
            continue
        if meta.shard_id == shard_id and meta.num_shards == num_shards:
            return True
    return False


def node_of_rank() -> Callable[[int], bool]:
    """Whether a global rank runs on this node, from torchrun's variables (ranks are given out
    node by node: ``GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``); without them, no rank is."""
    try:
        per_node, node = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["GROUP_RANK"])
        rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        return lambda r: False
    if per_node <= 0 or rank // per_node != node:
        return lambda r: False  # not the layout above: take every peer as remote
    return lambda r: r // per_node == node


# How long a survivor waits at least for a replica on its node to commit its own part before
# writing that part itself (beyond it: twice what this rank's own part took).
WAIT_MIN_S = 2.0


@dataclass(frozen=True)
class PartFill:
    """A survivor's JIT save of its shard's parts (the module's docstring): its own, then the
    others it is responsible for."""

    root: str                          # the checkpoint directory
    gen: int
    step: int
    replica: int                       # this rank's replica id
    replica_ranks: tuple               # the global rank of each replica of the shard
    on_this_node: Callable[[int], bool]
    lost: Callable[[], set]            # the ranks known lost now (read at every poll)
    poll_s: float = 0.01

    def write(self, write_part: Callable[[Optional[int]], tuple]) -> list:
        """``write_part(None)`` (this rank's part), then ``write_part(replica)`` for each other
        part this rank must write; returns what each returned, in that order."""
        t0 = time.monotonic()
        written = [write_part(None)]
        own = written[0][1]  # (path, CheckpointMeta)
        # Part r of shard s is checkpoint shard s * R + r of a grid of S * R (ShardedState.select_part).
        first, grid = own.shard_id - self.replica, own.num_shards
        deadline = time.monotonic() + max(WAIT_MIN_S, 2 * (time.monotonic() - t0))

        def committed(part: int) -> bool:
            return part_committed(self.root, kind="jit", gen=self.gen, step=self.step,
                                  shard_id=first + part, num_shards=grid)

        for part in self._others(committed, deadline=deadline):
            written.append(write_part(part))
        return written

    def _writer(self, part: int) -> int:
        """The replica responsible for ``part``: its owner, or the next one not known lost."""
        lost = self.lost()
        n = len(self.replica_ranks)
        for k in range(n):
            r = (part + k) % n
            if self.replica_ranks[r] not in lost:
                return r
        return self.replica

    def _others(self, committed: Callable[[int], bool], *, deadline: float) -> Iterator[int]:
        """The other parts (replica ids) this rank writes, each yielded once it is known that
        this rank must write it."""
        n = len(self.replica_ranks)
        for k in range(1, n):
            part = (self.replica + k) % n
            while not committed(part):
                writer = self._writer(part)
                if (writer == self.replica or not self.on_this_node(self.replica_ranks[writer])
                        or time.monotonic() >= deadline):
                    yield part
                    break
                time.sleep(self.poll_s)  # a replica on this node is writing it
