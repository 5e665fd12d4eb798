"""Uploads that give way to a writer: while a file of the mount is written fast (a checkpoint being
saved), the uploads of files closed before it pause, so the saving job has the node's cores, disk and
link to itself; the next save is not slowed by the last one's upload.

Bounded, so that nothing written is held back for long: a pause lasts at most :data:`MOST` seconds,
after which the uploads run beside the writer until it has been quiet for :data:`QUIET` seconds; a job
waiting in ``epochfs sync`` (or ``Client.sync()``) is waiting for the uploads, which then never pause.
Writing slower than :data:`RATE` (a log, a metrics file) is no burst and pauses nothing.

The writer's bytes are counted as they are seen: each daemon-path WRITE, and each growth of a file the
kernel writes (seen at its poll, every 50 ms). The uploads ask between every 256 KiB they send (the
S3 backend's transfer asks through its bandwidth limiter), from their own threads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: Bytes a second of writing that is a burst (a checkpoint's save, not a log).
RATE = 64 << 20
#: Seconds the writing rate is measured over.
WINDOW = 0.25
#: Most seconds one pause lasts.
MOST = 8.0
#: Seconds without a burst after which the next burst may pause the uploads again.
QUIET = 1.0


@dataclass(frozen=True)
class GiveWayStats:
    pauses: int  # bursts of writing the uploads paused for
    paused_seconds: float  # how long they were paused, in all
    paused: bool  # whether they are paused now


class GiveWay:
    """Whether uploads should wait now (:meth:`now`, any thread), from what was written (:meth:`wrote`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._marks: deque[tuple[float, int]] = deque()  # (when, bytes) written within WINDOW
        self._in_window = 0
        self._last_burst = -float("inf")  # when a burst was last seen
        self._since: float | None = None  # when the current pause began
        self._spent = False  # the current burst has had its pause
        self._paused_at: float | None = None  # (for the paused time: when :meth:`now` last said wait)
        self.syncing = 0  # callers waiting for the uploads (no pause while one waits)
        self.pauses = 0
        self.paused_seconds = 0.0

    def wrote(self, n: int) -> None:
        """``n`` bytes were written to a file of the mount just now."""
        if n <= 0:
            return
        with self._lock:
            now = self._clock()
            self._marks.append((now, n))
            self._in_window += n
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._marks and now - self._marks[0][0] > WINDOW:
            self._in_window -= self._marks.popleft()[1]

    def now(self) -> bool:
        """Whether an upload should wait now."""
        with self._lock:
            t = self._clock()
            self._trim(t)
            if self._in_window >= RATE * WINDOW:
                self._last_burst = t
            elif t - self._last_burst >= QUIET:
                self._since, self._spent = None, False  # (quiet long enough: the next burst pauses again)
            wait = self._wait(t)
            if self._paused_at is not None:
                self.paused_seconds += t - self._paused_at
            self._paused_at = t if wait else None
            return wait

    def _wait(self, t: float) -> bool:
        if self.syncing or self._spent or t - self._last_burst > WINDOW:
            return False
        if self._since is None:
            self._since = t
            self.pauses += 1
        if t - self._since >= MOST:
            self._spent = True
            return False
        return True

    def statistics(self) -> GiveWayStats:
        with self._lock:
            return GiveWayStats(self.pauses, self.paused_seconds, self._paused_at is not None)
