"""Load a snapshot's flat bytes straight into the trainer's own tensors (one copy of every byte, no
private copy of the snapshot), verifying the checksum and checking for NaN/Inf beside the copy.

:func:`targets_in` pairs each tensor of a snapshot layout (:mod:`jitckpt.snapshot.layout`) with the
tensor at the same place of a live state (``model.state_dict()``, ``optimizer.state_dict()`` ...:
their tensors share memory with the parameters and optimizer state) when its dtype and shape match.
:func:`copy_verified_into` then copies the snapshot object into those tensors (fresh tensors for
the rest) while a second thread hashes the same bytes on the other core (one rank);
:func:`copy_parts_into` copies a node's objects, laid end to end, and hashes the caller's share of
them behind its copy (several ranks of one node, each on its own core). ``load_state_dict`` of the
result then copies nothing: the parameters are their own source, and the optimizer keeps the
tensors it is given.

On a mismatch the live tensors hold unverified data: the caller must load another state or stop.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np
import torch

from jitckpt.snapshot.checksum import Checksum, copy_bytes
from jitckpt.snapshot.layout import ALIGN, dtype_named, places_in

CHUNK = 1 << 20  # per native call (measured: faster than 2 or 4 MiB)


def targets_in(doc: dict, live: Any) -> list[Optional[torch.Tensor]]:
    """For each tensor of layout ``doc``, the tensor at the same place of ``live`` when it can take
    the bytes in place (CPU, contiguous, same dtype and shape), else None."""
    table = doc["tensors"]
    out: list[Optional[torch.Tensor]] = [None] * len(table)
    for i, obj in places_in(doc, live):
        if isinstance(obj, torch.Tensor) and _fits(table[i], obj):
            out[i] = obj
    return out


def _fits(entry: list, t: torch.Tensor) -> bool:
    name, shape, _, _ = entry
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous() and not t.is_quantized
            and dtype_named(name) == t.dtype and list(t.shape) == list(shape) and t.numel() > 0)


def _pieces(doc: dict, size: int, targets: list[Optional[torch.Tensor]],
            check_finite: bool) -> tuple[list[torch.Tensor], list]:
    """The tensors to load ``doc``'s table into (``targets``, fresh where None) and the flat object of
    ``size`` bytes in order as (start, end, destination or None for an alignment gap, dtype to
    check or None). A table entry outside the object or misaligned is a ValueError."""
    table = doc["tensors"]
    pos = 0
    for name, shape, offset, nbytes in table:
        if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset <= size - nbytes
                and offset % ALIGN == 0 and dtype_named(name) is not None):
            raise ValueError(f"snapshot layout: tensor {name} at {offset}+{nbytes} does not fit the "
                             f"{size}-byte object")
        if offset < pos:
            raise ValueError("snapshot layout: tensors overlap or are out of order")
        pos = offset + nbytes
    if len(targets) != len(table):
        raise ValueError("snapshot layout: the targets given do not match its table")
    tensors: list[torch.Tensor] = []
    pieces: list = []
    pos = 0
    for (name, shape, offset, nbytes), target in zip(table, targets):
        t = target if target is not None else torch.empty([int(s) for s in shape], dtype=dtype_named(name))
        if nbytes and t.numel() * t.element_size() != nbytes:
            raise ValueError(f"snapshot layout: tensor {shape} {name} cannot take {nbytes} bytes")
        tensors.append(t)
        if offset > pos:
            pieces.append((pos, offset, None, None))
        dst = t.reshape(-1).view(torch.uint8).numpy() if nbytes else None
        check = t.dtype if check_finite and t.is_floating_point() else None
        for at in range(0, nbytes, CHUNK):
            pieces.append((offset + at, offset + min(at + CHUNK, nbytes), dst[at:at + CHUNK], check))
        pos = offset + nbytes
    if pos < size:
        pieces.append((pos, size, None, None))
    return tensors, pieces


def copy_verified_into(doc: dict, src: np.ndarray, algorithm: str,
                       targets: list[Optional[torch.Tensor]], *,
                       check_finite: bool) -> tuple[list[torch.Tensor], int, bool]:
    """Copy the tensors of snapshot object ``src`` (the whole flat state, uint8) into ``targets``
    (fresh tensors where None); the tensors, the checksum of ``src``'s bytes, and whether every
    floating tensor is finite (True when not asked).

    The copy runs on this thread while a helper thread hashes ``src`` and checks its floats for
    NaN/Inf, both native with the GIL released: after a failure the machine's other core is idle,
    and verifying beside the copy costs about nothing on top of the copy. ``src`` must not change
    meanwhile (the keeper's object: its only writer is the rank being restored). Gaps between
    tensors (alignment, always zero when written) are hashed too. A layout entry outside ``src``
    or misaligned is a ValueError before anything is written.
    """
    tensors, pieces = _pieces(doc, len(src), targets, check_finite)
    verdict: list = []

    def verify() -> None:
        try:
            h, finite = Checksum(algorithm), True
            for start, end, _, check in pieces:
                finite = h.update(src[start:end], finite=check if finite else None) and finite
            verdict.append((h.value(), finite))
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread below
            verdict.append(e)

    # Independent, not pipelined behind the copy: measured faster (each thread streams at its own
    # pace; making the verifier wait for each copied piece cost 10-15 %).
    verifier = threading.Thread(target=verify, name="jitckpt-restore-verify")
    verifier.start()
    try:
        for start, end, dst, _ in pieces:
            if dst is not None:
                # Streaming stores: a state larger than the cache would not stay in it anyway.
                copy_bytes(dst, src[start:end], bypass_cache=True)
    finally:
        verifier.join()
    if isinstance(verdict[0], BaseException):
        raise verdict[0]
    value, finite = verdict[0]
    return tensors, value, finite


def copy_parts_into(doc: dict, parts: list[np.ndarray], algorithm: str,
                    targets: list[Optional[torch.Tensor]], *, share: tuple[int, int],
                    check_finite: bool) -> tuple[list[torch.Tensor], dict[int, int], bool]:
    """Copy the flat state that ``parts`` (uint8 arrays: a node's snapshot objects) form end to end
    into ``targets`` (fresh tensors where None). Returns the tensors, the checksum of each part of
    this caller's ``share=(i, n)`` (parts i, i+n, ...), and whether the floats in those parts are
    all finite (True when not asked).

    Several ranks of one node restore the same state from the same keeper objects at once, each on
    its own core: each copies all of it into its own tensors, and hashes and checks its share of the
    parts right behind the copy, while the bytes are in cache. The caller combines the verdicts."""
    size = sum(len(p) for p in parts)
    tensors, pieces = _pieces(doc, size, targets, check_finite)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + len(p))
    index, count = share
    hashes = {k: Checksum(algorithm) for k in range(len(parts)) if k % count == index}
    finite, k = True, 0
    for start, end, dst, check in pieces:
        at = 0
        while start < end:  # a piece may cross from one part into the next
            while start >= bounds[k + 1]:
                k += 1
            stop = min(end, bounds[k + 1])
            chunk = parts[k][start - bounds[k]:stop - bounds[k]]
            if dst is not None:
                copy_bytes(dst[at:at + stop - start], chunk, bypass_cache=True)
            h = hashes.get(k)
            if h is not None:  # the chunk just read: in cache
                finite = h.update(chunk, finite=check if finite else None) and finite
            at, start = at + stop - start, stop
    return tensors, {k: h.value() for k, h in hashes.items()}, finite
