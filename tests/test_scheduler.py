"""The prefetcher without a mount: following the reader, hand-over, bandwidth cap, warmup."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from epochfs.blockstore.store import BlockStore
from epochfs.cache.service import BlockCache, CacheSettings
from epochfs.core.records import ObjectInfo
from epochfs.eviction.manifest import ManifestPolicy
from epochfs.prefetch.scheduler import Prefetcher, PrefetchSettings

from .helpers import BS, MemoryBackend


def objs(n: int, size: int = BS, prefix: str = "f") -> list[ObjectInfo]:
    return [ObjectInfo(f"{prefix}{i:03d}", size, 0, '"e"') for i in range(n)]


def with_prefetcher(tmp_path, fn, *, capacity=1 << 30, bandwidth=None, clock=None, backend=None):
    store = BlockStore(tmp_path / "c", capacity, 0.0, ManifestPolicy())
    store.open()
    backend = backend or MemoryBackend()
    # No fetch deadline: with a mock clock that jumps ahead, a worker thread's wall time looks endless.
    cache = BlockCache(store, backend, CacheSettings(block_size=BS, concurrency=4, readahead_blocks=0,
                       fetch_timeout=math.inf if clock is not None else 60.0))
    pf = Prefetcher(cache, PrefetchSettings(capacity=capacity, max_inflight=2, bandwidth=bandwidth))
    cache.wire(observer=pf)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(cache.run)
            await n.start(pf.run)
            result = await fn(cache, pf, backend)
            n.cancel_scope.cancel()
        return result

    try:
        return trio.run(main, clock=clock)
    finally:
        store.close()


def test_position_follows_the_reader(tmp_path):
    files = objs(10)
    outside = ObjectInfo("elsewhere", BS, 0, '"e"')

    async def fn(cache, pf, backend):
        await pf.load(files)
        seen = []
        cache.open_stream(files[3])  # opened out of order: jumps ahead
        seen.append(pf.statistics().file_position)
        cache.open_stream(files[1])  # a file behind the position: served, no move
        seen.append(pf.statistics().file_position)
        cache.open_stream(outside)  # not in the plan: no move
        seen.append(pf.statistics().file_position)
        await cache.read(files[5], 0, 10)
        seen.append(pf.statistics().file_position)
        return seen

    assert with_prefetcher(tmp_path, fn) == [3, 3, 3, 5]


def test_next_epoch_is_queued_and_reached_only_at_the_end(tmp_path):
    e0 = objs(300, size=100)
    e1 = list(reversed(e0))

    async def fn(cache, pf, backend):
        await pf.load(e0, epoch=0)
        reply = await pf.load(e1, epoch=1)
        out = [reply["appended"], pf.statistics().files]
        cache.open_stream(e0[10])
        cache.open_stream(e0[5])  # a re-read early in epoch 0 is not the start of epoch 1
        out.append((pf.statistics().file_position, pf.statistics().epoch))
        cache.open_stream(e0[299])
        cache.open_stream(e1[1])  # epoch 0 is finishing: this is epoch 1
        out.append((pf.statistics().file_position, pf.statistics().epoch))
        return out

    appended, files, reread, next_epoch = with_prefetcher(tmp_path, fn)
    assert appended and files == 600
    assert reread == (10, 0)
    assert next_epoch == (301, 1)


def test_an_epoch_handed_over_again_replaces_what_is_left_of_it(tmp_path):
    """A job resumed mid-epoch hands the rest of the epoch over again (one reader, or rank by rank): it
    replaces that epoch's earlier hand-over (the rank's part) instead of queueing a second copy after
    it; another epoch is still queued after."""
    order = objs(10, size=100)

    async def one_reader(cache, pf, backend):
        await pf.load(order, epoch=3)
        cache.open_stream(order[4])  # the job read into the epoch, then was restarted
        resumed = await pf.load(order[6:], epoch=3)  # what is left of epoch 3
        files = pf.statistics().files
        await pf.load(order, epoch=4)  # the next epoch: queued after
        return resumed, files, pf.statistics().files

    async def by_rank(cache, pf, backend):
        await pf.load(order[:5], epoch=3, rank=0)
        await pf.load(order[5:], epoch=3, rank=1)
        cache.open_stream(order[0])
        await pf.load(order[8:], epoch=3, rank=1)  # rank 1 restarted: what is left of its share
        return pf.statistics().files

    resumed, files, queued = with_prefetcher(tmp_path / "a", one_reader)
    assert resumed["merged"] and files == 4 and queued == 4 + 10
    assert with_prefetcher(tmp_path / "b", by_rank) == 5 + 2


def test_a_plan_fetched_whole_is_done_though_its_reader_is_not_at_its_end(tmp_path):
    files = objs(8, size=100)

    async def fn(cache, pf, backend):
        await pf.load(files)
        cache.open_stream(files[2])
        await trio.sleep(1.5)  # (a reader that pauses: the window opens, the rest is fetched)
        await cache.wait_idle()
        return pf.statistics()

    after = with_prefetcher(tmp_path, fn)
    assert after.file_position == 2 and after.queued_bytes == 0 and after.inflight == 0
    assert not after.active  # nothing left to fetch: done, not "running"


def test_prefetch_runs_ahead_and_stays_within_the_window(tmp_path):
    files = objs(40)

    async def fn(cache, pf, backend):
        await pf.load(files)
        await trio.sleep(0.5)
        await cache.wait_idle()
        return pf.statistics(), sum(backend.calls.values())

    stats, calls = with_prefetcher(tmp_path, fn, capacity=16 * BS)
    # the reader has not started: the window is what is in flight, at most a quarter of the cache
    assert 1 <= stats.fetched_blocks == calls <= 4
    assert stats.lead_bytes == stats.fetched_blocks * BS


def test_bandwidth_cap_paces_prefetch(tmp_path):
    files = objs(20)
    rate = 4 * BS  # bytes per second

    async def fn(cache, pf, backend):
        await pf.load(files)
        pf.lead = 1e9
        start = trio.current_time()
        for f in files:
            await cache.read(f, 0, 1)
            await trio.sleep(0.1)
        await cache.wait_idle()
        return pf.statistics().fetched_bytes, trio.current_time() - start

    fetched, elapsed = with_prefetcher(tmp_path, fn, bandwidth=rate, clock=trio.testing.MockClock(autojump_threshold=0))
    assert fetched <= rate * elapsed + BS


def test_warmup_fills_at_most_the_cache_and_never_evicts_what_it_warmed(tmp_path):
    files = objs(10)

    async def fn(cache, pf, backend):
        job = pf.warmup(files)
        await job.done.wait()
        return job, cache.store.statistics()

    job, store = with_prefetcher(tmp_path, fn, capacity=6 * BS)
    assert job.done_bytes == 6 * BS and job.skipped_bytes == 4 * BS
    assert store.evictions == 0 and store.used_bytes == 6 * BS


def test_warmup_into_a_full_cache_evicts_what_the_plan_does_not_read(tmp_path):
    """A cache an epoch filled: a warmup of other files evicts blocks no handed-over order reads, and
    keeps the ones the plan reads next."""
    old, planned, new = objs(4, prefix="old"), objs(2, prefix="next"), objs(3, prefix="new")

    async def fn(cache, pf, backend):
        for f in old + planned:  # an epoch read them: the cache is full
            await cache.read(f, 0, BS)
        await pf.load(planned)  # the next epoch's order reads only these
        job = pf.warmup(new)
        await job.done.wait()
        return job, {f.key: cache.is_cached(cache.block_id(f, 0)) for f in old + planned + new}

    job, cached = with_prefetcher(tmp_path, fn, capacity=6 * BS)
    assert job.done_bytes == 3 * BS and job.skipped_bytes == 0
    assert all(cached[f.key] for f in planned + new)
    assert sum(cached[f.key] for f in old) == 1


def test_a_warmup_counts_done_only_what_it_left_cached(tmp_path):
    """A warmup while a handed-over order is read, into a cache that cannot hold both: the order's
    reads evict blocks the warmup fetched before it ends. The job then counts those as evicted, not
    done: what it reports done is exactly what is cached when it ends (what `warmup --check` sees)."""
    order, warm = objs(6, prefix="o"), objs(6, prefix="w")

    async def fn(cache, pf, backend):
        await pf.load(order)
        job = pf.warmup(warm)
        for f in order:  # the epoch's reads, while the warmup runs
            await cache.read(f, 0, BS)
        await job.done.wait()
        resident = sum(BS for f in warm if cache.is_resident(cache.block_id(f, 0)))
        return job, resident

    for attempt in range(5):  # (on a loaded machine the warmup may end before the reads reach its blocks)
        job, resident = with_prefetcher(tmp_path / str(attempt), fn, capacity=6 * BS,
                                        backend=MemoryBackend(delay=0.05))
        assert job.done_bytes == resident  # whatever the timing
        assert job.done_bytes + job.skipped_bytes + job.evicted_bytes + job.failed_bytes == job.total_bytes
        assert job.as_dict()["evicted_bytes"] == job.evicted_bytes
        if job.evicted_bytes > 0:
            break
    assert job.evicted_bytes > 0, "in 5 tries the reads never evicted a warmed block"  # the situation happened


def test_a_merge_keeps_the_reader_where_it_is_and_its_rate_positive(tmp_path):
    """A rank that hands over late rebuilds the plan around the reader: it stays on the block it was
    reading, and the rate measured across the rebuild is what it read, never negative."""
    r0 = objs(8, size=3 * BS, prefix="a")
    r1 = objs(8, size=3 * BS, prefix="b")

    async def fn(cache, pf, backend):
        await pf.load(r0, epoch=0, rank=0)
        for i in range(4):  # rank 0 reads its first files, through the middle of the fourth
            for b in range(3 if i < 3 else 2):
                await cache.read(r0[i], b * BS, 10)
                await trio.sleep(0.01)
        before = pf.statistics()
        await pf.load(r1, epoch=0, rank=1)
        after = pf.statistics()
        plan = pf._plan
        await cache.read(r0[4], 0, 10)
        return before, after, plan.block(after.position)[:2], pf.statistics()

    before, after, (obj, index), later = with_prefetcher(tmp_path, fn)
    assert (obj.key, index) == (r0[3].key, 1)  # the same block of the same file
    assert after.reader_bytes_per_second == before.reader_bytes_per_second > 0
    assert later.reader_bytes_per_second > 0


def test_hand_overs_of_several_ranks_for_one_epoch_are_merged_side_by_side(tmp_path):
    """Each rank's sampler hands over its own share: the node's plan reads them interleaved, as the
    ranks do, and a rank that hands over late does not move the reader back."""
    r0, r1 = objs(6, size=100, prefix="a"), objs(6, size=100, prefix="b")
    nxt = objs(4, size=100, prefix="c")

    async def fn(cache, pf, backend):
        out = []
        await pf.load(r0, epoch=3, rank=0)
        cache.open_stream(r0[2])  # rank 0 has started reading
        reply = await pf.load(r1, epoch=3, rank=1)
        plan = pf._plan
        out.append([f.obj.key for f in plan.files])
        out.append((reply["merged"], pf.statistics().file_position, plan.files[pf.statistics().file_position].obj.key))
        reply = await pf.load(nxt, epoch=4, rank=0)  # the next epoch of rank 0: a segment of its own
        out.append((reply["merged"], pf.statistics().files))
        return out

    keys, merged, nxt_epoch = with_prefetcher(tmp_path, fn)
    assert keys == [k for pair in zip([o.key for o in r0], [o.key for o in r1], strict=True) for k in pair]
    assert merged == (True, 4, r0[2].key)  # still at rank 0's third file, now position 4
    assert nxt_epoch == (False, 16)


@pytest.mark.page_cache  # (counts on pages another test's drop of every cache would take)
def test_cached_bytes_the_reader_reads_next_are_read_into_memory_ahead_of_it(tmp_path):
    """A warm epoch: the cached blocks the plan reads next are read from the cache disk into memory
    ahead of the reader (at most ``WARM_AHEAD`` bytes ahead), so its reads are answered as they come
    instead of each waiting for the disk.

    What the prefetcher asks of the kernel is checked exactly (the blocks it advised); what the kernel
    did is checked as pages read in: held now, or held and reclaimed since (cachestat's evicted count:
    a machine short of memory, or a host that takes clean page cache back, reclaims pages read ahead
    before anyone touched them, and that is not the prefetcher's doing)."""
    import os

    from epochfs.blockstore import pagecache
    from epochfs.blockstore.keys import block_relpath

    if not pagecache.available():
        pytest.skip("this kernel has no cachestat(2)")
    files = objs(12)

    def where(store, bid):
        meta = store.lookup(bid)
        path = store.packs.path(meta.pack) if meta.pack else str(store.root / "blocks" / block_relpath(bid))
        return path, (meta.offset if meta.pack else 0), meta.length

    def pages(store, bid) -> tuple[int, int, int]:
        path, offset, length = where(store, bid)
        fd = os.open(path, os.O_RDONLY)
        try:
            return pagecache.counts(fd, offset, length)
        finally:
            os.close(fd)

    def evict(store, bid) -> None:
        path, offset, length = where(store, bid)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # (dirty pages are not dropped)
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    async def fn(cache, pf, backend):
        job = pf.warmup(files)  # the epoch before left every block cached
        await job.done.wait()
        await cache.wait_idle()
        bids = [cache.block_id(f, 0) for f in files]
        for bid in bids:
            evict(cache.store, bid)
        before = [pages(cache.store, b) for b in bids]
        advised = []
        real_advise = cache.store.advise

        def advise(bid, meta, lo=0, hi=None):
            advised.append(bids.index(bid))
            real_advise(bid, meta, lo, hi)

        def read_in(positions):
            return [p for p in positions if (lambda n, cached, evicted: cached + evicted >= n)(*pages(cache.store, bids[p]))]

        cache.store.advise = advise
        pf.WARM_AHEAD = 4 * BS
        await pf.load(files)
        await trio.sleep(pf.PAUSE + 0.5)  # the reader has not started: the window is open
        at_start, first = sorted(advised), read_in(range(4))
        calls = sum(backend.calls.values())
        for f in files[:5]:
            await cache.read(f, 0, 10)
            await trio.sleep(0.01)
        await trio.sleep(0.2)
        return before, at_start, first, sorted(advised), read_in(range(4, 8)), calls, sum(backend.calls.values())

    before, at_start, first, advised, later, calls, calls_after = with_prefetcher(tmp_path, fn)
    # (dirty until the test's fsync, the blocks' pages cannot have been reclaimed before: no evicted count)
    assert before == [(BS // os.sysconf("SC_PAGE_SIZE"), 0, 0)] * 12, "the test could not take the blocks out of memory"
    assert at_start == [0, 1, 2, 3]  # WARM_AHEAD bytes ahead, no further
    assert first == [0, 1, 2, 3], "the blocks advised were not read into memory"
    assert advised == list(range(8))  # follows the reader (at file 5 of 12), WARM_AHEAD ahead of it
    assert later == [4, 5, 6, 7], "the blocks advised were not read into memory"
    assert calls_after == calls == 12  # nothing fetched again: read from the cache disk


def test_what_keeps_ahead_is_reported_beside_the_cap(tmp_path):
    """statistics() says how many fetches Little's law asks for (unknown before the reader moved) and
    the cap (--prefetch-concurrency), so the doctor can tell when the cap is what binds: a reader held
    up by a slow backend wants more in flight than the cap of 2 lets start."""
    files = objs(8)

    async def fn(cache, pf, backend):
        await pf.load(files)
        before = pf.statistics()
        for f in files:
            await cache.read(f, 0, BS)
        return before, pf.statistics()

    before, after = with_prefetcher(tmp_path, fn, backend=MemoryBackend(delay=0.2))
    assert before.wanted_inflight is None and before.max_inflight == 2
    assert after.max_inflight == 2 and after.wanted_inflight is not None and after.wanted_inflight > 2
    assert after.advised_inflight == max(4, after.wanted_inflight)  # (twice the cap, or what is wanted)


def test_the_advised_cap_stays_within_the_flags_bounds():
    from epochfs.prefetch.plan import MAX_PREFETCH_CONCURRENCY

    pf = Prefetcher.__new__(Prefetcher)  # (only the cap and what is wanted matter here)
    for cap, wanted, advised in ((96, 300, 300), (96, 150, 192), (96, 90, None), (600, 900, MAX_PREFETCH_CONCURRENCY),
                                 (MAX_PREFETCH_CONCURRENCY, 5000, None), (96, None, None)):
        pf.max_inflight = cap
        assert pf._advised_inflight(wanted) == advised, (cap, wanted)
