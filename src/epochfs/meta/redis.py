"""The shared metadata store: versioned namespace snapshots in Redis, so a thousand nodes load one
listing instead of each listing the bucket. Schema: ``docs/metadata-store.md``.

Publishing writes a new version's chunks and info first and then flips ``current`` with one SET, so a
reader sees the previous version or the new one. A whole snapshot (``epochfs import``) is a full
version. A node's own writes (:meth:`RedisMetaStore.update`) are a *change set*: a version holding only
what was put and deleted, on top of the version before it, so publishing costs the change, not the
dataset, and a node serving the version before applies it in proportion too (:meth:`changes`). Change
sets are numbered under a short lock (one chain of versions that every node applies in the same
order); the lock is held to read ``current``, write the change and flip ``current``: milliseconds, in
proportion to the change. Every ``COMPACT_AFTER`` change sets, a full copy of the current version is
written beside it (:meth:`compact`, without the lock: a version never changes once published), and a
node that has no version to start from loads the newest full copy and the change sets after it.
Versions far behind the newest full copy are deleted (a node loading one right then sees it vanish and
retries with the current one).

Whoever can write to the store decides what the namespace holds, so what it may decide is bounded. With
a password (:class:`~epochfs.meta.base.StoreAccess`: from a private file, never the command line) the
connection is authenticated and every value the nodes write is signed (a keyed BLAKE3 MAC over the
value and the key it is stored under, with a key derived from the password): a value that is not signed
with it is refused, and owners and modes are taken from the records. Without one the store is not
trusted for them: a record that claims its own owner and mode is presented to the mount's owner only
(:func:`~epochfs.meta.base.decode_objects`), until the bucket's own attribute records say otherwise.
Every value is bounded in what it costs to decode: an info record of at most 4 KiB of JSON, chunks of
at most ``_CHUNK`` records, deleted keys as length-prefixed UTF-8.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

import blake3
import redis

from epochfs.core.records import MAX_KEY_BYTES, ObjectInfo
from epochfs.meta.base import (
    MAX_OBJECTS,
    Change,
    Head,
    Progress,
    Snapshot,
    SnapshotInvalid,
    StoreAccess,
    decode_objects,
    encode_objects,
)
from epochfs.meta.redis_link import Link, MetaUnavailable
from epochfs.meta.redis_lock import UpdateLocks

log = logging.getLogger(__name__)

_FORMAT = 3
_CHUNK = 20_000  # objects per chunk value
_MAX_INFO = 4096  # bytes of an info record's JSON
_SIGNED, _PLAIN = b"\x01", b"\x00"  # the first byte of every value: signed (a 16-byte MAC follows) or not
_MAC = 16
_KEY_CONTEXT = "epochfs 2026-12-02 shared store records v1 MAC key"
_COUNT = struct.Struct("<I")
_KEEP = 2  # full versions kept by an import: the current one and the one before
_PUBLICATION_MEMORY = 86400  # seconds a change set's name is kept (a writer retries within that)
COMPACT_AFTER = 64  # change sets after a full copy before another is written
_LAG = 2 * COMPACT_AFTER  # change sets kept behind the newest full copy, for nodes catching up


class _Gone(Exception):
    """A version went while it was read (a newer one replaced it): read the current one again."""


_BATCH = 64  # chunks fetched per round trip


@dataclass(frozen=True)
class _Info:
    source: str
    created: float
    objects: int  # -1 in a change set: the count is known once applied
    chunks: int
    base: int | None = None  # a change set: the version it applies to
    removed: int = 0  # a change set: how many keys it deletes


def _version(raw: bytes, where: str) -> int:
    if not raw.isdigit() or len(raw) > 18 or int(raw) < 1:
        raise SnapshotInvalid(f"{where} is {raw[:32]!r}, not a version number")
    return int(raw)


def _info(raw: bytes, version: int, url: str) -> _Info:
    """The info record of a version, checked: the right format and version, counts in range."""
    what = f"snapshot version {version} in {url}"
    if len(raw) > _MAX_INFO:
        raise SnapshotInvalid(f"{what}: its info is longer than {_MAX_INFO} bytes")
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
    base, removed = info.get("base"), info.get("removed", 0)
    change = base is not None

    def count(v: object, low: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and low <= v <= MAX_OBJECTS

    if (not isinstance(source, str) or info.get("version") != version
            or not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created)
            or not count(objects, -1 if change else 0) or (objects == -1) != change
            or not isinstance(chunks, int) or isinstance(chunks, bool)
            or not 0 <= chunks <= max(1, MAX_OBJECTS // _CHUNK if change else objects)
            or (change and (not isinstance(base, int) or isinstance(base, bool) or not 1 <= base < version
                            or not count(removed)))):
        raise SnapshotInvalid(f"{what}: its info is malformed or out of range")
    return _Info(source, float(created), objects, chunks, base, removed if change else 0)


def _encode_removed(keys: list[str]) -> bytes:
    """Deleted keys as a count, then each key's UTF-8 length and bytes."""
    out = bytearray(_COUNT.pack(len(keys)))
    for key in keys:
        raw = key.encode("utf-8")
        out += _COUNT.pack(len(raw)) + raw
    return bytes(out)


