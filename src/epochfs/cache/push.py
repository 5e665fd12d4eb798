"""Pushing verified blocks into the kernel page cache ahead of a sequential reader.

A sequential reader of a large file would otherwise send the daemon one READ per MiB, each answered
on the trio thread. Instead, as the reader moves into block ``k``, blocks ``k + 1 .. k + ahead`` are
pushed (``FUSE_NOTIFY_STORE``) from worker threads: their bytes go straight into the file's page
cache and the reader's next reads of them never reach the daemon.

Rules:

- **Only verified bytes.** A block is pushed from the block store after its checksums were verified
  in the same worker-thread job, or from the memory of a completed fetch (the bytes readers are served).
  A push never starts a fetch of its own: readahead and the prefetcher do that, and a block still in
  flight is pushed when its bytes arrive.
- **The reader stays visible.** The first page of each pushed block is left out, so the reader's
  arrival there is one small READ: that is how the daemon learns where it is and pushes further.
- **Bounded.** At most ``ahead`` blocks beyond the block a reader last asked for are pushed for it, and
  at most ``threads`` pushes run at once. Pushed pages are ordinary page cache: the kernel reclaims them
  under memory pressure (a reclaimed page is read again through the daemon).
- **Never stale.** The kernel seam's :meth:`KernelPages.current` is asked after every push whether the
  inode still shows the object pushed; if a new snapshot changed it meanwhile, the inode's pages are
  dropped again.
- **Accounting.** A pushed block counts as a hit of the bytes pushed (it was in the cache or had been
  fetched ahead, and its reader will not wait for it); the first page's READ counts as usual. So the hit
  ratio keeps its meaning: misses are reads that waited for the backend. A page reclaimed before it
  was read and read again counts twice.
- **Failure changes nothing.** A push that fails (the kernel forgot the inode, ENOSYS, a damaged block)
  only means the reader's READs reach the daemon as before; a damaged block is dropped from the store.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, NamedTuple, Protocol

import trio

from epochfs.blockstore.store import BlockStore
from epochfs.core.blocks import block_bounds, block_count
from epochfs.core.records import ObjectInfo

log = logging.getLogger(__name__)

#: Left out at the start of each pushed block: the reader's READ there says where it is.
GAP = 4096


class KernelPages(Protocol):
    """The kernel's page cache of the mount's files (the FUSE adapter implements it)."""

    def store(self, inode: int, offset: int, data: memoryview) -> None:
        """(Worker thread; may block while a READ of those pages is in flight.) Put ``data`` into the
        page cache of ``inode`` at ``offset``. OSError if the kernel does not know the inode (ENOENT)
        or cannot store (ENOSYS)."""

    def current(self, inode: int, obj: ObjectInfo) -> bool:
        """(Trio thread.) Whether ``inode`` still shows ``obj``."""

    def forget(self, inode: int) -> None:
        """(Worker thread.) Drop the inode's cached pages."""


class Blocks(Protocol):
    """What the pusher needs of the block cache (:class:`epochfs.cache.service.BlockCache`)."""

    block_size: int
    store: BlockStore

    nursery: trio.Nursery | None  # where pushes run (None: the cache is not running)

    def block_id(self, obj: ObjectInfo, index: int) -> bytes: ...

    def at_hand(self, bid: bytes) -> tuple[bytes | bytearray | memoryview | None, Any, bool]:
        """The block's bytes kept in memory, its fetch in flight (an object with ``event``, ``data`` and
        ``error``), whether the store holds it."""

    def count_hit(self, nbytes: int) -> None:
        """Count ``nbytes`` served without waiting for the backend."""


class PushStats(NamedTuple):
    pushed_blocks: int
    pushed_bytes: int
    push_failures: int  # pushes the kernel refused (it forgot the inode, cannot store) or damaged blocks
    push_stale: int  # pushes whose inode changed meanwhile (its pages were dropped again)


