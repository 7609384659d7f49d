"""Load a snapshot's flat bytes straight into the trainer's own tensors, verifying the checksum in
the same pass (one copy of every byte, no private copy of the snapshot).

:func:`targets_in` pairs each tensor of a snapshot layout (:mod:`jitckpt.snapshot.layout`) with the
tensor at the same place of a live state (``model.state_dict()``, ``optimizer.state_dict()`` ...:
their tensors share memory with the parameters and optimizer state) when its dtype and shape match.
:func:`copy_verified_into` then copies the snapshot object chunk by chunk into those tensors (fresh
tensors for the rest), hashing each chunk from the destination while it is still in cache, so the
checksum covers exactly the bytes the trainer gets. ``load_state_dict`` of the result then copies
nothing: the parameters are their own source, and the optimizer keeps the tensors it is given.

On a mismatch the live tensors hold partial data: the caller must load another state or stop.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from jitckpt.snapshot.checksum import Checksum
from jitckpt.snapshot.layout import ALIGN, dtype_named, places_in

CHUNK = 1 << 20  # hashed right after its copy, from L2


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


def copy_verified_into(doc: dict, src: np.ndarray, algorithm: str,
                       targets: list[Optional[torch.Tensor]], *,
                       check_finite: bool) -> tuple[list[torch.Tensor], int, bool]:
    """Copy the tensors of snapshot object ``src`` (the whole flat state, uint8) into ``targets``
    (fresh tensors where None); the tensors, the checksum of ``src``'s bytes as copied, and
    whether every floating tensor is finite (checked in the copy's pass, while the bytes are in
    cache; True when not asked).

    Gaps between tensors (alignment, always zero when written) are hashed from ``src``. A layout
    entry outside ``src`` or misaligned is a ValueError before anything is written.
    """
    table = doc["tensors"]
    size = len(src)
    for name, shape, offset, nbytes in table:
        if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset <= size - nbytes
                and offset % ALIGN == 0 and dtype_named(name) is not None):
            raise ValueError(f"snapshot layout: tensor {name} at {offset}+{nbytes} does not fit the "
                             f"{size}-byte object")
    h = Checksum(algorithm)
    finite = True
    tensors: list[torch.Tensor] = []
    pos = 0
    for (name, shape, offset, nbytes), target in zip(table, targets):
        if offset < pos:
            raise ValueError("snapshot layout: tensors overlap or are out of order")
        if offset > pos:
            h.update(src[pos:offset])  # alignment gap
        t = target if target is not None else torch.empty([int(s) for s in shape], dtype=dtype_named(name))
        if nbytes:
            dst = t.reshape(-1).view(torch.uint8).numpy()
            if dst.size != nbytes:
                raise ValueError(f"snapshot layout: tensor {shape} {name} cannot take {nbytes} bytes")
            check = t.dtype if check_finite and finite and t.is_floating_point() else None
            for at in range(0, nbytes, CHUNK):
                end = min(at + CHUNK, nbytes)
                # NaN/Inf checked in the copy's pass, while the bytes are in cache
                finite = h.copy(dst[at:end], src[offset + at:offset + end], finite=check) and finite
        tensors.append(t)
        pos = offset + nbytes
    if pos < size:
        h.update(src[pos:])
    return tensors, h.value(), finite
