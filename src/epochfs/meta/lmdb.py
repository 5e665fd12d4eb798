"""The embedded metadata store: namespace snapshots in an LMDB environment in the cache directory.

Schema: see ``docs/metadata-store.md``. A snapshot is written in a single write transaction, so a
reader sees the old or the new one, never half.

LMDB forbids opening one environment twice in a process, so every store object on a path shares one
environment, opened on first use and closed when the last of them is closed; its transactions are
short and may run in any thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import lmdb as _lmdb

from epochfs.errors import EpochfsError
from epochfs.meta.base import (
    MAX_OBJECTS,
    Head,
    Progress,
    Snapshot,
    SnapshotInvalid,
    decode_objects,
    encode_objects,
    merged,
)
from epochfs.private import private_dir
from epochfs.records import ObjectInfo

log = logging.getLogger(__name__)

_FORMAT = 3
_CHUNK = 10_000  # objects per record chunk
_PREFIX = b"o/"

_ENVIRONMENTS: dict[str, tuple[_lmdb.Environment, int]] = {}  # real path -> (environment, users)
_ENVIRONMENTS_LOCK = threading.Lock()


class LmdbMetaStore:
    shared = False

    def __init__(self, path: Path):
        self.path = Path(path)
        self.url = f"lmdb://{self.path}"
        self._key: str | None = None

    def _env(self) -> _lmdb.Environment:
        with _ENVIRONMENTS_LOCK:
            if self._key is None:
                key = os.path.realpath(private_dir(self.path))
                env, users = _ENVIRONMENTS.get(key, (None, 0))
                if env is None:
                    env = _lmdb.open(key, map_size=1 << 38, subdir=True, max_dbs=0, lock=True, mode=0o600)
                _ENVIRONMENTS[key] = (env, users + 1)
                self._key = key
            return _ENVIRONMENTS[self._key][0]

    def close(self) -> None:
        with _ENVIRONMENTS_LOCK:
            if self._key is None:
                return
            env, users = _ENVIRONMENTS.pop(self._key)
            if users > 1:
                _ENVIRONMENTS[self._key] = (env, users - 1)
            else:
                env.close()
            self._key = None

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
        with self._env().begin(buffers=True) as txn:
            info = self._info(txn, source)
            version = info.get("version") if info else None
            return version if isinstance(version, int) else None

    def head(self, source: str) -> Head | None:
        """The stored version's identity (None when there is none, or it is unreadable: then the source is
        listed again)."""
        try:
            with self._env().begin(buffers=True) as txn:
                info = self._info(txn, source)
        except (_lmdb.Error, EpochfsError) as exc:
            log.warning("metadata store %s is unreadable (%s); the source will be listed again", self.path, exc)
            return None
        if info is None:
            return None
        version, created, count = info.get("version"), info.get("created"), info.get("objects")
        if not (isinstance(version, int) and isinstance(created, (int, float)) and isinstance(count, int)):
            return None
        return Head(source, version, float(created), count)

    def load(self, source: str) -> Snapshot | None:
        try:
            env = self._env()
        except (_lmdb.Error, EpochfsError) as exc:
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
                        raise SnapshotInvalid(f"chunk {n} is missing")
                    objects += decode_objects(raw)
            if len(objects) != count:
                log.warning("metadata store %s is incomplete; the source will be listed again", self.path)
                return None
            return Snapshot(source, int(info["version"]), float(info["created"]), objects)
        except (_lmdb.Error, ValueError, KeyError, TypeError, SnapshotInvalid) as exc:
            log.warning("metadata store %s is damaged (%s); the source will be listed again", self.path, exc)
            return None

    def save(self, source: str, objects: Iterable[ObjectInfo], progress: Progress | None = None, *,
             version: int | None = None, created: float | None = None) -> Snapshot:
        """Publish a new version (the next number, or ``version``/``created`` as given: a local copy of a
        snapshot loaded from a shared store keeps its number)."""
        listed = list(objects)
        env = self._env()
        with env.begin(write=True) as txn:
            if version is None:
                version = 1
                raw = txn.get(b"info")
                if raw is not None:
                    try:
                        version = int(json.loads(raw).get("version", 0)) + 1
                    except (ValueError, AttributeError, TypeError):
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
        return Snapshot(source, version, created, listed)

    def update(self, source: str, added: dict[str, ObjectInfo], removed: set[str]) -> Head:
        """The stored version with ``added`` and ``removed`` applied (one daemon owns this store: its
        cache directory is locked)."""
        current = self.load(source)
        return self.save(source, merged(current.objects if current else (), added, removed)).head

    def put_manifest(self, source: str, name: str, text: str) -> None:
        with self._env().begin(write=True) as txn:
            txn.put(b"m/" + name.encode(), text.encode())

    def get_manifest(self, source: str, name: str) -> str | None:
        with self._env().begin() as txn:
            raw = txn.get(b"m/" + name.encode())
            return raw.decode() if raw is not None else None