def _removed(raw: bytes | None, expected: int, what: str) -> set[str]:
    """The deleted keys of a change set, checked (``expected`` of them, each UTF-8 of at most
    ``MAX_KEY_BYTES`` without NUL): decoding costs their bytes, nothing more."""
    if raw is None:
        raise SnapshotInvalid(f"{what}: its deleted keys are missing")
    if len(raw) < _COUNT.size or _COUNT.unpack_from(raw)[0] != expected:
        raise SnapshotInvalid(f"{what}: its deleted keys are not the {expected} its info says")
    keys, pos = set(), _COUNT.size
    for _ in range(expected):
        if pos + _COUNT.size > len(raw):
            raise SnapshotInvalid(f"{what}: its deleted keys are cut short")
        (size,) = _COUNT.unpack_from(raw, pos)
        pos += _COUNT.size
        if size > MAX_KEY_BYTES or pos + size > len(raw):
            raise SnapshotInvalid(f"{what}: a deleted key is longer than {MAX_KEY_BYTES} bytes or cut short")
        try:
            key = raw[pos:pos + size].decode("utf-8")
        except UnicodeDecodeError:
            raise SnapshotInvalid(f"{what}: a deleted key is not UTF-8") from None
        if "\x00" in key:
            raise SnapshotInvalid(f"{what}: a deleted key holds a NUL")
        keys.add(key)
        pos += size
    if pos != len(raw):
        raise SnapshotInvalid(f"{what}: bytes follow its deleted keys")
    return keys


