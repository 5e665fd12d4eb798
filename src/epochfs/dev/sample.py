"""Sample datasets whose bytes can be checked anywhere.

The content of an object is a pure function of (key, version, offset): :func:`pattern` returns any
range of it without the rest, so a test or a benchmark can verify every read, at any offset, without
keeping the data. Used by the demo, the tests and the benchmarks.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass
from typing import Any

_CHUNK = 4096


def pattern(key: str, version: int, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of version ``version`` of the object ``key``."""
    if length <= 0:
        return b""
    first, last = offset // _CHUNK, (offset + length - 1) // _CHUNK
    prefix = f"{key}\0{version}\0".encode()
    data = b"".join(hashlib.shake_128(prefix + c.to_bytes(8, "little")).digest(_CHUNK)
                    for c in range(first, last + 1))
    skip = offset - first * _CHUNK
    return data[skip:skip + length]


@dataclass(frozen=True)
class SampleFile:
    key: str
    size: int
    version: int = 0

    def content(self, offset: int = 0, length: int | None = None) -> bytes:
        if length is None:
            length = self.size - offset
        length = max(0, min(length, self.size - offset))
        return pattern(self.key, self.version, offset, length)


def sample_layout(small: int = 300, large: int = 3, large_mib: int = 24, seed: int = 1) -> list[SampleFile]:
    """Small files of 0-256 KiB in nested folders (including chunk-boundary sizes), and a few large
    files of about ``large_mib`` MiB with sizes that are not a multiple of any block size."""
    rng = random.Random(seed)
    edge_sizes = [0, 1, 65535, 65536, 65537, 131072, 4 << 20, (4 << 20) + 1]
    files = []
    for i in range(small):
        size = edge_sizes[i] if i < len(edge_sizes) else rng.randrange(1, 256 << 10)
        files.append(SampleFile(f"train/shard-{i % 7}/class-{i % 5}/img-{i:05d}.bin", size))
    for i in range(large):
        size = (large_mib << 20) + rng.randrange(1, 1 << 20) - i * (3 << 20)
        files.append(SampleFile(f"archives/part-{i:03d}.tar", max(size, (1 << 20) + 7)))
    return files


def upload(client: Any, bucket: str, prefix: str, files: list[SampleFile]) -> None:
    """Create ``bucket`` if needed and upload ``files`` under ``prefix``."""
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    except client.exceptions.BucketAlreadyExists:
        pass
    from concurrent.futures import ThreadPoolExecutor

    def put(f: SampleFile) -> None:
        client.put_object(Bucket=bucket, Key=prefix + f.key, Body=f.content())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, files))


def write_tree(root: str, files: list[SampleFile]) -> None:
    """Write ``files`` under a local directory (for file:// sources)."""
    import os

    for f in files:
        path = os.path.join(root, f.key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            out.write(f.content())


def drop_file_pages(path: Any) -> None:
    """Evict one file's clean pages from the kernel page cache (POSIX_FADV_DONTNEED), so the next read
    of it reaches its file system (a mount's: its daemon) and nothing else is dropped."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
