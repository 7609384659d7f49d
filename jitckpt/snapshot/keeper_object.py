"""Keeper objects that carry their own description: an 8-byte header length, a JSON header (what
the object is, and the layout of its state: :class:`~jitckpt.snapshot.layout.FlatState`), then
the state's tensors at 64-byte aligned offsets. JSON, never pickle: a restore reads what another
process wrote. Used for AOR's partitions and the gradient log's bases."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from jitckpt.snapshot.checksum import DEFAULT_ALGORITHM, Checksum
from jitckpt.snapshot.keeper_client import KeeperClient
from jitckpt.snapshot.layout import ALIGN, FlatState, rebuild


def write_object(keeper: KeeperClient, *, key: str, step: int, header: dict, state: Any,
                 mapping: Any = None) -> tuple[Any, int, Checksum]:
    """Begin keeper object ``key`` of ``step`` (or write into ``mapping``, already begun) and write
    ``state`` into it: an 8-byte header length, the JSON ``header`` with the state's layout
    (:class:`FlatState`: JSON, never pickle), then the state's tensors at 64-byte aligned offsets,
    hashed while copied. Returns (the mapping, the object's size, its checksum); the caller commits."""
    flat = FlatState(state)
    head = json.dumps(header | {"layout": flat.layout}, allow_nan=False, separators=(",", ":")).encode()
    start = -(-(8 + len(head)) // ALIGN) * ALIGN
    prefix = np.zeros(start, dtype=np.uint8)
    prefix[:8] = np.frombuffer(len(head).to_bytes(8, "little"), dtype=np.uint8)
    prefix[8:8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
    size = start + flat.total
    m = keeper.begin(key, step, size) if mapping is None else mapping
    if len(m) < size:
        raise ValueError(f"keeper object {key}: {size} bytes do not fit the {len(m)} begun")
    dst = np.frombuffer(m, dtype=np.uint8, count=size)
    h = Checksum(DEFAULT_ALGORITHM)
    h.copy(dst[:start], prefix)
    # Streaming stores: the keeper's copy is not read back by this process.
    h.copy_flat(dst[start:], flat, 0, bypass_cache=True)
    return m, size, h


def object_header(data: Any) -> dict:
    """The JSON header of an object :func:`write_object` wrote into ``data``; ValueError if damaged."""
    buf = memoryview(data).cast("B")
    n = int.from_bytes(buf[:8], "little") if len(buf) >= 8 else -1
    try:
        if not 0 < n <= len(buf) - 8:
            raise ValueError(f"header length {n}")
        head = json.loads(bytes(buf[8:8 + n]))
        if not isinstance(head, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"its header is damaged ({e}) or written by another jitckpt version") from None
    return head


def read_object(data: Any, *, key: str, step: int, want: dict) -> Any:
    """The state written by :func:`write_object` into ``data`` (a buffer the returned tensors keep
    viewing), after checking that its header has every ``want`` entry."""
    buf = memoryview(data).cast("B")
    try:
        head = object_header(buf)
    except ValueError as e:
        raise ValueError(f"keeper object {key} step {step}: {e}") from None
    n = int.from_bytes(buf[:8], "little")
    got = {k: head.get(k) for k in want}
    if got != want:
        raise ValueError(f"keeper object {key} is for {got}, this job needs {want} "
                         "(different job, world size, optimizer or jitckpt version)")
    start = -(-(8 + n) // ALIGN) * ALIGN
    return rebuild(head["layout"], buf[start:])
