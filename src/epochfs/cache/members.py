"""A reader of a packed member: a file whose bytes are a range of its shard (:func:`records.stored_extent`).
Its reads are the shard's, through the same blocks, single-flight and checksums as any object's: the
members that share a block share its fetch, and the prefetcher fetches the shard's blocks in the order
the members are read. (Trio thread, as :class:`~epochfs.cache.streams.ReadStream`.)"""

from __future__ import annotations

from typing import Protocol

from epochfs.cache.keys import blocks_for_range
from epochfs.records import ObjectInfo


class BlockCache(Protocol):
    """What a member's reader uses of :class:`epochfs.cache.service.BlockCache`."""

    block_size: int
    readahead_blocks: int

    def prefetch(self, obj: ObjectInfo, indices: range) -> int: ...

    async def read(self, obj: ObjectInfo, offset: int, size: int) -> bytes | memoryview: ...

    def read_now(self, obj: ObjectInfo, offset: int, size: int) -> bytes | memoryview | None: ...


class MemberStream:
    """One open member. A sequential reader of a member larger than a block has the next
    ``readahead_blocks`` blocks of its range fetched ahead (never past the member's end); the kernel's page
    cache keeps what it read (pushing pages is for whole objects, whose blocks align with the file)."""

    SLACK = 1 << 20

    def __init__(self, cache: BlockCache, obj: ObjectInfo, stored: ObjectInfo, base: int) -> None:
        self.cache = cache
        self.obj = obj
        self.stored = stored
        self.base = base
        self._next = 0
        self._sequential = 0
        self._ahead_to = 0  # shard blocks below this were handed to readahead
        bs = cache.block_size
        blocks = blocks_for_range(base, obj.size, stored.size, bs)
        self._last = blocks.stop  # one past the member's last block in the shard
        self._large = len(blocks) > 1

    def close(self) -> None:
        pass

    def read_now(self, offset: int, size: int) -> bytes | memoryview | None:
        """:meth:`read` of a member within one block if its bytes are at hand, else None."""
        if self._large:
            return None
        end = min(offset + size, self.obj.size)
        if offset >= end:
            return b""
        return self.cache.read_now(self.stored, self.base + offset, end - offset)

    async def read(self, offset: int, size: int) -> bytes | memoryview:
        end = min(offset + size, self.obj.size)
        if offset >= end:
            return b""
        cache = self.cache
        if self._large:
            self._sequential = self._sequential + 1 if abs(offset - self._next) <= self.SLACK else 0
            self._next = end
            if self._sequential >= 2 and cache.readahead_blocks:
                current = (self.base + offset) // cache.block_size
                first = max(current + 1, self._ahead_to)
                last = min(current + 1 + cache.readahead_blocks, self._last)
                if first < last:
                    cache.prefetch(self.stored, range(first, last))
                    self._ahead_to = last
        return await cache.read(self.stored, self.base + offset, end - offset)
