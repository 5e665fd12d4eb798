"""The block cache's statistics (:class:`CacheStats`). Where what readers read came from is worked out
from them by :func:`epochfs.core.stats.read_origins`, where the daemon, its control channel and the
doctor (which reads them from ``status``, never from the cache) meet."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class Tally:
    """What readers read (hits and misses, in reads and bytes) and what was fetched for them, by where
    it came from: the counters behind :class:`CacheStats` (trio thread)."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    fetches: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # demand? -> fetches
    fetched_bytes: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # from the backend
    peer_bytes: int = 0
    replica_bytes: int = 0

    def read(self, hit: bool, nbytes: int) -> None:
        if hit:
            self.hits += 1
            self.hit_bytes += nbytes
        else:
            self.misses += 1
            self.miss_bytes += nbytes

    def fetched(self, demand: bool, origin: str, nbytes: int) -> None:
        """A fetch's bytes arrived from ``origin`` (the backend, a peer's owner or replica)."""
        self.fetches[demand] += 1
        if origin == "backend":
            self.fetched_bytes[demand] += nbytes
            return
        self.peer_bytes += nbytes
        if origin == "replica":
            self.replica_bytes += nbytes

    def counts(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "hit_bytes": self.hit_bytes, "miss_bytes": self.miss_bytes,
                "demand_fetches": self.fetches[True], "prefetch_fetches": self.fetches[False],
                "demand_bytes": self.fetched_bytes[True], "prefetch_bytes": self.fetched_bytes[False],
                "peer_bytes": self.peer_bytes, "replica_bytes": self.replica_bytes}

