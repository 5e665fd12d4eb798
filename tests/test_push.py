"""Pushing verified blocks into the kernel page cache ahead of a sequential reader (epochfs.cache.push):
with a recording stand-in for the kernel, then for real through a mount."""

from __future__ import annotations

import errno
import os
import random

import pytest

from epochfs.cache.push import GAP, Pusher
from epochfs.core.records import ObjectInfo
from epochfs.dev.sample import SampleFile, pattern, upload

from .conftest import requires_fuse
from .helpers import BS, MemoryBackend
from .test_cache_service import run_with_cache

OBJ = ObjectInfo("big.bin", 12 * BS + 1234, 0, '"v1"')
INODE = 7


class Pages:
    """The kernel's page cache, recorded: every store, and what the pages of each inode now hold."""

    def __init__(self, fail: int | None = None) -> None:
        self.stores: list[tuple[int, int, int]] = []
        self.image: dict[int, bytearray] = {}
        self.fail = fail
        self.is_current = True
        self.forgotten: list[int] = []

    def store(self, inode: int, offset: int, data: memoryview) -> None:
        if self.fail is not None:
            raise OSError(self.fail, os.strerror(self.fail))
        self.stores.append((inode, offset, len(data)))
        image = self.image.setdefault(inode, bytearray(64 * BS))
        image[offset:offset + len(data)] = data

    def current(self, inode: int, obj: ObjectInfo) -> bool:
        return self.is_current

    def forget(self, inode: int) -> None:
        self.forgotten.append(inode)


def run(tmp_path, fn, pages: Pages, *, ahead: int = 3, readahead: int = 0, backend=None):
    """``fn(cache)`` with a pusher into ``pages``; returns once the fetches and pushes it started are done."""
    async def pushing(cache):
        cache.wire(pusher=Pusher(cache, pages, ahead=ahead))
        result = await fn(cache)
        await cache.wait_idle()
        await cache.pusher.wait_idle()
        return result

    return run_with_cache(tmp_path, backend or MemoryBackend(), pushing, readahead=readahead)


async def fill(cache, obj=OBJ):
    await cache.read(obj, 0, obj.size)
    await cache.wait_idle()


def flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def expected(off: int, n: int) -> bytes:
    return pattern(OBJ.key, 0, off, n)


def test_a_sequential_reader_gets_the_blocks_ahead_pushed_whole_but_their_first_page(tmp_path):
    pages = Pages()

    async def fn(cache):
        await fill(cache)
        before = cache.statistics()
        stream = cache.open_stream(OBJ, INODE)
        seen = []
        for off in (0, 4096, 8192):  # a reader at the start of the file: block 0
            assert bytes(await stream.read(off, 4096)) == expected(off, 4096)
        await cache.pusher.wait_idle()
        seen.append(sorted(pages.stores))
        # The reader's pages of block 1 came from the kernel; its READ of block 2's first page is the
        # next the daemon sees.
        assert bytes(await stream.read(2 * BS, 4096)) == expected(2 * BS, 4096)
        await cache.pusher.wait_idle()
        seen.append(sorted(pages.stores))
        return before, cache.statistics(), seen

    (before, after, seen), cache = run(tmp_path, fn, pages, ahead=3)
    # At block 0: blocks 1, 2, 3, each from its second page to its end.
    assert seen[0] == [(INODE, i * BS + GAP, BS - GAP) for i in (1, 2, 3)]
    # At block 2: 3 more blocks ahead of it, and nothing pushed twice.
    assert seen[1] == [(INODE, i * BS + GAP, BS - GAP) for i in (1, 2, 3, 4, 5)]
    image = pages.image[INODE]
    for _, off, n in pages.stores:
        assert bytes(image[off:off + n]) == expected(off, n)  # the object's own bytes, verified
    assert after.pushed_blocks == 5 and after.pushed_bytes == 5 * (BS - GAP) and after.push_failures == 0
    # Pushed bytes count as hits (they were in the cache); none of it waited for the backend.
    assert after.hit_bytes - before.hit_bytes == 4 * 4096 + 5 * (BS - GAP)
    assert after.misses == before.misses


@pytest.mark.parametrize("tail", [10000, 1234])
def test_the_last_block_is_pushed_to_the_end_of_the_object_and_no_further(tmp_path, tail):
    pages = Pages()
    obj = ObjectInfo("big.bin", 12 * BS + tail, 0, '"v1"')

    async def fn(cache):
        await fill(cache, obj)
        stream = cache.open_stream(obj, INODE)
        for off in range(10 * BS, obj.size, 8191):
            assert bytes(await stream.read(off, 8191)) == expected(off, min(8191, obj.size - off))

    run(tmp_path, fn, pages, ahead=8)
    last = max(pages.stores, key=lambda s: s[1])
    if tail > GAP:  # to the object's end, where the kernel takes a partial last page
        assert last == (INODE, 12 * BS + GAP, tail - GAP)
    else:  # a last block no longer than the page left out has nothing to push
        assert last == (INODE, 11 * BS + GAP, BS - GAP)
    assert all(off + n <= obj.size for _, off, n in pages.stores)
    for _, off, n in pages.stores:
        assert bytes(pages.image[INODE][off:off + n]) == expected(off, n)


