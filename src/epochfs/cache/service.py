"""The block cache service: reads byte ranges of snapshot objects through the store and the backend.

Concurrency contract (all on the trio thread unless noted):

- **Single flight.** At most one backend fetch per block id is in flight; every reader of that block
  waits on the same :class:`Fetch`. A flight runs in the service's own nursery, so a reader that goes
  away does not cancel a fetch other readers wait on.
- **Write-behind.** One worker-thread job fetches a block, hands it to its readers at once, then writes
  it at its place in its object's file; the trio thread indexes it. Until then the flight serves later
  readers from memory: a block is never fetched twice while its fill runs. Room is reserved before the
  fetch, so the eviction policy decides then.
- **Recent blocks in memory.** The last blocks fetched for a reader (on demand or read ahead) stay in
  memory, up to ``recent_max`` bytes, until their last byte is read, and its next requests are served
  from there; those of at least ``store.DIRECT_MIN`` bytes are written around the page cache
  (``O_DIRECT``), which costs far less CPU than filling new page-cache pages. Blocks the manifest
  prefetcher fetches ahead are written through the page cache: the reader comes later and finds them
  in memory there.
- **Demand before prefetch.** Demand fetches and readahead/prefetch fetches take tokens from separate
  capacity limiters, so prefetch can never starve demand of a connection; the prefetcher also holds
  back while a demand fetch is waiting.
- **A read waits for one deadline.** The blocks a read spans are asked for together, and the read waits
  ``fetch_timeout`` (and ``READ_SLACK``) in all, never one deadline per block in turn. The kernel asks
  again at once for the pages a failed readahead left (a buffered read is a readahead, then a read of
  the same range): a block whose demand fetch failed less than ``RETRY_WINDOW`` seconds ago is fetched
  again (errors are never cached: an endpoint that healed answers) with a deadline of ``retry_budget``
  only, so one read waits for ``--backend-timeout`` and that budget at most, not for two or three full
  deadlines.
- **Accounting.** A block read is a *hit* when it is served without waiting for the backend: from the
  disk cache, a completed readahead/prefetch, or a peer's cache (the cluster tier). Every other block
  read is a *miss*. Fetched bytes are counted by where they came from: the backend or a peer.
- **Sources.** Every fetch goes through a :class:`BlockSource`: the backend itself, or the cluster tier
  (which asks the block's owner and falls back to the backend). A source may say a block is not kept
  here (another member owns it); such a block is read through, never cached.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict

import trio

from epochfs.backend.base import Backend
from epochfs.blockstore.format import BlockMeta
from epochfs.blockstore.handoff import Handoff
from epochfs.blockstore.objects import Place
from epochfs.blockstore.store import WOULD_BLOCK, BlockStore
from epochfs.blockstore.writes import Filled
from epochfs.cache import workers
from epochfs.cache.accounting import CacheStats, Tally
from epochfs.cache.flights import CacheSettings, Fetch, Kept, ReadObserver
from epochfs.cache.members import MemberStream, Verified
from epochfs.cache.own import OwnUploads
from epochfs.cache.peer_reads import PeerReads
from epochfs.cache.push import Pusher
from epochfs.cache.readahead import Readahead
from epochfs.cache.shared import SharedContent
from epochfs.cache.sources import BackendSource, BlockSource
from epochfs.cache.streams import Reader, ReadStream
from epochfs.core.blocks import block_bounds, block_id, overlap, range_blocks
from epochfs.core.errors import BackendUnavailable, EpochfsError
from epochfs.core.memory import MemoryBudget
from epochfs.core.records import ObjectInfo, member_location
from epochfs.eviction import EvictionPolicy
from epochfs.transport import buffers

log = logging.getLogger(__name__)


class BlockCache(PeerReads):
    #: Bytes that open handles may keep of the small objects they read (see :class:`ReadStream`).
    WHOLE_BUDGET = 64 << 20
    RETRY_WINDOW = 1.0  # seconds after a demand fetch failed in which a new one is the same read's retry
    READ_SLACK = 0.5  # seconds a read's bound lies past its fetches' (so a fetch's own error is what it sees)
    FAILED_KEPT = 1024  # failed blocks remembered at most

    def __init__(self, store: BlockStore, backend: Backend, settings: CacheSettings, *,
                 source: BlockSource | None = None) -> None:
        self.store = store
        self.source: BlockSource = source or BackendSource(backend)
        self.fetch_timeout = settings.fetch_timeout
        self.backend = backend
        self.block_size = block_size = settings.block_size
        self.readahead_blocks = readahead_blocks = settings.readahead_blocks
        concurrency = settings.concurrency
        self._source = backend.source_id
        self._block_id = functools.lru_cache(maxsize=1 << 16)(self._compute_block_id)  # hot files' ids
        self._flights: dict[bytes, Fetch] = {}
        self._failed: OrderedDict[bytes, float] = OrderedDict()  # bid -> when its demand fetch failed
        # the deadline of a failed fetch's retry: a quarter of a fetch's, 2 s at least, never more than one
        self.retry_budget = min(self.fetch_timeout, max(2.0, self.fetch_timeout / 4))
        memory = settings.memory  # (the shares of --memory-limit: demand slots, bytes ahead, kept, whole, pool)
        self._demand_limiter = trio.CapacityLimiter(memory.demand_slots if memory else concurrency)
        self.ahead = MemoryBudget(memory.ahead if memory else 1 << 62)  # bytes fetched ahead, in flight
        if memory is not None:
            self.WHOLE_BUDGET = memory.whole
            buffers.set_pool_limit(memory.pool)
        self._prefetch_limiter = trio.CapacityLimiter(concurrency)
        self._plan_limiter = trio.CapacityLimiter(settings.plan_concurrency or concurrency)
        self._read_limiter = trio.CapacityLimiter(16)
        self._nursery: trio.Nursery | None = None
        self._idle = trio.Event()
        self.observer: ReadObserver | None = None
        # Blocks just fetched for a reader (cached or not), kept for its next requests (see Kept).
        self._recent: OrderedDict[bytes, Kept] = OrderedDict()
        self._recent_bytes = 0
        self.recent_max = min(max((concurrency + Readahead.widest(readahead_blocks, block_size)) * block_size,
                                  16 << 20), memory.recent if memory else 1 << 62)
        self.tally = Tally()
        # Files this node uploaded: their bytes, read here until adopted (write-back hands them over).
        self.uploads = OwnUploads(store, block_size, self.block_id, self.is_cached)
        self.whole_held = 0  # bytes kept by open handles (ReadStream.WHOLE)
        self.verified = Verified()  # packed members checked against their checksums
        self.pusher: Pusher | None = None  # pushes blocks into the kernel's page cache ahead of readers
        self.shared: SharedContent | None = None  # the node's other mounts' objects, by content (set before run)

    def wire(self, *, observer: ReadObserver | None = None, pusher: Pusher | None = None) -> None:
        """The parts built on this cache that it tells back, wired once by the composition root before it
        runs: ``observer`` hears of each file opened and block read (the prefetcher); ``pusher`` pushes
        blocks into the kernel's page cache ahead of sequential readers (through the FUSE adapter)."""
        if observer is not None:
            assert self.observer is None, "one observer"
            self.observer = observer
        if pusher is not None:
            assert self.pusher is None, "one pusher"
            self.pusher = pusher

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.shared is not None:
                    nursery.start_soon(self.shared.run)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None  # shutting down: no new fetches

    # -- reading ---------------------------------------------------------------------------------------

    @property
    def source_id(self) -> str:
        """The source the cached blocks are of (part of every block's id)."""
        return self._source

    def block_id(self, obj: ObjectInfo, index: int) -> bytes:
        return self._block_id(obj.key, obj.etag, index)

    def _compute_block_id(self, key: str, etag: str, index: int) -> bytes:
        return block_id(self._source, key, etag, index, block_size=self.block_size)

    def place(self, obj: ObjectInfo, index: int) -> Place:  # (in obj's file, named by its first block's id)
        return Place(self.block_id(obj, 0), index * self.block_size, obj.size)

    def block_length(self, obj: ObjectInfo, index: int) -> int:
        """Length of block ``index`` of ``obj`` (ValueError if it has no such block)."""
        return block_bounds(index, obj.size, self.block_size)[1]

    async def read(self, obj: ObjectInfo, offset: int, size: int, *,
                   counted: tuple[int, int] | None = None, reader: Reader | None = None) -> bytes | memoryview:
        """Bytes [offset, offset + size) of ``obj``, clipped to its size. ``counted``: the range of ``obj``
        a reader asked for, which the statistics count (default: all that is read); ``reader``: who
        reads (the observer hears it). One bound per call, whatever the blocks behind it: the blocks of a
        read that spans several are all asked for at once, and the call waits ``fetch_timeout`` at most
        in all (then :class:`BackendUnavailable`, EIO), never a deadline per block in turn."""
        spans = list(range_blocks(offset, size, obj.size, self.block_size))
        started = self._start_missing(obj, [index for index, _, _, _ in spans]) if len(spans) > 1 else {}
        parts = []
        with trio.move_on_after(self.fetch_timeout + self.READ_SLACK) as bound:
            for index, length, lo, hi in spans:
                asked = None if counted is None else overlap(counted, index * self.block_size + lo,
                                                              index * self.block_size + hi)
                parts.append(await self._read_block(obj, index, length, lo, hi, asked=asked, reader=reader,
                                                    started=started.get(index)))
        if bound.cancelled_caught:
            raise BackendUnavailable(f"{obj.key}: bytes {offset}-{offset + size} not had within "
                                     f"{self.fetch_timeout + self.READ_SLACK:g}s (the read's bound)")
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def _start_missing(self, obj: ObjectInfo, indices: list[int]) -> dict[int, Fetch]:
        """Start the demand fetches of the blocks among ``indices`` that are neither cached, in memory
        nor on their way, together; the fetches started, by index (their reader waits for these, and
        counts them as misses, even where one is done before the reader comes to it)."""
        started = {}
        for index in indices:
            bid = self.block_id(obj, index)
            if bid not in self._flights and bid not in self._recent and self.store.lookup(bid) is None:
                started[index] = self._start_demand(obj, index, bid)
        return started

    def _start_demand(self, obj: ObjectInfo, index: int, bid: bytes, *, direct: bool = False) -> Fetch:
        """A demand fetch of the block; a block whose fetch failed moments ago (the kernel asking again
        for what a failed readahead left: the same read) gets the short ``retry_budget``."""
        failed = self._failed.pop(bid, None)
        flight = self._start(obj, index, bid, demand=True, direct=direct)
        if failed is not None and trio.current_time() - failed < self.RETRY_WINDOW:
            flight.budget = self.retry_budget
        return flight

    def read_now(self, obj: ObjectInfo, offset: int, size: int, *,
                 counted: tuple[int, int] | None = None, reader: Reader | None = None) -> bytes | memoryview | None:
        """Bytes [offset, offset + size) of ``obj`` if they are at hand (a completed fetch kept in
        memory, or a range of a cached block that the page cache holds), read and verified now; None if
        getting them would wait (a fetch, the cache disk, more than one block): then :meth:`read`.
        Counted only when answered (``counted`` as for :meth:`read`)."""
        end = min(offset + size, obj.size)
        if offset >= end:
            return b""
        index = offset // self.block_size
        if (end - 1) // self.block_size != index:
            return None
        lo = offset - index * self.block_size
        return self._block_now(obj, index, self.block_length(obj, index), lo, end - index * self.block_size,
                               end - offset if counted is None else overlap(counted, offset, end), reader)

    def read_whole_now(self, obj: ObjectInfo, offset: int, size: int, *,
                       reader: Reader | None = None) -> bytes | memoryview | None:
        """:meth:`read_whole` if the bytes are at hand (as :meth:`read_now`), else None."""
        if self.whole_held + obj.size > self.WHOLE_BUDGET:
            return None
        asked = max(0, min(offset + size, obj.size) - offset)
        return self._block_now(obj, 0, obj.size, 0, obj.size, asked, reader)

    def _block_now(self, obj: ObjectInfo, index: int, length: int, lo: int, hi: int,
                   nbytes: int, reader: Reader | None = None) -> bytes | memoryview | None:
        bid = self.block_id(obj, index)
        if bid in self._flights:
            return None
        kept = self._recent.get(bid)
        if kept is not None:
            data, hit = kept.data, kept.hit
        else:
            meta = self.store.lookup(bid)
            if meta is None or meta.length != length:
                return None  # (a damaged length is dropped by the full read)
            read = self.store.read(bid, meta, lo, hi, nowait=True)
            if read is None or read is WOULD_BLOCK:  # damaged (dropped: fetched again), or on disk only
                return None
            if self.observer is not None:
                self.observer.touched(obj, index, reader)
            self._count(True, nbytes)
            return read
        if self.observer is not None:
            self.observer.touched(obj, index, reader)
        self._count(hit, nbytes)
        self._served(bid, hi - lo)
        return memoryview(data)[lo:hi]

    async def _read_block(self, obj: ObjectInfo, index: int, length: int, lo: int, hi: int, *,
                          for_peer: bool = False, asked: int | None = None, reader: Reader | None = None,
                          started: Fetch | None = None) -> bytes | memoryview:
        """Bytes [lo, hi) of block ``index`` (``length`` bytes long) of ``obj``; ``asked``: how many of
        them the reader asked for (what the statistics count; default all); ``started``: the fetch this
        read started for it."""
        bid = self.block_id(obj, index)
        if self.observer is not None and not for_peer:
            self.observer.touched(obj, index, reader)
        count = self._ignore if for_peer else self._count
        nbytes = hi - lo if asked is None else asked
        flight = started or self._flights.get(bid)
        if flight is None:
            kept = self._recent.get(bid)
            if kept is not None:
                data = kept.data
                count(kept.hit, nbytes)
                self._served(bid, hi - lo)
                return memoryview(data)[lo:hi]
            meta = self.store.lookup(bid)
            if meta is not None and meta.length != length:
                # Not the block this request needs (damage): a corrupt block, dropped and fetched again.
                self.store.drop_corrupt(bid, meta, f"stored length {meta.length}, expected {length}")
                meta = None
            if meta is not None:
                # Bytes the page cache holds are read inline; a read that would wait for the disk goes
                # to a worker thread, so the loop keeps serving meanwhile and the readers' reads reach
                # the disk together (16 readers of 100 KiB files on the cache disk, page cache dropped:
                # 1.3x the files/s of reading each inline, for 10% more daemon CPU per file).
                data = self.store.read(bid, meta, lo, hi, nowait=True)
                if data is WOULD_BLOCK:
                    data = await self._read_from_disk(bid, meta, lo, hi)
                if data is not None:
                    count(True, nbytes)
                    return data
                flight = self._flights.get(bid)  # another reader may have started it meanwhile
            if flight is None:
                flight = self._start_demand(obj, index, bid, direct=for_peer)
        hit = flight.event.is_set() and not flight.demand
        flight.waited = True  # (a prefetch still queued for its source goes first now)
        await flight.event.wait()
        if flight.error is None and flight.data is None:  # a prefetch that only warmed the owner
            again = self._flights.get(bid)
            flight = again if again is not None and not again.warm else self._start(
                obj, index, bid, demand=True, direct=for_peer)
            hit = False
            await flight.event.wait()
        count(hit or flight.from_peer, nbytes)
        if flight.error is not None:
            raise flight.error
        if flight.data is None:
            raise BackendUnavailable(f"{obj.key}: block {index} could not be read")
        flight.served += hi - lo  # (if its fill is still running and all was served, it does not keep it)
        self._served(bid, hi - lo)  # (if the fill finished before this reader woke up and kept it)
        return memoryview(flight.data)[lo:hi]

    async def _read_from_disk(self, bid: bytes, meta: BlockMeta, lo: int, hi: int) -> memoryview | None:
        """A cached block that is not in memory: read it in a worker thread, so the event loop serves
        other requests meanwhile. None if it turned out damaged, or was evicted while we read."""
        raw = await workers.run_sync(self.store.pread_range, bid, meta, lo, hi, limiter=self._read_limiter)
        if self.store.lookup(bid) != meta:
            return None  # evicted (or evicted and refilled) meanwhile: not damage, a miss
        return self.store.finish_read(bid, meta, lo, hi, raw)

    def _ignore(self, hit: bool, nbytes: int) -> None:  # (a peer's read: its own node counts it)
        return

    def _count(self, hit: bool, nbytes: int) -> None:
        self.tally.read(hit, nbytes)

    # -- what the prefetcher asks -----------------------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        return self.store.policy

    def is_cached(self, bid: bytes) -> bool:
        """Resident in the store, or being fetched (:meth:`read_stored` waits for it)."""
        return bid in self._flights or self.store.lookup(bid) is not None

    def is_resident(self, bid: bytes) -> bool:
        """Resident in the store."""
        return self.store.lookup(bid) is not None

    def keeps(self, bid: bytes) -> bool:
        """Whether this node stores the block when it fetches it (a cluster tier may keep it at its owner
        only)."""
        return self.source.keeps(bid)

    def would_admit(self, bid: bytes, nbytes: int) -> bool:
        """Whether the store would cache this block now (evicting what its policy gives up for it)."""
        return self.store.would_admit(bid, nbytes)

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit now without evicting anything."""
        return self.store.has_room(nbytes)

    def warm(self, bid: bytes, lo: int, hi: int) -> None:
        """Have the kernel read bytes [lo, hi) of a cached block from the cache disk into memory, so the
        reader that comes next is answered as it reads (not by a worker thread waiting for the disk).
        Nothing for a block in flight or kept in memory, or not cached."""
        if bid in self._flights or bid in self._recent:
            return
        meta = self.store.lookup(bid)
        if meta is not None:
            self.store.advise(bid, meta, lo, hi)

    def demand_waiting(self) -> bool:
        """Whether a demand fetch is waiting for a backend connection (prefetch then holds back)."""
        return self._demand_limiter.statistics().tasks_waiting > 0

    def fetch(self, obj: ObjectInfo, index: int, bid: bytes, *, near: bool = False) -> Fetch | None:
        """Fetch a block in the background; the flight to wait on, or None if it is already cached.
        ``near``: a reader comes for it soon (kept in memory for it, written around the page cache)."""
        flight = self._flights.get(bid)
        if flight is not None:
            return flight
        if self.store.lookup(bid) is not None or self._nursery is None:
            return None
        return self._start(obj, index, bid, demand=False, warm_ok=True, near=near, planned=True)

    def prefetch(self, obj: ObjectInfo, indices: range) -> int:
        """Start background fetches of those blocks that are neither cached nor in flight."""
        started = 0
        for index in indices:
            bid = self.block_id(obj, index)
            if bid in self._flights:
                continue
            meta = self.store.lookup(bid)
            if meta is not None:
                self.store.advise(bid, meta)  # cached: have the kernel read it from disk ahead of the reader
                continue
            self._start(obj, index, bid, demand=False)
            started += 1
        return started

    def opened(self, obj: ObjectInfo, reader: Reader | None = None) -> None:
        """``obj`` was opened (the prefetch plan follows the reader by its opens) by ``reader``."""
        if self.observer is not None:
            self.observer.opened(obj, reader)

    def open_stream(self, obj: ObjectInfo, inode: int = 0, reader: Reader | None = None) -> ReadStream | MemberStream:
        """A reader of ``obj``; ``inode``: the kernel's for it (where blocks may be pushed; 0: nowhere);
        ``reader``: who opened it. A packed member's reader reads the range of its shard."""
        self.opened(obj, reader)
        location = member_location(obj)
        if location is not None:
            return MemberStream(self, obj, *location)
        return ReadStream(self, obj, inode, reader)

    @property
    def nursery(self) -> trio.Nursery | None:
        """Where the service's tasks run (None: it is not running, or is shutting down)."""
        return self._nursery

    def at_hand(self, bid: bytes) -> tuple[bytes | bytearray | memoryview | None, Fetch | None, bool]:
        """What a push may take a block from: its bytes kept in memory, its fetch in flight (not one
        that only warms an owner), whether the store holds it."""
        kept, flight = self._recent.get(bid), self._flights.get(bid)
        return (kept.data if kept is not None else None, flight if flight is not None and not flight.warm else None,
                self.store.lookup(bid) is not None)

    async def read_whole(self, obj: ObjectInfo, offset: int, size: int, *,
                         reader: Reader | None = None) -> bytes | memoryview | None:
        """All of a one-block object, verified, for a handle to keep (the statistics count the ``size``
        bytes at ``offset`` asked for); None if the handles already hold :attr:`WHOLE_BUDGET` bytes."""
        if self.whole_held + obj.size > self.WHOLE_BUDGET:
            return None
        asked = max(0, min(offset + size, obj.size) - offset)
        return await self._read_block(obj, 0, obj.size, 0, obj.size, asked=asked, reader=reader)

    def count_hit(self, nbytes: int) -> None:
        """A read served from bytes a handle keeps (see :class:`ReadStream`)."""
        self._count(True, nbytes)

    # -- fetching --------------------------------------------------------------------------------------

    def _start(self, obj: ObjectInfo, index: int, bid: bytes, *, demand: bool, direct: bool = False,
               warm_ok: bool = False, near: bool = True, planned: bool = False) -> Fetch:
        """A fetch of the block; ``warm_ok`` (the manifest prefetcher, far ahead of the reader): of a
        block this node does not keep, only warm its owner; ``near``: a reader is at or right behind it;
        ``planned``: for the prefetch plan or a warmup, which have slots of their own (the scheduler
        sizes how many it uses by the backend's latency)."""
        if self._nursery is None:
            raise BackendUnavailable("the cache service is not running (shutting down)")
        keep = direct or self.source.keeps(bid)
        flight = Fetch(demand, direct, warm=warm_ok and not keep and not demand, near=near)
        self._flights[bid] = flight
        start, length = block_bounds(index, obj.size, self.block_size)
        # Room is reserved now (the policy decides whether the block is cached), so what the store
        # reports as free already accounts for every fetch started.
        # (An object another mount of the node offers is taken from there first: room is reserved only if
        # it is fetched after all.)
        shared = keep and self.shared is not None and self.shared.offered(obj)
        admitted = keep and not shared and self.store.reserve(bid, length, in_use=demand)
        limiter = self._demand_limiter if demand else self._plan_limiter if planned else self._prefetch_limiter
        self._nursery.start_soon(self._fetch_and_fill, obj, index, start, length, bid, flight, admitted, limiter,
                                 shared)
        return flight

    async def _fetch_and_fill(self, obj: ObjectInfo, index: int, start: int, length: int, bid: bytes,
                              flight: Fetch, admitted: bool, limiter: trio.CapacityLimiter, shared: bool = False) -> None:
        """One worker-thread job per block: fetch it, hand the bytes to the readers at once (from the
        thread), write them to a temporary file if ``admitted``; then, back on the trio thread, install
        and index it."""
        installed = False
        box = workers.mailbox()
        handoff = Handoff()

        def job() -> None:
            local = self.uploads.reader(obj)
            data = local(start, length) if local is not None else None
            if data is not None and len(data) == length:
                origin = "local"
            else:
                data, origin = self.source.read_block(obj, index, start, length, bid, direct=flight.direct,
                                                      warm=flight.warm, urgent=flight.urgent)
            box.post(self._deliver, flight, data, origin)
            if not admitted or data is None:
                return
            try:
                got: Filled | OSError = self.store.write_temp(bid, data, flight.near, self.place(obj, index))
            except OSError as exc:
                got = exc
            if not handoff.give(got) and isinstance(got, tuple):
                try:  # the fill gave up waiting: nobody installs this block; undo its write
                    box.post(self.store.abandon, *got)
                except trio.RunFinishedError:
                    pass  # shut down: what it wrote is cleared at the next start

        held = 0
        try:
            written: Filled | OSError | None = None
            try:
                if shared and self.shared is not None:
                    data = await self.shared.block(obj, bid, length, self.fetch_timeout / 2, self._read_from_disk)
                    if data is not None:
                        self._deliver(flight, data, "local")  # (taken from another mount's cache: no fetch)
                        return
                    admitted = self.store.reserve(bid, length, in_use=flight.demand)
                if not flight.demand:  # (room for it in memory first; a reader that comes to wait lets it go)
                    await self.ahead.acquire(length, flight.urgent)
                    held = length
                done = False
                # The backend bounds its own requests; this bounds what it cannot (a server that drips
                # its headers): the readers get their error in time, the thread is left to finish.
                try:
                    with trio.move_on_after(flight.budget or self.fetch_timeout):
                        await workers.run_sync(job, limiter=limiter, abandon_on_cancel=True)
                        done = True
                finally:
                    written = handoff.take()
                if not done:
                    raise BackendUnavailable(f"{obj.key}: no complete answer within "
                                             f"{flight.budget or self.fetch_timeout:g}s")
            except EpochfsError as exc:
                flight.error = exc
            except Exception as exc:  # a bug or an unexpected library error: fail the read, not the mount
                log.exception("unexpected error fetching %r at %d", obj.key, start)
                flight.error = BackendUnavailable(f"{obj.key}: {exc}")
            if flight.error is not None:
                flight.event.set()
            elif isinstance(written, tuple):
                try:
                    self.store.install(bid, *written)
                    installed = True
                    if self.shared is not None:
                        self.shared.installed(obj, written[1])
                except OSError as exc:
                    written = exc
            if isinstance(written, OSError):
                log.warning("could not cache a block (%s); reading through", written)
            if flight.data is not None and (not installed or flight.near and flight.served < length):
                self._keep_recent(bid, Kept(flight.data, installed or flight.from_peer or not flight.demand,
                                            installed, flight.served))
        finally:
            self.ahead.release(held)
            if isinstance(written, tuple) and not installed:
                self.store.abandon(*written)  # written, but the fill gave up (deadline, error, shutdown)
            if admitted and not installed:
                self.store.release(length, failed=isinstance(written, OSError))
            if self._flights.get(bid) is flight:  # (a warm flight may have been replaced by a real one)
                del self._flights[bid]
                if flight.error is not None and flight.demand:
                    self._failed[bid] = trio.current_time()
                    while len(self._failed) > self.FAILED_KEPT:
                        self._failed.popitem(last=False)
            if not self._flights:
                self._idle.set()

    def _served(self, bid: bytes, nbytes: int) -> None:
        """Readers were given ``nbytes`` more of a block: once they were given all of it and the store
        has it, it leaves memory (later reads go to the verified block file)."""
        kept = self._recent.get(bid)
        if kept is None:
            return
        kept.served += nbytes
        if kept.stored and kept.served >= len(kept.data):
            del self._recent[bid]
            self._recent_bytes -= len(kept.data)

    def _keep_recent(self, bid: bytes, kept: Kept) -> None:
        old = self._recent.pop(bid, None)
        if old is not None:
            self._recent_bytes -= len(old.data)
        self._recent[bid] = kept
        self._recent_bytes += len(kept.data)
        while self._recent_bytes > self.recent_max:
            self._recent_bytes -= len(self._recent.popitem(last=False)[1].data)

    def _deliver(self, flight: Fetch, data: bytes | None, origin: str) -> None:
        """The bytes of a fetch arrived (called on the trio thread from the worker): release the readers."""
        flight.data = data
        flight.from_peer = origin != "backend"  # (or this node's own file: not a miss either)
        if origin == "local":  # (not a fetch: what readers read of it counts as this node's own)
            flight.event.set()
            return
        self.tally.fetched(flight.demand, origin, len(data or b""))
        flight.event.set()

    async def wait_idle(self) -> None:
        """Return once no fetch or fill is in flight."""
        while self._flights:
            if self._idle.is_set():
                self._idle = trio.Event()
            await self._idle.wait()

    def statistics(self) -> CacheStats:
        return CacheStats(
            **self.tally.counts(), inflight=len(self._flights),
            demand_inflight_bytes=sum(self.block_size for f in self._flights.values() if f.demand),
            ahead_bytes=self.ahead.held, recent_bytes=self._recent_bytes, whole_bytes=self.whole_held,
            throttled_seconds=self.ahead.throttled_seconds,
            **({} if self.pusher is None else self.pusher.statistics()._asdict()),
        )
