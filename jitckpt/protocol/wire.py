"""How a typed message travels: one JSON object, its fields plus ``"type"``.

Shared by the channels of :mod:`jitckpt.protocol` (each has its own module of message classes).
:func:`decode` turns bytes back into a message class of the receiving end's table, refusing
unknown types and fields by name, so a typo on either side fails loudly instead of being read as
a missing field.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Message:
    """Base of every message class; ``TYPE`` names it on the wire."""

    TYPE: ClassVar[str] = ""

    def encode(self) -> bytes:
        """One JSON line."""
        return (json.dumps({"type": self.TYPE, **dataclasses.asdict(self)}, default=str) + "\n").encode()


class ProtocolError(ValueError):
    """Bytes that are not one of the channel's messages."""


def table(*classes: type) -> dict[str, type]:
    """The decoding table of the messages one end may receive."""
    return {c.TYPE: c for c in classes}


def decode(line: bytes, types: dict[str, type], *, channel: str = "control") -> Any:
    """The message class of ``types`` that ``line`` holds (``channel`` names it in errors)."""
    try:
        raw = json.loads(line)
        kind = raw.pop("type")
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise ProtocolError(f"{channel} message is not a JSON object with a type: {line[:200]!r} ({e})") from None
    cls = types.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown {channel} message type {kind!r}; expected one of {sorted(types)}")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(raw) - names)
    if extra:
        raise ProtocolError(f"{channel} message {kind!r} has unknown field(s) {extra}")
    try:
        return cls(**raw)
    except TypeError as e:
        raise ProtocolError(f"{channel} message {kind!r}: {e}") from None
