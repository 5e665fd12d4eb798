import random

import pytest

from epochfs.blockstore.keys import CHUNK_SIZE, block_relpath, chunk_span
from epochfs.core.blocks import block_bounds, block_count, block_id, blocks_for_range


def test_block_id_depends_on_every_part():
    bs = 4 << 20
    base = block_id("s3://b/p/", "a/b.bin", '"etag1"', 0, block_size=bs)
    assert len(base) == 16
    assert base == block_id("s3://b/p/", "a/b.bin", '"etag1"', 0, block_size=bs)
    others = {
        block_id("s3://c/p/", "a/b.bin", '"etag1"', 0, block_size=bs),
        block_id("s3://b/p/", "a/b.bin", '"etag1"', 0, block_size=1 << 20),
        block_id("s3://b/p/", "a/b.bim", '"etag1"', 0, block_size=bs),
        block_id("s3://b/p/", "a/b.bin", '"etag2"', 0, block_size=bs),
        block_id("s3://b/p/", "a/b.bin", '"etag1"', 1, block_size=bs),
    }
    assert base not in others and len(others) == 5


def test_block_id_parts_cannot_be_shifted():
    # Length-prefixed parts: moving a character from one part to the next gives another id.
    assert block_id("s", "ab", "c", 0, block_size=1) != block_id("s", "a", "bc", 0, block_size=1)


def test_block_path_never_contains_the_key():
    bid = block_id("s3://b/", "../../etc/passwd", "e", 3, block_size=1 << 20)
    path = block_relpath(bid)
    assert ".." not in path and "passwd" not in path
    assert path.split("/")[-1] == bid.hex() and path.count("/") == 1


def test_block_arithmetic_edges():
    bs = 4 << 20
    assert block_count(0, bs) == 0
    assert block_count(1, bs) == 1
    assert block_count(bs, bs) == 1
    assert block_count(bs + 1, bs) == 2
    assert block_bounds(0, 100, bs) == (0, 100)
    assert block_bounds(1, bs + 5, bs) == (bs, 5)
    with pytest.raises(ValueError):
        block_bounds(1, bs, bs)
    assert list(blocks_for_range(0, 10, 0, bs)) == []
    assert list(blocks_for_range(bs - 1, 2, 3 * bs, bs)) == [0, 1]
    assert list(blocks_for_range(bs, bs, 3 * bs, bs)) == [1]
    assert list(blocks_for_range(2 * bs, 10 * bs, 2 * bs + 3, bs)) == [2]
    assert list(blocks_for_range(5 * bs, 1, 2 * bs, bs)) == []


def test_blocks_for_range_matches_brute_force():
    rng = random.Random(42)
    bs = 1 << 12  # (the arithmetic does not depend on the size; a small one keeps the brute force quick)
    for _ in range(2000):
        size = rng.randrange(0, 10 * bs)
        off = rng.randrange(0, size + bs)
        n = rng.randrange(0, 3 * bs)
        expected = sorted({b // bs for b in range(off, min(off + n, size))}) if n < 5 * bs else None
        got = list(blocks_for_range(off, n, size, bs))
        assert got == expected
        covered = sum(block_bounds(i, size, bs)[1] for i in got)
        assert covered >= max(0, min(off + n, size) - off)


def test_chunk_span():
    assert chunk_span(0, 1, 100) == (0, 100)
    assert chunk_span(0, CHUNK_SIZE, 4 * CHUNK_SIZE) == (0, CHUNK_SIZE)
    assert chunk_span(CHUNK_SIZE - 1, CHUNK_SIZE + 1, 4 * CHUNK_SIZE) == (0, 2 * CHUNK_SIZE)
    assert chunk_span(3 * CHUNK_SIZE + 5, 3 * CHUNK_SIZE + 9, 3 * CHUNK_SIZE + 10) == (3 * CHUNK_SIZE, 3 * CHUNK_SIZE + 10)
    with pytest.raises(ValueError):
        chunk_span(5, 5, 10)


def test_the_block_glob_matches_every_block_path():
    from fnmatch import fnmatchcase

    from epochfs.blockstore.keys import BLOCK_GLOB

    for n in range(50):
        path = block_relpath(block_id("s", f"k{n}", "e", n, block_size=1 << 20))
        assert fnmatchcase(path, BLOCK_GLOB) and path.count("/") == BLOCK_GLOB.count("/")
