"""Point-to-point channel of one pipeline stage for one iteration: live or from the logs.

Each peer is either *live* (gloo isend/irecv on the stage's process group, observed by the
installed :class:`SendLogger` hooks) or *logged*: that peer is not running this iteration
(it already completed it, or this stage is a replacement replaying alone), so inputs from it
come from the log (:class:`LogIndex`) and outputs to it are not sent but checked bitwise
against the digest it logged when it received the original (divergence detection).
"""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import Callable, ContextManager, Mapping, Iterable, Optional

import torch
import torch.distributed as dist

from jitckpt.swift.pipeline.logging_records import MessageKey
from jitckpt.swift.pipeline.logging_replay import LogIndex
from jitckpt.swift.pipeline.logging_sender import SendLogger


class PeerFailure(RuntimeError):
    """A point-to-point operation failed: a pipeline peer died or the group was aborted."""


class WorkWaiter:
    """Waits for gloo works on a helper thread so the stage can stop waiting on a failure.

    Gloo's ``Work.is_completed()`` only turns true inside ``wait()``, aborting the group does
    not wake a pending receive and a short-timeout wait breaks the connection; so the blocking
    ``wait()`` runs here while the stage thread polls the failure flag every ``poll`` seconds.
    After a failure the helper stays blocked until the old group's timeout (it is a daemon).
    """

    def __init__(self, *, poll: float = 0.02) -> None:
        self.poll = poll
        self._queue: "queue.Queue[tuple[object, threading.Event, list]]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="swift-p2p-wait")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            work, done, error = self._queue.get()
            try:
                work.wait()
            except BaseException as exc:  # reported to the stage thread
                error.append(exc)
            done.set()

    def wait(self, work: object, *, failed: Callable[[], bool], what: str) -> None:
        """Block until ``work`` completes; raise :class:`PeerFailure` if it fails or if
        ``failed()`` turns true first."""
        done, error = threading.Event(), []
        self._queue.put((work, done, error))
        while not done.wait(self.poll):
            if failed():
                raise PeerFailure(f"{what}: failure flag set while waiting")
        if error:
            raise PeerFailure(f"{what} failed: {error[0]}") from error[0]


class PipelineChannel:
    """Sends/receives of one stage; ``logged_peers`` are served from/checked against ``index``.

    ``group`` may be None when every peer is logged (a replacement replaying alone).
    ``idle()`` is entered while the stage blocks on a live peer (a pipeline bubble), e.g.
    :meth:`SendLogger.idle`;
    With a ``waiter``, waits for live peers are interrupted when ``failure()`` (the job-wide
    failure flag) turns true. ``ranks`` maps stage ids to ranks of ``group`` when it is a
    sub-group (a selective-logging group replaying together); its traffic is never logged.
    """

    def __init__(self, *, stage: int, group: Optional[dist.ProcessGroup],
                 logger: Optional[SendLogger] = None, index: Optional[LogIndex] = None,
                 logged_peers: Iterable[int] = (),
                 idle: Optional[Callable[[], ContextManager[None]]] = None,
                 failure: Optional[Callable[[], bool]] = None,
                 waiter: Optional["WorkWaiter"] = None,
                 ranks: Optional[Mapping[int, int]] = None) -> None:
        self.stage = stage
        self.group = group
        self.logger = logger
        self.index = index
        self.logged_peers = frozenset(logged_peers)
        if self.logged_peers and index is None:
            raise ValueError("logged_peers given without a LogIndex to serve them from")
        self.idle = idle
        self.failure = failure if failure is not None else (lambda: False)
        self.waiter = waiter
        self.ranks = dict(ranks) if ranks is not None else None
        self._works: list[object] = []
        self.replayed_inputs = 0
        self.checked_outputs = 0

    def _rank(self, stage: int) -> int:
        return self.ranks[stage] if self.ranks is not None else stage

    def _tag(self, key: MessageKey) -> ContextManager[None]:
        if self.logger is None:
            return contextlib.nullcontext()
        if self.ranks is not None:
            return self.logger.untracked()  # intra-group replay traffic: never logged
        return self.logger.tagged(iteration=key.iteration, micro_batch=key.micro_batch,
                                  payload=key.payload)

    def _need_group(self, peer: int) -> dist.ProcessGroup:
        if self.group is None:
            raise PeerFailure(f"stage {self.stage}: no process group for live peer {peer}")
        return self.group

    def send(self, tensor: torch.Tensor, key: MessageKey) -> None:
        """Send (live) or check against the receiver's log (logged peer)."""
        if key.dst in self.logged_peers:
            self.index.check_output(key, tensor)
            self.checked_outputs += 1
            if self.logger is not None and key.dst in self.logger.log_peers:
                # Re-log the replayed output: this stage's own log was lost with its machine.
                self.logger.record_send(tensor, key)
            return
        group = self._need_group(key.dst)
        try:
            with self._tag(key):
                work = dist.isend(tensor, group=group, group_dst=self._rank(key.dst))
        except RuntimeError as exc:
            raise PeerFailure(f"stage {self.stage}: send {key} failed: {exc}") from exc
        self._works.append(work)

    def recv(self, like: torch.Tensor, key: MessageKey) -> torch.Tensor:
        """Receive into a new tensor shaped like ``like`` (live) or take it from the log."""
        if key.src in self.logged_peers:
            t = self.index.take_input(key).clone()
            self.replayed_inputs += 1
            if self.logger is not None and key.src in self.logger.log_peers:
                self.logger.record_recv(t, key)
            return t
        group = self._need_group(key.src)
        buf = torch.empty_like(like)
        try:
            with self._tag(key):
                work = dist.irecv(buf, group=group, group_src=self._rank(key.src))
            self._wait(work, key)
        except RuntimeError as exc:
            raise PeerFailure(f"stage {self.stage}: recv {key} failed: {exc}") from exc
        return buf

    def _wait(self, work, what: object) -> None:
        # The stage is about to block: a bubble, in which the logger may work.
        with self.idle() if self.idle is not None else contextlib.nullcontext():
            if self.waiter is None:
                work.wait()
            else:
                self.waiter.wait(work, failed=self.failure, what=f"stage {self.stage}: {what}")

    def finish(self) -> None:
        """Wait for this iteration's outstanding sends."""
        try:
            for w in self._works:
                self._wait(w, "send completion")
        except RuntimeError as exc:
            raise PeerFailure(f"stage {self.stage}: send completion failed: {exc}") from exc
        finally:
            self._works.clear()
