"""The lifecycle of the namespace a mount serves: load at start-up, refresh, poll, and this node's copy.

:class:`Snapshots` owns the current :class:`Snapshot` and its :class:`Namespace`. At start-up it loads
the snapshot the store holds (a store that is not shared lists the source when it has none, or when
asked to; a shared store is never listed from a node). Afterwards it switches to newer versions on
``refresh()`` or every ``poll`` seconds, without unmounting: the new tree is built and compared with the
old one in a worker thread, then swapped in on the trio thread and announced through ``on_switch`` (the
FUSE adapter takes the new tree and the kernel forgets what changed).

Whatever arrives from a shared store is checked when it is decoded (:mod:`.base`); a snapshot that
does not check out is refused as a whole with a log line, and the mount keeps serving what it has. A
store that keeps a local copy (a shared one: ``keeps_local_copy``) has each loaded snapshot copied into
the cache directory, one copy at a time, off the refresh path; at start-up a node whose shared store is
unreachable or holds an invalid snapshot mounts from that copy.

All state lives on the trio thread; store calls run in worker threads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from epochfs.errors import BackendUnavailable, ConfigError, EpochfsError
from epochfs.meta.base import MetaStore, Snapshot, SnapshotInvalid, kept_attributes
from epochfs.meta.lmdb import LmdbMetaStore
from epochfs.meta.namespace import Namespace, diff
from epochfs.records import ObjectInfo

log = logging.getLogger(__name__)

T = TypeVar("T")
Switch = Callable[[Namespace, list[tuple[int, bytes]], list[int]], Any]  # new tree, changed entries, inodes


@dataclass(frozen=True)
class SnapshotSettings:
    source_id: str
    cache_dir: Path
    refresh: bool = False  # list again at start-up instead of reusing the stored snapshot
    ttl: float = 0.0  # list again at start-up when the stored snapshot is older (0: never)
    poll: float = 0.0  # look for a newer published version this often (0: only on refresh)
    name: str | None = None  # the dataset's name in a shared store


@dataclass(frozen=True)
class SnapshotStats:
    version: int
    created: float
    objects: int
    files: int
    directories: int
    bytes: int
    store: str
    reachable: bool
    error: str | None
    latest_version: int


def build(snapshot: Snapshot, previous: Namespace | None = None) -> Namespace:
    return Namespace.build(snapshot.objects, mtime_ns=int(snapshot.created * 1e9), previous=previous)


class Snapshots:
    def __init__(self, store: MetaStore, settings: SnapshotSettings,
                 list_source: Callable[[], Iterable[ObjectInfo]], *, on_switch: Switch | None = None) -> None:
        self.store = store
        self.settings = settings
        self.list_source = list_source
        self.on_switch = on_switch
        self.error: str | None = None  # why the store is unreachable (None: it answered last time)
        self._copy: LmdbMetaStore | None = None
        self.snapshot, self.error = self._load_at_start()
        self.latest_version = self.snapshot.version
        self.namespace = build(self.snapshot)
        self._changed = trio.Event()  # set on a switch; wakes the local-copy task
        self._switching = trio.Lock()

    # -- start-up ---------------------------------------------------------------------------------------

    def _local_copy(self) -> tuple[LmdbMetaStore, str]:
        s = self.settings
        if self._copy is None:
            self._copy = LmdbMetaStore(s.cache_dir / "meta-shared")
        return self._copy, f"{self.store.url}#{s.name or s.source_id}"

    def close(self) -> None:
        if self._copy is not None:
            self._copy.close()
        self.store.close()

    def _load_at_start(self) -> tuple[Snapshot, str | None]:
        """The snapshot to serve, and why the store is unreachable (None when it answered)."""
        source = self.settings.source_id
        if self.store.shared:  # load what was published, never list
            try:
                snapshot = self.store.load(source)
            except (BackendUnavailable, SnapshotInvalid) as exc:
                return self._from_local_copy(exc), str(exc)
            if snapshot is None:
                raise ConfigError(f"no snapshot of {source} in {self.store.url}; publish one with: "
                                  f"epochfs import {source} --meta {self.store.url}")
            log.info("loaded snapshot version %d of %s from %s (%d objects)", snapshot.version, snapshot.source,
                     self.store.url, len(snapshot.objects))
            return snapshot, None
        stored = self.store.load(source)
        snapshot = None if self.settings.refresh else stored
        if snapshot is not None and self.settings.ttl and time.time() - snapshot.created > self.settings.ttl:
            log.info("snapshot version %d is older than the TTL; listing the source again", snapshot.version)
            snapshot = None
        if snapshot is not None and not snapshot.objects:  # a mistyped prefix, or data not there yet
            log.info("the stored snapshot of %s is empty; listing the source again", source)
            snapshot = None
        if snapshot is not None:
            log.info("using snapshot version %d of %s (%d objects)", snapshot.version, snapshot.source,
                     len(snapshot.objects))
            return snapshot, None
        started = time.monotonic()
        log.info("listing %s", source)
        snapshot = self.store.save(source, kept_attributes(self.list_source(), stored.objects if stored else ()))
        log.info("listed %d objects in %.1fs; snapshot version %d", len(snapshot.objects),
                 time.monotonic() - started, snapshot.version)
        return snapshot, None

    def _from_local_copy(self, exc: EpochfsError) -> Snapshot:
        copy, key = self._local_copy()
        kept = copy.load(key)
        if kept is None:
            raise ConfigError(f"{exc}; and {self.settings.cache_dir} holds no copy of a snapshot to serve") from None
        log.warning("%s; serving this node's copy of snapshot version %d (%d objects) until it answers",
                    exc, kept.version, len(kept.objects))
        return dataclasses.replace(kept, source=self.settings.source_id)

    # -- switching versions -------------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Call the store in a worker thread, tracking whether it is reachable."""
        try:
            result = await trio.to_thread.run_sync(fn, *args)
        except BackendUnavailable as exc:
            if self.error is None:
                log.warning("metadata store unreachable, serving snapshot version %d: %s", self.snapshot.version, exc)
            self.error = str(exc)
            raise
        if self.error is not None:
            log.info("metadata store %s is reachable again", self.store.url)
        self.error = None
        return result

    async def refresh(self) -> dict[str, Any]:
        """Switch to a newer snapshot without unmounting (listing the source again for a store that is not
        shared). Open files keep the version they opened. Refreshes run one at a time."""
        async with self._switching:
            source = self.settings.source_id
            if not self.store.shared:
                previous = self.snapshot.objects
                snapshot = await trio.to_thread.run_sync(
                    lambda: self.store.save(source, kept_attributes(self.list_source(), previous)))
            else:
                latest = await self._call(self.store.current_version, source)
                if latest is None or latest == self.snapshot.version:
                    return {"changed": False, "version": self.snapshot.version}
                try:
                    loaded = await self._call(self.store.load, source)
                except SnapshotInvalid as exc:
                    log.warning("refusing snapshot version %d from %s: %s; still serving version %d",
                                latest, self.store.url, exc, self.snapshot.version)
                    raise
                if loaded is None:
                    return {"changed": False, "version": self.snapshot.version}
                snapshot = loaded
            return await self._switch_to(snapshot)

    async def _switch_to(self, snapshot: Snapshot) -> dict[str, Any]:
        old = self.namespace
        new, (entries, inodes) = await trio.to_thread.run_sync(_build_and_diff, snapshot, old)
        self.namespace, self.snapshot, self.latest_version = new, snapshot, snapshot.version
        if self.on_switch is not None:
            await self.on_switch(new, entries, inodes)
        log.info("now serving snapshot version %d (%d entries changed)", snapshot.version, len(entries))
        self._changed.set()
        return {"changed": True, "version": snapshot.version, "changed_entries": len(entries)}

    async def apply(self, added: dict[str, ObjectInfo], removed: set[str]) -> None:
        """Publish this node's writes (objects uploaded, objects deleted) as a new version of the
        store's snapshot, and serve it. Raises :class:`EpochfsError` if the store cannot take it (the
        caller tries again later)."""
        async with self._switching:
            snapshot = await self._call(self.store.update, self.settings.source_id, added, removed)
            await self._switch_to(snapshot)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll the store (if asked to) and keep this node's local copy (if the store wants one)."""
        async with trio.open_nursery() as nursery:
            if self.settings.poll and self.store.shared:
                nursery.start_soon(self._poll)
            if self.store.keeps_local_copy:
                nursery.start_soon(self._keep_local_copy)
            task_status.started()

    async def _poll(self) -> None:
        while True:
            await trio.sleep(self.settings.poll)
            try:
                latest = await self._call(self.store.current_version, self.settings.source_id)
                if latest is not None:
                    self.latest_version = latest
                if latest is not None and latest != self.snapshot.version:
                    await self.refresh()
            except SnapshotInvalid as exc:
                log.warning("the shared store holds an invalid snapshot (%s); still serving version %d",
                            exc, self.snapshot.version)
            except EpochfsError:
                continue  # logged once by _call; keep serving what is loaded
            except Exception:  # a bug here must not take the mount down
                log.exception("looking for a new snapshot failed; still serving version %d", self.snapshot.version)

    async def _keep_local_copy(self) -> None:
        """Copy each snapshot loaded from the shared store into the cache directory, one copy at a time."""
        copy, key = self._local_copy()
        while True:
            changed = self._changed = trio.Event()  # before copying: a switch meanwhile is seen
            if self.error is None:  # not when serving this node's copy: it holds that version
                await trio.to_thread.run_sync(copy.keep, key, self.snapshot)
            await changed.wait()

    async def put_manifest(self, name: str, text: str) -> None:
        """Publish a manifest to the store under ``name``, for the daemons of the other ranks."""
        await self._call(self.store.put_manifest, self.settings.source_id, name, text)

    async def get_manifest(self, name: str) -> str | None:
        return await self._call(self.store.get_manifest, self.settings.source_id, name)

    def statistics(self) -> SnapshotStats:
        ns, snap = self.namespace, self.snapshot
        return SnapshotStats(snap.version, snap.created, len(snap.objects), ns.file_count, ns.dir_count,
                             ns.total_bytes, self.store.url, self.error is None, self.error, self.latest_version)


def _build_and_diff(snapshot: Snapshot, old: Namespace) -> tuple[Namespace, tuple[list[tuple[int, bytes]], list[int]]]:
    new = build(snapshot, previous=old)
    return new, diff(old, new)
