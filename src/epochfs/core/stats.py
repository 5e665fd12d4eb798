"""Plain statistics helpers shared by components (no Prometheus here: see :mod:`epochfs.daemon.metrics`)."""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Latency bucket upper bounds in seconds: 100 us to 30 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket (not cumulative); one more than bounds: the +Inf bucket
    total: float
    count: int

    def quantile(self, q: float) -> float | None:
        """The q-quantile, interpolated linearly within the bucket that holds it (as Prometheus's
        ``histogram_quantile``); ``inf`` when it lies beyond the last bound. None without observations."""
        if not self.count:
            return None
        rank, seen, lower = q * self.count, 0, 0.0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            if n and seen + n >= rank:
                if bound == float("inf"):
                    return bound
                return lower + (bound - lower) * max(0.0, rank - seen) / n
            seen += n
            lower = bound
        return float("inf")

    def minus(self, earlier: HistogramSnapshot) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True)),
                                 self.total - earlier.total, self.count - earlier.count)

    def as_dict(self) -> dict[str, object]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total, "count": self.count}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> HistogramSnapshot:
        return cls(tuple(d["bounds"]), tuple(d["counts"]), float(d["sum"]), int(d["count"]))  # type: ignore[arg-type]


class Histogram:
    """A fixed-bucket histogram that worker threads and the trio thread may observe into."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(self.bounds, tuple(self._counts), self._sum, sum(self._counts))


def read_origins(c: Mapping[str, Any] | object, before: Mapping[str, Any] | object | None = None) -> dict[str, int]:
    """Where what readers read came from (between ``before`` and ``c``, or since the start): the bytes
    this node fetched from the backend, from blocks' first owners in the cluster tier and from other
    replicas, and the rest of what was read (``local``: this node's own cache). Fetched bytes readers
    never read (a prefetch past the end) leave less to ``local``, never below nothing. ``c`` and
    ``before``: the cache's counters (:class:`epochfs.cache.accounting.CacheStats`, or ``status``'s
    mapping of them)."""
    def get(d: Mapping[str, Any] | object | None, key: str) -> int:
        if d is None:
            return 0
        value = d.get(key, 0) if isinstance(d, Mapping) else getattr(d, key)
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
