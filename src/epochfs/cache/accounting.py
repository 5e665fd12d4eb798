"""The block cache's statistics (:class:`CacheStats`) and where what readers read came from
(:func:`read_origins`). Pure: the doctor and ``status`` read them without the cache's event loop."""

from __future__ import annotations

import math
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


def read_origins(c: dict[str, int] | CacheStats, before: dict[str, int] | CacheStats | None = None) -> dict[str, int]:
    """Where what readers read came from (between ``before`` and ``c``, or since the start): the bytes
    this node fetched from the backend, from blocks' first owners in the cluster tier and from other
    replicas, and the rest of what was read (``local``: this node's own cache). Fetched bytes readers
    never read (a prefetch past the end) leave less to ``local``, never below nothing."""
    def get(d: dict[str, int] | CacheStats | None, key: str) -> int:
        if d is None:
            return 0
        value = d.get(key, 0) if isinstance(d, dict) else getattr(d, key)
        if isinstance(value, float) and math.isfinite(value):
            return int(value)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def delta(key: str) -> int:
        return max(0, get(c, key) - get(before, key))

    backend = delta("demand_bytes") + delta("prefetch_bytes")
    replica = min(delta("replica_bytes"), delta("peer_bytes"))
    owner = delta("peer_bytes") - replica
    read = delta("hit_bytes") + delta("miss_bytes")
    return {"local": max(0, read - backend - owner - replica), "owner": owner, "replica": replica, "backend": backend}
