"""Flatten a training state (nested dicts/lists of tensors and plain values) into one byte space.

A snapshot copies byte ranges of this space, so sharding and parity never need to know where one
tensor ends: tensor ``i`` occupies ``[offset_i, offset_i + nbytes_i)``, each start aligned to 64
bytes, gaps are zero. The *layout* is a JSON document: a table of the tensors (dtype, shape,
offset, bytes) and the state's tree with each tensor replaced by its table index. It travels
with the snapshot and :func:`rebuild` turns layout + bytes back into the same state, bit for bit.

JSON, not pickle: a snapshot is read back from memory another process wrote, and unpickling it
could run arbitrary code. So the state may hold only tensors, ``None``, ``bool``, ``int``,
``float``, ``str`` and ``dict`` / ``OrderedDict`` / ``list`` / ``tuple`` of them (what model,
optimizer, scheduler and scaler state_dicts hold); anything else is refused with the path to it.
"""
from __future__ import annotations

import bisect
import json
import math
from collections import OrderedDict
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch

ALIGN = 64
FORMAT = "jitckpt.flat/1"
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_NAMES = {d: str(d).removeprefix("torch.") for d in _DTYPES.values()}
# Tags of the JSON tree; a JSON scalar is a leaf value as is.
_TENSOR, _DICT, _LIST, _TUPLE, _FLOAT = "T", "D", "L", "U", "F"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class FlatState:
    """A state's tensors laid end to end; reads any byte range of the layout into a buffer.

    ``layout`` is the JSON-able description (``skeleton`` the same, encoded), ``total`` the size
    of the byte space.
    """

    def __init__(self, state: Any) -> None:
        self._src: list[torch.Tensor] = []      # the state's tensors (references, no copy)
        self._u8: Optional[list[torch.Tensor]] = None
        self._pieces: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self.offsets: list[int] = []
        self._table: list[list] = []
        self._pos = 0
        tree = self._encode(state, None)
        self.total = self._pos
        self.layout = {"format": FORMAT, "total": self.total, "tensors": self._table, "tree": tree}

    @property
    def skeleton(self) -> bytes:
        """The layout as JSON (encoded on demand: begin() runs on the trainer's critical path)."""
        return json.dumps(self.layout, allow_nan=False, check_circular=False, separators=(",", ":")).encode()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Flat uint8 views of the state's tensors (made on first use, by the copying thread)."""
        if self._u8 is None:
            self._u8 = [t.detach().reshape(-1).view(torch.uint8) if t.numel()
                        else torch.empty(0, dtype=torch.uint8) for t in self._src]
        return self._u8

    def pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The state's tensors as (addresses, offsets, sizes) uint64 arrays, for a native copy of a
        byte range in one call (:meth:`jitckpt.snapshot.checksum.Checksum.copy_flat`); valid while
        this object (which holds the tensors) lives."""
        if self._pieces is None:
            self._pieces = (np.array([t.data_ptr() for t in self._src], dtype=np.uint64),
                            np.array(self.offsets, dtype=np.uint64),
                            np.array([t.nbytes for t in self._src], dtype=np.uint64))
        return self._pieces

    # The path to a value is a chain of tuples, formatted only for an error message. The walk runs
    # on the trainer's critical path at every snapshot, once per tensor of the state (thousands in a
    # large model): exact type tests first, torch's cheapest accessors.
    def _encode(self, obj: Any, path: Any) -> Any:
        t = type(obj)
        if t is torch.Tensor or t is torch.nn.Parameter:
            return {_TENSOR: self._add(obj, path)}
        if obj is None or t is bool or t is int or t is str:
            return obj
        if t is float:
            return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}  # strict JSON has no nan/inf
        if t is dict or t is OrderedDict:
            node: dict = {_DICT: [[k if type(k) is str or type(k) is int else self._key(k, path),
                                   {_TENSOR: self._add(v, (path, "[]", k))} if type(v) is torch.Tensor
                                   else self._encode(v, (path, "[]", k))] for k, v in obj.items()]}
            if t is OrderedDict:
                node["O"] = 1
                attrs = vars(obj)
                if attrs:  # a module state_dict's _metadata carries versions load_state_dict reads
                    node["A"] = {name: self._encode(v, (path, ".", name)) for name, v in attrs.items()}
            return node
        if t is list or t is tuple:
            return {_LIST if t is list else _TUPLE: [self._encode(v, (path, "[]", i))
                                                     for i, v in enumerate(obj)]}
        if isinstance(obj, torch.Tensor):  # a subclass
            return {_TENSOR: self._add(obj, path)}
        raise TypeError(
            f"snapshot: {_fmt(path)} is a {t.__module__}.{t.__qualname__}; a snapshot state may hold "
            "only tensors, None, bool, int, float, str and dict/OrderedDict/list/tuple of them (it "
            "is stored as JSON, never pickled) - convert it in state_fn (e.g. to a list or a tensor)")

    def _key(self, k: Any, path: Any) -> Any:
        if type(k) is str or type(k) is int:
            return k
        if isinstance(k, torch.Tensor):
            raise TypeError(f"snapshot: {_fmt(path)} has a tensor as a dict key; use str or int keys")
        return self._encode(k, (path, " key", k))

    def _add(self, t: torch.Tensor, path: Any) -> int:
        if not t.is_cpu:
            raise ValueError(
                f"snapshot: {_fmt(path)} is a tensor on {t.device} - this implementation snapshots "
                "CPU tensors only (move the state to CPU in state_fn, or snapshot on a CPU build)")
        if t.layout is not torch.strided or t.is_quantized:
            raise ValueError(f"snapshot: {_fmt(path)} is a sparse or quantized tensor; densify it in "
                             "state_fn")
        if not t.is_contiguous():
            t = t.contiguous()  # the values at begin(); contiguous tensors are read while copying
        nbytes = t.nbytes
        index = len(self._src)
        pos = self._pos
        self._table.append([_NAMES[t.dtype], t.shape, pos, nbytes])  # a torch.Size: a JSON array
        self._src.append(t)
        self.offsets.append(pos)
        self._pos = _align(pos + nbytes)
        return index

    def read_into(self, start: int, out: torch.Tensor) -> None:
        """Copy bytes ``[start, start + len(out))`` of the layout into uint8 tensor ``out``.

        Bytes past the end of the state or between tensors read as zero.
        """
        out_np = out.numpy()
        for pos, src, n in self.segments(start, out.numel()):
            if src is None:
                out_np[pos:pos + n] = 0
            else:
                # numpy's copy is glibc memcpy (about 1.7x torch's single-thread uint8 copy_ here)
                # and, like torch, releases the GIL for the trainer
                np.copyto(out_np[pos:pos + n], src)

    def segments(self, start: int, n: int) -> Iterator[tuple[int, Optional[np.ndarray], int]]:
        """Bytes ``[start, start + n)`` of the layout as ``(position, source, length)`` pieces in
        order: ``source`` a uint8 array of a tensor's bytes, or None where they read as zero."""
        pos, tensors = 0, self.tensors
        i = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        while pos < n:
            at = start + pos
            if i >= len(tensors) or at < self.offsets[i]:
                nxt = self.offsets[i] if i < len(tensors) else at + (n - pos)
                gap = min(nxt - at, n - pos)
                yield pos, None, gap
                pos += gap
                continue
            t, off = tensors[i], at - self.offsets[i]
            if off >= t.numel():
                i += 1
                continue
            take = min(t.numel() - off, n - pos)
            yield pos, t.numpy()[off:off + take], take
            pos += take


