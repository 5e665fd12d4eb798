"""Writing a block around the page cache (``O_DIRECT``): from where it is when it is aligned (a block
received into :func:`epochfs.transport.buffers.aligned_buffer`), else through a buffer of the thread's own."""

from __future__ import annotations

import errno
import mmap
import os
import threading

from epochfs.blockstore.packs import padded
from epochfs.transport.buffers import ALIGN, is_aligned

_aligned = threading.local()  # one aligned buffer per worker thread, reused (fresh pages cost faults)


def write_direct(fd: int, data: bytes | bytearray | memoryview, at: int = 0) -> None:
    """Write ``data`` at offset ``at`` (aligned) of ``fd`` opened with O_DIRECT, where nothing follows it
    in the file: from where it is if it is aligned, else through an aligned buffer, the length rounded up
    to the alignment, then the file truncated to end with it."""
    n = len(data)
    if is_aligned(data):
        _pwrite_all(fd, memoryview(data), at)
        return
    size = padded(n)
    buf: mmap.mmap | None = getattr(_aligned, "buf", None)
    if buf is None or len(buf) < size:
        if buf is not None:
            buf.close()
        buf = _aligned.buf = mmap.mmap(-1, max(size, 4 << 20))  # page-aligned by construction
    buf[:n] = data
    if size > n:
        buf[n:size] = bytes(size - n)
    with memoryview(buf) as whole:
        view = whole[:size]
        _pwrite_all(fd, view, at)
        view.release()
    if size > n:
        os.ftruncate(fd, at + n)


def _pwrite_all(fd: int, view: memoryview, at: int) -> None:
    """Write all of the aligned ``view`` at offset ``at`` of ``fd`` (O_DIRECT)."""
    written, size = 0, len(view)
    while written < size:
        done = os.pwrite(fd, view[written:], at + written)
        if done <= 0 or done % ALIGN:  # a short direct write cannot be continued aligned
            raise OSError(errno.EIO, f"short direct write ({done} of {size - written} bytes)")
        written += done
