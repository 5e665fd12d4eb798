"""Owners and modes kept in the bucket itself, so that every mount of it, on any node, presents a file
with the owner and mode it was written with. Pure: names and the rules; the S3 backend lists and writes
them.

An S3 listing carries no user metadata, and reading each object's (a HEAD per object) would cost a
request per file at every listing. So a write-back mount records the attributes of what it writes as
*attribute records*: empty objects under the source's reserved ``.epochfs/attrs/`` prefix whose name
says everything, read with one listing of that prefix::

    .epochfs/attrs/f-<blake2b-128 of the key>.<mode, octal>.<uid>.<gid>     a file
    .epochfs/attrs/d-<blake2b-128 of the key + "/">.<mode>.<uid>.<gid>      a directory

Only the holders of the backend's credentials can write them: the same parties who can write the data,
and none of the local users a mount protects (they write only through the mount, which refuses names
under ``.epochfs/``). A record is written before its object and removed after it (and a record for the
same key with other attributes after the new one is in place), so at every moment a key's records are
at least as strict as the object's own. Where several records name one key, the strictest wins: their
modes are ANDed, and owners that disagree leave the object to the mount's default owner. An object
with no record has unknown attributes: the mount presents its defaults for unknown files.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from epochfs.core.records import ObjectInfo, reserved_key

#: Keys under this prefix of a source are epochfs's own: never files of the mount, never a writer's.
RESERVED = ".epochfs/"
ATTR_DIR = RESERVED + "attrs/"
_NAME = re.compile(r"([fd])-([0-9a-f]{32})\.([0-7]{1,5})\.(\d{1,10})\.(\d{1,10})")
_ID_LIMIT = 1 << 32


class Attrs(NamedTuple):
    mode: int
    uid: int | None  # None: the records disagree (the mount's default owner)
    gid: int | None


def reserved(key: str) -> bool:
    """Whether ``key`` (relative to the source root) is epochfs's own: a ``.epochfs`` component at any
    depth (the source's records are under its root's; a deeper one is another mount's, or planted)."""
    return reserved_key(key)


def _kind_hash(key: str) -> str:
    kind = "d" if not key or key.endswith("/") else "f"
    return f"{kind}-{hashlib.blake2b(key.encode('utf-8'), digest_size=16).hexdigest()}"


def record_prefix(key: str) -> str:
    """The prefix (relative to the source root) of every record of ``key`` (``path/`` for a directory)."""
    return f"{ATTR_DIR}{_kind_hash(key)}."


def record_key(key: str, mode: int, uid: int, gid: int) -> str:
    """The record of ``key`` with these attributes (relative to the source root)."""
    return f"{record_prefix(key)}{mode & 0o7777:o}.{uid}.{gid}"


def parse(name: str) -> tuple[str, Attrs] | None:
    """(kind-hash, attributes) of a record's key relative to :data:`ATTR_DIR`, or None if it is none."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    mode, uid, gid = int(m[3], 8), int(m[4]), int(m[5])
    if mode > 0o7777 or uid >= _ID_LIMIT or gid >= _ID_LIMIT:
        return None
    return f"{m[1]}-{m[2]}", Attrs(mode, uid, gid)


def strictest(a: Attrs | None, b: Attrs) -> Attrs:
    """What two records of one key allow together: the modes ANDed, an owner only where they agree."""
    if a is None:
        return b
    return Attrs(a.mode & b.mode, a.uid if a.uid == b.uid else None, a.gid if a.gid == b.gid else None)


class Records:
    """The attribute records of one listing, by kind-hash."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.by_hash: dict[str, Attrs] = {}
        self.malformed = 0
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        parsed = parse(name)
        if parsed is None:
            self.malformed += 1
            return
        h, attrs = parsed
        self.by_hash[h] = strictest(self.by_hash.get(h), attrs)

    def __len__(self) -> int:
        return len(self.by_hash)

    def of(self, key: str) -> Attrs | None:
        return self.by_hash.get(_kind_hash(key)) if self.by_hash else None

    def applied(self, obj: ObjectInfo) -> ObjectInfo:
        """``obj`` with the attributes its records give (unchanged where it has none)."""
        a = self.of(obj.key)
        return obj if a is None else obj._replace(mode=a.mode, uid=a.uid, gid=a.gid)

    def apply(self, objects: Iterable[ObjectInfo]) -> Iterator[ObjectInfo]:
        """A listing with its attribute records applied: reserved keys dropped, files and directory
        markers given their records' attributes, and a marker made for a directory that has a record
        but no marker object (a directory exists in S3 only as the prefix of its files)."""
        dirs = {h for h in self.by_hash if h.startswith("d-")}
        marked: set[str] = set()
        for obj in objects:
            if reserved(obj.key):
                continue
            if self.by_hash:
                obj = self.applied(obj)
            if obj.key.endswith("/") or not obj.key:
                marked.add(obj.key)
            elif dirs:
                yield from self._markers(obj, marked)
            yield obj

    def _markers(self, obj: ObjectInfo, marked: set[str]) -> Iterator[ObjectInfo]:
        parent = obj.key.rpartition("/")[0]
        while parent and parent + "/" not in marked:
            marked.add(parent + "/")
            a = self.of(parent + "/")
            if a is not None:
                yield ObjectInfo(parent + "/", 0, obj.mtime_ns, "", a.mode, a.uid, a.gid)
            parent = parent.rpartition("/")[0]