def _fmt(path: Any) -> str:
    parts = []
    while path is not None:
        path, kind, k = path
        parts.append(f"[{k!r}]" if kind == "[]" else f"{kind}{k if kind == '.' else ''}")
    return "state" + "".join(reversed(parts))


def parse_layout(skeleton: Union[bytes, str, dict]) -> dict:
    """The layout document from its JSON (bytes or str) or an already parsed dict, checked."""
    try:
        doc = json.loads(skeleton) if isinstance(skeleton, (bytes, bytearray, str)) else skeleton
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"snapshot layout is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"snapshot layout: not a {FORMAT} document (written by another version?)")
    return doc


def rebuild(skeleton: Union[bytes, str, dict], flat: Any = None, *,
            tensors: Optional[list[torch.Tensor]] = None) -> Any:
    """The state from its layout (see :class:`FlatState`) and a buffer holding the flat bytes, or
    the layout's tensors already loaded (``tensors``, in table order).

    The tensors view ``flat`` (no copy). Every table entry is checked against the buffer and its
    dtype, so a damaged layout gives a ValueError, never an out-of-range view.
    """
    doc = parse_layout(skeleton)
    if tensors is None:
        buf = memoryview(flat).cast("B")
        tensors = [_tensor(entry, buf) for entry in doc["tensors"]]
    elif len(tensors) != len(doc["tensors"]):
        raise ValueError("snapshot layout: the tensors given do not match its table")

    def decode(node: Any) -> Any:
        if not isinstance(node, (dict, list)):
            return node
        if not isinstance(node, dict) or len(node) < 1:
            raise ValueError(f"snapshot layout: malformed node {str(node)[:80]}")
        if _TENSOR in node:
            return tensors[node[_TENSOR]]
        if _DICT in node:
            out = OrderedDict() if node.get("O") else {}
            for k, v in node[_DICT]:
                out[decode(k)] = decode(v)
            for name, v in node.get("A", {}).items():
                setattr(out, name, decode(v))
            return out
        if _LIST in node:
            return [decode(v) for v in node[_LIST]]
        if _TUPLE in node:
            return tuple(decode(v) for v in node[_TUPLE])
        if _FLOAT in node:
            return float(node[_FLOAT])
        raise ValueError(f"snapshot layout: unknown node {str(node)[:80]}")

    try:
        return decode(doc["tree"])
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"snapshot layout is damaged: {e!r}") from None


