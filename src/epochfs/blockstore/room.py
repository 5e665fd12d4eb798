"""How much a block store may hold (a part of :class:`epochfs.blockstore.store.BlockStore`): its
``--cache-size``, this mount's part of the node's cache where the node's mounts split one
(:mod:`epochfs.cache.nodeshare`), and the room its file system has above ``--free-space-ratio``. The trio
thread only."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from epochfs.eviction import EvictionPolicy


class Room:
    capacity: int
    limit: int | None
    linked_bytes: int
    linked: dict[bytes, int]
    used: int
    pending: int
    pinned: int
    policy: EvictionPolicy
    cache_dir: Path
    free_space_ratio: float

    def _evict(self, bid: bytes) -> None: ...  # (BlockStore's)

    @property
    def cap(self) -> int:
        """What the store may hold now: ``--cache-size``, or this mount's part of the node's (:attr:`limit`)
        and what it holds linked from another store (charged to that one)."""
        return self.capacity if self.limit is None else min(self.capacity, self.limit + self.linked_bytes)

    def shrink(self, most: int = 1024) -> int:
        """Evict (the policy's victims first) until what is held fits :attr:`cap`, ``most`` blocks at a time
        (the rest at the next call: the loop is not held for long); the blocks evicted."""
        n = 0
        while self.used + self.pending + self.pinned > self.cap and n < most:
            victim = self.policy.victim()
            if victim is None:
                break
            self._evict(victim)
            n += 1
        return n

    def _disk_room(self) -> float:
        """Free bytes of the cache's file system above the share kept free (``--free-space-ratio``);
        raises OSError when it cannot be asked."""
        st = os.statvfs(self.cache_dir)
        return st.f_bavail * st.f_frsize - self.free_space_ratio * st.f_blocks * st.f_frsize

    def _disk_low(self, nbytes: int) -> bool:
        if self.free_space_ratio <= 0:
            return False
        try:
            return self._disk_room() - nbytes < 0
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise
            return True

    def bound(self) -> int:
        """What the cache can hold now: ``capacity`` (or this mount's part of the node's), or less where its
        file system holds less (what it holds, plus the free space above the share kept free)."""
        try:
            room = self._disk_room()
        except OSError:
            return self.cap
        return max(0, min(self.cap, self.used + self.pending + int(room)))

    def has_room(self, nbytes: int, bound: int | None = None) -> bool:
        """Whether ``nbytes`` fit now without evicting anything (under ``bound``; default :attr:`cap`)."""
        return self.used + self.pending + self.pinned + nbytes <= (self.cap if bound is None else bound) \
            and not self._disk_low(nbytes)

    def link_in(self, oid: bytes, size: int) -> None:
        """Object ``oid``'s file is another store's of the node too: its bytes are not charged to this
        mount's part of the node (:attr:`cap`)."""
        self.linked_bytes += size - self.linked.get(oid, 0)
        self.linked[oid] = size

    def alone_now(self, oid: bytes) -> None:
        """No other store holds ``oid``'s file any more: charged again."""
        self.linked_bytes -= self.linked.pop(oid, 0)
