"""On-disk checkpoint layout shared by the JIT, periodic and in-memory-flush tiers.

Layout: one directory per (rank, save) directly under the checkpoint root::

    <root>/<kind>-g<gen>-r<rank>-s<step>/      kind: jit | periodic | snapshot
        <files written by the user's save_fn>
        jitckpt-meta.json                      written last, atomically

A save goes to a hidden ``.tmp-*`` directory first; the user's files are written and fsynced, then
their sizes and CRC32s go into the metadata file (written to a temporary name, fsynced, renamed),
and only then is the directory renamed to its final name. A directory without a valid metadata
file, or whose files do not match it, is never used. Older checkpoints are deleted only after a
newer complete one exists.

A save that fails because the file system is full raises :class:`CheckpointError` ("no space left
on <dir>: N bytes needed") and leaves nothing behind. A checkpoint that verifies but cannot be
loaded is moved aside to ``bad-<name>`` by :func:`quarantine` (kept, never selected again).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import google_crc32c

log = logging.getLogger("jitckpt.checkpoint")

META_FILE = "jitckpt-meta.json"
FORMAT_VERSION = 2
KINDS = ("jit", "periodic", "snapshot")
# "-p<shard id>": a part of a shard a rank wrote for another replica of it (runtime/shard_parts.py).
_DIR_RE = re.compile(r"^(?P<kind>[a-z]+)-g(?P<gen>\d+)-r(?P<rank>\d+)-s(?P<step>-?\d+)(?:-p\d+)?$")
_CHUNK = 8 << 20
QUARANTINE_PREFIX = "bad-"
QUARANTINE_NOTE = "jitckpt-quarantine.txt"
RESERVE_PREFIX = ".reserve-"  # jitckpt.runtime.save_reserve's files
# A save that fails with less free space than this left is taken as one that ran out of space:
# torch.save's zip writer reports a failed write as "unexpected pos", without the errno.
_FULL_MARGIN = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not usable."""


@dataclass
class CheckpointMeta:
    """What ``jitckpt-meta.json`` records about one rank's checkpoint."""

    kind: str
    step: int
    rank: int
    world_size: int
    gen: int
    shard_id: int = 0
    num_shards: int = 1
    created: float = 0.0
    save_seconds: float = 0.0
    files: dict = field(default_factory=dict)  # relative path -> {"size": int, "crc32c": int}
    format_version: int = FORMAT_VERSION
    run_id: str = ""  # the job that wrote it (jitckpt run's --rdzv-id or its generated id)
    # What a framework resumes from inside the directory (a Trainer's checkpoint-<step>/, a
    # Lightning .ckpt): the name save_fn returned; "" for the directory itself.
    entry: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())


def _crc32c_file(path: Path) -> tuple[int, int]:
    # CRC32C: hardware-accelerated (SSE4.2 / ARMv8), several times faster than zlib's CRC32.
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return crc, size
            crc = google_crc32c.extend(crc, chunk)
            size += len(chunk)


def _fsynced_crc32c(path: Path) -> tuple[int, int]:
    """fsync ``path`` and read its CRC32C at the same time: the checksum pass reads the page cache
    (CPU) while the flush waits on the disk, so a save costs about the longer of the two, not their
    sum (fsync releases the GIL)."""
    out: list = []
    reader = threading.Thread(target=lambda: out.append(_crc32c_file(path)), name="jitckpt-crc32c")
    reader.start()
    try:
        _fsync_path(path)
    finally:
        reader.join()
    if not out:
        return _crc32c_file(path)  # the reader failed: raise its error here
    return out[0]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(directory: str | os.PathLike) -> None:
    """fsync a checkpoint written with ``fsync=False``: every file in it, the directory and its parent
    (where its rename landed). OSError if any of them cannot be flushed."""
    directory = Path(directory)
    for p in sorted(p for p in directory.rglob("*") if p.is_file()):
        _fsync_path(p)
    _fsync_path(directory)
    _fsync_path(directory.parent)


def _data_files(directory: Path) -> Iterable[Path]:
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != META_FILE:
            yield p


