"""Blocks: the identity of a block of an object's version, and the arithmetic of cutting a file into
blocks. Pure, no I/O: the cache, the cluster tier and the prefetcher all count blocks the same way.

A block is identified by (source, object key, ETag, block size, block index): a new version of an
object, or a new block size, gives new block ids, so a cached block can never be served for another
version or another geometry (and a peer is never asked for one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator


def identity(person: bytes, parts: tuple[str, ...], *numbers: int) -> hashlib.blake2b:
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
    return identity(b"epochfs-block-v2", (source_id, key, etag), block_size, index).digest()


def scope_id(*parts: str) -> bytes:
    """16-byte id of a content scope: objects are shared by content only between mounts of one scope
    (an endpoint, a bucket and the credentials that read it: :mod:`epochfs.cache.shared`)."""
    return identity(b"epochfs-scope-v1", parts).digest()


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


def overlap(span: tuple[int, int], lo: int, hi: int) -> int:
    """How many bytes of [lo, hi) lie in ``span``."""
    return max(0, min(hi, span[1]) - max(lo, span[0]))
