"""The metadata store contract: namespace snapshots (and published manifests) of a dataset.

Two implementations, chosen by URL scheme (:func:`epochfs.meta.open_meta`): ``lmdb://PATH`` (embedded,
the default, in the cache directory) and ``redis://HOST:PORT/DB`` (shared by every node of a cluster).
Their keys and encodings are documented in ``docs/metadata-store.md``.

A snapshot is versioned and published atomically: a reader sees the previous version or the new one,
never a mix. Stores are blocking; the daemon calls them from worker threads.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from epochfs.core.errors import BackendUnavailable, EpochfsError
from epochfs.core.records import ObjectInfo, record_problem

#: One object record: size, mtime_ns, len(key), len(etag), mode, uid, gid (0xFFFFFFFF: not given).
_RECORD = struct.Struct("<QqIIIII")
_NONE = 0xFFFFFFFF
#: Most objects one snapshot may hold (memory: about 0.5 GiB per million in the daemon).
MAX_OBJECTS = 100_000_000



class StoreRefused(BackendUnavailable):
    """The shared metadata store refuses this node's password (or user): at start-up a configuration
    error (the mount does not start), later the store unreachable for that reason (a password rotated
    under a running node: it keeps serving what it has, and says why in its status and log)."""

class SnapshotInvalid(EpochfsError):
    """A stored snapshot that does not decode or breaks a limit. It is refused as a whole: the daemon
    keeps serving what it has (or, at start-up, this node's local copy)."""


#: URL schemes of a store shared by nodes (Redis, directly or found through Redis Sentinel).
SHARED_SCHEMES = ("redis://", "rediss://", "redis+sentinel://", "rediss+sentinel://")
SHARED_FORMS = "redis[s]://[USER@]HOST:PORT/DB or redis[s]+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"


def is_shared(url: str | None) -> bool:
    """Whether ``url`` names a store shared by nodes."""
    return (url or "").startswith(SHARED_SCHEMES)


@dataclass(frozen=True)
class StoreAccess:
    """How to reach a shared store and vouch for what it holds: ``password`` (read from a private file
    or the environment, never the command line) authenticates the connection and signs every record
    published, so a node takes owners and modes only from records signed with it; ``ca_file``: the
    certificates a ``rediss://`` store's must chain to (default: the system's)."""

    password: bytes | None = None
    ca_file: str | None = None


@dataclass(frozen=True)
class Head:
    """What identifies a version, read without its objects."""

    source: str
    version: int
    created: float
    objects: int  # how many (-1: a change set's, known once applied)
    base: int | None = None  # a change set: the version it applies to


@dataclass(frozen=True)
class Change:
    """One published change set: the version it makes, when, what it puts and what it deletes."""

    version: int
    created: float
    added: dict[str, ObjectInfo]
    removed: set[str]


class Objects(Protocol):
    """A version's objects: a list, or read from the store as they are iterated."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[ObjectInfo]: ...


@dataclass(frozen=True)
class Snapshot:
    source: str
    version: int
    created: float
    objects: Objects

    @property
    def head(self) -> Head:
        return Head(self.source, self.version, self.created, len(self.objects))


def _opt(value: int | None) -> int:
    return _NONE if value is None else value


def encode_objects(objects: Iterable[ObjectInfo]) -> bytes:
    """Records ``struct("<QqIIIII")(size, mtime_ns, len(key), len(etag), mode, uid, gid) + key + etag``
    back to back; keys and ETags are UTF-8."""
    out = bytearray()
    for o in objects:
        key, etag = o.key.encode("utf-8"), o.etag.encode("utf-8")
        out += _RECORD.pack(o.size, o.mtime_ns, len(key), len(etag), _opt(o.mode), _opt(o.uid), _opt(o.gid))
        out += key
        out += etag
    return bytes(out)


#: The attributes an entry is presented with when its record claims its own owner and mode but comes from
#: a store that cannot vouch for them (:func:`decode_objects` with ``trusted=False``): the mount's owner
#: only, until a source that can vouch (the bucket's attribute records) says otherwise.
CLOSED_FILE, CLOSED_DIR = 0o400, 0o500


def decode_objects(raw: bytes | memoryview, *, limit: int | None = None, trusted: bool = True) -> list[ObjectInfo]:
    """The records of one chunk, every field checked; :class:`SnapshotInvalid` for the first bad one or
    past ``limit`` records. Untrusted (a store that is not authenticated), a record's owner and mode
    are not taken: one that claims its own is closed to the mount's owner (:data:`CLOSED_FILE`)."""
    data = bytes(raw)
    objects: list[ObjectInfo] = []
    append, unpack, head, end, pos = objects.append, _RECORD.unpack_from, _RECORD.size, len(data), 0
    problem_of = record_problem
    while pos < end:
        if limit is not None and len(objects) >= limit:
            raise SnapshotInvalid(f"more than {limit} records in one chunk")
        if pos + head > end:
            raise SnapshotInvalid(f"record at byte {pos} is cut short")
        size, mtime_ns, klen, elen, mode, uid, gid = unpack(data, pos)
        at, pos = pos, pos + head
        if pos + klen + elen > end:  # (the lengths themselves are the record's: record_problem)
            raise SnapshotInvalid(f"record at byte {at}: key or ETag length out of range")
        try:
            key = data[pos:pos + klen].decode()
            etag = data[pos + klen:pos + klen + elen].decode()
        except UnicodeDecodeError:
            raise SnapshotInvalid(f"record at byte {at}: key or ETag is not UTF-8") from None
        pos += klen + elen
        if mode == _NONE and uid == _NONE and gid == _NONE:  # an S3 object: no owner or mode
            obj = ObjectInfo(key, size, mtime_ns, etag)
        else:
            obj = ObjectInfo(key, size, mtime_ns, etag, None if mode == _NONE else mode,
                             None if uid == _NONE else uid, None if gid == _NONE else gid)
        problem = problem_of(obj, (klen, elen))
        if problem:
            raise SnapshotInvalid(f"record at byte {at}: {problem}")
        if not trusted and (obj.mode is not None or obj.uid is not None or obj.gid is not None):
            obj = closed(obj)
        append(obj)
    return objects


def closed(obj: ObjectInfo) -> ObjectInfo:
    """``obj`` presented to the mount's owner only (its claimed owner and mode not taken)."""
    return obj._replace(mode=CLOSED_DIR if obj.key.endswith("/") or not obj.key else CLOSED_FILE, uid=None, gid=None)


def merged(objects: Iterable[ObjectInfo], added: dict[str, ObjectInfo], removed: set[str]) -> list[ObjectInfo]:
    """A listing with objects put (``added``, by key) and deleted (``removed``): the next version of a
    snapshot after a node's own writes."""
    out = {o.key: o for o in objects if o.key not in removed}
    out.update(added)
    return list(out.values())


def kept_attributes(listed: Iterable[ObjectInfo], previous: Iterable[ObjectInfo]) -> Iterator[ObjectInfo]:
    """The listing, each object without permission bits taking the owner and mode the previous snapshot
    had for the same key and version. S3 listings carry none, so without this a file written private
    through a write-back mount would turn readable at the next relist. (The map of the previous
    attributes is built only if the listing has an object without them.)"""
    kept: dict[str, ObjectInfo] | None = None
    for o in listed:
        if o.mode is None:
            if kept is None:
                kept = {p.key: p for p in previous if p.mode is not None}
            p = kept.get(o.key)
            if p is not None and p.etag == o.etag:
                o = o._replace(mode=p.mode, uid=p.uid, gid=p.gid)
        yield o


Progress = Callable[[int], None]  # called with the number of objects written so far


class MetaStore(Protocol):
    url: str
    #: Shared by the nodes of a cluster: a node loads what was published and never lists the source.
    shared: bool
    #: Whether the owners and modes it holds can be taken: only its holders can have written them (a
    #: private directory, or a shared store whose records are signed with a secret no local user has).
    trusted: bool

    def head(self, source: str) -> Head | None:
        """The current version's number, time and size, without its objects (None if none was
        published); :class:`SnapshotInvalid` if its record is malformed."""

    def load(self, source: str) -> Snapshot | None:
        """The current snapshot of ``source``, or None if none was published."""

    def current_version(self, source: str) -> int | None:
        """The current version number, cheaply (for polling)."""

    def save(self, source: str, objects: Iterable[ObjectInfo], progress: Progress | None = None) -> Snapshot:
        """Publish a new version atomically and return it."""

    def update(self, source: str, added: dict[str, ObjectInfo], removed: set[str], *,
               publication: str | None = None) -> Head:
        """Publish the current version with objects put and deleted (write-back), atomically with
        respect to other nodes doing the same; return the new version's identity. ``publication`` names
        the change: a shared store that already holds a change of that name returns its version instead
        of taking it twice (the writer's earlier try got through, its answer did not)."""

    def changes(self, source: str, after: int, upto: int) -> list[Change] | None:
        """A shared store: the change sets that take version ``after`` to ``upto`` (None when the way
        is not change sets alone: load the version whole)."""

    def compaction_due(self, source: str) -> bool:
        """A shared store: whether a full copy of the current version is due."""

    def compact(self, source: str) -> int | None:
        """A shared store: write a full copy of the current version; the version copied."""

    def put_manifest(self, source: str, name: str, text: str) -> None:
        """Publish a manifest under ``name`` for every node to fetch."""

    def get_manifest(self, source: str, name: str) -> str | None:
        """A published manifest, or None."""

    def close(self) -> None:
        """Release connections."""
