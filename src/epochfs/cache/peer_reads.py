"""What the block cache answers other members (the cluster tier's peer port): a block read and checked,
one only if it is held here, or a cached block's range of its file for the kernel to send. A part of
:class:`epochfs.cache.service.BlockCache` (the trio thread); nothing here counts as this node's reads.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import trio

from epochfs.blockstore.format import BlockMeta, digest
from epochfs.blockstore.lending import Extent
from epochfs.cache import workers
from epochfs.cache.flights import Fetch, Kept
from epochfs.core.records import ObjectInfo

if TYPE_CHECKING:
    from epochfs.blockstore.store import BlockStore


class PeerReads:
    store: BlockStore
    _flights: dict[bytes, Fetch]
    _recent: OrderedDict[bytes, Kept]
    _read_limiter: trio.CapacityLimiter

    def block_id(self, obj: ObjectInfo, index: int) -> bytes: ...  # (BlockCache's)

    def block_length(self, obj: ObjectInfo, index: int) -> int: ...

    async def _read_block(self, obj: ObjectInfo, index: int, length: int, lo: int, hi: int, *,
                          for_peer: bool = False, **kw: object) -> bytes | memoryview: ...

    async def _read_from_disk(self, bid: bytes, meta: BlockMeta, lo: int, hi: int) -> memoryview | None: ...

    async def read_for_peer(self, obj: ObjectInfo, index: int, warm: bool) -> bytes | None:
        """Block ``index`` of ``obj`` for another member: from the store, or fetched from the backend
        (never from a peer); ``warm``: only make sure it is here. Not counted as a read of this node."""
        length = self.block_length(obj, index)
        if warm and self.store.lookup(self.block_id(obj, index)) is not None:
            return None
        data = await self._read_block(obj, index, length, 0, length, for_peer=True)
        return None if warm else bytes(data)

    def extent_for_peer(self, obj: ObjectInfo, index: int) -> Extent | None:
        """Block ``index`` of ``obj`` as its range of its file on the cache disk, with the digest taken at
        its fill, for the kernel to send to another member (hand it back: :meth:`sent`); None if it is
        not there so (in flight, not cached, or without a digest). Not counted."""
        bid = self.block_id(obj, index)
        meta = None if bid in self._flights else self.store.lookup(bid)
        if meta is None or meta.length != self.block_length(obj, index):
            return None
        return self.store.extent(bid, meta)

    def sent(self, extent: Extent) -> None:
        self.store.sent(extent)

    async def digest_for_peer(self, obj: ObjectInfo, index: int, data: bytes) -> bytes:
        """The digest of block ``index`` of ``obj``, whose ``data`` was read and checked for a member;
        kept with the block where it is cached without one (its next answer is sent from its file)."""
        bid = self.block_id(obj, index)
        meta = self.store.lookup(bid)
        if meta is not None and meta.digest and meta.length == len(data):
            return meta.digest  # (taken at its fill from the bytes read: the asker checks them against it)
        found = await workers.run_sync(digest, data, limiter=self._read_limiter) if len(data) >= 256 << 10 else digest(data)
        meta = self.store.lookup(bid)
        if self.store.digests and meta is not None and not meta.digest and meta.length == len(data):
            self.store.index.put(bid, meta._replace(digest=found))
        return found

    async def read_stored(self, obj: ObjectInfo, index: int) -> bytes | None:
        """Block ``index`` of ``obj`` if this node holds it (in memory or on the cache disk, verified),
        else None: never fetched (another cache node filling its share asks this). Not counted."""
        bid, length = self.block_id(obj, index), self.block_length(obj, index)
        flight = self._flights.get(bid)
        if flight is not None and not flight.warm:  # on its way here: wait for it
            await flight.event.wait()
            if flight.error is None and flight.data is not None and len(flight.data) == length:
                return bytes(flight.data)
        kept = self._recent.get(bid)
        if kept is not None and len(kept.data) == length:
            return bytes(kept.data)
        meta = self.store.lookup(bid)
        if meta is None or meta.length != length:
            return None
        data = await self._read_from_disk(bid, meta, 0, length)
        return None if data is None else bytes(data)
