"""The lifecycle of the namespace a mount serves: load at start-up, refresh, poll, publish.

:class:`Snapshots` owns the current snapshot's identity (:class:`Head`) and its :class:`Namespace`, a
view of the node's namespace index (:mod:`.index`, in the cache directory). The index is written once
per snapshot version: at start-up, a stored snapshot (or, for a shared store, the published version)
that the index already holds is served at once, whatever its size; otherwise its objects are loaded
and the index built. Afterwards it switches to newer versions on ``refresh()`` or every ``poll``
seconds, without unmounting: the new tree is written and compared with the old one in a worker thread,
then swapped in on the trio thread and announced through ``on_switch`` (the FUSE adapter takes the new
tree and the kernel forgets what changed). A node's own writes (:meth:`Snapshots.apply`) are applied
to the index as a change set, in time proportional to the change, when the store's new version
follows the one served.

Whatever arrives from a shared store is checked when it is decoded (:mod:`.base`); a snapshot that
does not check out is refused as a whole with a log line, and the mount keeps serving what it has. The
index is also this node's copy of the shared snapshot: at start-up a node whose shared store is
unreachable or holds an invalid snapshot mounts the version its index holds.

All state lives on the trio thread; store calls and index writes run in worker threads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from epochfs.core.errors import BackendUnavailable, ConfigError, EpochfsError
from epochfs.core.records import ObjectInfo
from epochfs.meta.base import (
    Change,
    Head,
    MetaStore,
    Snapshot,
    SnapshotInvalid,
    StoreRefused,
    kept_attributes,
)
from epochfs.meta.index import NamespaceIndex
from epochfs.meta.namespace import Namespace, diff

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
    renumber_changed: bool = False  # a changed file gets a new inode (mounts that open with no request)


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
    shards: int = 0  # packed shards the files' bytes are in (0: a plain dataset)
    master: str | None = None  # a Sentinel store: the master in use (HOST:PORT)
    master_since: float | None = None  # and since when


class Snapshots:
    def __init__(self, store: MetaStore, settings: SnapshotSettings,
                 list_source: Callable[[], Iterable[ObjectInfo]], *, on_switch: Switch | None = None) -> None:
        self.store = store
        self.settings = settings
        self.list_source = list_source
        self.on_switch = on_switch
        self.error: str | None = None  # why the store is unreachable (None: it answered last time)
        self.index = NamespaceIndex(settings.cache_dir / "namespace", renumber_changed=settings.renumber_changed)
        self._identity = f"{store.url}#{settings.name or settings.source_id}"  # what the index was built from
        try:
            self.snapshot, self.namespace, self.error = self._load_at_start()
        except BaseException:
            self.index.close()
            raise
        self.latest_version = self.snapshot.version
        self._refused: int | None = None  # an older version the store offered, refused
        self._switching = trio.Lock()
        self._compact = trio.Event()  # set when the shared store is due a full copy

    def close(self) -> None:
        self.namespace.close()
        self.index.close()
        self.store.close()

    # -- start-up ---------------------------------------------------------------------------------------

    def _build(self, snapshot: Snapshot, previous: Namespace | None = None) -> Namespace:
        started = time.monotonic()
        log.info("indexing snapshot version %d (%d objects; written once per version, then reused)",
                 snapshot.version, len(snapshot.objects))
        view = self.index.build(snapshot.objects, source=self._identity, version=snapshot.version,
                                created=snapshot.created, mtime_ns=int(snapshot.created * 1e9), previous=previous)
        log.info("indexed snapshot version %d in %.1fs", snapshot.version, time.monotonic() - started)
        if self.store.shared:
            log.info("kept a copy of snapshot version %d in %s", snapshot.version, self.index.path)
        return view

    def _indexed(self, head: Head) -> Namespace | None:
        return self.index.view(self._identity, head.version, head.created)

    def _load_at_start(self) -> tuple[Head, Namespace, str | None]:
        """The snapshot to serve, its tree, and why the store is unreachable (None when it answered)."""
        source = self.settings.source_id
        if self.store.shared:  # load what was published, never list
            try:
                head = self.store.head(source)
                kept = self.index.view(self._identity)
                if head is not None and kept is not None and head.version < kept.version and not self.settings.refresh:
                    log.warning("the store's snapshot of %s is version %d, older than the version %d this node served: "
                                "a version never goes back (a store written without the password, or restored from an "
                                "old backup); serving version %d (--refresh takes the store's as it is)",
                                source, head.version, kept.version, kept.version)
                    return self._head_of(kept), kept, None
                if kept is not None:
                    kept.close()
                view = self._indexed(head) if head is not None else None
                if head is not None and view is None:
                    view = self._catch_up(head)
                if head is not None and view is None:
                    snapshot = self.store.load(source)
                    if snapshot is not None:
                        head, view = snapshot.head, self._build(snapshot)
                if view is not None and head is not None and head.objects < 0:  # a change set's: counted here
                    head = dataclasses.replace(head, objects=view.info["objects"])
            except StoreRefused as exc:  # (a password refused at start-up: the node's configuration)
                raise ConfigError(str(exc)) from None
            except (BackendUnavailable, SnapshotInvalid) as exc:
                return self._from_local_copy(exc)
            if head is None or view is None:
                raise ConfigError(f"no snapshot of {source} in {self.store.url}; publish one with: "
                                  f"epochfs import {source} --meta {self.store.url}")
            log.info("loaded snapshot version %d of %s from %s (%d objects)", head.version, head.source,
                     self.store.url, head.objects)
            return head, view, None
        stored = self.store.head(source)
        use = None if self.settings.refresh else stored
        if use is not None and self.settings.ttl and time.time() - use.created > self.settings.ttl:
            log.info("snapshot version %d is older than the TTL; listing the source again", use.version)
            use = None
        if use is not None and not use.objects:  # a mistyped prefix, or data not there yet
            log.info("the stored snapshot of %s is empty; listing the source again", source)
            use = None
        if use is not None:
            view = self._indexed(use)
            if view is None:
                snapshot = self.store.load(source)
                try:
                    view = self._build(snapshot) if snapshot is not None and snapshot.version == use.version else None
                except SnapshotInvalid as exc:
                    log.warning("the stored snapshot is damaged (%s); listing the source again", exc)
            if view is not None:
                log.info("using snapshot version %d of %s (%d objects)", use.version, use.source, use.objects)
                return use, view, None
        started = time.monotonic()
        log.info("listing %s", source)
        snapshot = self.store.save(source, kept_attributes(self.list_source(), self._previous_objects()))
        log.info("listed %d objects in %.1fs; snapshot version %d", len(snapshot.objects),
                 time.monotonic() - started, snapshot.version)
        return snapshot.head, self._build(snapshot), None

    def _catch_up(self, head: Head) -> Namespace | None:
        """The index's version brought to ``head`` by the change sets published since (a restart after
        other nodes' writes), or None if there is none to start from or the way is not change sets."""
        kept = self.index.view(self._identity)
        if kept is None or kept.version >= head.version:
            return None
        changes = self.store.changes(self.settings.source_id, kept.version, head.version)
        kept.close()
        if not changes:
            return None
        view, _ = self.index.apply_all(changes)
        log.info("caught up from version %d to %d by %d change sets", kept.version, head.version, len(changes))
        return view

    def _previous_objects(self) -> Iterable[ObjectInfo]:
        """The objects of the version served last (for the owners and modes a listing does not carry)."""
        view = self.index.view(self._identity)
        if view is not None:
            return (f.obj for f in view.files())
        stored = self.store.load(self.settings.source_id)
        return _readable(stored.objects) if stored is not None else ()

    def _from_local_copy(self, exc: EpochfsError) -> tuple[Head, Namespace, str]:
        view = self.index.view(self._identity)
        if view is None:
            raise ConfigError(f"{exc}; and {self.settings.cache_dir} holds no copy of a snapshot to serve") from None
        head = self._head_of(view)
        log.warning("%s; serving this node's copy of snapshot version %d (%d objects) until it answers",
                    exc, head.version, head.objects)
        return head, view, str(exc)

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
                namespace = self.namespace
                snapshot = await trio.to_thread.run_sync(lambda: self.store.save(
                    source, kept_attributes(self.list_source(), (f.obj for f in namespace.files()))))
            else:
                latest = await self._call(self.store.current_version, source)
                if latest is None or latest == self.snapshot.version:
                    return {"changed": False, "version": self.snapshot.version}
                if latest < self.snapshot.version:
                    self._refuse_older(latest)
                    return {"changed": False, "version": self.snapshot.version, "refused": latest}
                try:
                    changes = await self._call(self.store.changes, source, self.namespace.version, latest)
                    if changes:
                        return await self._apply_changes(changes)
                    loaded = await self._call(self.store.load, source)
                except SnapshotInvalid as exc:
                    log.warning("refusing snapshot version %d from %s: %s; still serving version %d",
                                latest, self.store.url, exc, self.snapshot.version)
                    raise
                if loaded is None:
                    return {"changed": False, "version": self.snapshot.version}
                if loaded.version < self.snapshot.version:  # (replaced under us between the two reads)
                    self._refuse_older(loaded.version)
                    return {"changed": False, "version": self.snapshot.version, "refused": loaded.version}
                snapshot = loaded
            return await self._switch_to(snapshot)

    def _refuse_older(self, version: int) -> None:
        """The store says ``version``, older than the one served: a version never goes back."""
        if self._refused != version:  # (once per version offered, not at every poll)
            log.warning("the store's snapshot of %s is now version %d, older than the version %d served: a version "
                        "never goes back (a store written without the password, or restored from an old backup); "
                        "still serving version %d", self.settings.source_id, version, self.snapshot.version,
                        self.snapshot.version)
            self._refused = version

    async def _switch_to(self, snapshot: Snapshot) -> dict[str, Any]:
        old = self.namespace
        new, (entries, inodes) = await trio.to_thread.run_sync(self._build_and_diff, snapshot, old)
        return await self._serve(snapshot.head, new, entries, inodes)

    def _build_and_diff(self, snapshot: Snapshot, old: Namespace) -> tuple[Namespace, tuple[list[tuple[int, bytes]], list[int]]]:
        new = self._build(snapshot, previous=old)
        return new, diff(old, new)

    async def _serve(self, head: Head, new: Namespace, entries: list[tuple[int, bytes]], inodes: list[int]
                     ) -> dict[str, Any]:
        self.namespace, self.snapshot, self.latest_version = new, head, head.version
        if self.on_switch is not None:
            await self.on_switch(new, entries, inodes)
        log.info("now serving snapshot version %d (%d entries changed)", head.version, len(entries))
        return {"changed": True, "version": head.version, "changed_entries": len(entries)}

    async def _apply_changes(self, changes: list[Change]) -> dict[str, Any]:
        """Serve the version the change sets make, each applied to the tree in proportion to its size."""
        new, (entries, inodes) = await trio.to_thread.run_sync(self.index.apply_all, changes)
        assert new is not None
        return await self._serve(self._head_of(new), new, entries, inodes)

    def _head_of(self, view: Namespace) -> Head:
        """The identity of the version a view of the index serves."""
        return Head(self.settings.source_id, view.version, float(view.info["created"]), view.info["objects"])

    async def apply(self, added: dict[str, ObjectInfo], removed: set[str], publication: str | None = None) -> None:
        """Publish this node's writes (objects uploaded, objects deleted) as a new version of the
        store's snapshot, and serve it: applied to the tree as change sets when the new version descends
        from the one served by change sets (the common case), else built whole. Raises
        :class:`EpochfsError` if the store cannot take it (the caller tries again later, under the same
        ``publication`` name: a store that already holds it does not take it twice)."""
        async with self._switching:
            source = self.settings.source_id
            head = await self._call(functools.partial(self.store.update, publication=publication), source, added,
                                    removed)
            mine = Change(head.version, head.created, added, removed)
            changes: list[Change] | None = None
            if head.base == self.namespace.version:
                changes = [mine]
            elif head.base is not None and self.store.shared:  # other nodes' change sets came first
                before = await self._call(self.store.changes, source, self.namespace.version, head.base)
                changes = None if before is None else [*before, mine]
            if changes:
                await self._apply_changes(changes)
                if self.store.shared and await self._call(self.store.compaction_due, source):
                    self._compact.set()
                return
            snapshot = await self._call(self.store.load, source)
            if snapshot is not None:
                await self._switch_to(snapshot)

    async def _compact_when_due(self) -> None:
        """Write a full copy of the shared snapshot after enough change sets (one at a time, in a worker
        thread, never in a publication's way)."""
        while True:
            await self._compact.wait()
            self._compact = trio.Event()
            try:
                await self._call(self.store.compact, self.settings.source_id)
            except EpochfsError as exc:
                log.warning("could not write a full copy of the shared snapshot (the next publication tries "
                            "again): %s", exc)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll the store (if asked to) and write full copies of a shared snapshot when they are due."""
        async with trio.open_nursery() as nursery:
            if self.settings.poll and self.store.shared:
                nursery.start_soon(self._poll)
            if self.store.shared:
                nursery.start_soon(self._compact_when_due)
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

    async def put_manifest(self, name: str, text: str) -> None:
        """Publish a manifest to the store under ``name``, for the daemons of the other ranks."""
        await self._call(self.store.put_manifest, self.settings.source_id, name, text)

    async def get_manifest(self, name: str) -> str | None:
        return await self._call(self.store.get_manifest, self.settings.source_id, name)

    def statistics(self) -> SnapshotStats:
        ns, snap = self.namespace, self.snapshot
        stored = ns.info.get("stored")
        return SnapshotStats(snap.version, snap.created, snap.objects, ns.file_count, ns.dir_count,
                             ns.total_bytes, self.store.url, self.error is None, self.error, self.latest_version,
                             len(stored) if isinstance(stored, list) else 0, *self._master())

    def _master(self) -> tuple[str | None, float | None]:
        master = getattr(self.store, "master", None)
        return (f"{master[0]}:{master[1]}", getattr(self.store, "master_since", None)) if master else (None, None)


def _readable(objects: Iterable[ObjectInfo]) -> Iterator[ObjectInfo]:
    """``objects`` up to where the store turns out damaged (what is read is still worth keeping)."""
    try:
        yield from objects
    except SnapshotInvalid as exc:
        log.warning("the stored snapshot is damaged (%s); its owners and modes are kept as far as it reads", exc)
