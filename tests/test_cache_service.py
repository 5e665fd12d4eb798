"""BlockCache with an in-memory backend: single flight, hit/miss accounting, errors, readahead."""

from __future__ import annotations

import random
import threading
import time

import pytest
import trio

from epochfs.blockstore.keys import block_relpath
from epochfs.blockstore.store import BlockStore
from epochfs.cache.service import BlockCache, CacheSettings
from epochfs.core.errors import BackendUnavailable, ObjectChanged
from epochfs.core.records import ObjectInfo
from epochfs.dev.sample import pattern
from epochfs.eviction.lru import LruPolicy

from .helpers import BS, MemoryBackend, damage_block


def run_with_cache(tmp_path, backend, fn, capacity=1 << 30, readahead=0):
    store = BlockStore(tmp_path / "c", capacity, 0.0, LruPolicy())
    store.open()
    cache = BlockCache(store, backend, CacheSettings(block_size=BS, concurrency=8, readahead_blocks=readahead))

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            result = await fn(cache)
            nursery.cancel_scope.cancel()
        return result

    try:
        return trio.run(main), cache
    finally:
        store.close()


OBJ = ObjectInfo("f.bin", 5 * BS + 777, 0, '"v1"')


def record_store_reads(cache, into: list) -> None:
    """Append the block id of every read from the block store (disk) to ``into``."""
    real_read = cache.store.read

    def recording_read(*a, **k):
        into.append(a[0])
        return real_read(*a, **k)

    cache.store.read = recording_read


def test_reads_across_block_boundaries(tmp_path):
    backend = MemoryBackend()

    async def fn(cache):
        out = []
        for off, size in [(0, OBJ.size), (BS - 3, 7), (2 * BS - 1, BS + 2), (OBJ.size - 10, 100), (OBJ.size, 5)]:
            out.append((off, size, bytes(await cache.read(OBJ, off, size))))
        return out

    results, _ = run_with_cache(tmp_path, backend, fn)
    for off, size, data in results:
        assert data == pattern(OBJ.key, 0, off, max(0, min(size, OBJ.size - off)))


def test_concurrent_misses_make_one_request_per_block(tmp_path):
    backend = MemoryBackend(delay=0.2)

    async def fn(cache):
        async def reader(off):
            assert bytes(await cache.read(OBJ, off, 1000)) == pattern(OBJ.key, 0, off, 1000)

        async with trio.open_nursery() as n:
            for i in range(32):
                n.start_soon(reader, (i % 4) * 1000)  # all in block 0
        return cache.statistics()

    stats, cache = run_with_cache(tmp_path, backend, fn)
    assert backend.calls[(OBJ.key, 0)] == 1
    assert stats.misses == 32 and stats.hits == 0 and stats.demand_fetches == 1


def test_warm_reads_are_hits_and_make_no_requests(tmp_path):
    backend = MemoryBackend()

    async def fn(cache):
        await cache.read(OBJ, 0, OBJ.size)
        await cache.wait_idle()
        before = sum(backend.calls.values())
        cold = cache.statistics()
        await cache.read(OBJ, 0, OBJ.size)
        return before, cold, cache.statistics()

    (before, cold, warm), _ = run_with_cache(tmp_path, backend, fn)
    assert before == 6 and sum(backend.calls.values()) == 6
    assert cold.misses == 6 and cold.hits == 0 and cold.miss_bytes == OBJ.size
    assert warm.hits == 6 and warm.hit_bytes == OBJ.size and warm.misses == 6


def test_backend_errors_reach_every_waiter_and_are_not_cached(tmp_path):
    backend = MemoryBackend(delay=0.05)
    backend.fail = ObjectChanged("gone")

    async def fn(cache):
        errors = []

        async def reader():
            try:
                await cache.read(OBJ, 0, 10)
            except ObjectChanged as exc:
                errors.append(exc)

        async with trio.open_nursery() as n:
            for _ in range(5):
                n.start_soon(reader)
        backend.fail = None
        data = bytes(await cache.read(OBJ, 0, 10))
        return errors, data

    (errors, data), cache = run_with_cache(tmp_path, backend, fn)
    assert len(errors) == 5
    assert data == pattern(OBJ.key, 0, 0, 10)
    assert backend.calls[(OBJ.key, 0)] == 2


