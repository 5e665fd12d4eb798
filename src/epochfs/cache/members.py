"""A reader of a packed member: a file whose bytes are a range of its shard (:func:`records.stored_extent`).
Its reads are the shard's, through the same blocks, single-flight and checksums as any object's: the
members that share a block share its fetch, and the prefetcher fetches the shard's blocks in the order
the members are read. (Trio thread, as :class:`~epochfs.cache.streams.ReadStream`.)

The blocks' checksums vouch for the shard's bytes, not for where the index says a file lies in it. So
no byte of a member reaches a reader before the member's whole range has been checked against the
member's own checksum (the xxh64 the pack recorded from the source file, carried in its ETag:
:func:`records.member_location`): an index entry off by a byte, pointing at a tar header, cut short or
overlapping another file gives EIO, never another file's bytes. A member within one block is read
whole and checked at its first read (and kept for the handle's later reads, as a small object is); a
larger one is read through, block by block, at its first read. A member found right is remembered
(:class:`Verified`, by its ETag, which names the shard's version and the range): its later reads are
the shard's verified blocks of that version, the same bytes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Protocol

import xxhash

from epochfs.cache.readahead import Readahead
from epochfs.core.blocks import blocks_for_range
from epochfs.core.errors import EpochfsError
from epochfs.core.records import ObjectInfo

log = logging.getLogger(__name__)


class DamagedMember(EpochfsError):
    """A packed member's range does not hold the bytes its checksum names (the pack's index is wrong):
    the reader gets EIO."""


class Verified:
    """The members (by ETag) whose ranges were found to hold their bytes; the least recently checked
    are forgotten past ``capacity`` (and checked again at their next first read)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.damaged = 0  # members found not to match their checksum

    def __contains__(self, etag: str) -> bool:
        if etag in self._seen:
            self._seen.move_to_end(etag)
            return True
        return False

    def add(self, etag: str) -> None:
        self._seen[etag] = None
        self._seen.move_to_end(etag)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


class BlockCache(Protocol):
    """What a member's reader uses of :class:`epochfs.cache.service.BlockCache`."""

    block_size: int
    readahead_blocks: int
    whole_held: int
    WHOLE_BUDGET: int
    verified: Verified

    def prefetch(self, obj: ObjectInfo, indices: range) -> int: ...

    async def read(self, obj: ObjectInfo, offset: int, size: int, *,
                   counted: tuple[int, int] | None = None) -> bytes | memoryview: ...

    def read_now(self, obj: ObjectInfo, offset: int, size: int, *,
                 counted: tuple[int, int] | None = None) -> bytes | memoryview | None: ...

    def count_hit(self, nbytes: int) -> None: ...


class MemberStream:
    """One open member. A member larger than a block has the blocks of its range ahead of the reader
    fetched as a whole object's are (:class:`~epochfs.cache.readahead.Readahead`: while it is read
    through at its first read, and then for a sequential reader), never past the member's end; the
    kernel's page cache keeps what it read (pushing pages is for whole objects, whose blocks align with
    the file)."""

    WHOLE = 1 << 20  # a member within one block and at most this long is kept by its handle once checked

    def __init__(self, cache: BlockCache, obj: ObjectInfo, stored: ObjectInfo, base: int, checksum: int) -> None:
        self.cache = cache
        self.obj = obj
        self.stored = stored
        self.base = base
        self.checksum = checksum
        self._whole: bytes | memoryview | None = None  # a small member's checked bytes, kept by this handle
        bs = cache.block_size
        blocks = blocks_for_range(base, obj.size, stored.size, bs)
        self._large = len(blocks) > 1
        self._ahead = Readahead(cache, stored, blocks.stop, start=base)

    def close(self) -> None:
        if self._whole is not None:
            self.cache.whole_held -= len(self._whole)
            self._whole = None

    def _span(self, offset: int, size: int) -> tuple[int, int]:
        end = min(offset + size, self.obj.size)
        return offset, max(offset, end)

    def _check(self, data: bytes | memoryview) -> None:
        if xxhash.xxh64_intdigest(data) != self.checksum:
            self._damaged()
        self.cache.verified.add(self.obj.etag)

    def _damaged(self) -> None:
        self.cache.verified.damaged += 1
        raise DamagedMember(f"{self.obj.key}: the bytes its pack's index locates in {self.stored.key} do not "
                            "match the file's checksum (a damaged index: pack it again)")

    def _keep(self, whole: bytes | memoryview) -> None:
        if len(whole) <= self.WHOLE and self.cache.whole_held + len(whole) <= self.cache.WHOLE_BUDGET:
            self._whole = whole
            self.cache.whole_held += len(whole)

    def read_now(self, offset: int, size: int) -> bytes | memoryview | None:
        """:meth:`read` of a member within one block if its bytes are at hand, else None."""
        if self._large:
            return None
        offset, end = self._span(offset, size)
        if offset >= end:
            return b""
        if self._whole is not None:
            self.cache.count_hit(end - offset)
            return self._whole[offset:end]
        if self.obj.etag in self.cache.verified:
            return self.cache.read_now(self.stored, self.base + offset, end - offset)
        whole = self.cache.read_now(self.stored, self.base, self.obj.size,
                                    counted=(self.base + offset, self.base + end))
        if whole is None:
            return None
        self._check(whole)
        self._keep(whole)
        return whole[offset:end]

    async def read(self, offset: int, size: int) -> bytes | memoryview:
        offset, end = self._span(offset, size)
        if offset >= end:
            return b""
        cache = self.cache
        if not self._large:
            if self._whole is not None:
                cache.count_hit(end - offset)
                return self._whole[offset:end]
            if self.obj.etag not in cache.verified:
                whole = await cache.read(self.stored, self.base, self.obj.size,
                                         counted=(self.base + offset, self.base + end))
                self._check(whole)
                self._keep(whole)
                return whole[offset:end]
            return await cache.read(self.stored, self.base + offset, end - offset)
        self._ahead.note(self.base + offset, end - offset)
        if self.obj.etag not in cache.verified:
            await self._read_through(offset, end)
            return await cache.read(self.stored, self.base + offset, end - offset, counted=(0, 0))
        return await cache.read(self.stored, self.base + offset, end - offset)

    async def _read_through(self, offset: int, end: int) -> None:
        """Check a large member against its checksum, reading its range block by block (the readahead
        keeps the next blocks coming); the bytes asked for [offset, end) are counted here."""
        cache, bs = self.cache, self.cache.block_size
        digest = xxhash.xxh64()
        pos, stop = self.base, self.base + self.obj.size
        asked = (self.base + offset, self.base + end)
        while pos < stop:
            current = pos // bs
            self._ahead.ahead(current)
            upto = min(stop, (current + 1) * bs)
            digest.update(await cache.read(self.stored, pos, upto - pos, counted=asked))
            pos = upto
        if digest.intdigest() != self.checksum:
            self._damaged()
        cache.verified.add(self.obj.etag)
