"""Files this node wrote and uploaded (write-back), as the block cache sees them (:class:`OwnUploads`).

Their bytes are on this node already. From the moment an upload is published until they are adopted
as cached blocks of the uploaded version, a block of it the store lacks is read from the data file, not
fetched: a restore right after ``sync`` on the node that saved the checkpoint costs the backend nothing,
however far behind the copy into the cache is. Adopted blocks are checksummed and bound to the uploaded
version's ETag as any fill; the data file is never written again once its upload is published.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from epochfs.blockstore.objects import Place
from epochfs.blockstore.store import BlockStore
from epochfs.core.blocks import block_bounds, block_count
from epochfs.core.records import ObjectInfo

log = logging.getLogger(__name__)

#: ``read(start, length)``: bytes of an uploaded file (blocking), or None once they are gone.
Read = Callable[[int, int], "bytes | None"]


class OwnUploads:
    """What write-back hands the block cache (:class:`epochfs.writeback.uploads.Keep`)."""

    def __init__(self, store: BlockStore, block_size: int, block_id: Callable[[ObjectInfo, int], bytes],
                 is_cached: Callable[[bytes], bool]) -> None:
        self.store = store
        self.block_size = block_size
        self.block_id = block_id  # (block 0's names the object's file in the store)
        self.is_cached = is_cached  # resident, or being fetched
        self._offered: dict[tuple[str, str], Read] = {}  # by (key, ETag) of the uploaded version

    def offer(self, obj: ObjectInfo, read: Read) -> None:
        """The bytes of ``obj`` are on this node: from now until :meth:`withdraw`, a block of it not in
        the store is read with ``read``, not fetched."""
        self._offered[(obj.key, obj.etag)] = read

    def withdraw(self, obj: ObjectInfo) -> None:
        """The bytes :meth:`offer` named are going: misses fetch again."""
        self._offered.pop((obj.key, obj.etag), None)

    def reader(self, obj: ObjectInfo) -> Read | None:
        """How to read ``obj``'s bytes here, if they were offered (any thread)."""
        return self._offered.get((obj.key, obj.etag)) if self._offered else None

    async def adopt(self, obj: ObjectInfo, read: Read, path: str | None = None) -> int:
        """Keep the bytes of ``obj`` as its cached blocks, so that reading it back here fetches nothing
        once the data file is gone. Each block is admitted as a fetched one would be (the eviction policy
        decides; counted against the cache's bound); it stops at the first the policy refuses or that
        fails. ``path``: the data file, which the store may take as the object's file (no byte copied,
        each block checksummed from it) where it holds none of the object yet. The bytes cached."""
        if path is not None:
            taken = await self._adopt_file(obj, path)
            if taken is not None:
                return taken
        store = self.store
        kept = 0
        for index in range(block_count(obj.size, self.block_size)):
            bid = self.block_id(obj, index)
            start, length = block_bounds(index, obj.size, self.block_size)
            if self.is_cached(bid):
                continue
            if not store.reserve(bid, length):
                break
            try:
                data = await trio.to_thread.run_sync(read, start, length)
                if data is None or len(data) != length:
                    raise OSError(f"{0 if data is None else len(data)} bytes read of {length}")
                place = Place(self.block_id(obj, 0), start, obj.size)
                tmp, meta = await trio.to_thread.run_sync(store.write_temp, bid, data, False, place)
            except OSError as exc:
                store.release(length)
                log.warning("could not keep %s in the cache after its upload: %s", obj.key, exc)
                break
            if store.lookup(bid) is not None:  # (fetched by a reader meanwhile)
                store.abandon(tmp, meta)
                store.release(length, failed=False)
                continue
            try:
                store.install(bid, tmp, meta)
            except OSError as exc:
                store.release(length)
                log.warning("could not keep %s in the cache after its upload: %s", obj.key, exc)
                break
            kept += length
        return kept

    async def _adopt_file(self, obj: ObjectInfo, path: str) -> int | None:
        """:meth:`adopt` by taking the data file itself; None where the store does not take it."""
        store = self.store
        oid = self.block_id(obj, 0)
        written = store.take_file(oid, path, obj.size)
        if written is None:
            return None
        kept = at = 0
        try:
            for index in range(block_count(obj.size, self.block_size)):
                bid = self.block_id(obj, index)
                at, length = block_bounds(index, obj.size, self.block_size)
                if self.is_cached(bid):
                    continue  # (being fetched by a reader: its fill writes the same bytes at the same place)
                if not store.reserve(bid, length):
                    break
                place = Place(oid, at, obj.size)
                try:
                    meta = await trio.to_thread.run_sync(store.checked_block, bid, written, place, length)
                    if store.lookup(bid) is not None:
                        store.release(length, failed=False)
                        continue
                    store.install(bid, written, meta)
                except OSError as exc:
                    store.release(length)
                    log.warning("could not keep %s in the cache after its upload: %s", obj.key, exc)
                    break
                kept += length
                at += length
            else:
                at = obj.size
        finally:
            store.untake(oid, at, obj.size)
        return kept
