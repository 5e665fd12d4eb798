"""Objects shared between the node's mounts by content (:class:`SharedContent`), as the block cache sees them.

Each mount has a store of its own; the node's content index (:mod:`epochfs.blockstore.content`) says
where one of them holds an object of a given content. This mount:

- **offers** each object it holds whole whose ETag names its content: its file (or its pack range)
  goes into the index, in batches written off the trio thread every :attr:`SharedContent.FLUSH`
  seconds (the newest offer of a content wins);
- **adopts** before it fetches: the first fetch of an object of which it holds nothing, whose content
  another store offered, waits while the object is copied from there (at most half a fetch's
  deadline; it fetches after that), hashed (MD5, against the ETag), taken into the store as the
  object's file (or a small object's pack block) and checksummed per chunk like any fill. An object
  file is taken by a hard link, so the bytes are on disk once for both stores: neither store then
  punches or writes that file (a block it loses takes the whole object out of that store:
  :func:`epochfs.blockstore.content.alone`); a pack's range is copied. An entry that
  does not lead to those bytes is dropped and the object fetched. One adoption per object at a time;
  every block of it then reads from the store.

Adopted bytes count as hits (nothing was fetched) and in :class:`SharedStats`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from epochfs.blockstore import packs as pk
from epochfs.blockstore.content import (
    MAX_COPY,
    ContentIndex,
    Entry,
    Refused,
    content_md5,
    copy_checked,
    key_of,
    link_checked,
    open_source,
    read_checked,
)
from epochfs.blockstore.format import BlockMeta
from epochfs.blockstore.objects import Place
from epochfs.blockstore.store import WOULD_BLOCK, BlockStore
from epochfs.cache.nodeshare import NodeShare
from epochfs.core.blocks import block_bounds, block_count
from epochfs.core.errors import ConfigError
from epochfs.core.private import private_dir
from epochfs.core.records import ObjectInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedStats:
    adopted_objects: int = 0  # objects copied from another store of the node instead of fetched
    adopted_bytes: int = 0
    refused: int = 0  # index entries that did not lead to the content they name (dropped, fetched)
    offered: int = 0  # objects this store offered to the node's other mounts
    linked: int = 0  # of the objects adopted, those linked (on disk once for both stores), not copied


class SharedContent:
    FLUSH = 0.5  # seconds between the offers' writes

    def __init__(self, index: ContentIndex, store: BlockStore, scope: bytes, block_size: int,
                 block_id: Callable[[ObjectInfo, int], bytes]) -> None:
        self.index = index
        self.store = store
        self.scope = scope
        self.block_size = block_size
        self.block_id = block_id
        self._root = os.path.realpath(store.cache_dir)
        self._offers: list[tuple[bytes, str, int]] = []  # (key, path, offset) to write
        self._adopting: dict[bytes, trio.Event] = {}  # object id -> its adoption's end
        self._nursery: trio.Nursery | None = None
        self._adopted = self._adopted_bytes = self._refused = self._offered = self._linked = 0

    @classmethod
    def open(cls, directory: Path, store: BlockStore, scope: bytes | None, block_size: int,
             block_id: Callable[[ObjectInfo, int], bytes]) -> SharedContent | None:
        """The mount's part in the node's sharing, or None (said in the log) where it cannot take part:
        a backend whose versions do not name content, a cache directory outside the share directory's
        parent, an index that cannot be opened."""
        if scope is None:
            log.info("objects are not shared with the node's other mounts: this backend's versions do not "
                     "name their content")
            return None
        index = ContentIndex(directory)
        if not os.path.realpath(store.cache_dir).startswith(index.root + "/"):
            log.info("objects are not shared with the node's other mounts: the cache directory %s is not under "
                     "%s, where the share directory %s is", store.cache_dir, index.root, directory)
            return None
        try:
            index.open()
        except (ConfigError, OSError) as exc:
            log.warning("objects are not shared with the node's other mounts: %s", exc)
            return None
        except Exception as exc:  # noqa: BLE001 (lmdb.Error: a damaged index costs sharing, not the mount)
            log.warning("objects are not shared with the node's other mounts: the index in %s: %s", directory, exc)
            return None
        return cls(index, store, scope, block_size, block_id)

    def close(self) -> None:
        self.index.close()


    async def run(self) -> None:
        """Write the offers, every :attr:`FLUSH` seconds (runs in the cache's nursery)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                while True:
                    await trio.sleep(self.FLUSH)
                    await self._flush()
            finally:
                self._nursery = None
                with trio.CancelScope(shield=True):
                    await self._flush()

    def key(self, obj: ObjectInfo) -> bytes | None:
        """The index key of ``obj``'s content, or None where its ETag does not name it."""
        md5 = content_md5(obj.etag)
        if md5 is None or not 0 < obj.size <= MAX_COPY:
            return None
        return key_of(self.scope, md5, obj.size)

    # -- offering ---------------------------------------------------------------------------------------

    def installed(self, obj: ObjectInfo, meta: BlockMeta) -> None:
        """A block of ``obj`` was indexed (``meta``): offer the object if it is whole now."""
        key = self.key(obj)
        if key is None:
            return
        if meta.pack:
            if obj.size == meta.length:
                self._offers.append((key, self.store.packs.path(meta.pack), meta.offset))
            return
        f = self.store.objects.get(meta.obj)
        if f is not None and f.whole:
            self._offers.append((key, self.store.object_path(meta.obj), 0))

    async def _flush(self) -> None:
        offers, self._offers = self._offers, []
        if offers:
            self._offered += await trio.to_thread.run_sync(self._write, offers)

    def _write(self, offers: list[tuple[bytes, str, int]]) -> int:
        entries = []
        for key, path, offset in offers:
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue  # (evicted meanwhile)
            entries.append((key, Entry(st.st_ino, offset, os.path.join(self._root, os.path.relpath(path, self.store.cache_dir)))))
        try:
            self.index.offer(entries)
        except Exception as exc:  # noqa: BLE001 (lmdb.Error, a full map: offers are lost, nothing else)
            log.warning("could not offer cached objects to the node's other mounts: %s", exc)
            return 0
        return len(entries)

    async def held(self, objs: list[ObjectInfo]) -> list[bool]:
        """Whether another store of the node holds each object now (by its content: an entry that leads
        to a file of the node's caches, the inode offered, long enough; the MD5 is checked only when it
        is copied): what a first read of it would copy rather than fetch (``epochfs plan``)."""
        return await trio.to_thread.run_sync(self._held, [(self.key(obj), obj.size) for obj in objs])

    def _held(self, asked: list[tuple[bytes | None, int]]) -> list[bool]:
        out = []
        for key, size in asked:
            entry = self.index.find(key) if key is not None else None
            held = False
            if entry is not None:
                try:
                    os.close(open_source(self.index.root, entry, size))
                    held = True
                except Refused:
                    pass
            out.append(held)
        return out

    # -- adopting ---------------------------------------------------------------------------------------

    def offered(self, obj: ObjectInfo) -> bool:
        """Whether a fetch of ``obj`` is to take it from another store of the node first (then
        :meth:`block`): it is being taken now, or this store holds none of it and the index names its
        content (its taking starts now)."""
        key = self.key(obj)
        if key is None or self._nursery is None:
            return False
        oid = self.block_id(obj, 0)
        if oid in self._adopting:
            return True
        if self.store.objects.get(oid) is not None or self.store.lookup(oid) is not None:
            return False  # (something of it is here: fetched block by block as it is)
        entry = self.index.find(key)
        if entry is None:
            return False
        done = self._adopting[oid] = trio.Event()
        self._nursery.start_soon(self._adopt, obj, oid, key, entry, done)
        return True

    async def block(self, obj: ObjectInfo, bid: bytes, length: int, wait: float,
                    read_from_disk: Callable[[bytes, BlockMeta, int, int], Awaitable[memoryview | None]]
                    ) -> memoryview | None:
        """Block ``bid`` of ``obj`` (``length`` bytes, :meth:`offered`), verified, from the store once the
        object was taken (waiting ``wait`` seconds at most for that); None where it was not (then it is
        fetched)."""
        done = self._adopting.get(self.block_id(obj, 0))
        if done is not None:
            with trio.move_on_after(wait):
                await done.wait()
        meta = self.store.lookup(bid)
        if meta is None or meta.length != length:
            return None
        data = self.store.read(bid, meta, 0, length, nowait=True)
        if data is WOULD_BLOCK:
            data = await read_from_disk(bid, meta, 0, length)
        return data

    async def _adopt(self, obj: ObjectInfo, oid: bytes, key: bytes, entry: Entry, done: trio.Event) -> None:
        try:
            kept = await self._copy_in(obj, oid, key, entry)
        except Refused as exc:
            self._refused += 1
            log.info("%s: the copy another mount offered was refused (%s); fetching it", obj.key, exc)
            try:
                self.index.forget(key, entry)
            except Exception:  # noqa: BLE001 (lmdb.Error: the entry stays, the next reader refuses it too)
                pass
            kept = 0
        except OSError as exc:
            log.warning("%s: could not copy it from another mount's cache (%s); fetching it", obj.key, exc)
            kept = 0
        except Exception:  # a bug or an unexpected library error: this object is fetched, the mount serves on
            log.exception("%s: taking it from another mount's cache failed; fetching it", obj.key)
            kept = 0
        finally:
            del self._adopting[oid]
            done.set()
        if kept == obj.size:
            self._adopted += 1
            self._adopted_bytes += kept

    async def _copy_in(self, obj: ObjectInfo, oid: bytes, key: bytes, entry: Entry) -> int:
        """Copy, check and install every block of ``obj``; the bytes installed (all, or none: a block the
        policy refuses room for stops it before anything is copied)."""
        store, n = self.store, block_count(obj.size, self.block_size)
        blocks = []
        for index in range(n):
            bid = self.block_id(obj, index)
            start, length = block_bounds(index, obj.size, self.block_size)
            blocks.append((bid, start, length))
        reserved = [0]  # (bytes reserved and not yet installed: given back at the end)
        try:
            linkable = not entry.offset and not (store.packing and obj.size < pk.PACK_BELOW)
            for bid, _, length in blocks:
                if store.lookup(bid) is not None or not store.reserve(bid, length, shared=linkable):
                    return 0
                reserved[0] += length
            md5 = key[16:32]
            if store.packing and obj.size < pk.PACK_BELOW:  # (a small object: one block in a pack)
                data = await trio.to_thread.run_sync(read_checked, self.index.root, entry, obj.size, md5)
                bid, _, length = blocks[0]
                written, meta = await trio.to_thread.run_sync(store.write_temp, bid, data, False,
                                                              Place(oid, 0, obj.size))
                if store.lookup(bid) is not None:
                    store.abandon(written, meta)
                    return 0
                store.install(bid, written, meta)
                reserved[0] -= length
                self.installed(obj, meta)
                return obj.size
            return await self._take_file(obj, oid, entry, md5, blocks, reserved)
        finally:
            if reserved[0]:
                store.release(reserved[0], failed=False)

    async def _take_file(self, obj: ObjectInfo, oid: bytes, entry: Entry, md5: bytes,
                         blocks: list[tuple[bytes, int, int]], reserved: list[int]) -> int:
        store = self.store
        tmp = str(store.tmp_dir / f"shared-{oid.hex()}")
        args = (self.index.root, entry, obj.size, md5, tmp, blocks, store.digests)
        sums = await trio.to_thread.run_sync(link_checked, *args)  # (a link: the bytes on disk once)
        linked = sums is not None
        if sums is None:
            sums = await trio.to_thread.run_sync(copy_checked, *args)
        written = store.take_file(oid, tmp, obj.size, linked=linked)
        if written is None:  # (a fill made the object's file meanwhile)
            await trio.to_thread.run_sync(_discard, tmp)
            return 0
        if linked:  # (its bytes are the other store's too: not charged to this mount; before any block is
            store.link_in(oid, obj.size)  # indexed, so no record counts them; undone if the file goes)
        at = 0
        meta = None
        try:
            for (bid, start, length), (chunks, whole) in zip(blocks, sums, strict=True):
                meta = BlockMeta(length, chunks, 0, 0, start, oid, obj.size, whole)
                if store.lookup(bid) is None:  # (else a fill wrote the same bytes at the same place)
                    store.install(bid, written, meta)
                    reserved[0] -= length
                at = start + length
        finally:
            store.untake(oid, at, obj.size)
        if meta is not None:
            self.installed(obj, meta)
        if linked and at == obj.size:
            self._linked += 1
        return at

    def statistics(self) -> SharedStats:
        return SharedStats(adopted_objects=self._adopted, adopted_bytes=self._adopted_bytes,
                           refused=self._refused, offered=self._offered, linked=self._linked)


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def join_node(directory: Path, store: BlockStore, scope: bytes | None, block_size: int,
              block_id: Callable[[ObjectInfo, int], bytes], opened: contextlib.ExitStack, *,
              content: bool = True) -> tuple[SharedContent | None, NodeShare | None]:
    """A mount's part in the node's cache under ``directory``: one capacity split with the node's other
    mounts (:mod:`epochfs.cache.nodeshare`), and, with ``content``, objects shared by content (None for a
    part it cannot take, said in the log). What it opens is closed by ``opened``."""
    node: NodeShare | None = NodeShare(directory, store)
    try:
        private_dir(directory)
        node.open()
        opened.callback(node.close)
    except (ConfigError, OSError) as exc:
        log.warning("this mount does not share the node's cache (%s): it holds its own --cache-size", exc)
        return None, None
    except Exception as exc:  # noqa: BLE001 (lmdb.Error: a damaged record file costs the split, not the mount)
        log.warning("this mount does not share the node's capacity (the records in %s: %s)", directory, exc)
        node = None
    shared = SharedContent.open(directory, store, scope, block_size, block_id) if content else None
    if shared is not None:
        opened.callback(shared.close)
    return shared, node
