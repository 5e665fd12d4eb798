"""What training jobs report about themselves (``epochfs.watch``): per job and rank, the time spent
waiting for data, the time spent between batches (compute), the steps, and GPU utilisation where
known. Pure: the control handler feeds it validated reports, the metrics and ``epochfs status`` read it.

Reports carry what happened since the previous one (deltas), so a job that restarts only adds to the
totals and the exported counters never go back. At most :data:`MAX_ENTRIES` job x rank entries are kept;
the one reported least recently is forgotten first. Each entry keeps its reports of the last
:data:`WINDOW` seconds, for answers about "now" rather than since the mount started.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field

MAX_ENTRIES = 256
WINDOW = 600.0  # seconds of reports kept per entry
MAX_SAMPLES = 1024  # reports kept per entry within the window
#: A job name: what a Prometheus label, a log line and a file name can all carry unescaped.
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


@dataclass(frozen=True, slots=True)
class Report:
    """One report of one rank of one job: what happened since its previous report."""

    job: str
    rank: int
    steps: int
    data_wait: float  # seconds spent waiting in next() for a batch
    compute: float  # seconds between batches
    gpu_utilization: float | None = None  # percent, averaged over the interval, where known
    saves: int = 0  # checkpoint saves timed (epochfs.watch.saving)
    save_seconds: float = 0.0  # how long they took, as the job saw it


@dataclass(frozen=True)
class JobStats:
    job: str
    rank: int
    steps: int
    data_wait_seconds: float
    compute_seconds: float
    gpu_utilization: float | None
    last_report: float  # when (the daemon's clock)
    recent: tuple[tuple[float, int, float, float, int, float], ...]  # (time, steps, data_wait, compute,
    #                                                                  saves, save_seconds) in the window
    saves: int = 0
    save_seconds: float = 0.0


@dataclass
class _Entry:
    steps: int = 0
    data_wait: float = 0.0
    compute: float = 0.0
    gpu: float | None = None
    last: float = 0.0
    saves: int = 0
    save_seconds: float = 0.0
    recent: deque[tuple[float, int, float, float, int, float]] = field(
        default_factory=lambda: deque(maxlen=MAX_SAMPLES))


class Jobs:
    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()

    def report(self, r: Report, now: float) -> None:
        key = (r.job, r.rank)
        entry = self._entries.pop(key, None) or _Entry()
        self._entries[key] = entry  # most recently reported last
        while len(self._entries) > MAX_ENTRIES:
            self._entries.popitem(last=False)
        entry.steps += r.steps
        entry.data_wait += r.data_wait
        entry.compute += r.compute
        if r.gpu_utilization is not None:
            entry.gpu = r.gpu_utilization
        entry.saves += r.saves
        entry.save_seconds += r.save_seconds
        entry.last = now
        entry.recent.append((now, r.steps, r.data_wait, r.compute, r.saves, r.save_seconds))
        while entry.recent and entry.recent[0][0] < now - WINDOW:
            entry.recent.popleft()

    def statistics(self) -> tuple[JobStats, ...]:
        return tuple(JobStats(job, rank, e.steps, e.data_wait, e.compute, e.gpu, e.last, tuple(e.recent), e.saves,
                              e.save_seconds)
                     for (job, rank), e in self._entries.items())