def dtype_named(name: str) -> Optional[torch.dtype]:
    """The dtype a layout's tensor table names (``"float32"``...), or None for a name torch lacks."""
    return _DTYPES.get(name)


def places_in(doc: dict, live: Any) -> Iterator[tuple[int, Any]]:
    """For each tensor of layout ``doc`` whose place (dict key by dict key, item by item) exists in
    ``live``: (its index in ``doc["tensors"]``, the object at that place of ``live``). Keys the layout
    encodes (tuples...) are not matched."""
    table_size = len(doc["tensors"])

    def walk(node: Any, obj: Any) -> Iterator[tuple[int, Any]]:
        if not isinstance(node, dict):
            return
        if _TENSOR in node:
            i = node[_TENSOR]
            if isinstance(i, int) and 0 <= i < table_size:
                yield i, obj
        elif _DICT in node and isinstance(obj, dict):
            for key, value in node[_DICT]:
                if isinstance(key, (str, int)) and key in obj:
                    yield from walk(value, obj[key])
        elif isinstance(obj, (list, tuple)):
            items = node.get(_LIST, node.get(_TUPLE))
            if isinstance(items, list):
                for value, o in zip(items, obj):
                    yield from walk(value, o)

    yield from walk(doc["tree"], live)


def _tensor(entry: Any, buf: memoryview) -> torch.Tensor:
    try:
        name, shape, offset, nbytes = entry
        dtype = _DTYPES[name]
        shape = [int(s) for s in shape]
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"snapshot layout: bad tensor entry {str(entry)[:80]}") from None
    if math.prod(shape) * dtype.itemsize != nbytes or min(shape, default=0) < 0:
        raise ValueError(f"snapshot layout: tensor {shape} {name} cannot take {nbytes} bytes")
    if not 0 <= offset <= len(buf) - nbytes or offset % ALIGN:
        raise ValueError(f"snapshot layout: tensor at {offset}+{nbytes} is outside the {len(buf)}-byte "
                         "snapshot or misaligned")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    u8 = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return u8.view(dtype).reshape(shape)
