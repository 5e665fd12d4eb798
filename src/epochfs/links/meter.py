"""A link's rate measured from the transfers that crossed it.

Each transfer is recorded as the time its body moved (from its first byte to its last) and its size;
the time before the first byte (the request's way there, the server's work, added latency) is left
out, so a backend far away is not taken for a narrow link. Every :data:`WINDOW` seconds the window just
ended is looked at: if bytes were moving at least :data:`BUSY` of its time, its rate (the bytes over
the time they were moving, overlapping transfers counted once) is a measurement of what the link
carries. A link that is mostly idle gives none: a few quick transfers say little about a sustained rate,
and a reader whose demand is low never measures its demand as the link's capacity.

The capacity measured is the highest rate of the last :data:`HOLD` seconds, each rate the mean of up to
:data:`RUN` busy windows in a row (a link shared with other nodes gives each a share that swings from
window to window; an old, higher figure would hide that the others read too), or, when no window of
that time was busy, the last one measured. The meter also counts the seconds bytes were moving
(:attr:`TransferMeter.busy_seconds`): over an epoch, the fraction of its time the link carried a
transfer, which says the link was the bound whatever its capacity.

Concurrency contract: :meth:`TransferMeter.record` is called from any thread (under a lock, a few
operations); :meth:`TransferMeter.sample` and :meth:`TransferMeter.measured` from one thread (the
daemon's link watch).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

WINDOW = 10.0  # seconds of one measurement
BUSY = 0.5  # of a window with bytes moving: a window busier than this measures the link
MIN_BYTES = 1 << 20  # a window that moved less measures nothing
HOLD = 600.0  # seconds a measurement is kept as the capacity
RUN = 3  # busy windows in a row averaged into one rate
KEPT = 50_000  # transfers kept (a window's worth at most; the oldest go first)


@dataclass(frozen=True)
class Transfer:
    start: float  # monotonic seconds: the first byte moved
    end: float  # the last byte moved
    nbytes: int


@dataclass(frozen=True)
class Measurement:
    when: float  # monotonic seconds: the end of the window
    bytes_per_second: float
    busy: float  # the fraction of the window with bytes moving


def union_length(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``spans`` (each ``(start, end)``)."""
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi <= reach:
            continue
        total += hi - max(lo, reach)
        reach = hi
    return total


def window_rate(transfers: Iterable[Transfer], lo: float, hi: float) -> Measurement | None:
    """The measurement of the window ``[lo, hi)``, or None if it was not busy enough. A transfer that
    crosses an edge counts with the part of its bytes inside (its rate taken as even)."""
    spans, moved = [], 0.0
    for t in transfers:
        a, b = max(t.start, lo), min(t.end, hi)
        if b <= a:
            if t.end <= t.start and lo <= t.end < hi:  # (all its bytes at one instant)
                moved += t.nbytes
            continue
        spans.append((a, b))
        moved += t.nbytes * (b - a) / (t.end - t.start)
    busy = union_length(spans)
    if hi <= lo or busy < BUSY * (hi - lo) or moved < MIN_BYTES:
        return None
    return Measurement(hi, moved / busy, busy / (hi - lo))


class TransferMeter:
    """The transfers of one link and what they measured."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._transfers: deque[Transfer] = deque(maxlen=KEPT)
        self._measurements: deque[Measurement] = deque()
        self._run: list[Measurement] = []  # the busy windows in a row so far (the last RUN)
        self._last: Measurement | None = None
        self._peak: Measurement | None = None  # the busiest single window of the last HOLD seconds
        self._sampled = clock()
        self.busy_seconds = 0.0  # seconds bytes were moving, over every window sampled

    def record(self, start: float, end: float, nbytes: int) -> None:
        """A body of ``nbytes`` moved from ``start`` to ``end`` (monotonic seconds)."""
        if nbytes > 0:
            with self._lock:
                self._transfers.append(Transfer(start, max(start, end), nbytes))

    def sample(self, now: float | None = None) -> Measurement | None:
        """Look at the window since the previous sample (at most :data:`WINDOW` seconds): its
        measurement, if it was busy enough."""
        now = self._clock() if now is None else now
        lo = max(self._sampled, now - WINDOW)
        self._sampled = now
        with self._lock:
            while self._transfers and self._transfers[0].end < lo:
                self._transfers.popleft()
            transfers = list(self._transfers)
        self.busy_seconds += union_length((max(t.start, lo), min(t.end, now)) for t in transfers
                                          if min(t.end, now) > max(t.start, lo))
        got = window_rate(transfers, lo, now)
        if self._peak is not None and self._peak.when < now - HOLD:
            self._peak = None
        if got is None:
            self._run.clear()
        else:
            if self._peak is None or got.bytes_per_second > self._peak.bytes_per_second:
                self._peak = got
            self._run = [*self._run, got][-RUN:]
            mean = Measurement(now, sum(m.bytes_per_second for m in self._run) / len(self._run),
                               sum(m.busy for m in self._run) / len(self._run))
            self._measurements.append(mean)
            self._last = mean
        while self._measurements and self._measurements[0].when < now - HOLD:
            self._measurements.popleft()
        return got

    def measured(self) -> Measurement | None:
        """The capacity measured: the highest rate of the last :data:`HOLD` seconds, else the last; never
        below the busiest single window of that time (a mean of windows is lower than its busiest one,
        and a capacity under a rate seen on the link would read as more than all of it)."""
        best = max(self._measurements, key=lambda m: m.bytes_per_second) if self._measurements else self._last
        if best is not None and self._peak is not None and self._peak.bytes_per_second > best.bytes_per_second:
            return self._peak
        return best