class RedisMetaStore:
    shared = True

    def __init__(self, url: str, name: str | None = None, access: StoreAccess | None = None) -> None:
        access = access or StoreAccess()
        self.name = name
        self._key = (blake3.blake3(access.password, derive_key_context=_KEY_CONTEXT).digest()
                     if access.password else None)
        #: Owners and modes are taken only from values signed with the password.
        self.trusted = self._key is not None
        self._link = Link(url, access)  # the connection (directly or through sentinels), its errors
        self.url = self._link.url
        self._redis = self._link.client
        self._call = self._link.call
        self._replicated = self._link.replicated
        self._locks = UpdateLocks(self._redis, self._call, self.url)  # numbering change sets

    @property
    def master(self) -> tuple[str, int] | None:
        """(a Sentinel store) The master last in use."""
        return self._link.master

    @property
    def master_since(self) -> float | None:
        """When that master was first used."""
        return self._link.master_since

    # -- signed values -------------------------------------------------------------------------------

    def _mac(self, name: str, payload: bytes) -> bytes:
        assert self._key is not None
        mac = blake3.blake3(key=self._key)
        raw = name.encode("utf-8")
        mac.update(len(raw).to_bytes(8, "little"))
        mac.update(raw)
        mac.update(payload)
        return mac.digest(_MAC)

    def _wrap(self, name: str, payload: bytes) -> bytes:
        """The value stored under ``name``: signed when this node holds the password."""
        return _PLAIN + payload if self._key is None else _SIGNED + self._mac(name, payload) + payload

    def _unwrap(self, name: str, raw: bytes | None) -> bytes | None:
        """The payload of the value stored under ``name`` (None if there is none): with the password,
        only a value signed with it for that very key (:class:`SnapshotInvalid` otherwise)."""
        if raw is None:
            return None
        if raw[:1] == _PLAIN and self._key is None:
            return raw[1:]
        if raw[:1] != _SIGNED or len(raw) < 1 + _MAC:
            raise SnapshotInvalid(f"{name} in {self.url} is not a value of this epochfs (format {_FORMAT})"
                                  + ("; it is not signed: publish it again with --meta-password-file"
                                     if self._key is not None and raw[:1] == _PLAIN else ""))
        payload = raw[1 + _MAC:]
        if self._key is not None and not hmac.compare_digest(raw[1:1 + _MAC], self._mac(name, payload)):
            raise SnapshotInvalid(f"{name} in {self.url} is not signed with this store's password (written by "
                                  "someone who does not hold it): refused")
        return payload

    def _get(self, name: str) -> bytes | None:
        return self._unwrap(name, self._call(self._redis.get, name))

    def _prefix(self, source: str) -> str:
        return f"epochfs:{self.name or source}:"

    def current_version(self, source: str) -> int | None:
        name = self._prefix(source) + "current"
        raw = self._get(name)
        return None if raw is None else _version(raw, name)

    def head(self, source: str) -> Head | None:
        for _ in range(3):  # the version may be replaced while we read it
            version = self.current_version(source)
            if version is None:
                return None
            raw = self._get(f"{self._prefix(source)}v{version}:info")
            if raw is not None:
                info = _info(raw, version, self.url)
                return Head(info.source, version, info.created, info.objects)
        raise MetaUnavailable(f"snapshot of {source} in {self.url} kept changing while reading it")

    def _set_chunks(self, pipe: redis.client.Pipeline, key: str, objects: list[ObjectInfo],
                    progress: Progress | None = None) -> int:
        """Queue ``objects`` as chunks ``key + K`` (sent ten at a time; the rest with the caller's last
        commands, so they land before what names them). The number of chunks."""
        chunks = 0
        for start in range(0, len(objects), _CHUNK):
            pipe.set(f"{key}{chunks}", self._wrap(f"{key}{chunks}", encode_objects(objects[start:start + _CHUNK])))
            chunks += 1
            if chunks % 10 == 0:
                self._call(pipe.execute)
                if progress:
                    progress(min(start + _CHUNK, len(objects)))
        return chunks

    def _chunks(self, vp: str, name: str, count: int, limit: int, what: str) -> list[ObjectInfo] | None:
        """The records of ``count`` chunks ``vp + name + K``, checked (None: the version went meanwhile)."""
        objects: list[ObjectInfo] = []
        for first in range(0, count, _BATCH):
            pipe = self._redis.pipeline(transaction=False)
            for n in range(first, min(first + _BATCH, count)):
                pipe.get(f"{vp}{name}{n}")
            chunks = self._call(pipe.execute)
            if any(c is None for c in chunks):
                return None
            for n, c in enumerate(chunks, start=first):
                objects += decode_objects(self._unwrap(f"{vp}{name}{n}", c) or b"", limit=_CHUNK, trusted=self.trusted)
            if len(objects) > limit:
                raise SnapshotInvalid(f"{what} holds more objects than its info says ({limit})")
        return objects

    def _version_info(self, source: str, version: int) -> _Info:
        raw = self._get(f"{self._prefix(source)}v{version}:info")
        if raw is None:
            raise _Gone
        return _info(raw, version, self.url)

    def _full(self, source: str, version: int, info: _Info) -> list[ObjectInfo] | None:
        """The objects of a version held whole (an import, or a change set with a full copy written
        beside it), or None for a change set without one. :class:`_Gone` if it went meanwhile."""
        vp = f"{self._prefix(source)}v{version}:"
        what = f"snapshot version {version} in {self.url}"
        if info.base is not None:
            whole = self._get(vp + "full")
            if whole is None:
                return None
            if len(whole) > _MAX_INFO:
                raise SnapshotInvalid(f"{what}: its full copy's record is longer than {_MAX_INFO} bytes")
            try:
                copy = json.loads(whole)
                objects, chunks = copy["objects"], copy["chunks"]
            except (ValueError, KeyError, TypeError):
                raise SnapshotInvalid(f"{what}: its full copy's record is malformed") from None
            if not (isinstance(objects, int) and isinstance(chunks, int) and 0 <= objects <= MAX_OBJECTS
                    and 0 <= chunks <= max(1, objects)):
                raise SnapshotInvalid(f"{what}: its full copy's record is out of range")
            name = "fullchunk:"
        else:
            objects, chunks, name = info.objects, info.chunks, "chunk:"
        listed = self._chunks(vp, name, chunks, objects, what)
        if listed is None:
            raise _Gone
        if len(listed) != objects:
            raise SnapshotInvalid(f"{what} holds {len(listed)} objects, its info says {objects}")
        return listed

    def _change(self, source: str, version: int, info: _Info) -> Change:
        vp = f"{self._prefix(source)}v{version}:"
        what = f"change set version {version} in {self.url}"
        added = self._chunks(vp, "chunk:", info.chunks, MAX_OBJECTS, what)
        if added is None:
            raise _Gone
        removed = _removed(self._get(vp + "removed"), info.removed, what)
        return Change(version, info.created, {o.key: o for o in added}, removed)

    def changes(self, source: str, after: int, upto: int) -> list[Change] | None:
        """The change sets that take version ``after`` to ``upto``, oldest first, each checked; None
        when ``upto`` does not descend from ``after`` by change sets alone (an import came between) or a
        version on the way is gone: then load it whole."""
        chain: list[tuple[int, _Info]] = []
        version = upto
        try:
            while version > after:
                info = self._version_info(source, version)
                if info.base is None or len(chain) > _LAG + COMPACT_AFTER:
                    return None
                chain.append((version, info))
                version = info.base
            if version != after:
                return None
            return [self._change(source, v, i) for v, i in reversed(chain)]
        except _Gone:
            return None

    def load(self, source: str) -> Snapshot | None:
        """The current snapshot, every field checked (:class:`SnapshotInvalid` if one is wrong): the
        newest version at or before it held whole, and the change sets after that."""
        for _ in range(3):  # the version may be replaced while we read it
            version = self.current_version(source)
            if version is None:
                return None
            try:
                chain: list[tuple[int, _Info]] = []
                at = version
                while True:  # back along the change sets to a version held whole
                    info = self._version_info(source, at)
                    objects = self._full(source, at, info)
                    if objects is not None:
                        break
                    if len(chain) > _LAG + COMPACT_AFTER:
                        raise SnapshotInvalid(f"snapshot version {version} in {self.url}: no full copy within "
                                              f"{len(chain)} versions")
                    chain.append((at, info))
                    assert info.base is not None
                    at = info.base
                created = info.created
                if chain:
                    by_key = {o.key: o for o in objects}
                    for v, i in reversed(chain):
                        change = self._change(source, v, i)
                        for key in change.removed:
                            by_key.pop(key, None)
                        by_key.update(change.added)
                        created = change.created
                    objects = list(by_key.values())
            except _Gone:
                continue
            return Snapshot(source, version, created, objects)
        raise MetaUnavailable(f"snapshot of {source} in {self.url} kept changing while loading it")

    def save(self, source: str, objects: Iterable[ObjectInfo], progress: Progress | None = None) -> Snapshot:
        listed = list(objects)
        prefix = self._prefix(source)
        version = int(self._call(self._redis.incr, prefix + "next-version"))
        vp = f"{prefix}v{version}:"
        pipe = self._redis.pipeline(transaction=False)
        chunks = self._set_chunks(pipe, f"{vp}chunk:", listed, progress)
        created = time.time()
        pipe.set(vp + "info", self._wrap(vp + "info", json.dumps({
            "format": _FORMAT, "source": source, "version": version, "created": created, "objects": len(listed),
            "chunks": chunks}).encode()))
        self._call(pipe.execute)
        self._call(self._redis.set, prefix + "current", self._wrap(prefix + "current", str(version).encode()))  # the switch
        self._call(self._redis.set, prefix + "full", self._wrap(prefix + "full", str(version).encode()))
        self._replicated(f"snapshot version {version}")
        if progress:
            progress(len(listed))
        self._forget(prefix, version - _KEEP + 1, 10)
        return Snapshot(source, version, created, listed)

    def update(self, source: str, added: dict[str, ObjectInfo], removed: set[str], *,
               publication: str | None = None) -> Head:
        """Publish ``added`` and ``removed`` as a change set on the current version (``objects`` in the
        answer is -1: the count is known to whoever applies it). The lock that numbers change sets is
        held for the change's own size; it expires if its holder dies. ``publication`` (see
        :meth:`MetaStore.update`): its version is recorded with the change set, before the switch to it,
        so a change set the current version includes is never published twice, and one a failover lost
        (the record may survive the switch, never the other way round) is published again."""
        prefix = self._prefix(source)
        with self._locks.held(prefix + "update-lock", source):
            base = self.current_version(source)
            done = self._published(source, publication, base) if publication else None
            if done is not None:
                log.info("change set %s is already in %s as version %d (the answer was lost, not the write)",
                         publication, self.url, done.version)
                self._replicated(f"change set {done.version}")
                return done
            if base is None:
                return self.save(source, added.values()).head
            version = int(self._call(self._redis.incr, prefix + "next-version"))
            vp = f"{prefix}v{version}:"
            records = list(added.values())
            gone = sorted(removed - added.keys())
            pipe = self._redis.pipeline(transaction=False)
            chunks = self._set_chunks(pipe, f"{vp}chunk:", records)
            pipe.set(vp + "removed", self._wrap(vp + "removed", _encode_removed(gone)))
            created = time.time()
            pipe.set(vp + "info", self._wrap(vp + "info", json.dumps({
                "format": _FORMAT, "source": source, "version": version, "created": created, "objects": -1,
                "chunks": chunks, "base": base, "removed": len(gone)}).encode()))
            if publication:
                pipe.set(prefix + "pub:" + publication, self._wrap(prefix + "pub:" + publication,
                                                                   str(version).encode()), ex=_PUBLICATION_MEMORY)
            pipe.set(prefix + "current", self._wrap(prefix + "current", str(version).encode()))  # the switch, last
            self._call(pipe.execute)
            self._replicated(f"change set {version}")
            return Head(source, version, created, -1, base=base)

    def _published(self, source: str, publication: str, current: int | None) -> Head | None:
        """The change set named ``publication`` if the current version includes it."""
        name = self._prefix(source) + "pub:" + publication
        try:
            raw = self._get(name)
            version = _version(raw, name) if raw is not None else None
        except SnapshotInvalid:
            return None  # (not one of ours: publish)
        if version is None or current is None or version > current:
            return None  # never recorded, or its switch was lost: publish it (again)
        try:
            info = self._version_info(source, version)
        except (_Gone, SnapshotInvalid):  # (long since folded into a full copy)
            return Head(source, version, 0.0, -1)
        return Head(source, version, info.created, -1, base=info.base)

    def compaction_due(self, source: str) -> bool:
        """Whether the current version is ``COMPACT_AFTER`` change sets past the newest full copy."""
        current = self.current_version(source)
        try:
            raw = self._get(self._prefix(source) + "full")
        except SnapshotInvalid:
            raw = None
        full = int(raw) if raw is not None and raw.isdigit() and len(raw) <= 18 else 0
        return current is not None and current - full >= COMPACT_AFTER

    def compact(self, source: str) -> int | None:
        """Write a full copy of the current version beside it (no lock: a version never changes once
        published) and delete what no node needs any more. The version copied, or None."""
        snapshot = self.load(source)
        if snapshot is None:
            return None
        prefix, version, objects = self._prefix(source), snapshot.version, list(snapshot.objects)
        vp = f"{prefix}v{version}:"
        pipe = self._redis.pipeline(transaction=False)
        chunks = self._set_chunks(pipe, f"{vp}fullchunk:", objects)
        pipe.set(vp + "full", self._wrap(vp + "full", json.dumps({"objects": len(objects), "chunks": chunks}).encode()))
        pipe.set(prefix + "full", self._wrap(prefix + "full", str(version).encode()))
        self._call(pipe.execute)
        self._forget(prefix, version - _LAG, COMPACT_AFTER + 8)
        log.info("wrote a full copy of snapshot version %d of %s (%d objects)", version, source,
                 len(objects))
        return version

    def _forget(self, prefix: str, before: int, span: int) -> None:
        """Delete the ``span`` versions numbered below ``before``."""
        for old in range(max(1, before - span), before):
            keys = list(self._call(self._redis.scan_iter, f"{prefix}v{old}:*"))
            if keys:
                self._call(self._redis.delete, *keys)

    # -- cluster members (the peer tier) --------------------------------------------------------------

    #: The member list of each role: GPU nodes that serve (``peer``), cache nodes (``server``), and the
    #: sessions of clients (``client``: mounts that read through the tier, listed for ``cluster status``
    #: only, never members).
    ROLES = {"peer": "peers", "server": "servers", "client": "clients"}
    MAX_STATS = 4096  # bytes of one member's published statistics

    def heartbeat(self, source: str, member: str | None, ttl: float, limit: int,
                  role: str = "peer") -> dict[str, list[bytes]]:
        """Renew ``member`` in its ``role``'s list for ``ttl`` seconds (by the store's clock, so the
        nodes' clocks do not matter; None: renew nothing), forget members whose time ran out, and return
        the live ones of every role (at most ``limit`` each), unchecked."""
        seconds, micros = self._call(self._redis.time)
        now = seconds + micros / 1e6
        pipe = self._redis.pipeline(transaction=True)
        if member is not None:
            pipe.zadd(self._prefix(source) + self.ROLES[role], {member: now + ttl})
        for name in self.ROLES.values():
            pipe.zremrangebyscore(self._prefix(source) + name, "-inf", now)
            pipe.zrangebyscore(self._prefix(source) + name, now, "+inf", start=0, num=limit)
        answers = self._call(pipe.execute)[1 if member is not None else 0:]
        return {role: list(answers[2 * i + 1]) for i, role in enumerate(self.ROLES)}

    def leave(self, source: str, member: str, role: str = "peer") -> None:
        self._call(self._redis.zrem, self._prefix(source) + self.ROLES[role], member)
        self._call(self._redis.hdel, self._prefix(source) + "member-stats", member)

    def publish_stats(self, source: str, member: str, stats: bytes) -> None:
        """A member's statistics for ``epochfs cluster status`` (what it claims; signed with the store's
        password where there is one)."""
        key = self._prefix(source) + "member-stats"
        self._call(self._redis.hset, key, member, self._wrap(f"{key}:{member}", stats[:self.MAX_STATS]))

    def member_stats_of(self, source: str, members: list[str]) -> dict[str, bytes]:
        """The published statistics of ``members`` (a node's own ring: a few), each read only if it is
        no larger than a member publishes (a planted value of any size costs one length query)."""
        key = self._prefix(source) + "member-stats"
        pipe = self._redis.pipeline(transaction=False)
        for member in members:
            pipe.hstrlen(key, member)
        lengths = self._call(pipe.execute)
        wanted = [m for m, n in zip(members, lengths, strict=True) if isinstance(n, int) and 0 < n <= 2 * self.MAX_STATS]
        out = {}
        for member, raw in zip(wanted, self._call(self._redis.hmget, key, wanted) if wanted else [], strict=True):
            try:
                payload = self._unwrap(f"{key}:{member}", raw) if raw is not None else None
            except SnapshotInvalid:
                continue
            if payload is not None and len(payload) <= self.MAX_STATS:
                out[member] = payload
        return out

    def put_manifest(self, source: str, name: str, text: str) -> None:
        key = f"{self._prefix(source)}manifest:{name}"
        self._call(self._redis.set, key, self._wrap(key, text.encode()))

    def get_manifest(self, source: str, name: str) -> str | None:
        raw = self._get(f"{self._prefix(source)}manifest:{name}")
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SnapshotInvalid(f"manifest {name!r} in {self.url} is not UTF-8 text") from None

    def close(self) -> None:
        self._link.close()
