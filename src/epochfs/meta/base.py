"""The metadata store contract: namespace snapshots (and published manifests) of a dataset.

Two implementations, chosen by URL scheme (:func:`epochfs.meta.open_meta`): ``lmdb://PATH`` (embedded,
the default, in the cache directory) and ``redis://HOST:PORT/DB`` (shared by every node of a cluster).
Their keys and encodings are documented in ``docs/metadata-store.md``.

A snapshot is versioned and published atomically: a reader sees the previous version or the new one,
never a mix. Stores are blocking; the daemon calls them from worker threads.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from epochfs.backend.base import ObjectInfo

_RECORD = struct.Struct("<QqII")  # size, mtime_ns, len(key), len(etag)


@dataclass(frozen=True)
class Snapshot:
    source: str
    version: int
    created: float
    objects: list[ObjectInfo]


def encode_objects(objects: Iterable[ObjectInfo]) -> bytes:
    """Records ``struct("<QqII")(size, mtime_ns, len(key), len(etag)) + key + etag`` back to back."""
    out = bytearray()
    for o in objects:
        key, etag = o.key.encode("utf-8", "surrogateescape"), o.etag.encode("utf-8")
        out += _RECORD.pack(o.size, o.mtime_ns, len(key), len(etag))
        out += key
        out += etag
    return bytes(out)


def decode_objects(raw: bytes | memoryview) -> list[ObjectInfo]:
    view = memoryview(raw)
    objects, pos, size = [], 0, _RECORD.size
    while pos < len(view):
        nbytes, mtime_ns, klen, elen = _RECORD.unpack_from(view, pos)
        pos += size
        key = bytes(view[pos:pos + klen]).decode("utf-8", "surrogateescape")
        pos += klen
        objects.append(ObjectInfo(key, nbytes, mtime_ns, bytes(view[pos:pos + elen]).decode("utf-8")))
        pos += elen
    return objects


Progress = Callable[[int], None]  # called with the number of objects written so far


class MetaStore(Protocol):
    url: str

    def load(self, source: str) -> Snapshot | None:
        """The current snapshot of ``source``, or None if none was published."""

    def current_version(self, source: str) -> int | None:
        """The current version number, cheaply (for polling)."""

    def save(self, source: str, objects: Iterable[ObjectInfo], progress: Progress | None = None) -> Snapshot:
        """Publish a new version atomically and return it."""

    def put_manifest(self, source: str, name: str, text: str) -> None:
        """Publish a manifest under ``name`` for every node to fetch."""

    def get_manifest(self, source: str, name: str) -> str | None:
        """A published manifest, or None."""

    def close(self) -> None:
        """Release connections."""
