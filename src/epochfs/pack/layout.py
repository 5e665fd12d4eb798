"""What a packed dataset is made of, where each part lives under its root, and the codecs of its index.
Pure: no I/O.

Under the root (``s3://b/packed/``)::

    epochfs-pack.json            the pointer: which index is current (written last: the flip)
    index/000003.json.gz         generation 3's index: every shard, every member
    index/000003/00012.json      a shard's own member list, written after the shard (resuming reads them)
    shards/000003-00012.tar      shard 12 of generation 3: a standard tar (PAX headers where names are long)

An index names shards of its own generation and of earlier ones (an incremental pack keeps the members
that did not change where they are). A member is ``[path, shard, offset, size, mtime_ns, xxh64, etag]``:
``offset`` is where its bytes start in the shard's tar, ``xxh64`` their checksum (hex), ``etag`` the
source object's version it was packed from.

An index or pointer read back is checked whole; anything malformed is :class:`PackInvalid` and nothing of
it is used.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from epochfs.errors import EpochfsError
from epochfs.records import (
    MAX_MTIME_NS,
    MAX_OBJECT_SIZE,
    MIN_MTIME_NS,
    ObjectInfo,
    member_etag,
    record_problem,
    text_problem,
)

FORMAT = 1
POINTER = "epochfs-pack.json"
INDEX_DIR = "index/"
SHARD_DIR = "shards/"
#: What a packed root may hold besides the pack's own parts: nothing.
_PART = re.compile(r"^(epochfs-pack\.json|index/\d{6}\.json\.gz|index/\d{6}/\d{5}\.json|shards/\d{6}-\d{5}\.tar)$")
_SHARD = re.compile(r"^shards/(\d{6})-(\d{5})\.tar$")
_SIDECAR = re.compile(r"^index/(\d{6})/(\d{5})\.json$")
#: Largest index or pointer read back (about 40 M members): a bigger one is malformed input.
MAX_INDEX_BYTES = 4 << 30
MAX_POINTER_BYTES = 64 << 10
MAX_GENERATION, MAX_SHARDS = 999_999, 99_999


class PackInvalid(EpochfsError):
    """A pointer, index or shard list that does not decode or breaks a limit: refused whole."""


@dataclass(frozen=True)
class Member:
    path: str
    shard: str  # the shard's key
    offset: int
    size: int
    mtime_ns: int
    xxh64: str
    source_etag: str
    mode: int | None = None  # the source's permission bits and owner, where it has them (file://)
    uid: int | None = None
    gid: int | None = None

    def row(self) -> list[Any]:
        return [self.path, self.shard, self.offset, self.size, self.mtime_ns, self.xxh64, self.source_etag,
                self.mode, self.uid, self.gid]


@dataclass(frozen=True)
class Index:
    generation: int
    source: str
    created: float
    shards: dict[str, ObjectInfo]  # key -> the shard as uploaded (size, ETag)
    members: dict[str, Member]  # path -> member
    #: The source's directory markers (``path/``, "" for the root) with their mtime, mode and owner: a
    #: private directory stays private in the mount.
    dirs: dict[str, ObjectInfo] = field(default_factory=dict)

    def objects(self) -> list[ObjectInfo]:
        """The original tree: one record per member, its bytes located in its shard, and the markers."""
        return [*self.dirs.values(), *(ObjectInfo(m.path, m.size, m.mtime_ns, member_etag(self.shards[m.shard], m.offset),
                                                  m.mode, m.uid, m.gid) for m in self.members.values())]

    @property
    def total_bytes(self) -> int:
        return sum(m.size for m in self.members.values())


def index_key(generation: int) -> str:
    return f"{INDEX_DIR}{generation:06d}.json.gz"


def shard_key(generation: int, number: int) -> str:
    return f"{SHARD_DIR}{generation:06d}-{number:05d}.tar"


def sidecar_key(generation: int, number: int) -> str:
    return f"{INDEX_DIR}{generation:06d}/{number:05d}.json"


def is_part(key: str) -> bool:
    """Whether ``key`` (relative to the root) is one of a pack's parts."""
    return _PART.match(key) is not None