def test_a_damaged_block_is_never_pushed_and_is_fetched_again(tmp_path):
    pages = Pages()

    async def fn(cache):
        await fill(cache)
        bid = cache.block_id(OBJ, 2)
        path, at, length = cache.store.block_location(bid)
        flip(path, at + length // 2)  # one flipped byte in the middle of block 2
        stream = cache.open_stream(OBJ, INODE)
        for off in (0, 4096):
            await stream.read(off, 4096)
        await cache.pusher.wait_idle()
        gone = cache.store.lookup(bid) is None
        data = bytes(await cache.read(OBJ, 2 * BS, BS))
        return gone, data, cache.statistics()

    (gone, data, stats), cache = run(tmp_path, fn, pages, ahead=3)
    assert sorted(s[1] for s in pages.stores) == [1 * BS + GAP, 3 * BS + GAP]  # block 2 never pushed
    assert gone  # dropped from the store at once
    assert data == expected(2 * BS, BS)  # and read right again, from the backend
    assert stats.push_failures == 1


def test_a_push_whose_file_changed_meanwhile_has_its_pages_dropped(tmp_path):
    pages = Pages()
    pages.is_current = False  # a new snapshot shows another object at this inode

    async def fn(cache):
        await fill(cache)
        stream = cache.open_stream(OBJ, INODE)
        await stream.read(0, 4096)
        await cache.pusher.wait_idle()
        return cache.statistics()

    stats, _ = run(tmp_path, fn, pages, ahead=2)
    assert stats.push_stale == 2 and pages.forgotten == [INODE, INODE]


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ENOSYS])
def test_a_refused_push_changes_nothing_for_the_reader(tmp_path, code):
    pages = Pages(fail=code)

    async def fn(cache):
        await fill(cache)
        stream = cache.open_stream(OBJ, INODE)
        rng = random.Random(code)
        off = 0
        while off < OBJ.size:  # odd sizes, sequential
            n = rng.randrange(1, 3 * 4096)
            assert bytes(await stream.read(off, n)) == expected(off, min(n, OBJ.size - off))
            off += n

    _, cache = run(tmp_path, fn, pages, ahead=3)
    stats = cache.statistics()
    assert stats.pushed_blocks == 0 and 1 <= stats.push_failures <= 12
    # ENOSYS: the kernel cannot store at all, and the pusher stops trying.
    assert cache.pusher.enabled == (code != errno.ENOSYS)


def test_a_reader_jumping_about_gets_nothing_pushed_and_blocks_in_flight_are_pushed_when_they_land(tmp_path):
    pages = Pages()
    wide = ObjectInfo("wide.bin", 64 * BS, 0, '"v1"')  # 4 MiB: jumps of more than a MiB are not sequential

    async def fn(cache):
        await fill(cache, wide)
        stream = cache.open_stream(wide, INODE)
        for off in (3 * BS * 8, 2 * BS, 60 * BS, 20 * BS, 45 * BS, 0 + 5 * BS):
            await stream.read(off, 100)
        return cache.statistics()

    stats, _ = run(tmp_path, fn, pages)
    assert pages.stores == [] and stats.pushed_blocks == 0

    cold = Pages()

    async def cold_reader(cache):  # nothing cached: the readahead fetches, the pushes follow them
        stream = cache.open_stream(OBJ, INODE)
        for off in range(0, 2 * BS, 16384):
            assert bytes(await stream.read(off, 16384)) == expected(off, 16384)

    _, cache = run(tmp_path / "cold", cold_reader, cold, ahead=3, readahead=3, backend=MemoryBackend(delay=0.05))
    assert {s[1] for s in cold.stores} >= {2 * BS + GAP, 3 * BS + GAP, 4 * BS + GAP}
    for _, off, n in cold.stores:
        assert bytes(cold.image[INODE][off:off + n]) == expected(off, n)


@requires_fuse
def test_a_mount_pushing_ahead_serves_every_byte_right(tmp_path, s3_client, fresh_bucket, mount_factory):
    big = SampleFile("shards/big.tar", 24 * 1024 * 1024 + 4321)
    upload(s3_client, fresh_bucket, "", [big])
    m = mount_factory(f"s3://{fresh_bucket}", "--push-ahead", "4", "--block-size", "1M")
    with m:
        path = m.path(big.key)
        for _ in range(2):  # cold (pushed as the readahead lands), then from the cache
            with open(path, "rb", buffering=0) as f:
                off = 0
                rng = random.Random(11)
                while off < big.size:
                    n = rng.choice([4096, 65536, 1 << 20, 123457])
                    chunk = f.read(n)
                    assert chunk == big.content(off, len(chunk)), off
                    off += len(chunk)
                    if not chunk:
                        break
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel's pages go: read through us again
            os.close(fd)
        with open(path, "rb") as f:  # seeded random offsets over whatever the kernel still holds
            rng = random.Random(3)
            for _ in range(200):
                off = rng.randrange(0, big.size)
                f.seek(off)
                n = rng.randrange(1, 300000)
                assert f.read(n) == big.content(off, min(n, big.size - off))
        stats = m.status()["cache"]
        assert stats["pushed_blocks"] > 0 and stats["push_failures"] == 0
        assert stats["hit_bytes"] >= stats["pushed_bytes"]
