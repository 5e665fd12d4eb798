"""Where the cache keeps what: block files' names, whole copies' ids, checksum chunks. Pure, no I/O.

Block file names are a hash of the block's identity (:func:`epochfs.core.blocks.block_id`), never the
object key, so nothing under the cache directory is named by the dataset.
"""

from __future__ import annotations

from epochfs.core.blocks import identity

#: Checksums are kept per chunk of a block, so a read verifies only the chunks it touches.
CHUNK_SIZE = 64 << 10
#: The block sizes a cache can be filled at.
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 64 << 10, 64 << 20


def whole_id(source_id: str, key: str, etag: str, size: int) -> str:
    """Hex id of version ``etag`` (``size`` bytes) of ``key`` in ``source_id``, held whole
    (:mod:`epochfs.blockstore.whole`): another version, another id."""
    return identity(b"epochfs-whole-v1", (source_id, key, etag), size).hexdigest()


def block_relpath(bid: bytes) -> str:
    """Where a block lives under the cache's ``blocks/`` directory: one level of 256 directories. (Two
    levels would put each block of a small cache in a directory of its own: one more directory to read
    from disk per block when the kernel's caches are cold.)"""
    name = bid.hex()
    return f"{name[0:2]}/{name}"


#: The glob that matches every path :func:`block_relpath` gives (for walks over the block files).
BLOCK_GLOB = "*/*"


def chunk_span(lo: int, hi: int, length: int, chunk: int = CHUNK_SIZE) -> tuple[int, int]:
    """Byte range [start, end) of whole checksum chunks covering [lo, hi) of a block of ``length``."""
    if not 0 <= lo < hi <= length:
        raise ValueError(f"bad range [{lo}, {hi}) of a block of {length} bytes")
    start = (lo // chunk) * chunk
    end = min(length, -(-hi // chunk) * chunk)
    return start, end
