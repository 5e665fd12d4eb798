"""What a packed dataset is made of, where each part lives under its root, and the codecs of its index.
Pure: no I/O.

Under the root (``s3://b/packed/``)::

    epochfs-pack.json            the pointer: which index is current (written last: the flip)
    index/000003.jsonl.gz        generation 3's index: every shard, every member
    index/000003/00012.jsonl     a shard's own member list, written after the shard (resuming reads them)
    shards/000003-00012.tar      shard 12 of generation 3: a standard tar (PAX headers where names are long)

An index names shards of its own generation and of earlier ones (an incremental pack keeps the members
that did not change where they are). A member is ``[path, shard, offset, size, mtime_ns, xxh64, etag,
mode, uid, gid]``: ``offset`` is where its bytes start in the shard's tar, ``xxh64`` their checksum
(hex; every byte a mount serves for the member is checked against it first), ``etag`` the source
object's version it was packed from.

An index and a shard's list are JSON Lines (a header line with the counts, then one row a line), so
they are decoded a line at a time: what decoding costs is bounded by the rows it yields, never by what
a line could expand to (:func:`lines`: at most :data:`MAX_LINE` bytes a line, and a compressed index at
most :data:`MAX_EXPANSION` times its size once decompressed). An index or pointer read back is checked
whole (members inside their shards, none overlapping another); anything malformed is
:class:`PackInvalid` and nothing of it is used.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from epochfs.core.errors import EpochfsError
from epochfs.core.records import (
    MAX_MTIME_NS,
    MAX_OBJECT_SIZE,
    MIN_MTIME_NS,
    ObjectInfo,
    member_etag,
    record_problem,
    text_problem,
)

FORMAT = 2
POINTER = "epochfs-pack.json"
INDEX_DIR = "index/"
SHARD_DIR = "shards/"
#: What a packed root may hold besides the pack's own parts: nothing.
_PART = re.compile(r"^(epochfs-pack\.json|index/\d{6}\.jsonl?\.gz|index/\d{6}/\d{5}\.jsonl?|shards/\d{6}-\d{5}\.tar)$")
_SHARD = re.compile(r"^shards/(\d{6})-(\d{5})\.tar$")
_SIDECAR = re.compile(r"^index/(\d{6})/(\d{5})\.jsonl?$")
#: Largest index or shard list read back (compressed, for an index): a bigger one is malformed input.
MAX_INDEX_BYTES = 4 << 30
MAX_POINTER_BYTES = 64 << 10
#: Longest line of an index or shard list: a row whose path (4096 bytes) and ETags are escaped in full.
MAX_LINE = 64 << 10
#: A compressed index decompresses to at most this many times its size (an index of real paths,
#: checksums and ETags compresses 3-10x; far more is a decompression bomb).
MAX_EXPANSION = 64
#: Most members one index may hold (about 400 bytes of the daemon's memory each while it is decoded).
MAX_MEMBERS = 50_000_000
MAX_GENERATION, MAX_SHARDS = 999_999, 99_999


class PackInvalid(EpochfsError):
    """A pointer, index or shard list that does not decode or breaks a limit: refused whole."""


@dataclass(frozen=True, slots=True)
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
        return [*self.dirs.values(),
                *(ObjectInfo(m.path, m.size, m.mtime_ns, member_etag(self.shards[m.shard], m.offset, m.xxh64),
                             m.mode, m.uid, m.gid) for m in self.members.values())]

    @property
    def total_bytes(self) -> int:
        return sum(m.size for m in self.members.values())


def index_key(generation: int) -> str:
    return f"{INDEX_DIR}{generation:06d}.jsonl.gz"


def shard_key(generation: int, number: int) -> str:
    return f"{SHARD_DIR}{generation:06d}-{number:05d}.tar"


def sidecar_key(generation: int, number: int) -> str:
    return f"{INDEX_DIR}{generation:06d}/{number:05d}.jsonl"


def is_part(key: str) -> bool:
    """Whether ``key`` (relative to the root) is one of a pack's parts (an earlier format's included)."""
    return _PART.match(key) is not None


def shard_number(key: str) -> tuple[int, int] | None:
    """(generation, number) of a shard key, or None."""
    m = _SHARD.match(key)
    return (int(m[1]), int(m[2])) if m else None


def sidecar_number(key: str) -> tuple[int, int] | None:
    m = _SIDECAR.match(key)
    return (int(m[1]), int(m[2])) if m else None


def lines(raw: bytes, *, compressed: bool, what: str) -> Iterator[bytes]:
    """The lines of an index (gzip) or a shard's list, each at most :data:`MAX_LINE` bytes, decompressed
    a piece at a time and never past :data:`MAX_EXPANSION` times ``raw``'s size: :class:`PackInvalid`
    as soon as one is longer or the text grows past that."""
    if len(raw) > MAX_INDEX_BYTES:
        raise PackInvalid(f"{what} is {len(raw)} bytes (at most {MAX_INDEX_BYTES})")
    budget = MAX_EXPANSION * len(raw) + MAX_LINE if compressed else len(raw)
    pending = b""
    for piece in _pieces(raw, compressed, budget, what):
        pending += piece
        *whole, pending = pending.split(b"\n")
        for line in whole:
            if len(line) > MAX_LINE:
                raise PackInvalid(f"{what} has a line longer than {MAX_LINE} bytes")
            yield line
        if len(pending) > MAX_LINE:
            raise PackInvalid(f"{what} has a line longer than {MAX_LINE} bytes")
    if pending:
        yield pending


def _pieces(raw: bytes, compressed: bool, budget: int, what: str) -> Iterator[bytes]:
    if not compressed:
        for start in range(0, len(raw), 1 << 20):
            yield raw[start:start + (1 << 20)]
        return
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip
    data, made, step = raw, 0, 1 << 18
    try:
        while True:
            piece = inflate.decompress(data, step)
            made += len(piece)
            if made > budget:
                raise PackInvalid(f"{what} decompresses to more than {MAX_EXPANSION} times its size (a decompression "
                                  "bomb, not an index)")
            if piece:
                yield piece
            data = inflate.unconsumed_tail
            if inflate.eof:
                break
            if not data and not piece:
                raise PackInvalid(f"{what} is cut short (its gzip stream does not end)")
        if inflate.unused_data.strip(b"\0"):
            raise PackInvalid(f"bytes follow the end of {what}'s gzip stream")
    except zlib.error as exc:
        raise PackInvalid(f"{what} does not decompress: {exc}") from None


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
        hint = (" (an earlier epochfs wrote it: pack again with --full)"
                if isinstance(doc, dict) and doc.get("format") == 1 else "")
        raise PackInvalid(f"the pointer is not an epochfs pack pointer of format {FORMAT}{hint}")
    generation = doc.get("generation")
    if not _int(generation, 1, MAX_GENERATION) or doc.get("index") != index_key(generation):
        raise PackInvalid("the pointer names no valid generation and index")
    return generation, doc["index"]


# -- the index -----------------------------------------------------------------------------------------------

def encode_index(index: Index) -> bytes:
    shards = [[key, s.size, s.etag] for key, s in sorted(index.shards.items())]
    members = [m.row() for m in sorted(index.members.values(), key=lambda m: (m.shard, m.offset))]
    dirs = [[d.key, d.mtime_ns, d.mode, d.uid, d.gid] for d in sorted(index.dirs.values())]
    head = {"format": FORMAT, "generation": index.generation, "source": index.source, "created": index.created,
            "shards": len(shards), "dirs": len(dirs), "members": len(members)}
    text = "\n".join(json.dumps(row, separators=(",", ":")) for row in (head, *shards, *dirs, *members))
    return gzip.compress(text.encode() + b"\n", compresslevel=6, mtime=0)


def decode_index(raw: bytes, generation: int) -> Index:
    """An index object, every field checked (:class:`PackInvalid` for the first bad one), decoded a line
    at a time (:func:`lines`)."""
    it = lines(raw, compressed=True, what="the index")
    head = _json(next(it, b""), "the index's header")
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("generation") != generation:
        found = head.get("format") if isinstance(head, dict) else None
        hint = " (an earlier epochfs wrote it: pack again with --full)" if found == 1 else ""
        raise PackInvalid(f"the index is not generation {generation} of format {FORMAT}{hint}")
    source, created = head.get("source"), head.get("created")
    if not isinstance(source, str) or len(source) > 8192 or not isinstance(created, (int, float)) or isinstance(created, bool):
        raise PackInvalid("the index names no source or time")
    nshards, ndirs, nmembers = head.get("shards"), head.get("dirs"), head.get("members")
    if (not _int(nshards, 0, MAX_SHARDS * (generation + 1)) or not _int(ndirs, 0, MAX_MEMBERS)
            or not _int(nmembers, 0, MAX_MEMBERS)):
        raise PackInvalid("the index's counts are missing or out of range")
    shards = decode_shards((_json(_next(it), "a shard") for _ in range(nshards)), generation)
    dirs = decode_dirs(_json(_next(it), "a directory") for _ in range(ndirs))
    out: dict[str, Member] = {}
    for i in range(nmembers):
        row = _json(_next(it), "a member")
        member = decode_member(row, shards)
        if member is None:
            raise PackInvalid(f"member {i} is malformed: {str(row)[:200]}")
        if member.path in out:
            raise PackInvalid(f"member {i}: {member.path!r} is listed twice")
        out[member.path] = member
    if next(it, None) is not None:
        raise PackInvalid("the index holds more rows than its header says")
    check_extents(out.values())
    return Index(generation, source, float(created), shards, out, dirs)


def _next(it: Iterator[bytes]) -> bytes:
    line = next(it, None)
    if line is None:
        raise PackInvalid("the index holds fewer rows than its header says")
    return line


def check_extents(members: Iterable[Member]) -> None:
    """:class:`PackInvalid` unless every member's bytes lie after a tar header (512 bytes) and no two
    members' bytes overlap: each file's range is its own."""
    by_shard = sorted((m.shard, m.offset, m.size, m.path) for m in members)
    previous: tuple[str, int, str] | None = None  # shard, end, path
    for shard, offset, size, path in by_shard:
        if offset < 512:
            raise PackInvalid(f"member {path[:200]!r} starts at byte {offset} of its shard, inside the first header")
        if previous is not None and previous[0] == shard and offset < previous[1]:
            raise PackInvalid(f"members {previous[2][:200]!r} and {path[:200]!r} overlap in {shard}")
        if previous is None or previous[0] != shard or offset + size > previous[1]:
            previous = (shard, offset + size, path)


def decode_dirs(rows: Iterable[Any]) -> dict[str, ObjectInfo]:
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


def decode_shards(rows: Iterable[Any], generation: int) -> dict[str, ObjectInfo]:
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
    head = {"format": FORMAT, "shard": [shard.key, shard.size, shard.etag], "members": len(members)}
    rows = (head, *([m.path, *m.row()[2:]] for m in members))
    return "\n".join(json.dumps(r, separators=(",", ":")) for r in rows).encode() + b"\n"


def decode_sidecar(raw: bytes, key: str) -> tuple[ObjectInfo, list[Member]]:
    it = lines(raw, compressed=False, what=key)
    head = _json(next(it, b""), key)
    if (not isinstance(head, dict) or head.get("format") != FORMAT
            or not _int(head.get("members"), 0, MAX_MEMBERS)):
        raise PackInvalid(f"{key} is not a shard's member list of format {FORMAT}")
    generation = (sidecar_number(key) or (0, 0))[0]
    shards = decode_shards([head.get("shard")], generation)
    (shard,) = shards.values()
    if sidecar_number(key) != shard_number(shard.key):
        raise PackInvalid(f"{key} lists another shard ({shard.key[:200]!r})")
    members = []
    for _ in range(head["members"]):
        row = _json(_next(it), key)
        member = decode_member([row[0], shard.key, *row[1:]] if isinstance(row, list) and row else row, shards)
        if member is None:
            raise PackInvalid(f"{key}: a member is malformed: {str(row)[:200]}")
        members.append(member)
    if next(it, None) is not None:
        raise PackInvalid(f"{key} holds more rows than its header says")
    check_extents(members)
    return shard, members


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise PackInvalid(f"{what} is not JSON: {str(exc)[:200]}") from None


def _int(value: Any, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi
