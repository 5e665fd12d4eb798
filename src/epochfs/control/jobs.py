"""What training jobs report about themselves (``epochfs.watch``): per job and rank, the time spent
waiting for data, the time spent between batches (compute), the steps, and GPU utilisation where
known. Pure: the control handler feeds it validated reports, the metrics and ``epochfs status`` read it.

Reports carry what happened since the previous one (deltas), so a job that restarts only adds to the
totals and the exported counters never go back. At most :data:`MAX_ENTRIES` job x rank entries are kept;
the one reported least recently is forgotten first. Each entry keeps its reports of the last
:data:`WINDOW` seconds, for answers about "now" rather than since the mount started.

A report may name the pass over the loader it belongs to (``epoch``: 0 for the first pass of the job's
process): each entry then keeps its totals per epoch (the last :data:`MAX_EPOCHS`), and each job the
mount's backend usage when its first report of each epoch arrived (:meth:`Jobs.marks`), so that what an
epoch asked of the backend is a difference of two marks. An epoch number lower than one already seen
is a job that started again: its epochs begin afresh.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field

MAX_ENTRIES = 256
MAX_ENTRIES_PER_UID = 64  # job x rank entries one uid may hold (operators aside)
WINDOW = 600.0  # seconds of reports kept per entry
MAX_SAMPLES = 1024  # reports kept per entry within the window
MAX_EPOCHS = 64  # epochs kept per entry, and marks per job
MAX_EPOCH = 1 << 20
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
    epoch: int | None = None  # the pass over the loader these steps belong to (None: not said)


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
    epochs: tuple[EpochStats, ...] = ()
    uid: int | None = None  # the uid that reports it (None: the daemon's own, or not known)


@dataclass(frozen=True, slots=True)
class EpochStats:
    """One rank's totals of one epoch."""

    epoch: int
    steps: int
    data_wait: float
    compute: float
    first_report: float  # when its first and last reports arrived (the daemon's clock)
    last_report: float


@dataclass(frozen=True, slots=True)
class Mark:
    """The mount's backend usage when a job's first report of ``epoch`` arrived."""

    epoch: int
    time: float
    usage: tuple[int, int, int]  # (GET-class requests, LIST requests, bytes read), since the mount started
    #: other counters at that moment (where reads came from, the host's CPU time): name, value
    counters: tuple[tuple[str, float], ...] = ()


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
    epochs: OrderedDict[int, list[float]] = field(default_factory=OrderedDict)  # epoch -> [steps, wait,
    #                                                                            compute, first, last]


class JobTaken(ValueError):
    """A report another uid may not make: the job name is held by another uid, or its uid holds as many
    entries as one may."""


class Jobs:
    """The jobs' reports. A job name belongs to the uid whose report first named it, for as long as any
    rank of it is kept: another uid's report of that name is refused (:class:`JobTaken`), so no user
    forges or rewrites another's view, and one uid holds at most :data:`MAX_ENTRIES_PER_UID` entries."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._marks: dict[str, OrderedDict[int, Mark]] = {}
        self._owners: dict[str, int | None] = {}  # job -> the uid that reports it (exactly the jobs kept)

    def check(self, r: Report, uid: int | None, operator: bool = True) -> None:
        """:class:`JobTaken` if ``uid`` may not report ``r`` (an operator may report any job)."""
        if operator:
            return
        if self._owners.get(r.job, uid) != uid:
            raise JobTaken(f"job name {r.job!r} is reported by another user; name your job apart (watch(..., job=...))")
        if (r.job, r.rank) not in self._entries and sum(
                1 for (job, _) in self._entries if self._owners.get(job) == uid) >= MAX_ENTRIES_PER_UID:
            raise JobTaken(f"uid {uid} already reports {MAX_ENTRIES_PER_UID} job ranks; the oldest are kept until "
                           "they are forgotten")

    def new_epoch(self, r: Report) -> bool:
        """Whether ``r`` is its job's first report of its epoch (the caller then passes the backend's
        usage to :meth:`report`)."""
        return r.epoch is not None and (r.epoch not in self._marks.get(r.job, ()) or self._restarted(r) is not None)

    def _restarted(self, r: Report) -> float | None:
        """When ``r``'s rank last reported before it started again (None: it did not start again)."""
        entry = self._entries.get((r.job, r.rank))
        if r.epoch is None or entry is None or not entry.epochs:
            return None
        last = next(reversed(entry.epochs))
        return entry.epochs[last][4] if r.epoch < last else None

    def report(self, r: Report, now: float, usage: tuple[int, int, int] | None = None,
               counters: dict[str, float] | None = None, uid: int | None = None) -> None:
        restarted = self._restarted(r)
        key = (r.job, r.rank)
        self._owners.setdefault(r.job, uid)  # (its keys are the jobs with entries: the first reporter's)
        entry = self._entries.pop(key, None) or _Entry()
        self._entries[key] = entry  # most recently reported last
        while len(self._entries) > MAX_ENTRIES:
            (gone, _), _ = self._entries.popitem(last=False)
            if not any(k[0] == gone for k in self._entries):
                self._owners.pop(gone, None)
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
        if r.epoch is not None:
            self._count_epoch(entry, r, now)
            self._mark(r, now, usage, restarted, counters)

    @staticmethod
    def _count_epoch(entry: _Entry, r: Report, now: float) -> None:
        assert r.epoch is not None
        if entry.epochs and r.epoch < next(reversed(entry.epochs)):
            entry.epochs.clear()  # the rank started again
        totals = entry.epochs.get(r.epoch)
        if totals is None:
            totals = entry.epochs[r.epoch] = [0, 0.0, 0.0, now, now]
            while len(entry.epochs) > MAX_EPOCHS:
                entry.epochs.popitem(last=False)
        totals[0] += r.steps
        totals[1] += r.data_wait
        totals[2] += r.compute
        totals[4] = now

    def _mark(self, r: Report, now: float, usage: tuple[int, int, int] | None, restarted: float | None,
              counters: dict[str, float] | None = None) -> None:
        assert r.epoch is not None
        marks = self._marks.get(r.job)
        if marks is None:
            for job in [j for j in self._marks if not any(k[0] == j for k in self._entries)]:
                del self._marks[job]  # (a job whose every rank was forgotten)
            marks = self._marks[r.job] = OrderedDict()
        if restarted is not None:  # the marks its earlier run set are not this run's
            for epoch in [e for e, m in marks.items() if e >= r.epoch and m.time <= restarted]:
                del marks[epoch]
        if r.epoch in marks or usage is None:
            return
        late = bool(marks) and r.epoch < next(reversed(marks))
        marks[r.epoch] = Mark(r.epoch, now, usage, tuple(sorted((counters or {}).items())))
        if late:  # (a rank that reports an epoch the others skipped: kept in epoch order)
            ordered = sorted(marks.items())
            marks.clear()
            marks.update(ordered)
        while len(marks) > MAX_EPOCHS:
            marks.popitem(last=False)

    def marks(self, job: str) -> tuple[Mark, ...]:
        """The backend usage at the start of each epoch of ``job`` the mount has seen, oldest first."""
        return tuple(self._marks.get(job, {}).values())

    def statistics(self) -> tuple[JobStats, ...]:
        return tuple(JobStats(job, rank, e.steps, e.data_wait, e.compute, e.gpu, e.last, tuple(e.recent), e.saves,
                              e.save_seconds, tuple(EpochStats(n, int(t[0]), t[1], t[2], t[3], t[4])
                                                    for n, t in e.epochs.items()), self._owners.get(job))
                     for (job, rank), e in self._entries.items())
