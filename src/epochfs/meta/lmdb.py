"""The embedded metadata store: namespace snapshots in an LMDB environment in the cache directory.

Schema (one environment, ``<cache-dir>/meta``):

- key ``b"info"`` -> JSON ``{"format": 1, "source": URL, "version": N, "created": UNIX_SECONDS,
  "objects": COUNT}``;
- keys ``b"o/" + uint64_be(n)`` -> ``struct("<QqI")(size, mtime_ns, len(key)) + key + utf8(etag)``,
  one per listed object, keys relative to the source root and kept as listed (unsafe names are
  filtered when the tree is built, so a fix to the filter applies without listing again).

A snapshot is written in a single write transaction, so a reader sees the old or the new one, never half.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import lmdb as _lmdb

from epochfs.backend.base import ObjectInfo

log = logging.getLogger(__name__)

_FORMAT = 1
_VALUE = struct.Struct("<QqI")
_PREFIX = b"o/"


@dataclass(frozen=True)
class Snapshot:
    source: str
    version: int
    created: float
    objects: list[ObjectInfo]


class LmdbMetaStore:
    def __init__(self, path: Path):
        self.path = Path(path)

    def _open(self) -> _lmdb.Environment:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return _lmdb.open(str(self.path), map_size=1 << 38, subdir=True, max_dbs=0, lock=True)

    def load(self, source: str) -> Snapshot | None:
        """The stored snapshot of ``source``, or None if there is none (or it is of another source)."""
        try:
            env = self._open()
        except _lmdb.Error as exc:
            log.warning("metadata store %s is unreadable (%s); the source will be listed again", self.path, exc)
            return None
        try:
            with env.begin(buffers=True) as txn:
                raw = txn.get(b"info")
                if raw is None:
                    return None
                info = json.loads(bytes(raw))
                if info.get("format") != _FORMAT or info.get("source") != source:
                    return None
                objects = []
                cursor = txn.cursor()
                if cursor.set_range(_PREFIX):
                    for key, value in cursor:
                        if not bytes(key).startswith(_PREFIX):
                            break
                        objects.append(_decode(bytes(value)))
            if len(objects) != info.get("objects"):
                log.warning("metadata store %s is incomplete; the source will be listed again", self.path)
                return None
            return Snapshot(source, int(info["version"]), float(info["created"]), objects)
        except (_lmdb.Error, ValueError, KeyError, struct.error) as exc:
            log.warning("metadata store %s is damaged (%s); the source will be listed again", self.path, exc)
            return None
        finally:
            env.close()

    def save(self, source: str, objects: Iterable[ObjectInfo]) -> Snapshot:
        """Replace the stored snapshot with a new version, atomically."""
        listed = list(objects)
        env = self._open()
        try:
            with env.begin(write=True) as txn:
                version = 1
                raw = txn.get(b"info")
                if raw is not None:
                    try:
                        version = int(json.loads(raw).get("version", 0)) + 1
                    except (ValueError, AttributeError):
                        pass
                txn.drop(env.open_db(), delete=False)
                for n, obj in enumerate(listed):
                    txn.put(_PREFIX + n.to_bytes(8, "big"), _encode(obj), append=True)
                created = time.time()
                txn.put(b"info", json.dumps({
                    "format": _FORMAT, "source": source, "version": version,
                    "created": created, "objects": len(listed),
                }).encode())
        finally:
            env.close()
        return Snapshot(source, version, created, listed)


def _encode(obj: ObjectInfo) -> bytes:
    key = obj.key.encode("utf-8", "surrogateescape")
    return _VALUE.pack(obj.size, obj.mtime_ns, len(key)) + key + obj.etag.encode("utf-8")


def _decode(raw: bytes) -> ObjectInfo:
    size, mtime_ns, keylen = _VALUE.unpack_from(raw)
    key = raw[_VALUE.size:_VALUE.size + keylen].decode("utf-8", "surrogateescape")
    return ObjectInfo(key, size, mtime_ns, raw[_VALUE.size + keylen:].decode("utf-8"))
