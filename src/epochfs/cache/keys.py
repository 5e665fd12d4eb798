"""Pure block arithmetic and cache key derivation. No I/O.

A block is identified by (source, object key, ETag, block size, block index): a new version of an
object, or a new block size, gives new block ids, so a cached block can never be served for another
version or another geometry. Block file names are a hash of that tuple, never the object key, so
nothing under the cache directory is named by the dataset.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

#: Checksums are kept per chunk of a block, so a read verifies only the chunks it touches.
CHUNK_SIZE = 64 << 10
#: The block sizes a cache can be filled at.
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 64 << 10, 64 << 20


def _identity(person: bytes, parts: tuple[str, ...], *numbers: int) -> hashlib.blake2b:
    """A BLAKE2b of length-prefixed UTF-8 ``parts`` and 8-byte ``numbers`` (no two tuples hash alike)."""
    h = hashlib.blake2b(digest_size=16, person=person)
    for part in parts:
        raw = part.encode("utf-8", "surrogateescape")
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    for n in numbers:
        h.update(n.to_bytes(8, "little"))
    return h


def block_id(source_id: str, key: str, etag: str, index: int, *, block_size: int) -> bytes:
    """16-byte id of block ``index`` of version ``etag`` of ``key`` in ``source_id``, cut at ``block_size``.

    The block size is part of the id: a cache filled at one block size and mounted at another never
    takes a block cut at the old geometry for one of the new.
    """
    return _identity(b"epochfs-block-v2", (source_id, key, etag), block_size, index).digest()


def whole_id(source_id: str, key: str, etag: str, size: int) -> str:
    """Hex id of version ``etag`` (``size`` bytes) of ``key`` in ``source_id``, held whole
    (:mod:`epochfs.cache.whole`): another version, another id."""
    return _identity(b"epochfs-whole-v1", (source_id, key, etag), size).hexdigest()


def block_relpath(bid: bytes) -> str:
    """Where a block lives under the cache's ``blocks/`` directory: one level of 256 directories. (Two
    levels would put each block of a small cache in a directory of its own: one more directory to read
    from disk per block when the kernel's caches are cold.)"""
    name = bid.hex()
    return f"{name[0:2]}/{name}"


#: The glob that matches every path :func:`block_relpath` gives (for walks over the block files).
BLOCK_GLOB = "*/*"


def block_count(file_size: int, block_size: int) -> int:
    """Number of blocks of a file; an empty file has none."""
    return -(-file_size // block_size)


def block_bounds(index: int, file_size: int, block_size: int) -> tuple[int, int]:
    """(offset, length) of block ``index``; the last block of a file may be short."""
    start = index * block_size
    if index < 0 or start >= file_size:
        raise ValueError(f"block {index} is outside a file of {file_size} bytes")
    return start, min(block_size, file_size - start)


def blocks_for_range(offset: int, size: int, file_size: int, block_size: int) -> range:
    """Indices of the blocks that bytes [offset, offset + size) touch, clipped to the file."""
    end = min(offset + size, file_size)
    if offset < 0 or size < 0:
        raise ValueError("negative offset or size")
    if offset >= end:
        return range(0)
    return range(offset // block_size, (end - 1) // block_size + 1)


def file_blocks(file_size: int, block_size: int) -> Iterator[tuple[int, int]]:
    """(index, length) of every block of a file, in order."""
    for index in range(block_count(file_size, block_size)):
        yield index, min(block_size, file_size - index * block_size)


def extent_blocks(offset: int, size: int, stored_size: int, block_size: int) -> Iterator[tuple[int, int, int]]:
    """(index, block length, bytes of the extent in it) of each block of an object of ``stored_size``
    that the extent [offset, offset + size) touches: a whole object (``offset`` 0, its own size), or a
    packed member's range of its shard."""
    for index in blocks_for_range(offset, size, stored_size, block_size):
        start, length = block_bounds(index, stored_size, block_size)
        yield index, length, min(offset + size, start + length) - max(offset, start)


def range_blocks(offset: int, size: int, file_size: int, block_size: int) -> Iterator[tuple[int, int, int, int]]:
    """(index, block length, lo, hi) of each block that bytes [offset, offset + size) touch, clipped to the
    file: [lo, hi) is the part of the block inside the range."""
    end = min(offset + size, file_size)
    for index in blocks_for_range(offset, size, file_size, block_size):
        start, length = block_bounds(index, file_size, block_size)
        yield index, length, max(offset, start) - start, min(end, start + length) - start


def chunk_span(lo: int, hi: int, length: int, chunk: int = CHUNK_SIZE) -> tuple[int, int]:
    """Byte range [start, end) of whole checksum chunks covering [lo, hi) of a block of ``length``."""
    if not 0 <= lo < hi <= length:
        raise ValueError(f"bad range [{lo}, {hi}) of a block of {length} bytes")
    start = (lo // chunk) * chunk
    end = min(length, -(-hi // chunk) * chunk)
    return start, end