def test_unexpected_backend_exception_becomes_unavailable(tmp_path):
    backend = MemoryBackend()
    backend.fail = RuntimeError("library bug")

    async def fn(cache):
        with pytest.raises(BackendUnavailable):
            await cache.read(OBJ, 0, 1)
        return True

    assert run_with_cache(tmp_path, backend, fn)[0]


def test_sequential_stream_reads_ahead(tmp_path):
    backend = MemoryBackend()

    async def fn(cache):
        stream = cache.open_stream(OBJ)
        for off in range(0, 3 * 32768, 32768):
            await stream.read(off, 32768)
        await cache.wait_idle()
        return cache.statistics()

    stats, _ = run_with_cache(tmp_path, backend, fn, readahead=3)
    assert stats.prefetch_fetches >= 3
    assert backend.calls[(OBJ.key, 3 * BS)] == 1


def test_a_long_sequential_readers_window_grows_and_a_jump_starts_it_small_again(tmp_path):
    """Readahead starts at ``readahead_blocks`` blocks ahead, doubles each time the reader has read
    through as many blocks as are ahead of it, stops at ``GROWTH`` times that (or ``READAHEAD_BYTES``),
    and starts small again after a jump."""
    from epochfs.cache.readahead import Readahead

    big = ObjectInfo("big", 128 * BS, 0, '"e"')
    backend = MemoryBackend()

    async def fn(cache):
        ahead = []  # per request: how far past the current block readahead has reached
        real = cache.prefetch

        def prefetch(obj, indices):
            ahead.append((current, indices.stop - current - 1))
            return real(obj, indices)

        cache.prefetch = prefetch
        stream = cache.open_stream(big)
        for current in range(0, 40):
            await stream.read(current * BS, BS)
        reached = max(a for _, a in ahead)
        ahead.clear()
        for current in range(100, 104):  # a jump (farther than Readahead.SLACK): sequential again
            await stream.read(current * BS, BS)
        await cache.wait_idle()
        return reached, ahead

    (reached, after_jump), _ = run_with_cache(tmp_path, backend, fn, readahead=2)
    assert reached == 2 * Readahead.GROWTH  # 2, 4, 8: grown, and no further
    assert max(a for _, a in after_jump) == 2
    grown = Readahead.READAHEAD_BYTES
    try:
        Readahead.READAHEAD_BYTES = 3 * BS  # the byte bound is lower than GROWTH times: it holds
        (reached, _), _ = run_with_cache(tmp_path / "bytes", backend, fn, readahead=2)
    finally:
        Readahead.READAHEAD_BYTES = grown
    assert reached == 3


