"""Memory that receives a block from the network: aligned for ``O_DIRECT`` (the cache writes a block to
disk from where it was received, without a copy) and, for blocks, reused once nothing refers to it.

A fresh 4 MiB buffer costs a thousand page faults and the zeroing of each page, on the thread that
receives into it and holding the GIL: measured, a seventh of the daemon's CPU on a cold stream. The
pool keeps block buffers (anonymous maps) and hands one out again once no view of it is alive; the
map itself says so (it refuses to be resized while a view of it exists), so a buffer a reader, the
recent-block memory or a fill still holds is never written to.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

#: The alignment of a buffer's first byte: what ``O_DIRECT`` asks of a buffer's address.
ALIGN = 4096
#: Buffers at least this large come from the pool.
POOLED_MIN = 1 << 20
#: Most bytes the pool keeps (it hands out more, unpooled, while all it keeps are in use).
POOL_BYTES = 128 << 20

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # the kernel fills the pages at once, without the GIL


class _Pool:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._maps: dict[int, list[mmap.mmap]] = {}
        self._bytes = 0

    def take(self, size: int) -> memoryview:
        with self._lock:  # (a map found free is handed out before another thread can find it free)
            kept = self._maps.setdefault(size, [])
            for m in kept:
                try:
                    m.resize(size)  # refused while a view of it is alive
                except BufferError:
                    continue
                except (OSError, ValueError, SystemError):  # a platform that cannot resize a map: no pool
                    self.limit = self._bytes = 0
                    self._maps.clear()
                    break
                return memoryview(m)
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
            if self._bytes + size <= self.limit:
                kept.append(m)
                self._bytes += size
            return memoryview(m)

    def statistics(self) -> tuple[int, int]:
        """(buffers kept, bytes kept)."""
        with self._lock:
            return sum(len(maps) for maps in self._maps.values()), self._bytes


_pool = _Pool(POOL_BYTES)


def aligned_buffer(size: int) -> memoryview:
    """``size`` writable bytes whose first byte's address is a multiple of :data:`ALIGN`: a pooled
    buffer (contents undefined) from :data:`POOLED_MIN` bytes, else fresh zeroed memory."""
    if size >= POOLED_MIN:
        return _pool.take(size)
    raw = bytearray(size + ALIGN)
    skip = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % ALIGN
    return memoryview(raw)[skip:skip + size]


def is_aligned(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``O_DIRECT`` can write ``data`` from where it is: its address and length are multiples of
    :data:`ALIGN` (a block received into :func:`aligned_buffer`, say)."""
    if not len(data) or len(data) % ALIGN or isinstance(data, bytes):
        return False
    with memoryview(data) as view:
        if view.readonly or not view.c_contiguous:
            return False
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


def set_pool_limit(limit: int) -> None:
    """Keep at most ``limit`` bytes of idle buffers (``--memory-limit``'s share); those over it go."""
    with _pool._lock:
        _pool.limit = limit
        for size, maps in _pool._maps.items():
            while maps and _pool._bytes > limit:
                _pool._bytes -= size
                try:
                    maps.pop().close()
                except BufferError:  # (in use: it goes when its last view does)
                    pass


def pool_statistics() -> tuple[int, int]:
    """(buffers kept, bytes kept) by the pool."""
    return _pool.statistics()