def shard_number(key: str) -> tuple[int, int] | None:
    """(generation, number) of a shard key, or None."""
    m = _SHARD.match(key)
    return (int(m[1]), int(m[2])) if m else None


def sidecar_number(key: str) -> tuple[int, int] | None:
    m = _SIDECAR.match(key)
    return (int(m[1]), int(m[2])) if m else None


# -- the pointer ---------------------------------------------------------------------------------------------

def encode_pointer(index: Index) -> bytes:
    return json.dumps({"format": FORMAT, "generation": index.generation, "index": index_key(index.generation),
                       "created": index.created, "source": index.source, "files": len(index.members),
                       "shards": len(index.shards), "bytes": index.total_bytes}, indent=1).encode() + b"\n"


def decode_pointer(raw: bytes) -> tuple[int, str]:
    """(generation, index key) of a pointer."""
    if len(raw) > MAX_POINTER_BYTES:
        raise PackInvalid(f"the pointer is {len(raw)} bytes (at most {MAX_POINTER_BYTES})")
    doc = _json(raw, "the pointer")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PackInvalid(f"the pointer is not an epochfs pack pointer of format {FORMAT}")
    generation = doc.get("generation")
    if not _int(generation, 1, MAX_GENERATION) or doc.get("index") != index_key(generation):
        raise PackInvalid("the pointer names no valid generation and index")
    return generation, doc["index"]


# -- the index -----------------------------------------------------------------------------------------------

def encode_index(index: Index) -> bytes:
    shards = [[key, s.size, s.etag] for key, s in sorted(index.shards.items())]
    members = [m.row() for m in sorted(index.members.values(), key=lambda m: (m.shard, m.offset))]
    dirs = [[d.key, d.mtime_ns, d.mode, d.uid, d.gid] for d in sorted(index.dirs.values())]
    doc = {"format": FORMAT, "generation": index.generation, "source": index.source, "created": index.created,
           "shards": shards, "members": members, "dirs": dirs}
    return gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=6, mtime=0)


def decode_index(raw: bytes, generation: int) -> Index:
    """An index object, every field checked (:class:`PackInvalid` for the first bad one)."""
    if len(raw) > MAX_INDEX_BYTES:
        raise PackInvalid(f"the index is {len(raw)} bytes (at most {MAX_INDEX_BYTES})")
    try:
        text = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise PackInvalid(f"the index does not decompress: {exc}") from None
    doc = _json(text, "the index")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("generation") != generation:
        raise PackInvalid(f"the index is not generation {generation} of format {FORMAT}")
    source, created = doc.get("source"), doc.get("created")
    if not isinstance(source, str) or not isinstance(created, (int, float)) or isinstance(created, bool):
        raise PackInvalid("the index names no source or time")
    shards = decode_shards(doc.get("shards"), generation)
    members = doc.get("members")
    if not isinstance(members, list):
        raise PackInvalid("the index lists no members")
    out: dict[str, Member] = {}
    for i, row in enumerate(members):
        member = decode_member(row, shards)
        if member is None:
            raise PackInvalid(f"member {i} is malformed: {str(row)[:200]}")
        if member.path in out:
            raise PackInvalid(f"member {i}: {member.path!r} is listed twice")
        out[member.path] = member
    return Index(generation, source, float(created), shards, out, decode_dirs(doc.get("dirs", [])))


