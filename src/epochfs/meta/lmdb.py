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
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb as _lmdb
import xxhash

from epochfs.core.errors import EpochfsError
from epochfs.core.private import private_dir
from epochfs.core.records import ObjectInfo
from epochfs.meta.base import (
    MAX_OBJECTS,
    Head,
    Progress,
    Snapshot,
    SnapshotInvalid,
    decode_objects,
    encode_objects,
)

log = logging.getLogger(__name__)

_FORMAT = 4
_CHUNK = 10_000  # records decoded at a time
_PREFIX = b"o/"


def _object_key(key: str) -> bytes:
    return _PREFIX + xxhash.xxh3_128_digest(key.encode("utf-8"))

_ENVIRONMENTS: dict[str, tuple[_lmdb.Environment, int]] = {}  # real path -> (environment, users)
_ENVIRONMENTS_LOCK = threading.Lock()


class _Stored:
    """A stored version's objects, read from the store when iterated (each time)."""

    def __init__(self, store: LmdbMetaStore, head: Head) -> None:
        self._store, self._head = store, head

    def __len__(self) -> int:
        return self._head.objects

    def __iter__(self) -> Iterator[ObjectInfo]:
        return self._store._records(self._head)


class LmdbMetaStore:
    shared = False
    trusted = True  # in the private cache directory (or a path root chose)

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
        """The stored snapshot, its objects read as they are iterated (in chunks, each checked:
        :class:`SnapshotInvalid` from the iteration if the store is damaged). None if there is none or it
        is unreadable (then the source is listed again)."""
        head = self.head(source)
        if head is None:
            return None
        if not 0 <= head.objects <= MAX_OBJECTS:
            log.warning("metadata store %s is damaged (it says %d objects); the source will be listed again",
                        self.path, head.objects)
            return None
        return Snapshot(source, head.version, head.created, _Stored(self, head))

    def _records(self, head: Head) -> Iterator[ObjectInfo]:
        """The objects of version ``head``, in chunks read in one transaction at a time, resuming after the
        last key read; :class:`SnapshotInvalid` if the store changed or is damaged meanwhile."""
        env, after, count = self._env(), _PREFIX, 0
        while True:
            records: list[bytes] = []
            try:
                with env.begin() as txn:
                    info = self._info(txn, head.source)
                    if info is None or info.get("version") != head.version:
                        raise SnapshotInvalid(f"{self.path}: version {head.version} was replaced while read")
                    cursor = txn.cursor()
                    at = cursor.set_range(after)
                    if at and cursor.key() == after and after != _PREFIX:
                        at = cursor.next()
                    while at and cursor.key()[:2] == _PREFIX and len(records) < _CHUNK:
                        records.append(cursor.value())
                        after = cursor.key()
                        at = cursor.next()
            except _lmdb.Error as exc:
                raise SnapshotInvalid(f"{self.path} is damaged: {exc}") from None
            objects = decode_objects(b"".join(records))
            count += len(objects)
            if count > head.objects:
                raise SnapshotInvalid(f"{self.path} holds more objects than its info says ({head.objects})")
            yield from objects
            if len(records) < _CHUNK:
                break
        if count != head.objects:
            raise SnapshotInvalid(f"{self.path} holds {count} objects, its info says {head.objects}")

    @staticmethod
    def _next_version(txn: _lmdb.Transaction) -> int:
        raw = txn.get(b"info")
        try:
            return int(json.loads(raw).get("version", 0)) + 1 if raw is not None else 1
        except (ValueError, AttributeError, TypeError):
            return 1

    def save(self, source: str, objects: Iterable[ObjectInfo], progress: Progress | None = None) -> Snapshot:
        """Publish a new version: every object under its key's hash (a key may be longer than an LMDB key)."""
        listed = list(objects)
        env = self._env()
        with env.begin(write=True) as txn:
            version = self._next_version(txn)
            manifests = {bytes(k): bytes(v) for k, v in txn.cursor() if bytes(k).startswith(b"m/")}
            txn.drop(env.open_db(), delete=False)
            for n, obj in enumerate(listed, 1):
                txn.put(_object_key(obj.key), encode_objects((obj,)))
                if progress and n % _CHUNK == 0:
                    progress(n)
            count = len({obj.key for obj in listed})  # (a key listed twice is one object)
            for k, v in manifests.items():
                txn.put(k, v)
            created = time.time()
            self._put_info(txn, source, version, created, count)
        if progress:
            progress(len(listed))
        return Snapshot(source, version, created, listed)

    @staticmethod
    def _put_info(txn: _lmdb.Transaction, source: str, version: int, created: float, count: int) -> None:
        txn.put(b"info", json.dumps({"format": _FORMAT, "source": source, "version": version, "created": created,
                                     "objects": count}).encode())

    def update(self, source: str, added: dict[str, ObjectInfo], removed: set[str], *,
               publication: str | None = None) -> Head:
        """The stored version with ``added`` and ``removed`` applied, in one transaction and in time
        proportional to the change (one daemon owns this store: its cache directory is locked)."""
        with self._env().begin(write=True) as txn:
            info = self._info(txn, source)
            count = info.get("objects") if info else 0
            if not isinstance(count, int):
                count = 0
            version = self._next_version(txn) if info else 1
            for key in removed - added.keys():
                count -= bool(txn.delete(_object_key(key)))
            for key, obj in added.items():
                k = _object_key(key)
                count += txn.get(k) is None
                txn.put(k, encode_objects((obj,)))
            created = time.time()
            self._put_info(txn, source, version, created, count)
        return Head(source, version, created, count, base=version - 1 if info else None)

    def put_manifest(self, source: str, name: str, text: str) -> None:
        with self._env().begin(write=True) as txn:
            txn.put(b"m/" + name.encode(), text.encode())

    def get_manifest(self, source: str, name: str) -> str | None:
        with self._env().begin() as txn:
            raw = txn.get(b"m/" + name.encode())
            return raw.decode() if raw is not None else None