def _entry_of(directory: Path, returned: object) -> str:
    """The entry ``save_fn`` named by returning its name (anything else: the directory itself), checked."""
    if isinstance(returned, os.PathLike):
        returned = os.fspath(returned)
    if not isinstance(returned, str):
        # Only a name names an entry; another value is what the save's last call gave back (a
        # file's write_bytes() count), ignored as before save functions could name one.
        return ""
    if not returned or os.path.isabs(returned) or ".." in Path(returned).parts:
        raise CheckpointError(f"save function returned {returned!r}: it may return None or the relative name of "
                              "the file or directory it wrote that a framework resumes from")
    if not (directory / returned).exists():
        raise CheckpointError(f"save function returned {returned!r}, which it did not write into {directory}")
    return returned


def resume_path(directory: str | os.PathLike) -> str:
    """What to resume from in a checkpoint directory: the entry its save function named, or itself."""
    entry = read_meta(directory).entry
    return str(Path(directory) / entry) if entry else str(directory)


def checkpoint_dir_name(kind: str, gen: int, rank: int, step: int, part: Optional[int] = None) -> str:
    return f"{kind}-g{gen:04d}-r{rank:05d}-s{step}" + ("" if part is None else f"-p{part}")


def write_checkpoint(
    root: str | os.PathLike,
    save_fn: Callable[[str], Optional[str]],
    *,
    kind: str,
    step: int,
    rank: int,
    world_size: int,
    gen: int,
    shard_id: int = 0,
    num_shards: int = 1,
    fsync: bool = True,
    run_id: Optional[str] = None,
    part: Optional[int] = None,
) -> tuple[Path, CheckpointMeta]:
    """Run ``save_fn(tmpdir)`` and commit the result atomically; return (final dir, metadata).

    ``save_fn`` may return the relative name of what a framework resumes from (recorded as the
    metadata's ``entry``; see :func:`resume_path`).

    Raises :class:`CheckpointError` if ``save_fn`` writes nothing or the file system fills up
    ("no space left on <root>: N bytes needed"); other errors of ``save_fn`` propagate. In every
    case the partial temporary directory is removed and no existing checkpoint is touched.
    ``run_id`` defaults to ``$TORCHELASTIC_RUN_ID`` (set by ``jitckpt run``). ``part``: the shard
    id of a part written for another rank (it goes into the directory's name).
    """
    if kind not in KINDS:
        raise ValueError(f"checkpoint kind must be one of {KINDS}, got {kind!r}")
    if run_id is None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_dir_name(kind, gen, rank, step, part)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.monotonic()
    try:
        tmp.mkdir()
        entry = _entry_of(tmp, save_fn(str(tmp)))
        files = {}
        for p in _data_files(tmp):
            crc, size = _fsynced_crc32c(p) if fsync else _crc32c_file(p)
            files[str(p.relative_to(tmp))] = {"size": size, "crc32c": crc}
        if not files:
            raise CheckpointError(
                f"save function wrote no files into {tmp}; it must save the state into the directory "
                "path it is given")
        meta = CheckpointMeta(kind=kind, step=step, rank=rank, world_size=world_size, gen=gen,
                              shard_id=shard_id, num_shards=num_shards, created=time.time(),
                              save_seconds=time.monotonic() - t0, files=files, run_id=run_id,
                              entry=entry)
        meta_tmp = tmp / (META_FILE + ".tmp")
        with open(meta_tmp, "w") as f:
            json.dump(asdict(meta), f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.rename(meta_tmp, tmp / META_FILE)
        if final.exists():  # same rank, same step, same generation saved twice: keep the first
            shutil.rmtree(tmp, ignore_errors=True)
            return final, read_meta(final)
        os.rename(tmp, final)
        if fsync:
            _fsync_path(root)
        return final, meta
    except BaseException as e:
        written = _tree_bytes(tmp)
        full = isinstance(e, Exception) and not isinstance(e, CheckpointError) and _out_of_space(e, root)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            needed = max(written, _newest_size(root, rank))
            raise CheckpointError(
                f"no space left on {root}: {needed} bytes needed, {_free_bytes(root)} free "
                f"(the partial save was removed; older checkpoints are kept)") from e
        raise


def _tree_bytes(directory: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(directory):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1


def _out_of_space(exc: BaseException, root: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC/EDQUOT anywhere in the exception chain, or
    (torch.save hides the errno) hardly any space left on the file system after the failure."""
    seen: set = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return 0 <= _free_bytes(root) < _FULL_MARGIN


def _newest_size(root: Path, rank: int) -> int:
    """Size of this rank's newest committed checkpoint (0 if none): what the next one needs."""
    for c in list_candidates(root):
        if c.rank == rank:
            try:
                return read_meta(c.path).total_bytes
            except CheckpointError:
                continue
    return 0


def read_meta(directory: str | os.PathLike) -> CheckpointMeta:
    """Parse a checkpoint's metadata; raise CheckpointError naming what is wrong."""
    path = Path(directory) / META_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {META_FILE} (incomplete save)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory}: unreadable {META_FILE}: {e}") from None
    try:
        known = CheckpointMeta.__dataclass_fields__
        # Fields added by a newer jitckpt are ignored; older metadata lacks e.g. run_id.
        meta = CheckpointMeta(**{k: v for k, v in raw.items() if k in known})
    except (TypeError, AttributeError) as e:
        raise CheckpointError(f"{directory}: malformed {META_FILE}: {e}") from None
    if meta.format_version != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory}: checkpoint format {meta.format_version}, this jitckpt reads {FORMAT_VERSION}")
    return meta


def verify_checkpoint(directory: str | os.PathLike) -> CheckpointMeta:
    """Check every file against the metadata (size, CRC32C); return the metadata or raise."""
    directory = Path(directory)
    meta = read_meta(directory)
    for rel, expect in meta.files.items():
        p = directory / rel
        if not p.is_file():
            raise CheckpointError(f"{directory}: file {rel} is missing")
        size = p.stat().st_size
        if size != expect["size"]:
            raise CheckpointError(
                f"{directory}: file {rel} has {size} bytes, metadata says {expect['size']} (truncated?)")
        crc, _ = _crc32c_file(p)
        if crc != expect.get("crc32c"):
            raise CheckpointError(f"{directory}: file {rel} fails its CRC32C check (corrupt)")
    return meta


@dataclass(frozen=True)
class Candidate:
    path: Path
    kind: str
    gen: int
    rank: int
    step: int


def list_candidates(root: str | os.PathLike) -> list[Candidate]:
    """Checkpoint directories under root, newest step first (names only; nothing verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _DIR_RE.match(p.name)
        if m and p.is_dir():
            out.append(Candidate(p, m["kind"], int(m["gen"]), int(m["rank"]), int(m["step"])))
    # Newest step first; at equal steps prefer JIT (taken from live replicas), then the newer
    # generation, then the lowest rank (so every reader examines candidates in the same order).
    out.sort(key=lambda c: (c.step, c.kind == "jit", c.gen, -c.rank), reverse=True)
    return out


def find_latest(
    root: str | os.PathLike,
    *,
    shard_id: int = 0,
    num_shards: int = 1,
    skipped: Optional[list] = None,
) -> Optional[tuple[Path, CheckpointMeta]]:
    """Newest step for which every shard has a verified replica; return this shard's copy.

    Corrupt or incomplete checkpoints are skipped with a logged reason (also appended to
    ``skipped`` as (path, reason) when given). Returns None when nothing usable exists.
    """
    found = find_complete_set(root, num_shards=num_shards, skipped=skipped)
    return None if found is None else found[shard_id]


def find_complete_set(
    root: str | os.PathLike,
    *,
    num_shards: Optional[int] = None,
    skipped: Optional[list] = None,
) -> Optional[dict[int, tuple[Path, CheckpointMeta]]]:
    """Newest step for which every shard has a verified copy: shard id -> (its copy, metadata).

    ``num_shards``: the job's; None takes the shard count each step was saved with (a job resumed
    on another mesh, which DCP reshards). Skips as :func:`find_latest` does.
    """
    def skip(path: Path, why: str) -> None:
        log.warning("skipping checkpoint: %s", why)
        if skipped is not None:
            skipped.append((path, why))

    by_step: dict[int, list[Candidate]] = {}
    for c in list_candidates(root):
        by_step.setdefault(c.step, []).append(c)
    for step in sorted(by_step, reverse=True):
        metas = []
        for c in by_step[step]:
            try:
                metas.append((c, read_meta(c.path)))
            except CheckpointError as e:
                skip(c.path, str(e))
        # A step may hold sets of several shard counts (a DTensor job's replicas split a shard's
        # writing when every rank is alive): each is tried, in the candidates' order.
        counts = [num_shards] if num_shards is not None else list(dict.fromkeys(m.num_shards for _, m in metas))
        for want in counts:
            verified: dict[int, tuple[Path, CheckpointMeta]] = {}
            for c, meta in metas:
                if meta.num_shards != want:
                    if num_shards is not None:
                        skip(c.path, f"{c.path}: saved with {meta.num_shards} shards, this job has {want}")
                    continue
                if meta.shard_id in verified:
                    continue
                try:
                    verify_checkpoint(c.path)
                except CheckpointError as e:
                    skip(c.path, str(e))
                    continue
                verified[meta.shard_id] = (c.path, meta)
                if len(verified) == want:
                    return verified
    return None


def prune(root: str | os.PathLike, *, older_than_step: int) -> list[Path]:
    """Delete checkpoints with a step below ``older_than_step`` and stale temporary directories.

    The caller must hold a verified checkpoint at ``older_than_step`` (the launcher prunes only
    after the job restored from one), so good state is never the last copy removed.
    """
    root = Path(root)
    removed = []
    for c in list_candidates(root):
        if c.step < older_than_step:
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.path)
    return removed + _remove_stale_tmp(root)


def prune_finished(root: str | os.PathLike) -> list[Path]:
    """At a successful job end: delete every JIT checkpoint, save reserve and stale temporary directory.

    JIT checkpoints hold mid-run states of a job that has since finished (several replicas' copies
    of one step, typically): a later job in the same directory must not resume from them.
    Periodic checkpoints and flushed snapshots, which the user asked for, are kept, and so are
    quarantined (``bad-*``) ones.
    """
    root = Path(root)
    removed = []
    for c in list_candidates(root):
        if c.kind == "jit":
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.path)
    for p in root.glob(RESERVE_PREFIX + "*"):  # the workers' JIT save reserves: all done now
        try:
            p.unlink()
        except OSError:
            continue
        removed.append(p)
    return removed + _remove_stale_tmp(root)


def _remove_stale_tmp(root: Path) -> list[Path]:
    """Temporary directories of writers that are gone (a save killed half-way)."""
    removed = []
    for p in root.glob(".tmp-*"):
        pid = p.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def quarantine(directory: str | os.PathLike, reason: str) -> Optional[Path]:
    """Move a checkpoint that verifies but cannot be loaded to ``bad-<name>``, with the reason.

    It is never deleted, and no reader (this job's other ranks, later restarts and later jobs)
    selects it again. Returns the new path, or None if it is gone already (another rank moved it).
    """
    src = Path(directory)
    for i in range(1000):
        dest = src.with_name(f"{QUARANTINE_PREFIX}{src.name}" + (f"-{i}" if i else ""))
        if dest.exists():
            continue
        try:
            os.rename(src, dest)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                continue  # another rank quarantined another copy under that name just now
            raise
        try:
            (dest / QUARANTINE_NOTE).write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {reason}\n")
        except OSError:
            pass  # e.g. a full disk: the name alone keeps it from being used
        log.warning("checkpoint %s cannot be loaded (%s); moved to %s (kept, not used again)",
                    src, reason, dest)
        return dest
    raise CheckpointError(f"{src}: cannot quarantine it: too many {QUARANTINE_PREFIX}{src.name}* exist")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a writer of a temporary file is gone if not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