class Pusher:
    def __init__(self, cache: Blocks, pages: KernelPages, *, ahead: int, threads: int = 2) -> None:
        self.cache = cache
        self.pages = pages
        self.ahead = ahead
        self._limiter = trio.CapacityLimiter(threads)
        self._blocks = self._bytes = self._failed = self._stale = 0
        self.enabled = True  # False once the kernel said it cannot store pages (ENOSYS)
        self._running = 0
        self._idle = trio.Event()
        self._idle.set()

    def follow(self, obj: ObjectInfo, inode: int, offset: int, pushed_to: int) -> int:
        """A sequential reader of ``obj`` (``inode``), which has had the blocks below ``pushed_to``
        pushed, asked for bytes at ``offset``: push what lies ahead of it that is not pushed yet; the
        new ``pushed_to``."""
        if not self.enabled or inode <= 0:
            return pushed_to
        size = self.cache.block_size
        current = offset // size
        last = min(current + 1 + self.ahead, block_count(obj.size, size))
        for index in range(max(current + 1, pushed_to), last):
            if not self._push_block(obj, inode, index):
                break  # neither in memory nor in the store yet: asked again at the reader's next request
            pushed_to = index + 1
        return pushed_to

    def _push_block(self, obj: ObjectInfo, inode: int, index: int) -> bool:
        """Push block ``index`` of ``obj`` once its verified bytes are at hand: from memory (a completed
        fetch, or one in flight once it completes) or from the store. False if it is neither (a push
        never fetches) or the cache is shutting down."""
        nursery = self.cache.nursery
        if nursery is None:
            return False
        bid = self.cache.block_id(obj, index)
        kept, flight, stored = self.cache.at_hand(bid)
        if kept is not None:
            nursery.start_soon(self.push, obj, inode, index, bid, memoryview(kept))
        elif flight is not None:
            nursery.start_soon(self._push_when_fetched, obj, inode, index, bid, flight)
        elif stored:
            nursery.start_soon(self.push, obj, inode, index, bid, None)
        else:
            return False
        self.started()
        return True

    async def _push_when_fetched(self, obj: ObjectInfo, inode: int, index: int, bid: bytes, flight: Any) -> None:
        await flight.event.wait()
        data = flight.data if flight.error is None else None
        if data is None:  # failed, or the block went to the store only: push from there, if anywhere
            self.ended()
            return
        await self.push(obj, inode, index, bid, memoryview(data))

    def started(self) -> None:
        """A push was handed to the cache's nursery (it ends with :meth:`ended`)."""
        self._running += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle

    def ended(self) -> None:
        self._running -= 1
        if not self._running:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no push is pending or running."""
        while self._running:
            await self._idle.wait()

    async def push(self, obj: ObjectInfo, inode: int, index: int, bid: bytes, data: memoryview | None) -> None:
        """Push block ``index`` (its verified ``data``, or, if None, read and verified from the store in
        the same worker-thread job)."""
        try:
            await self._push(obj, inode, index, bid, data)
        finally:
            self.ended()

    async def _push(self, obj: ObjectInfo, inode: int, index: int, bid: bytes, data: memoryview | None) -> None:
        cache = self.cache
        start, length = block_bounds(index, obj.size, cache.block_size)
        if length <= GAP:
            return
        meta = None
        if data is None:
            meta = cache.store.lookup(bid)
            if meta is None:
                return
        result = await trio.to_thread.run_sync(self._job, bid, meta, data, inode, start, limiter=self._limiter)
        if result == "pushed":
            self._blocks += 1
            self._bytes += length - GAP
            cache.count_hit(length - GAP)
            if meta is not None:
                cache.store.policy.accessed(bid)
            if not self.pages.current(inode, obj):
                self._stale += 1
                await trio.to_thread.run_sync(self._forget, inode)
            return
        self._failed += 1
        if result.startswith("damaged: ") and meta is not None and cache.store.lookup(bid) == meta:
            cache.store.drop_corrupt(bid, meta, result[len("damaged: "):])
        elif result == "unsupported":
            log.info("the kernel cannot store pages for this mount: reads go through the daemon")
            self.enabled = False

    def _job(self, bid: bytes, meta, data: memoryview | None, inode: int, start: int) -> str:  # type: ignore[no-untyped-def]
        """(Worker thread) read and verify the block if need be, then push all of it but its first page."""
        if data is None:
            store = self.cache.store
            raw = store.pread_range(bid, meta, 0, meta.length)
            why = store.verify(bid, meta, 0, meta.length, raw)
            if why:
                return "damaged: " + why
            assert not isinstance(raw, OSError)
            data = memoryview(raw)
        try:
            self.pages.store(inode, start + GAP, data[GAP:])

        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                return "unsupported"
            return "refused"
        return "pushed"

    def _forget(self, inode: int) -> None:
        try:
            self.pages.forget(inode)
        except OSError:
            pass

    def statistics(self) -> PushStats:
        return PushStats(self._blocks, self._bytes, self._failed, self._stale)
