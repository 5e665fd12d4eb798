"""Records that cross component boundaries, and the limits every boundary checks them against.

A :class:`Source` is where a dataset lives (what the backends read, what the config names). An
:class:`ObjectInfo` is one object of the dataset as listed: the backends produce it, the metadata
stores keep it, the namespace, the cache and the prefetcher read it. It lives here, not in any of those
packages, so none of them imports another for it.

:func:`record_problem` is the one definition of a record every boundary can hold (a listing, a stored
snapshot, the write-back journal, a peer's request); each boundary keeps its own policy for a record
that fails it: a listing skips the object, a store refuses the snapshot, the journal drops the record,
a peer's request is answered 400.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlparse

from epochfs.core.errors import ConfigError

#: Largest object accepted from a listing or a stored snapshot (64 TiB, above any object store's limit).
#: Anything larger is malformed input: block arithmetic over it would not finish.
MAX_OBJECT_SIZE = 1 << 46
#: Longest key and ETag (UTF-8 bytes) any boundary accepts: listings, stored snapshots, the
#: write-back journal, peers' requests.
MAX_KEY_BYTES = 4096
MAX_ETAG_BYTES = 1024
#: What the stores keep of an mtime: 64 bits of nanoseconds.
MIN_MTIME_NS, MAX_MTIME_NS = -(1 << 63), (1 << 63) - 1
_ID_LIMIT = 1 << 32  # uid and gid: 32 bits


class ObjectInfo(NamedTuple):
    """One object of the dataset: key relative to the source root, size, mtime and version tag.

    ``mode``, ``uid`` and ``gid`` are the source's permission bits (``0o7777`` at most) and owner, where
    the source has them (a ``file://`` directory); None where it has not (S3), and the mount then
    presents its uniform defaults. Immutable; a tuple, because a snapshot holds millions of them and a
    tuple is built in a fraction of a frozen dataclass's time.
    """

    key: str
    size: int
    mtime_ns: int
    etag: str
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None


def text_problem(value: object, what: str, max_bytes: int, *, empty: bool = False,
                 size: int | None = None) -> str | None:
    """Why ``value`` is not a key or ETag of at most ``max_bytes`` UTF-8 bytes (None if it is).
    ``size``: its length in UTF-8 bytes where the caller decoded it from them (then it is UTF-8)."""
    if type(value) is not str:
        return f"{what} is not text"
    if size is None:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            return f"{what} is not valid UTF-8"
    if size > max_bytes:
        return f"{what} longer than {max_bytes} bytes"
    if not size and not empty:
        return f"{what} is empty"
    if "\x00" in value:
        return f"{what} contains NUL"
    return None


def record_problem(obj: ObjectInfo, utf8_sizes: tuple[int, int] | None = None) -> str | None:
    """Why ``obj`` cannot be kept and served (None if it can): its size, mtime, key, ETag (required for a
    file; a directory marker, a key ending in ``/``, may have none), mode and owner within the bounds
    every store and reader relies on. ``utf8_sizes``: the key's and ETag's lengths in UTF-8 bytes, where
    the caller decoded them from those bytes."""
    ksize, esize = utf8_sizes if utf8_sizes is not None else (None, None)
    if type(obj.size) is not int or not 0 <= obj.size <= MAX_OBJECT_SIZE:  # (type: a bool is no size)
        return f"size {obj.size!r} is outside 0..{MAX_OBJECT_SIZE}"
    if type(obj.mtime_ns) is not int or not MIN_MTIME_NS <= obj.mtime_ns <= MAX_MTIME_NS:
        return f"mtime {obj.mtime_ns!r} is outside what 64 bits of nanoseconds hold"
    problem = text_problem(obj.key, "key", MAX_KEY_BYTES, empty=True, size=ksize)
    if problem:
        return problem
    marker = not obj.key or obj.key.endswith("/")
    problem = text_problem(obj.etag, "ETag", MAX_ETAG_BYTES, empty=marker, size=esize)
    if problem is None and obj.etag == '""' and not marker:  # (a quoted nothing: SeaweedFS's remote storage
        problem = "ETag is empty"  # lists its origin's objects so until it has read them)
    if problem:
        return "no ETag (its version could not be pinned)" if problem == "ETag is empty" else problem
    if obj.etag.startswith(MEMBER_TAG):
        problem = _location_problem(obj)
        if problem:
            return f"packed member location: {problem}"
    if obj.mode is not None and (type(obj.mode) is not int or not 0 <= obj.mode <= 0o7777):
        return f"mode {obj.mode!r} is not a permission mode"
    for name, value in (("uid", obj.uid), ("gid", obj.gid)):
        if value is not None and (type(value) is not int or not 0 <= value < _ID_LIMIT):
            return f"{name} {value!r} is outside 32 bits"
    return None


#: The ETag of a file of a packed dataset starts with this: its bytes are a range of a shard object, and
#: the rest says which (:func:`member_etag`). It names the member's version exactly: the shard's key and
#: ETag, the offset in it and the checksum of the member's own bytes, so a repacked or changed file gets
#: another, and a reader can check that the range holds the file's bytes (:func:`member_location`).
MEMBER_TAG = "tar:"
_XXH64_HEX = frozenset("0123456789abcdef")


def member_etag(shard: ObjectInfo, offset: int, xxh64: str) -> str:
    """The ETag of the member whose bytes start at ``offset`` of ``shard`` and whose xxh64 (16 hex digits)
    is ``xxh64``: ``tar:OFFSET:SHARD_SIZE:XXH64:LEN(SHARD_ETAG):SHARD_ETAG SHARD_KEY`` (the last two back
    to back)."""
    return f"{MEMBER_TAG}{offset}:{shard.size}:{xxh64}:{len(shard.etag)}:{shard.etag}{shard.key}"


def _parse_location(etag: str) -> tuple[ObjectInfo, int, int] | None:
    parts = etag[len(MEMBER_TAG):].split(":", 4)
    if (len(parts) != 5 or not all(p.isascii() and p.isdigit() and len(p) <= 20 for p in (parts[0], parts[1], parts[3]))
            or len(parts[2]) != 16 or not _XXH64_HEX.issuperset(parts[2])):
        return None
    offset, size, elen = int(parts[0]), int(parts[1]), int(parts[3])
    rest = parts[4]
    if not 0 < elen < len(rest):
        return None
    return ObjectInfo(rest[elen:], size, 0, rest[:elen]), offset, int(parts[2], 16)


def _location_problem(obj: ObjectInfo) -> str | None:
    parsed = _parse_location(obj.etag)
    if parsed is None:
        return "not OFFSET:SIZE:XXH64:LENGTH:ETAG KEY (a pack listed or imported by an earlier epochfs: list it again)"
    shard, offset, _ = parsed
    if not 0 <= offset <= shard.size <= MAX_OBJECT_SIZE or offset + obj.size > shard.size:
        return f"bytes [{offset}, {offset + obj.size}) outside a shard of {shard.size}"
    if shard.key.endswith("/") or shard.key.startswith(MEMBER_TAG) or shard.etag.startswith(MEMBER_TAG):
        return "the shard is no object"
    return None


def member_location(obj: ObjectInfo) -> tuple[ObjectInfo, int, int] | None:
    """A packed member's shard, the offset of its bytes there and their xxh64 (seed 0), which every byte
    served for it is checked against first; None for a plain object (its blocks carry their own
    checksums). ``obj`` passed :func:`record_problem` (every boundary checks it)."""
    if not obj.etag.startswith(MEMBER_TAG):
        return None
    parsed = _parse_location(obj.etag)
    if parsed is None:
        raise ValueError(f"{obj.key}: malformed packed member location")
    return parsed


def stored_extent(obj: ObjectInfo) -> tuple[ObjectInfo, int]:
    """Where the bytes of ``obj`` are: the object that holds them and the offset there. A plain object
    holds its own at 0; a packed member's are a range of its shard (the shard's record has no mtime)."""
    location = member_location(obj)
    return (obj, 0) if location is None else (location[0], location[1])


@dataclass(frozen=True)
class Source:
    """Where the dataset lives: a URL of one of the registered forms (:func:`register_form`; the
    backends declare theirs, :mod:`epochfs.backend.kinds`): ``s3://bucket/prefix``, ``file:///path``..."""

    scheme: str  # the form's scheme ("s3", "file", ...)
    bucket: str  # the form's place (an S3 bucket); "" where it has none (a local directory)
    prefix: str  # within it: a key prefix ending in "/" or "" (S3), an absolute path (a directory)

    @classmethod
    def parse(cls, url: str) -> Source:
        form = _FORMS.get(urlparse(url).scheme)
        if form is None:
            shapes = " or ".join(f.shape for f in _FORMS.values()) or "a registered form"
            raise ConfigError(f"{url!r}: the source must be {shapes}" + "".join(f"; {p}" for p in FORM_PROBLEMS))
        return form.parse(url)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}{'' if self.prefix.startswith('/') else '/'}{self.prefix}"


