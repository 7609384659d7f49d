"""Sender-side (upstream backup) logging of pipeline point-to-point messages, SWIFT §5.1.

``SendLogger`` hooks ``torch.distributed`` send/isend/recv/irecv/batch_isend_irecv for one
stage. A send to a logged peer only appends a reference to a pending list (nothing on the
critical path); at the next *bubble* (:meth:`SendLogger.bubble`, called where the stage would
otherwise sit idle, e.g. just before it blocks on a receive) pending tensors are copied to host
memory; once a chunk's worth has been copied it is handed to a background thread that digests
it and writes a chunk file (one writer wake-up per chunk, not per bubble: on a busy host each
wake-up is a thread switch and a GIL hand-off, which cost more than the records). The writer
only works while the training thread is idle (inside :meth:`SendLogger.idle`, i.e. blocked on
a receive) or flushing, so it does not contend with training for the GIL or a core. Receives
from logged peers are recorded as digests only, so a replayed peer can be checked for
divergence. :meth:`SendLogger.flush` drains everything synchronously (on failure detection);
:meth:`SendLogger.drop_through` garbage-collects chunks made obsolete by a global checkpoint.

Contract (as for ``isend``): a sent tensor, and an ``irecv`` buffer once its receive completed,
must not be modified in place until the next bubble; with ``copy_at_bubble=False`` (for
callers that never modify them, like :class:`PipelineStage`) not until it is written, and the
training thread then does no copy at all: the writer thread reads the tensor itself.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from jitckpt.swift.pipeline.logging_records import (LogRecord, MessageKey, chunk_name, iter_chunks, tensor_digest,
                              write_chunk)

_HOOKED = ("send", "isend", "recv", "irecv", "batch_isend_irecv")


@dataclass
class _Pending:
    key: MessageKey
    seq: int
    generation: int
    kind: str
    tensor: torch.Tensor
    work: Optional[object]


class SendLogger:
    """Logs one pipeline stage's inter-machine messages to ``log_dir`` in chunks.

    ``stage`` is this process's rank in the pipeline process group, ``log_peers`` the ranks
    whose boundary with this stage is logged (other groups under selective logging),
    ``chunk_records`` the records per chunk file, ``copy_at_bubble`` whether pending tensors
    are copied by the training thread at the bubble (see the module contract),
    ``writer_nice`` the niceness of the writer thread (None: unchanged), ``max_backlog`` the
    number of chunks waiting for the writer after which it runs even outside bubbles. Use as a
    context manager (installs and removes the hooks) and tag every send with :meth:`tagged`.
    """

    def __init__(self, *, stage: int, log_dir: Path | str, log_peers: Iterable[int],
                 chunk_records: int = 256, generation: int = 0,
                 flush_timeout: float = 30.0, copy_at_bubble: bool = True,
                 writer_nice: Optional[int] = 19, max_backlog: int = 4) -> None:
        if stage < 0:
            raise ValueError(f"stage must be >= 0, got {stage}")
        if chunk_records < 1:
            raise ValueError(f"chunk_records must be >= 1, got {chunk_records}")
        self.stage = stage
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_peers = frozenset(int(p) for p in log_peers)
        if stage in self.log_peers:
            raise ValueError(f"log_peers contains this stage ({stage}); list the other stages")
        self.chunk_records = chunk_records
        self.generation = generation
        self.flush_timeout = flush_timeout
        self.copy_at_bubble = copy_at_bubble
        self.writer_nice = writer_nice
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {max_backlog}")
        self.max_backlog = max_backlog
        self._ctx = threading.local()
        self._send_seq: dict[int, int] = {}
        self._recv_seq: dict[int, int] = {}
        self._pending: list[_Pending] = []
        self._copied: list[tuple[_Pending, torch.Tensor]] = []  # at host, not yet handed over
        self._queue: "queue.Queue[object]" = queue.Queue()
        self._originals: dict[tuple[object, str], object] = {}
        self._chunk_no = max((n + 1 for _, g, n, _, _ in iter_chunks(self.log_dir)
                              if g == generation), default=0)
        self._writer_error: Optional[BaseException] = None
        self._idle = threading.Event()  # set while the training thread waits: writer may run
        self._writer = threading.Thread(target=self._write_loop, name=f"swift-log-{stage}",
                                        daemon=True)
        self._writer.start()
        self.bytes_logged = 0

    # ---------------------------------------------------------------- hooks -------------
    def install(self) -> "SendLogger":
        """Wrap the torch.distributed point-to-point functions (idempotent)."""
        if self._originals:
            return self
        wrappers = {"send": self._wrap_send(blocking=True),
                    "isend": self._wrap_send(blocking=False),
                    "recv": self._wrap_recv(blocking=True),
                    "irecv": self._wrap_recv(blocking=False),
                    "batch_isend_irecv": self._wrap_batch()}
        for name in _HOOKED:
            # Both namespaces: P2POp validates ``op`` against the c10d module's isend/irecv.
            for mod in (dist, c10d):
                self._originals[(mod, name)] = getattr(mod, name)
                setattr(mod, name, wrappers[name])
        return self

    def uninstall(self) -> None:
        """Restore the original torch.distributed functions."""
        for (mod, name), fn in self._originals.items():
            setattr(mod, name, fn)
        self._originals.clear()

    def __enter__(self) -> "SendLogger":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _orig(self, name: str):
        return self._originals[(c10d, name)]

    @contextlib.contextmanager
    def tagged(self, *, iteration: int, micro_batch: int, payload: str) -> Iterator[None]:
        """Attach (iteration, micro-batch, payload) to the sends/recvs issued inside."""
        prev = getattr(self._ctx, "tag", None)
        self._ctx.tag = (iteration, micro_batch, payload)
        try:
            yield
        finally:
            self._ctx.tag = prev

    def _tag(self, peer: int, op: str) -> tuple[int, int, str]:
        tag = getattr(self._ctx, "tag", None)
        if tag is None:
            raise RuntimeError(
                f"stage {self.stage}: {op} with logged peer {peer} outside SendLogger.tagged(): "
                "wrap pipeline sends/recvs in `with logger.tagged(iteration=, micro_batch=, "
                "payload=)` so the message can be logged and replayed in order")
        return tag

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Sends/recvs issued inside are not logged (e.g. on a sub-group whose ranks are not
        stage ids)."""
        prev = getattr(self._ctx, "in_batch", False)
        self._ctx.in_batch = True
        try:
            yield
        finally:
            self._ctx.in_batch = prev

    def _in_batch(self) -> bool:
        return getattr(self._ctx, "in_batch", False)

    def _wrap_send(self, *, blocking: bool):
        name = "send" if blocking else "isend"

        def hooked(tensor, dst=None, group=None, tag=0, group_dst=None):
            peer = group_dst if group_dst is not None else dst
            log = not self._in_batch() and peer in self.log_peers
            key = self._key(peer, name, outgoing=True) if log else None  # fail before sending
            work = self._orig(name)(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
            if key is not None:
                self.record_send(tensor, key)
            return work
        return hooked

    def _wrap_recv(self, *, blocking: bool):
        name = "recv" if blocking else "irecv"

        def hooked(tensor, src=None, group=None, tag=0, group_src=None):
            peer = group_src if group_src is not None else src
            log = not self._in_batch() and peer in self.log_peers
            key = self._key(peer, name, outgoing=False) if log else None
            work = self._orig(name)(tensor, src=src, group=group, tag=tag, group_src=group_src)
            if key is not None:
                if blocking:  # done: copy now, the caller may reuse its buffer at once
                    self.record_recv(tensor.detach().clone(), key)
                else:
                    self.record_recv(tensor, key, work=work)
            return work
        return hooked

    def _wrap_batch(self):
        def hooked(p2p_op_list):
            if self._in_batch():
                return self._orig("batch_isend_irecv")(p2p_op_list)
            keys = []
            for op in p2p_op_list:
                outgoing = op.op in (dist.isend, c10d.isend, self._orig("isend"))
                keys.append((self._key(op.peer, "batch_isend_irecv", outgoing=outgoing), outgoing)
                            if op.peer in self.log_peers else None)
            with self.untracked():  # its isend/irecv calls are logged here, not there
                works = self._orig("batch_isend_irecv")(p2p_op_list)
            for op, k, work in zip(p2p_op_list, keys, works or [None] * len(p2p_op_list)):
                if k is None:
                    continue
                key, outgoing = k
                if outgoing:
                    self.record_send(op.tensor, key)
                else:
                    # gloo returns one work per op; backends that coalesce return fewer, so
                    # the digest is then taken at the bubble after the caller's waits.
                    self.record_recv(op.tensor, key, work=work if len(works) == len(keys)
                                     else None)
            return works
        return hooked

    def _key(self, peer: int, op: str, *, outgoing: bool) -> MessageKey:
        it, mb, payload = self._tag(peer, op)
        src, dst = (self.stage, peer) if outgoing else (peer, self.stage)
        return MessageKey(iteration=it, micro_batch=mb, payload=payload, src=src, dst=dst)

    # ------------------------------------------------------------- recording ------------
    def record_send(self, tensor: torch.Tensor, key: MessageKey) -> None:
        """Queue an outgoing tensor for logging (reference only; copied at the next bubble)."""
        seq = self._send_seq.get(key.dst, 0)
        self._send_seq[key.dst] = seq + 1
        self._pending.append(_Pending(key, seq, self.generation, "send", tensor, None))

    def record_recv(self, tensor: torch.Tensor, key: MessageKey, *,
                    work: Optional[object] = None) -> None:
        """Queue a received tensor's digest (taken once ``work`` has completed)."""
        seq = self._recv_seq.get(key.src, 0)
        self._recv_seq[key.src] = seq + 1
        self._pending.append(_Pending(key, seq, self.generation, "recv", tensor, work))

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Mark a pipeline bubble: the training thread is about to block (e.g. on a receive);
        pending tensors are handed over and the writer runs until the block ends."""
        self.bubble()
        self._idle.set()
        try:
            yield
        finally:
            self._idle.clear()

    def bubble(self) -> None:
        """Copy pending tensors to host memory; hand a chunk's worth to the writer thread."""
        self._raise_writer_error()
        keep: list[_Pending] = []
        for p in self._pending:
            if p.work is not None and not p.work.is_completed():
                keep.append(p)  # receive still in flight: digest it at a later bubble
                continue
            self._copied.append((p, self._host(p.tensor)))
        self._pending = keep
        if len(self._copied) >= self.chunk_records:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._copied:
            self._queue.put(self._copied)
            self._copied = []

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        # On a GPU this is the async device-to-host copy on a side stream (SWIFT §6); on CPU a
        # clone decouples the log from the training tensor, unless the caller promised not to
        # modify it (copy_at_bubble=False).
        t = tensor.detach()
        if self.copy_at_bubble or t.device.type != "cpu":
            return t.to("cpu", copy=True).contiguous()
        return t

    def flush(self) -> None:
        """Write every completed pending message to disk now (e.g. when a failure is seen).

        Receives that never completed are dropped (their data never arrived)."""
        self._copied += [(p, self._host(p.tensor)) for p in self._pending
                         if p.work is None or p.work.is_completed()]
        self._pending = []
        self._hand_over()
        done = threading.Event()
        self._queue.put(done)
        self._idle.set()  # the caller waits for the writer: let it run
        try:
            finished = done.wait(self.flush_timeout)
        finally:
            self._idle.clear()
        if not finished:
            raise TimeoutError(f"stage {self.stage}: log writer did not drain within "
                               f"{self.flush_timeout}s")
        self._raise_writer_error()

    def drop_through(self, iteration: int) -> int:
        """Delete chunk files whose newest iteration is <= ``iteration`` (covered by the
        global checkpoint of that iteration); return how many were deleted."""
        dropped = 0
        for path, _g, _n, _lo, hi in list(iter_chunks(self.log_dir)):
            if hi <= iteration:
                path.unlink(missing_ok=True)
                dropped += 1
        return dropped

    def close(self) -> None:
        """Flush, stop the writer thread and remove the hooks."""
        try:
            self.flush()
        finally:
            self._queue.put(None)
            self._idle.set()
            self._writer.join(self.flush_timeout)
            self.uninstall()

    def _raise_writer_error(self) -> None:
        if self._writer_error is not None:
            raise RuntimeError(f"stage {self.stage}: log writer failed") from self._writer_error

    # --------------------------------------------------------------- writer -------------
    def _write_loop(self) -> None:
        records: list[LogRecord] = []
        tensors: list[Optional[torch.Tensor]] = []

        def write() -> None:
            if not records:
                return
            its = [r.key.iteration for r in records]
            write_chunk(self.log_dir, chunk_name(self.generation, self._chunk_no, min(its),
                                                 max(its)), records, tensors)
            self._chunk_no += 1
            records.clear()
            tensors.clear()

        if self.writer_nice is not None:
            try:  # Linux: niceness is per thread; the writer yields the core to training
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.writer_nice)
            except (AttributeError, OSError):
                pass
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    write()
                    return
                if isinstance(item, threading.Event):
                    write()
                    item.set()
                    continue
                # Only in bubbles (or while flushing), unless the backlog grows too long (a
                # stage that never waits must not accumulate logs without bound). Checked once
                # per hand-over: each check may trade the GIL with the training thread.
                while not self._idle.wait(0.05) and self._queue.qsize() < self.max_backlog:
                    pass
                for p, host in item:
                    # Only receive digests are ever checked; sends keep the tensor itself.
                    records.append(LogRecord(
                        key=p.key, seq=p.seq, generation=p.generation, kind=p.kind,
                        digest=tensor_digest(host) if p.kind == "recv" else ""))
                    if p.kind == "send":
                        tensors.append(host.contiguous())
                        self.bytes_logged += host.numel() * host.element_size()
                    else:
                        tensors.append(None)
                    if len(records) >= self.chunk_records:
                        write()
            except BaseException as exc:  # surfaced to the training thread at the next bubble
                self._writer_error = exc
                if isinstance(item, threading.Event):
                    item.set()