def decode_dirs(rows: Any) -> dict[str, ObjectInfo]:
    if not isinstance(rows, list):
        raise PackInvalid("the index's directories are not a list")
    dirs: dict[str, ObjectInfo] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)
                and (row[0] == "" or row[0].endswith("/")) and row[0] not in dirs):
            raise PackInvalid(f"a directory is malformed: {str(row)[:200]}")
        d = ObjectInfo(row[0], 0, row[1], "", row[2], row[3], row[4])
        problem = record_problem(d)
        if problem is not None:
            raise PackInvalid(f"directory {row[0][:200]!r}: {problem}")
        dirs[d.key] = d
    return dirs


def decode_shards(rows: Any, generation: int) -> dict[str, ObjectInfo]:
    if not isinstance(rows, list) or len(rows) > MAX_SHARDS * (generation + 1):
        raise PackInvalid("the index lists no shards")
    shards: dict[str, ObjectInfo] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and _int(row[1], 0, MAX_OBJECT_SIZE)
                and text_problem(row[2], "ETag", 1024) is None):
            raise PackInvalid(f"a shard is malformed: {str(row)[:200]}")
        number = shard_number(row[0])
        if number is None or number[0] > generation or row[0] in shards:
            raise PackInvalid(f"{row[0][:200]!r} is no shard of generation {generation} or earlier (or twice)")
        shards[row[0]] = ObjectInfo(row[0], row[1], 0, row[2])
    return shards


def decode_member(row: Any, shards: dict[str, ObjectInfo]) -> Member | None:
    """One member row, or None if it is malformed (a path that is no text, a shard the index does not
    list, bytes outside the shard, a checksum that is not 16 hex digits)."""
    if not isinstance(row, list) or len(row) != 10:
        return None
    path, shard, offset, size, mtime, digest, etag, mode, uid, gid = row
    if (not _owner(mode, uid, gid) or text_problem(path, "path", 4096) is not None or path.endswith("/")
            or not isinstance(shard, str)
            or shard not in shards or not _int(size, 0, MAX_OBJECT_SIZE) or not _int(offset, 0, MAX_OBJECT_SIZE)
            or offset + size > shards[shard].size or not _int(mtime, MIN_MTIME_NS, MAX_MTIME_NS)
            or not (isinstance(digest, str) and len(digest) == 16 and _HEX.match(digest))
            or text_problem(etag, "ETag", 1024) is not None):
        return None
    return Member(path, shard, offset, size, mtime, digest, etag, mode, uid, gid)


def _owner(mode: Any, uid: Any, gid: Any) -> bool:
    return ((mode is None or _int(mode, 0, 0o7777)) and (uid is None or _int(uid, 0, (1 << 32) - 1))
            and (gid is None or _int(gid, 0, (1 << 32) - 1)))


_HEX = re.compile(r"^[0-9a-f]{16}$")


# -- a shard's own list (resuming) -----------------------------------------------------------------------------

def encode_sidecar(shard: ObjectInfo, members: list[Member]) -> bytes:
    return json.dumps({"format": FORMAT, "shard": [shard.key, shard.size, shard.etag],
                       "members": [[m.path, *m.row()[2:]] for m in members]}, separators=(",", ":")).encode()


def decode_sidecar(raw: bytes, key: str) -> tuple[ObjectInfo, list[Member]]:
    doc = _json(raw, key)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("members"), list):
        raise PackInvalid(f"{key} is not a shard's member list")
    generation = (sidecar_number(key) or (0, 0))[0]
    shards = decode_shards([doc.get("shard")], generation)
    (shard,) = shards.values()
    if sidecar_number(key) != shard_number(shard.key):
        raise PackInvalid(f"{key} lists another shard ({shard.key[:200]!r})")
    members = []
    for row in doc["members"]:
        member = decode_member([row[0], shard.key, *row[1:]] if isinstance(row, list) and row else row, shards)
        if member is None:
            raise PackInvalid(f"{key}: a member is malformed: {str(row)[:200]}")
        members.append(member)
    return shard, members


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise PackInvalid(f"{what} is not JSON: {str(exc)[:200]}") from None


def _int(value: Any, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi
