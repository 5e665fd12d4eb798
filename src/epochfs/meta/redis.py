"""The shared metadata store: versioned namespace snapshots in Redis, so a thousand nodes load one
listing instead of each listing the bucket. Schema: ``docs/metadata-store.md``.

Publishing writes a new version's chunks and info first and then flips ``current`` with one SET, so a
reader sees the previous version or the new one. The version before the previous one is deleted after
the flip (a node that is loading it right then sees it vanish and retries with the current one).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from epochfs.errors import BackendUnavailable, ConfigError
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
from epochfs.records import ObjectInfo

log = logging.getLogger(__name__)

_FORMAT = 2
_CHUNK = 20_000  # objects per chunk value
_KEEP = 2  # versions kept: the current one and the one before


class MetaUnavailable(BackendUnavailable):
    """The shared metadata store cannot be reached."""


_BATCH = 64  # chunks fetched per round trip


def _plain(exc: Exception) -> str:
    """redis-py's message without its errno prefix ("Error 111 connecting to ...")."""
    text = str(exc).rstrip(".")
    m = re.match(r"Error \d+ connecting to \S+\.\s*(.*)", text)
    return m.group(1) if m and m.group(1) else re.sub(r"^Error \d+ ", "", text)


@dataclass(frozen=True)
class _Info:
    source: str
    created: float
    objects: int
    chunks: int


def _version(raw: bytes, where: str) -> int:
    if not raw.isdigit() or len(raw) > 18 or int(raw) < 1:
        raise SnapshotInvalid(f"{where} is {raw[:32]!r}, not a version number")
    return int(raw)


def _info(raw: bytes, version: int, url: str) -> _Info:
    """The info record of a version, checked: the right format and version, counts in range."""
    what = f"snapshot version {version} in {url}"
    try:
        info = json.loads(raw)
    except ValueError:
        raise SnapshotInvalid(f"{what}: its info is not JSON") from None
    if not isinstance(info, dict):
        raise SnapshotInvalid(f"{what}: its info is not a JSON object")
    if info.get("format") != _FORMAT:
        raise SnapshotInvalid(f"{what} has format {info.get('format')!r}; this daemon reads format {_FORMAT}: "
                              "publish it again with 'epochfs import'")
    source, created = info.get("source"), info.get("created")
    objects, chunks = info.get("objects"), info.get("chunks")
    if (not isinstance(source, str) or info.get("version") != version
            or not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created)
            or not isinstance(objects, int) or isinstance(objects, bool) or not 0 <= objects <= MAX_OBJECTS
            or not isinstance(chunks, int) or isinstance(chunks, bool) or not 0 <= chunks <= max(1, objects)):
        raise SnapshotInvalid(f"{what}: its info is malformed or out of range")
    return _Info(source, float(created), objects, chunks)


class RedisMetaStore:
    shared = True

    def __init__(self, url: str, name: str | None = None) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
            raise ConfigError(f"--meta {url!r}: expected redis://HOST[:PORT][/DB]")
        self.url = f"{parsed.scheme}://{parsed.hostname}:{parsed.port or 6379}{parsed.path or '/0'}"
        self.name = name
        self._redis = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5,
                                           health_check_interval=30)

    def _prefix(self, source: str) -> str:
        return f"epochfs:{self.name or source}:"

    def _call(self, fn, *args):  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except redis.exceptions.TimeoutError:
            raise MetaUnavailable(f"metadata store {self.url} did not answer in time") from None
        except redis.exceptions.ConnectionError as exc:
            raise MetaUnavailable(f"metadata store {self.url} is unreachable: {_plain(exc)}") from None
        except redis.exceptions.RedisError as exc:  # an error answer (WRONGTYPE, OOM, ...)
            raise MetaUnavailable(f"metadata store {self.url}: {_plain(exc)}") from None

    def current_version(self, source: str) -> int | None:
        raw = self._call(self._redis.get, self._prefix(source) + "current")
        return None if raw is None else _version(raw, f"{self._prefix(source)}current")

    def head(self, source: str) -> Head | None:
        for _ in range(3):  # the version may be replaced while we read it
            version = self.current_version(source)
            if version is None:
                return None
            raw = self._call(self._redis.get, f"{self._prefix(source)}v{version}:info")
            if raw is not None:
                info = _info(raw, version, self.url)
                return Head(info.source, version, info.created, info.objects)
        raise MetaUnavailable(f"snapshot of {source} in {self.url} kept changing while reading it")

    def load(self, source: str) -> Snapshot | None:
        """The current snapshot, every field checked (:class:`SnapshotInvalid` if one is wrong)."""
        for _ in range(3):  # the version may be replaced while we read it
            version = self.current_version(source)
            if version is None:
                return None
            vp = f"{self._prefix(source)}v{version}:"
            raw = self._call(self._redis.get, vp + "info")
            if raw is None:
                continue
            info = _info(raw, version, self.url)
            objects: list[ObjectInfo] = []
            complete = True
            for first in range(0, info.chunks, _BATCH):
                pipe = self._redis.pipeline(transaction=False)
                for n in range(first, min(first + _BATCH, info.chunks)):
                    pipe.get(f"{vp}chunk:{n}")
                chunks = self._call(pipe.execute)
                if any(c is None for c in chunks):
                    complete = False  # replaced while we read it
                    break
                for c in chunks:
                    objects += decode_objects(c)
                if len(objects) > info.objects:
                    raise SnapshotInvalid(f"snapshot version {version} in {self.url} holds more objects than "
                                          f"its info says ({info.objects})")
            if not complete:
                continue
            if len(objects) != info.objects:
                raise SnapshotInvalid(f"snapshot version {version} in {self.url} holds {len(objects)} objects, "
                                      f"its info says {info.objects}")
            return Snapshot(info.source, version, info.created, objects)
        raise MetaUnavailable(f"snapshot of {source} in {self.url} kept changing while loading it")

    def save(self, source: str, objects: Iterable[ObjectInfo], progress: Progress | None = None) -> Snapshot:
        listed = list(objects)
        prefix = self._prefix(source)
        version = int(self._call(self._redis.incr, prefix + "next-version"))
        vp = f"{prefix}v{version}:"
        chunks = 0
        pipe = self._redis.pipeline(transaction=False)
        for start in range(0, len(listed), _CHUNK):
            pipe.set(f"{vp}chunk:{chunks}", encode_objects(listed[start:start + _CHUNK]))
            chunks += 1
            if chunks % 10 == 0:
                self._call(pipe.execute)
                if progress:
                    progress(min(start + _CHUNK, len(listed)))
        created = time.time()
        pipe.set(vp + "info", json.dumps({"format": _FORMAT, "source": source, "version": version,
                                          "created": created, "objects": len(listed), "chunks": chunks}))
        self._call(pipe.execute)
        self._call(self._redis.set, prefix + "current", str(version))  # the atomic switch
        if progress:
            progress(len(listed))
        for old in range(max(1, version - 10), version - _KEEP + 1):
            keys = list(self._call(self._redis.scan_iter, f"{prefix}v{old}:*"))
            if keys:
                self._call(self._redis.delete, *keys)
        return Snapshot(source, version, created, listed)

    def update(self, source: str, added: dict[str, ObjectInfo], removed: set[str]) -> Head:
        """The current version with ``added`` and ``removed`` applied, under a lock that the nodes
        publishing their writes take in turn (it expires if its holder dies)."""
        lock = self._redis.lock(self._prefix(source) + "update-lock", timeout=120, blocking_timeout=60)
        if not self._call(lock.acquire):
            raise MetaUnavailable(f"metadata store {self.url}: another node held the update lock of {source} "
                                  "for a minute")
        try:
            current = self.load(source)
            return self.save(source, merged(current.objects if current else (), added, removed)).head
        finally:
            try:
                lock.release()
            except redis.exceptions.RedisError:
                pass  # expired (its timeout bounds any hold)

    # -- cluster members (the peer tier) --------------------------------------------------------------

    def heartbeat(self, source: str, member: str, ttl: float, limit: int) -> list[bytes]:
        """Renew ``member`` for ``ttl`` seconds (by the store's clock, so the nodes' clocks do not matter),
        forget members whose time ran out, and return the live ones (at most ``limit``), unchecked."""
        key = self._prefix(source) + "peers"
        seconds, micros = self._call(self._redis.time)
        now = seconds + micros / 1e6
        pipe = self._redis.pipeline(transaction=True)
        pipe.zadd(key, {member: now + ttl})
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.zrangebyscore(key, now, "+inf", start=0, num=limit)
        return list(self._call(pipe.execute)[2])

    def leave(self, source: str, member: str) -> None:
        self._call(self._redis.zrem, self._prefix(source) + "peers", member)

    def put_manifest(self, source: str, name: str, text: str) -> None:
        self._call(self._redis.set, f"{self._prefix(source)}manifest:{name}", text.encode())

    def get_manifest(self, source: str, name: str) -> str | None:
        raw = self._call(self._redis.get, f"{self._prefix(source)}manifest:{name}")
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SnapshotInvalid(f"manifest {name!r} in {self.url} is not UTF-8 text") from None

    def close(self) -> None:
        self._redis.close()
