"""The block cache's statistics (:class:`CacheStats`). Where what readers read came from is worked out
from them by :func:`epochfs.core.stats.read_origins`, where the daemon, its control channel and the
doctor (which reads them from ``status``, never from the cache) meet."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    hit_bytes: int
    miss_bytes: int
    demand_fetches: int
    prefetch_fetches: int
    demand_bytes: int  # from the backend
    prefetch_bytes: int  # from the backend
    inflight: int
    peer_bytes: int = 0  # fetched from peers (demand and prefetch)
    replica_bytes: int = 0  # of those, from a replica other than the block's first owner (it failed)
    pushed_blocks: int = 0  # pushed into the kernel page cache ahead of readers (see cache.push)
    pushed_bytes: int = 0
    push_failures: int = 0  # pushes refused by the kernel, or of blocks found damaged
    push_stale: int = 0  # pushes whose file changed meanwhile (its pages dropped again)
    # what the cache holds in memory (--memory-limit): demand fetches in flight (a block each, at most),
    # fetches ahead in flight, blocks kept for readers, small files kept whole; and how long fetches ahead
    # waited for room
    demand_inflight_bytes: int = 0
    ahead_bytes: int = 0
    recent_bytes: int = 0
    whole_bytes: int = 0
    throttled_seconds: float = 0.0
