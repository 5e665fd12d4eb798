"""The embedded metadata store: namespace snapshots in an LMDB environment in the cache directory.

Schema: see ``docs/metadata-store.md``. A snapshot is written in a single write transaction, so a
reader sees the old or the new one, never half.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import lmdb as _lmdb

from epochfs.meta.base import MAX_OBJECTS, Progress, Snapshot, SnapshotInvalid, decode_objects, encode_objects
from epochfs.private import private_dir
from epochfs.records import ObjectInfo

log = logging.getLogger(__name__)

_FORMAT = 3
_CHUNK = 10_000  # objects per record chunk
_PREFIX = b"o/"


class LmdbMetaStore:
    shared = False
    keeps_local_copy = False

    def __init__(self, path: Path):
        self.path = Path(path)
        self.url = f"lmdb://{self.path}"

    def _open(self) -> _lmdb.Environment:
        private_dir(self.path)
        return _lmdb.open(str(self.path), map_size=1 << 38, subdir=True, max_dbs=0, lock=True, mode=0o600)

    def _info(self, txn: _lmdb.Transaction, source: str) -> dict | None:
        raw = txn.get(b"info")
        if raw is None:
            return None
        try:
            info = json.loads(bytes(raw))
        except ValueError:
            return None  # damaged: treated as no snapshot (the source is listed again)
        if not isinstance(info, dict) or info.get("format") != _FORMAT or info.get("source") != source:
            return None
        return info

    def current_version(self, source: str) -> int | None:
        env = self._open()
        try:
            with env.begin(buffers=True) as txn:
                info = self._info(txn, source)
                return int(info["version"]) if info else None
        finally:
            env.close()

    def load(self, source: str) -> Snapshot | None:
        try:
            env = self._open()
        except _lmdb.Error as exc:
            log.warning("metadata store %s is unreadable (%s); the source will be listed again", self.path, exc)
            return None
        try:
            with env.begin(buffers=True) as txn:
                info = self._info(txn, source)
                if info is None:
                    return None
                chunks, count = info.get("chunks"), info.get("objects")
                if not (isinstance(chunks, int) and isinstance(count, int) and 0 <= count <= MAX_OBJECTS
                        and 0 <= chunks <= count):
                    raise SnapshotInvalid(f"info says {count!r} objects in {chunks!r} chunks")
                objects: list[ObjectInfo] = []
                for n in range(chunks):
                    raw = txn.get(_PREFIX + n.to_bytes(8, "big"))
                    if raw is None:
                        raise KeyError(f"chunk {n}")
                    objects += decode_objects(raw)
            if len(objects) != info.get("objects"):
                log.warning("metadata store %s is incomplete; the source will be listed again", self.path)
                return None
            return Snapshot(source, int(info["version"]), float(info["created"]), objects)
        except (_lmdb.Error, ValueError, KeyError, TypeError, SnapshotInvalid) as exc:
            log.warning("metadata store %s is damaged (%s); the source will be listed again", self.path, exc)
            return None
        finally:
            env.close()

    def save(self, source: str, objects: Iterable[ObjectInfo], progress: Progress | None = None, *,
             version: int | None = None, created: float | None = None) -> Snapshot:
        """Publish a new version (the next number, or ``version``/``created`` as given: a local copy of a
        snapshot loaded from a shared store keeps its number)."""
        listed = list(objects)
        env = self._open()
        try:
            with env.begin(write=True) as txn:
                if version is None:
                    version = 1
                    raw = txn.get(b"info")
                    if raw is not None:
                        try:
                            version = int(json.loads(raw).get("version", 0)) + 1
                        except (ValueError, AttributeError):
                            pass
                manifests = {bytes(k): bytes(v) for k, v in txn.cursor() if bytes(k).startswith(b"m/")}
                txn.drop(env.open_db(), delete=False)
                chunks = 0
                for start in range(0, len(listed), _CHUNK):
                    txn.put(_PREFIX + chunks.to_bytes(8, "big"), encode_objects(listed[start:start + _CHUNK]))
                    chunks += 1
                    if progress:
                        progress(min(start + _CHUNK, len(listed)))
                for k, v in manifests.items():
                    txn.put(k, v)
                created = time.time() if created is None else created
                txn.put(b"info", json.dumps({
                    "format": _FORMAT, "source": source, "version": version, "created": created,
                    "objects": len(listed), "chunks": chunks,
                }).encode())
        finally:
            env.close()
        return Snapshot(source, version, created, listed)

    def keep(self, key: str, snapshot: Snapshot) -> None:
        """Keep a copy of a snapshot loaded from another (shared) store under ``key``, with its version
        number. Best effort: a failure is logged, the daemon goes on serving."""
        try:
            if self.current_version(key) != snapshot.version:
                self.save(key, snapshot.objects, version=snapshot.version, created=snapshot.created)
                log.info("kept a copy of snapshot version %d in %s", snapshot.version, self.path)
        except (OSError, _lmdb.Error) as exc:
            log.warning("could not keep a copy of snapshot version %d in %s: %s", snapshot.version, self.path, exc)

    def put_manifest(self, source: str, name: str, text: str) -> None:
        env = self._open()
        try:
            with env.begin(write=True) as txn:
                txn.put(b"m/" + name.encode(), text.encode())
        finally:
            env.close()

    def get_manifest(self, source: str, name: str) -> str | None:
        env = self._open()
        try:
            with env.begin() as txn:
                raw = txn.get(b"m/" + name.encode())
                return raw.decode() if raw is not None else None
        finally:
            env.close()

    def close(self) -> None:
        pass
