"""The reader of one open object (:class:`ReadStream`): sequential detection and readahead, a small
object read whole once and served from those bytes, pages pushed ahead where the cache has a pusher.
(Trio thread, as :class:`~epochfs.cache.service.BlockCache`, whose surface it uses is :class:`BlockCache`
here.)"""

from __future__ import annotations

from typing import Protocol

from epochfs.cache.push import GAP, Pusher
from epochfs.cache.readahead import Readahead
from epochfs.core.blocks import block_count
from epochfs.core.records import ObjectInfo

Reader = tuple[int, int]  # (uid, gid) of the open that reads, as the kernel named it


class BlockCache(Protocol):
    """What a reader uses of :class:`epochfs.cache.service.BlockCache`."""

    block_size: int
    readahead_blocks: int
    whole_held: int
    pusher: Pusher | None

    def prefetch(self, obj: ObjectInfo, indices: range) -> int: ...

    async def read(self, obj: ObjectInfo, offset: int, size: int, *,
                   reader: Reader | None = None) -> bytes | memoryview: ...

    def read_now(self, obj: ObjectInfo, offset: int, size: int, *,
                 reader: Reader | None = None) -> bytes | memoryview | None: ...

    async def read_whole(self, obj: ObjectInfo, offset: int, size: int, *,
                         reader: Reader | None = None) -> bytes | memoryview | None: ...

    def read_whole_now(self, obj: ObjectInfo, offset: int, size: int, *,
                       reader: Reader | None = None) -> bytes | memoryview | None: ...

    def count_hit(self, nbytes: int) -> None: ...


class ReadStream:
    """One open file: detects sequential reading and keeps blocks in flight ahead of a sequential
    reader (:class:`~epochfs.cache.readahead.Readahead`: a window that grows while the reader keeps up).

    An object of at most :attr:`WHOLE` bytes in one block is read whole on the first request, verified,
    and later requests on the handle are served from those bytes until it is closed: with a large
    kernel readahead window the kernel asks for a small file in two requests (its first page, then the
    rest), and the second then costs no lookup, block file read or checksum. Bounded in total by
    :attr:`BlockCache.WHOLE_BUDGET`."""

    WHOLE = 1 << 20

    #: Requests at most that :meth:`read_now` noted and left to :meth:`read`.
    WAITING = 64

    def __init__(self, cache: BlockCache, obj: ObjectInfo, inode: int = 0, reader: Reader | None = None) -> None:
        self.cache = cache
        self.obj = obj
        self.inode = inode
        self.reader = reader  # who opened it (what the learned order learns from; None: nobody known)
        self._pushed_to = 0  # blocks below this were pushed into the kernel for this reader
        self._ahead = Readahead(cache, obj, block_count(obj.size, cache.block_size))
        self._whole: bytes | memoryview | None = None
        self._small = obj.size <= self.WHOLE and obj.size <= cache.block_size
        self._large = obj.size > cache.block_size
        self._waiting: set[tuple[int, int]] = set()  # requests read_now noted and left to read

    def close(self) -> None:
        if self._whole is not None:
            self.cache.whole_held -= len(self._whole)
            self._whole = None

    def read_now(self, offset: int, size: int) -> bytes | memoryview | None:
        """:meth:`read` if it would not wait (a small object's bytes at hand; a larger one's in memory
        or in the page cache), else None: then :meth:`read` (which does not count the request again)."""
        if not self._small:
            self._note(offset, size)
            data = self.cache.read_now(self.obj, offset, size, reader=self.reader)
            if data is None:
                if len(self._waiting) >= self.WAITING:  # (reads that never came: the session ended)
                    self._waiting.clear()
                self._waiting.add((offset, size))
                return None
            self._follow(offset)
            return data
        whole = self._whole
        if whole is None:
            whole = self.cache.read_whole_now(self.obj, offset, size, reader=self.reader)
            if whole is None:
                return None
            self._whole = whole
            self.cache.whole_held += len(whole)
            return whole[offset:offset + size]
        part = whole[offset:offset + size]
        self.cache.count_hit(len(part))
        return part

    async def read(self, offset: int, size: int) -> bytes | memoryview:
        cache = self.cache
        if self._small:
            whole = self._whole
            if whole is None:
                whole = await cache.read_whole(self.obj, offset, size, reader=self.reader)
                if whole is None:  # the budget is spent: read as asked
                    return await cache.read(self.obj, offset, size, reader=self.reader)
                if self._whole is None:  # (another request of this handle may have kept it meanwhile)
                    self._whole = whole
                    cache.whole_held += len(whole)
                return whole[offset:offset + size]
            part = whole[offset:offset + size]
            cache.count_hit(len(part))
            return part
        if (offset, size) in self._waiting:
            self._waiting.discard((offset, size))
        else:
            self._note(offset, size)
        data = await cache.read(self.obj, offset, size, reader=self.reader)
        self._follow(offset)
        return data

    def _note(self, offset: int, size: int) -> None:
        """A request at ``offset``: sequential detection, and readahead for a sequential reader (a read
        in the first page of a block pushed for it continues its run: it read the pages between)."""
        if not self._ahead.note(offset, size, continues=bool(self._pushed_to) and self._pushed_gap(offset)):
            self._pushed_to = 0

    def _follow(self, offset: int) -> None:
        """Push the pages ahead of a sequential reader that was just answered at ``offset``."""
        if self._ahead.sequential >= 1 and self._large and self.cache.pusher is not None:
            self._pushed_to = self.cache.pusher.follow(self.obj, self.inode, offset, self._pushed_to)

    def _pushed_gap(self, offset: int) -> bool:
        """Whether ``offset`` is in the first page of a block pushed for this reader (the reader read
        the pushed pages in between without the daemon seeing them)."""
        block = offset // self.cache.block_size
        return block < self._pushed_to and offset - block * self.cache.block_size < GAP