def test_a_large_packed_members_window_grows_as_a_streams_and_stops_at_the_members_end(tmp_path):
    """A member larger than a block is read through (and checked) at its first read; its shard's
    blocks ahead of the read-through come with the same growing window as a whole object's stream, and
    readahead never asks for a block of the shard past the member's last (nor one before its first)."""
    import xxhash

    from epochfs.cache.readahead import Readahead
    from epochfs.core.records import member_etag

    shard = ObjectInfo("s/shard-0.tar", 48 * BS, 0, '"s1"')
    base, size = 3 * BS + 100, 30 * BS
    digest = xxhash.xxh64_hexdigest(pattern(shard.key, 0, base, size))
    member = ObjectInfo("m/big.bin", size, 0, member_etag(shard, base, digest))
    first, last = base // BS, (base + size - 1) // BS
    backend = MemoryBackend()

    async def fn(cache):
        asked, read_at = [], [first - 1]
        real_prefetch, real_read = cache.prefetch, cache.read

        def prefetch(obj, indices):
            assert obj.key == shard.key
            asked.append((read_at[-1] + 1, indices))  # (the block read next, what readahead asked for)
            return real_prefetch(obj, indices)

        async def read(obj, offset, size, **kw):
            data = await real_read(obj, offset, size, **kw)
            read_at.append((offset + size - 1) // BS)
            return data

        cache.prefetch, cache.read = prefetch, read
        stream = cache.open_stream(member)
        data = bytes(await stream.read(BS, 5000))
        await cache.wait_idle()
        return data, asked

    (data, asked), _ = run_with_cache(tmp_path, backend, fn, readahead=2)
    assert data == pattern(shard.key, 0, base + BS, 5000)
    assert min(r.start for _, r in asked) == first + 1 and max(r.stop for _, r in asked) == last + 1
    assert max(r.stop - 1 - current for current, r in asked) == 2 * Readahead.GROWTH  # 2, 4, 8: grown
    assert all(backend.calls[(shard.key, i * BS)] == 1 for i in range(first, last + 1))
    assert not any(backend.calls[(shard.key, i * BS)] for i in list(range(first)) + list(range(last + 1, 48)))


def test_a_large_objects_bytes_at_hand_are_answered_at_once_and_each_request_counts_once(tmp_path):
    """As the session asks (``read_now``, then ``read`` when that could not answer): a lone request of a
    large object starts no readahead (it is noted once, not once per path); a sequential reader at odd
    sizes gets the right bytes; once the page cache holds the blocks, every request within one block is
    answered at once (no task), and counted once."""
    backend = MemoryBackend()

    async def fn(cache):
        async def request(stream, off, size):
            data = stream.read_now(off, size)
            if data is None:
                return bytes(await stream.read(off, size)), False
            return bytes(data), True

        lone = await request(cache.open_stream(OBJ), 2 * BS + 5, 1000)
        await cache.wait_idle()
        out = {"lone": lone, "after lone": cache.statistics().prefetch_fetches}
        rng = random.Random(39)
        sizes = []
        off = 0
        while off < OBJ.size:
            sizes.append(min(rng.randrange(1, BS // 3), OBJ.size - off))
            off += sizes[-1]
        for name in ("cold", "disk", "page cache"):
            if name != "cold":
                cache._recent.clear()  # (only the disk copy)
            stream, off, got, now, before = cache.open_stream(OBJ), 0, [], [], cache.statistics().hits
            for size in sizes:
                data, at_once = await request(stream, off, size)
                got.append(data)
                now.append(at_once or off // BS != (off + size - 1) // BS)  # (two blocks: never at once)
                off += size
            await cache.wait_idle()
            out[name] = (b"".join(got), all(now), cache.statistics().hits - before)
        return out, sizes

    (out, sizes), _ = run_with_cache(tmp_path, backend, fn, readahead=3)
    assert out["lone"] == (pattern(OBJ.key, 0, 2 * BS + 5, 1000), False)
    assert out["after lone"] == 0, "one request was counted as a sequential reader's"
    for name in ("cold", "disk", "page cache"):
        assert out[name][0] == pattern(OBJ.key, 0, 0, OBJ.size), name
    spans, off = 0, 0
    for size in sizes:
        spans += (off + size - 1) // BS - off // BS + 1
        off += size
    assert out["page cache"][1], "a request whose block the page cache holds waited for a task"
    assert out["page cache"][2] == spans  # one hit per block piece of each request, none twice


def test_capacity_bounds_the_cache_while_reads_stay_correct(tmp_path):
    backend = MemoryBackend()

    async def fn(cache):
        for _ in range(2):
            for off in range(0, OBJ.size, 50_000):
                n = min(50_000, OBJ.size - off)
                assert bytes(await cache.read(OBJ, off, n)) == pattern(OBJ.key, 0, off, n)
                assert cache.store.used + cache.store.pending <= 2 * BS
        return cache.store.statistics()

    stats, _ = run_with_cache(tmp_path, backend, fn, capacity=2 * BS)
    assert stats.used_bytes <= 2 * BS and stats.evictions > 0


def test_a_fill_in_progress_at_shutdown_leaves_no_unknown_block_file(tmp_path, monkeypatch):
    """The service is cancelled while a block is being written behind the reader: the write lands in
    its object's file before the store closes (which then is not marked clean), or is refused once it is, so
    the clean shutdown leaves no block file or pack the index does not know."""
    backend = MemoryBackend()
    writing, written = threading.Event(), threading.Event()
    real_write = BlockStore.write_temp

    def slow_write(self, bid, data, around=False, place=None):
        writing.set()
        time.sleep(0.3)
        try:
            return real_write(self, bid, data, around, place)
        finally:
            written.set()

    monkeypatch.setattr(BlockStore, "write_temp", slow_write)

    async def fn(cache):
        data = bytes(await cache.read(OBJ, 0, 100))
        await trio.to_thread.run_sync(writing.wait)
        return data  # run_with_cache cancels the service now, mid-write

    data, _ = run_with_cache(tmp_path, backend, fn)
    assert data == pattern(OBJ.key, 0, 0, 100)
    assert written.wait(10)  # the abandoned write has finished (after the store was closed)
    store = BlockStore(tmp_path / "c", 1 << 30, 0.0, LruPolicy())
    store.open(reconcile=False)
    try:
        report = store.fsck(repair=False)
    finally:
        store.close()
    assert report["blocks"] == 0 and report["orphans"] == 0, report
    assert not any((tmp_path / "c" / "blocks").rglob("*.*"))


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "file"])
def test_a_fill_abandoned_at_its_deadline_undoes_its_write_when_it_finishes(tmp_path, packing):
    """A fetch that answers after the fill's deadline: the reader gets its error in time; the worker
    thread finishes later and its write is undone (the range of its object's file punched, or the pack
    range freed), nothing stays counted as being written, and the next read fetches the block again.
    (Only an object of one small block is packed.)"""
    import os

    obj = ObjectInfo("one.bin", 700, 0, '"v1"') if packing else OBJ

    backend = MemoryBackend(delay=0.6)
    store = BlockStore(tmp_path / "c", 1 << 30, 0.0, LruPolicy())
    store.open()
    store.packing = packing
    cache = BlockCache(store, backend, CacheSettings(block_size=BS, concurrency=8, readahead_blocks=0,
                                                    fetch_timeout=0.2))

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            with pytest.raises(BackendUnavailable, match="no complete answer"):
                await cache.read(obj, 0, 100)
            await trio.sleep(1.0)  # the worker thread finishes; its write is undone on this thread
            packs = list((tmp_path / "c" / "packs").iterdir())
            files = [p for p in (tmp_path / "c" / "blocks").rglob("*") if p.is_file()]
            state = (dict(store.packs.pending), store.pending, store.used, list((tmp_path / "c" / "tmp").iterdir()),
                     sum(os.stat(p).st_blocks for p in packs + files), len(packs))
            backend.delay = 0
            data = bytes(await cache.read(obj, 0, 100))
            nursery.cancel_scope.cancel()
        return state, data

    try:
        (pending, reserved, used, tmp, allocated, packs), data = trio.run(main)
    finally:
        store.close()
    assert all(n == 0 for n in pending.values()) and reserved == 0 and used == 0
    assert tmp == [] and allocated == 0 and packs == (1 if packing else 0)
    assert data == pattern(obj.key, 0, 0, 100)
    assert backend.calls[(obj.key, 0)] == 2


def test_a_readers_blocks_are_served_from_memory_and_written_around_the_page_cache(tmp_path, monkeypatch):
    """A block fetched for a reader (on demand or read ahead) serves its next requests from memory, not
    from its block file, and the file is written with O_DIRECT; a block the manifest prefetcher fetches
    ahead goes through the page cache (its reader comes later). Hits are counted as before."""
    backend = MemoryBackend()
    arounds = []
    real_write = BlockStore.write_temp

    def recording_write(self, bid, data, around=False, place=None):
        arounds.append(around)
        return real_write(self, bid, data, around, place)

    monkeypatch.setattr(BlockStore, "write_temp", recording_write)
    disk_reads = []

    async def fn(cache):
        record_store_reads(cache, disk_reads)
        first = bytes(await cache.read(OBJ, 0, 1000))  # a miss: fetched on demand
        await cache.wait_idle()
        rest = bytes(await cache.read(OBJ, 1000, BS - 1000))  # the same block, after its fill
        stats = cache.statistics()
        flight = cache.fetch(OBJ, 3, cache.block_id(OBJ, 3))  # the manifest prefetcher's kind of fetch
        await flight.wait()
        await cache.wait_idle()
        return first + rest, stats

    (data, stats), cache = run_with_cache(tmp_path, backend, fn)
    assert data == pattern(OBJ.key, 0, 0, BS)
    assert disk_reads == []  # the second request never touched the block file
    assert stats.misses == 1 and stats.hits == 1  # the re-read did not wait for the backend
    assert arounds == [True, False]


def test_a_block_leaves_memory_once_all_of_it_was_served_not_when_its_end_was(tmp_path):
    """The kernel sends a sequential reader's readahead requests concurrently: the request that ends a
    block may be answered before one in its middle. The block stays in memory until every byte of it
    was served, so the middle one is not read back from the block file; after that, it is."""
    backend = MemoryBackend()
    disk_reads = []
    quarter = BS // 4

    async def fn(cache):
        record_store_reads(cache, disk_reads)
        parts = {}
        await cache.read(OBJ, 0, 100)  # a miss: the block is fetched for this reader
        await cache.wait_idle()  # filled, and kept in memory for the reader's next requests
        for lo in (3 * quarter, 100, quarter, 2 * quarter):  # the end before the middle
            hi = BS if lo == 3 * quarter else (quarter if lo == 100 else lo + quarter)
            parts[lo] = bytes(await cache.read(OBJ, lo, hi - lo))
        before = list(disk_reads)
        again = bytes(await cache.read(OBJ, 5, 10))  # all of it was served: now from the block file
        return parts, before, again

    (parts, before, again), cache = run_with_cache(tmp_path, backend, fn)
    for lo, data in parts.items():
        assert data == pattern(OBJ.key, 0, lo, len(data))
    assert before == [], "a part of the block was read back from disk while the block was in memory"
    assert again == pattern(OBJ.key, 0, 5, 10) and len(disk_reads) == 1


def test_a_small_object_is_read_whole_once_per_handle(tmp_path, monkeypatch):
    """The kernel may ask for a small file in pieces (its first page, then the rest): the handle reads
    the one block once, verified, and serves its later requests from it; statistics count what was
    asked for; the bytes are given back when the handle closes, and past the budget handles read as
    asked."""
    small = ObjectInfo("small.bin", 100 * 1024 // 2, 0, '"v1"')  # one block of the tests' 64 KiB
    backend = MemoryBackend()
    store_reads = []

    async def fn(cache):
        record_store_reads(cache, store_reads)
        await cache.read(small, 0, small.size)  # cached
        await cache.wait_idle()
        cache._recent.clear()
        cache._recent_bytes = 0
        before = cache.statistics()
        stream = cache.open_stream(small)
        pieces = [(0, 4096), (4096, 20000), (24096, 1 << 20), (7, 3), (small.size, 10)]
        got = [bytes(await stream.read(off, size)) for off, size in pieces]
        held = cache.whole_held
        stream.close()
        after = cache.statistics()
        monkeypatch.setattr(BlockCache, "WHOLE_BUDGET", small.size - 1)
        other = cache.open_stream(small)
        again = bytes(await other.read(100, 50))
        other.close()
        return got, held, cache.whole_held, before, after, again

    (got, held, released, before, after, again), _ = run_with_cache(tmp_path, backend, fn)
    for (off, size), data in zip([(0, 4096), (4096, 20000), (24096, 1 << 20), (7, 3), (small.size, 10)], got, strict=True):
        assert data == pattern(small.key, 0, off, max(0, min(size, small.size - off)))
    assert len(store_reads) == 2  # one for the handle, one for the handle past the budget
    assert held == small.size and released == 0
    assert after.hits - before.hits == 5 and after.misses == before.misses
    assert after.hit_bytes - before.hit_bytes == small.size + 3
    assert again == pattern(small.key, 0, 100, 50)


def test_read_now_answers_only_what_is_at_hand_and_counts_only_what_it_answers(tmp_path):
    """The session's fast path: bytes of one block that are in memory or on the cache disk come back at
    once, verified and counted as hits; anything that would wait (not cached, in flight, two blocks, a
    damaged block) is None with nothing counted, and the waiting read then does the work."""
    backend = MemoryBackend()

    async def fn(cache):
        out = {"cold": cache.read_now(OBJ, 10, 100), "stats0": cache.statistics()}
        await cache.read(OBJ, 0, 10)  # blocks 0 and the last fetched
        gate = threading.Event()  # the last block's fill is held until the fast path has been asked
        write_temp = cache.store.write_temp
        cache.store.write_temp = lambda *a, **k: gate.wait(10) and write_temp(*a, **k)
        await cache.read(OBJ, OBJ.size - 10, 10)
        out["filling"] = cache.read_now(OBJ, OBJ.size - 10, 10)  # (a fill still writing it: wait)
        gate.set()
        cache.store.write_temp = write_temp
        while cache.statistics().inflight:  # noqa: ASYNC110 - fills finish in worker threads
            await trio.sleep(0.01)
        cache._recent.clear()  # (only the disk copy)
        out["disk"] = bytes(cache.read_now(OBJ, 10, 100))
        out["two blocks"] = cache.read_now(OBJ, BS - 5, 10)
        out["tail"] = bytes(cache.read_now(OBJ, OBJ.size - 5, 100))  # (clipped to the object's end)
        out["stats1"] = cache.statistics()
        bid = cache.block_id(OBJ, 0)
        meta = cache.store.lookup(bid)
        where = (tmp_path / "c" / "packs" / f"{meta.pack:08x}", meta.offset, meta.length) if meta.pack else (
            tmp_path / "c" / "blocks" / block_relpath(bid), 0, meta.length)
        assert where[0].exists()
        damage_block(where, "flip")  # the fast path says no, the read refetches
        out["damaged"] = cache.read_now(OBJ, 10, 100)
        out["refetched"] = bytes(await cache.read(OBJ, 10, 100))
        out["meta"] = meta
        return out

    out, cache = run_with_cache(tmp_path, backend, fn)
    assert out["cold"] is None and out["stats0"].hits == out["stats0"].misses == 0 and out["filling"] is None
    assert out["disk"] == pattern(OBJ.key, 0, 10, 100) and out["two blocks"] is None
    assert out["tail"] == pattern(OBJ.key, 0, OBJ.size - 5, 5)
    assert (out["stats1"].hits, out["stats1"].hit_bytes) == (2, 105) and out["stats1"].misses == 2
    assert out["damaged"] is None and out["refetched"] == pattern(OBJ.key, 0, 10, 100)
    assert cache.store.statistics().corrupt_blocks == 1


class PeakBackend(MemoryBackend):
    """Counts the requests in flight at once (the most, and by which kind of fetch is not its concern)."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.now = self.peak = 0

    def read_range(self, key, etag, start, length):
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            return super().read_range(key, etag, start, length)
        finally:
            with self._lock:
                self.now -= 1


def test_planned_fetches_have_slots_of_their_own_and_readahead_keeps_its_own(tmp_path):
    """The prefetch plan and warmups (``fetch``) may keep ``plan_concurrency`` requests in flight, far
    more than ``concurrency`` (a far backend needs many); readahead (``prefetch``) stays within
    ``concurrency``."""
    obj = ObjectInfo("many.bin", 40 * BS, 0, '"v1"')

    def peak(start) -> int:
        backend = PeakBackend(delay=0.2)
        store = BlockStore(tmp_path / f"c{start.__name__}", 1 << 30, 0.0, LruPolicy())
        store.open()
        cache = BlockCache(store, backend, CacheSettings(block_size=BS, concurrency=3, readahead_blocks=0,
                                                         plan_concurrency=12))

        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(cache.run)
                start(cache)
                await cache.wait_idle()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main)
        finally:
            store.close()
        assert sum(backend.calls.values()) == 40  # every block fetched once
        return backend.peak

    def planned(cache):
        for index in range(40):
            cache.fetch(obj, index, cache.block_id(obj, index))

    def readahead(cache):
        cache.prefetch(obj, range(40))

    assert peak(planned) == 12
    assert peak(readahead) == 3


def test_an_objects_bytes_offered_here_are_read_here_not_fetched_and_kept_until_withdrawn(tmp_path):
    """A file this node uploaded, not yet adopted: a miss reads its data file (no request, not a miss in
    the accounting), and the block is cached as a fetched one would be. Once the offer is withdrawn, or
    its bytes are gone, misses fetch from the backend again."""
    backend = MemoryBackend()
    mine = ObjectInfo("ckpt.pt", 3 * BS + 5, 0, '"up1"')
    local = pattern(mine.key, 0, 0, mine.size)
    reads: list[tuple[int, int]] = []
    gone = ObjectInfo("gone.pt", BS, 0, '"up2"')

    def read(start, length):
        reads.append((start, length))
        return local[start:start + length]

    async def fn(cache):
        cache.uploads.offer(mine, read)
        cache.uploads.offer(gone, lambda start, length: None)  # (closed under the reader)
        first = bytes(await cache.read(mine, BS - 7, 2 * BS))
        stats = cache.statistics()
        cache.uploads.withdraw(mine)
        again = bytes(await cache.read(mine, 0, mine.size))
        fetched = bytes(await cache.read(gone, 0, BS))
        return first, stats, again, fetched, cache.statistics()

    (first, stats, again, fetched, end), cache = run_with_cache(tmp_path, backend, fn)
    assert first == local[BS - 7:3 * BS - 7]
    assert sorted(reads) == [(0, BS), (BS, BS), (2 * BS, BS)]  # (each once; fetched together, in any order)
    assert backend.calls == {("ckpt.pt", 3 * BS): 1, ("gone.pt", 0): 1}
    assert (stats.misses, stats.demand_fetches, stats.demand_bytes) == (0, 0, 0)
    assert again == local  # blocks 0-2 from the store, block 3 (5 bytes, never offered) from the backend
    assert end.demand_bytes == 5 + BS and fetched == pattern(gone.key, 0, 0, BS)
