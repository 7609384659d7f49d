"""Replay side of SWIFT logging: serve logged inputs in order and detect divergence.

``LogIndex`` loads the chunk files of the given stage log directories (the "global store"
the survivors flushed to) newer than a checkpoint iteration. A replaying stage takes its inputs
with :meth:`LogIndex.take_input` (checked to be consumed in each sender's original sequence
order) and checks each output it would have sent with :meth:`LogIndex.check_output` against the
digest the receiver logged at the time; any mismatch raises :class:`ReplayDivergenceError`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import torch

from jitckpt.swift.pipeline.logging_records import MessageKey, digest_matches, iter_chunks, read_chunk


class ReplayDivergenceError(RuntimeError):
    """Replay produced a message that differs from the one sent before the failure, or
    consumed logged inputs out of their original order."""


class MissingLogError(RuntimeError):
    """A message needed for replay is not in the logs."""


class LogIndex:
    """Logged sends (tensors) and receives (digests) of several stages, by message key.

    When a message was logged more than once (re-sent after an earlier recovery), the record
    of the newest process-group generation wins.
    """

    def __init__(self, dirs: Iterable[Path | str], *, after_iteration: int = -1) -> None:
        self._sent: dict[MessageKey, tuple[int, int, torch.Tensor]] = {}
        self._received: dict[MessageKey, tuple[int, str]] = {}
        self._last_taken: dict[int, tuple[int, int]] = {}
        self.chunks_read = 0
        for d in dirs:
            for path, _g, _n, _lo, hi in iter_chunks(Path(d)):
                if hi <= after_iteration:
                    continue
                self.chunks_read += 1
                for rec, tensor in read_chunk(path):
                    if rec.key.iteration <= after_iteration:
                        continue
                    if rec.kind == "send":
                        old = self._sent.get(rec.key)
                        if old is None or old[0] <= rec.generation:
                            self._sent[rec.key] = (rec.generation, rec.seq, tensor)
                    else:
                        oldr = self._received.get(rec.key)
                        if oldr is None or oldr[0] <= rec.generation:
                            self._received[rec.key] = (rec.generation, rec.digest)

    def __len__(self) -> int:
        return len(self._sent)

    def has_input(self, key: MessageKey) -> bool:
        """Whether the sender's log holds this message."""
        return key in self._sent

    def take_input(self, key: MessageKey) -> torch.Tensor:
        """The logged tensor of ``key``; enforces each sender's original send order."""
        entry = self._sent.get(key)
        if entry is None:
            raise MissingLogError(
                f"no logged message {key}: stage {key.src}'s log does not cover iteration "
                f"{key.iteration} (was it flushed before recovery, or dropped by a newer "
                "global checkpoint than the one loaded?)")
        gen, seq, tensor = entry
        last = self._last_taken.get(key.src)
        if last is not None and (gen, seq) <= last:
            raise ReplayDivergenceError(
                f"replay consumed {key} (generation {gen}, seq {seq}) after seq {last[1]} of "
                f"generation {last[0]} from stage {key.src}: the replay order differs from the "
                "original send order")
        self._last_taken[key.src] = (gen, seq)
        return tensor

    def check_output(self, key: MessageKey, tensor: torch.Tensor) -> Optional[str]:
        """Raise :class:`ReplayDivergenceError` if ``tensor`` differs bitwise from what the
        receiver got before the failure; return the digest."""
        entry = self._received.get(key)
        if entry is None:
            raise MissingLogError(
                f"receiver {key.dst} logged no digest for {key}: cannot check the replayed "
                "output (receiver's log not flushed, or not a logged boundary)")
        same, digest = digest_matches(tensor, entry[1])
        if not same:
            raise ReplayDivergenceError(
                f"replayed stage {key.src} diverged at {key}: output digest {digest} != "
                f"{entry[1]} received before the failure. Replay is not deterministic "
                "(check apply_determinism settings, RNG seeding, and that the checkpoint "
                "matches the logs)")
        return digest
