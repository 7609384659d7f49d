"""The messages between a rank and its node's snapshot keeper, one frozen class each.

One request or reply per ``SOCK_SEQPACKET`` packet, encoded as in :mod:`jitckpt.protocol.wire`.
A reply that grants a buffer carries its memfd alongside (SCM_RIGHTS). The keeper decodes with
:data:`TO_KEEPER`, a rank with :data:`TO_RANK`; every request is answered by exactly one reply,
:class:`Refused` when the keeper cannot do it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jitckpt.protocol.wire import Message, table

CHANNEL = "snapshot keeper"
MAX_PACKET = 1 << 20  # bytes of one request or reply


# ---- rank -> keeper --------------------------------------------------------------------------
@dataclass(frozen=True)
class Begin(Message):
    """A writable buffer of ``size`` bytes for version ``step`` of object ``key``."""
    TYPE: ClassVar[str] = "begin"
    key: str
    step: int
    size: int


@dataclass(frozen=True)
class Commit(Message):
    """The buffers begun for ``items`` ({key, step, checksum, algo} each, and a parity object's
    ``covers``: the checksum of each range it is the XOR of; ``pin``: keep this version until the
    key's next pinned one) are complete."""
    TYPE: ClassVar[str] = "commit"
    items: list


@dataclass(frozen=True)
class ListObjects(Message):
    """Every complete object version the keeper holds."""
    TYPE: ClassVar[str] = "list"


@dataclass(frozen=True)
class Open(Message):
    """A readable mapping of the complete version ``step`` of ``key``."""
    TYPE: ClassVar[str] = "open"
    key: str
    step: int


@dataclass(frozen=True)
class Reject(Message):
    """A restore from ``step`` failed: free every version of it, never offer it again."""
    TYPE: ClassVar[str] = "reject"
    step: int


@dataclass(frozen=True)
class DiscardNewer(Message):
    """Free every version newer than ``step`` (they cannot be restored)."""
    TYPE: ClassVar[str] = "discard_newer"
    step: int


@dataclass(frozen=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"


# ---- keeper -> rank --------------------------------------------------------------------------
@dataclass(frozen=True)
class Granted(Message):
    """The buffer of a :class:`Begin` or :class:`Open` (its memfd travels with this reply)."""
    TYPE: ClassVar[str] = "granted"
    buf_id: int
    size: int
    checksum: int = 0
    algo: str = ""


@dataclass(frozen=True)
class Objects(Message):
    """Reply to :class:`ListObjects`: {key, step, size, checksum, algo, buf_id} per complete version
    (and ``covers`` where its commit had them)."""
    TYPE: ClassVar[str] = "objects"
    objects: list
    node: int


@dataclass(frozen=True)
class Freed(Message):
    """Reply to :class:`Reject` and :class:`DiscardNewer`: how many buffers were freed."""
    TYPE: ClassVar[str] = "freed"
    count: int


@dataclass(frozen=True)
class Done(Message):
    """Reply to :class:`Commit`."""
    TYPE: ClassVar[str] = "done"


@dataclass(frozen=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    pid: int
    node: int


@dataclass(frozen=True)
class Refused(Message):
    """The keeper could not do the request; ``error`` says why."""
    TYPE: ClassVar[str] = "refused"
    error: str


TO_KEEPER = table(Begin, Commit, ListObjects, Open, Reject, DiscardNewer, Ping)
TO_RANK = table(Granted, Objects, Freed, Done, Pong, Refused)
