"""Descriptors kept open for the trio thread's reads of the cache (pack files, block files): a read
costs no ``open`` and no path walk, and the file's inode stays in memory. At most ``limit`` are kept,
the least recently used closed first; the owner forgets a file's descriptor before it deletes the file
(so a deleted file's space is freed), and worker threads open their own (a descriptor here may be
closed by the trio thread at any time). Not thread-safe: the trio thread only."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Descriptors(Generic[K]):
    def __init__(self, opener: Callable[[K], int], limit: int) -> None:
        self._open = opener
        self.limit = limit
        self._fds: OrderedDict[K, int] = OrderedDict()

    def get(self, key: K) -> int:
        """The descriptor of ``key``'s file, opened now if it is not kept (OSError as ``open`` raises)."""
        fd = self._fds.get(key)
        if fd is not None:
            self._fds.move_to_end(key)
            return fd
        fd = self._open(key)
        self._fds[key] = fd
        if len(self._fds) > self.limit:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def peek(self, key: K) -> int | None:
        """The descriptor of ``key``'s file if one is kept (nothing opened, the order unchanged)."""
        return self._fds.get(key)

    def forget(self, key: K) -> None:
        """Close ``key``'s descriptor if one is kept (before its file is deleted or replaced)."""
        fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __len__(self) -> int:
        return len(self._fds)