@dataclass(frozen=True)
class SourceForm:
    """One form of source URL: its scheme, its shape as errors show it, and how a URL of it is read
    (checked: a :class:`ConfigError` that says what is wrong)."""

    scheme: str
    shape: str
    parse: Callable[[str], Source]


_FORMS: dict[str, SourceForm] = {}
#: Why forms that were asked for are missing (a backend module that could not be loaded), said when a
#: source is of no known form.
FORM_PROBLEMS: list[str] = []


def register_form(form: SourceForm) -> None:
    """Make ``form`` a source URL mounts and tools take (each backend kind registers its own)."""
    _FORMS[form.scheme] = form


#: The longest name and path a mount takes (bytes of UTF-8).
NAME_MAX = 255
PATH_MAX = 4000
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


#: A path component that is epochfs's own at any depth of any source (its records: ``.epochfs/attrs/``):
#: never a file of a mount, never a name a writer may make. A mount of a parent prefix would otherwise
#: see, and let its writers make, the records of every mount under it.
RESERVED_NAME = ".epochfs"


def reserved_key(key: str) -> bool:
    """Whether ``key`` has a component named :data:`RESERVED_NAME`, at any depth."""
    return RESERVED_NAME in key and RESERVED_NAME in key.split("/")


def unsafe_reason(key: str) -> str | None:
    """Why ``key`` cannot be a path of the mount, or None if it can."""
    if key.isascii() and key.isprintable() and len(key) <= NAME_MAX:  # the common case, checked at once
        inner = "/" + (key[:-1] if key.endswith("/") else key) + "/"
        if "//" not in inner and "/./" not in inner and "/../" not in inner:
            return None
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8"
    if len(raw) > PATH_MAX:
        return f"path longer than {PATH_MAX} bytes"
    if _CONTROL.search(key):
        return "contains a NUL or control character"
    parts = key[:-1].split("/") if key.endswith("/") else key.split("/")
    for part in parts:
        if part == "":
            return "empty path component (leading '/' or '//')"
        if part in (".", ".."):
            return f"'{part}' path component"
        if len(part.encode("utf-8")) > NAME_MAX:
            return f"component longer than {NAME_MAX} bytes"
    return None
