"""The training job's own view: how long each step waited for data, and how long it computed.

    from epochfs.watch import watch               # (epochfs.torch.watch is the same)

    for batch in watch(loader, "/mnt/data", job="resnet50"):
        ...

:func:`watch` yields the loader's batches unchanged (any iterable: a DataLoader, a streaming loader, a
generator) and measures, per step, the time spent in ``next()`` waiting for the batch (*data wait*)
and the time from handing a batch over to being asked for the next (*compute*). In the loop it only
reads the clock and adds (a few microseconds per step, ``benchmarks/training/watch_overhead.py``); a
background thread reports what was measured since its previous report to the mount's daemon every
``interval`` seconds over the control socket, and a last time when the loop ends. Reporting never
blocks or breaks training: a daemon that is gone, slow or refuses (another user's mount) costs a
warning logged once, and measuring goes on. Each pass over the loader (an epoch) ends with one log
line: ``epoch 3 (resnet50 rank 0): waited for data 62% of step time (1250 steps, 88.1 s)``; each
report names the pass its steps belong to, so the daemon keeps the first epoch (the cold read) apart
from the later ones (``epochfs doctor``'s verdicts per epoch). At exit the process sends what it still
holds (at most :data:`EXIT_BUDGET` seconds), so a script that saves a checkpoint and ends reports it.
A save timed by :func:`saving` is reported to its own mount and to each mount the job watches in this
process (the data mount's doctor sees the saves that stall the job).

The rank is the argument, else ``torch.distributed``'s if it is initialised, else ``$RANK``, else 0;
the job name the argument, else ``$EPOCHFS_JOB``, else the script's name. With NVML (``pynvml``)
importable and a GPU present, the reporter also samples this rank's GPU utilisation.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from epochfs.control.jobs import JOB_NAME
from epochfs.core.errors import EpochfsError

log = logging.getLogger(__name__)

T = TypeVar("T")

INTERVAL = 5.0  # seconds between reports
TIMEOUT = 2.0  # a report the daemon has not answered by then is given up (the next one carries it)
EXIT_BUDGET = 5.0  # seconds a process's exit may wait for its last reports


def job_name(job: str | None) -> str:
    """The job's name as reported: ``job``, ``$EPOCHFS_JOB`` or the script's name, cut to what the
    daemon accepts (:data:`epochfs.control.jobs.JOB_NAME`)."""
    raw = job or os.environ.get("EPOCHFS_JOB") or os.path.splitext(os.path.basename(sys.argv[0] or ""))[0] or "job"
    name = re.sub(r"[^A-Za-z0-9_.:-]", "_", raw).lstrip("_.:-")[:64] or "job"
    assert JOB_NAME.fullmatch(name)
    return name


def job_rank(rank: int | None) -> int:
    if rank is not None:
        return int(rank)
    dist = sys.modules.get("torch.distributed")  # never imports torch itself
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a half-initialised process group must not stop training
        pass
    try:
        return max(0, int(os.environ.get("RANK", "0")))
    except ValueError:
        return 0


class Meter:
    """Totals of one rank's loop, written by the loop (single writer) and read by the reporter."""

    __slots__ = ("steps", "data_wait", "compute", "saves", "save_seconds", "marks")

    def __init__(self) -> None:
        self.steps = 0
        self.data_wait = 0.0
        self.compute = 0.0
        self.saves = 0
        self.save_seconds = 0.0
        # (epoch, steps, data_wait, compute) where each pass began: the loop appends, the reporter takes
        self.marks: deque[tuple[int, int, float, float]] = deque()


class _Gpu:
    """This rank's GPU utilisation through NVML, if it is there (never required)."""

    def __init__(self, rank: int) -> None:
        self.handle: Any = None
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            if count:
                local = int(os.environ.get("LOCAL_RANK", rank))
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(local % count)
                self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML, no GPU, no driver: utilisation stays unknown
            self.handle = None

    def utilization(self) -> float | None:
        if self.handle is None:
            return None
        try:
            return float(self._nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:  # noqa: BLE001
            return None


class Reporter:
    """Sends a meter's progress to the daemon in the background."""

    def __init__(self, mountpoint: str | os.PathLike[str], job: str, rank: int, meter: Meter, *,
                 interval: float = INTERVAL, send: Any = None) -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self.job, self.rank, self.meter, self.interval = job, rank, meter, interval
        self.epochs = 0  # passes over a loader through watch() (the epoch log line's number)
        self._send = send or self._request
        self._sent: tuple[int, float, float, int, float] = (0, 0.0, 0.0, 0, 0.0)
        self._epoch: int | None = None  # the pass the steps after ``_sent`` belong to
        self._pending: list[tuple[int, int, float, float]] = []  # marks taken, not yet reported past
        self._announced: int | None = None  # the last pass the daemon heard of
        self._warned = False
        #: Whether the daemon has an epoch order from this job's user (its answer to the last report).
        self.handed_over: bool | None = None
        self._wake = threading.Event()
        self._stop = False
        self._lock = threading.Lock()  # one report at a time (the thread, and the final flush)
        self._gpu: _Gpu | None = None
        self._thread = threading.Thread(target=self._run, name="epochfs-watch", daemon=True)
        self._thread.start()

    def _request(self, fields: dict[str, Any]) -> dict[str, Any]:
        from epochfs.control.client import request

        return request(self.mountpoint, "report", timeout=TIMEOUT, **fields)

    def _run(self) -> None:
        self._gpu = _Gpu(self.rank)
        while not self._stop:
            self._wake.wait(self.interval)
            self._wake.clear()
            self.report()

    def report(self) -> None:
        """Send what was measured since the last report that reached the daemon: one report per pass
        over the loader it covers, each naming its epoch."""
        with self._lock:
            m = self.meter
            now = (m.steps, m.data_wait, m.compute, m.saves, m.save_seconds)
            while m.marks and all(a <= b for a, b in zip(m.marks[0][1:], now, strict=False)):
                self._pending.append(m.marks.popleft())  # (a mark taken after ``now`` waits its turn)
            gpu = self._gpu.utilization() if self._gpu is not None else None
            while True:
                last = not self._pending
                upto = now if last else (*self._pending[0][1:], self._sent[3], self._sent[4])
                steps, wait, compute, saves, saving = (a - b for a, b in zip(upto, self._sent, strict=True))
                begun = last and self._epoch is not None and self._epoch != self._announced
                if steps > 0 or saves > 0 or begun:  # (a pass that began is said at once: the daemon
                    #                                   notes the backend's usage where it began)
                    fields = {"job": self.job, "rank": self.rank, "steps": steps, "data_wait": max(0.0, wait),
                              "compute": max(0.0, compute), "gpu_utilization": gpu}
                    if self._epoch is not None:
                        fields["epoch"] = self._epoch
                    if saves:
                        fields.update(saves=saves, save_seconds=max(0.0, saving))
                    if not self._deliver(fields):
                        return  # not sent: the next report carries it
                    self._announced = self._epoch
                self._sent = upto
                if last:
                    return
                self._epoch = self._pending.pop(0)[0]

    def _deliver(self, fields: dict[str, Any]) -> bool:
        from epochfs.control.client import tell_once

        try:
            reply = self._send(fields)
        except (EpochfsError, OSError, ValueError) as exc:
            if not self._warned:  # (one line: through the job's logging if it has any, else on stderr)
                if log.hasHandlers():
                    log.warning("epochfs.watch: cannot report to the daemon at %s (%s); measuring goes on",
                                self.mountpoint, exc)
                else:
                    tell_once("epochfs.watch (the job's view stays empty)", self.mountpoint, exc)
                self._warned = True
            return False
        if isinstance(reply, dict) and isinstance(reply.get("handed_over"), bool):
            self.handed_over = reply["handed_over"]
        return True

    def flush(self) -> None:
        """Have the reporter send now (in the background: the loop does not wait)."""
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()


def watch(loader: Iterable[T], mountpoint: str | os.PathLike[str], *, job: str | None = None,
          rank: int | None = None, interval: float = INTERVAL, reporter: Reporter | None = None,
          epoch: int | None = None) -> Iterator[T]:
    """Yield ``loader``'s items unchanged, measuring each step's data wait and compute (see the module).
    ``epoch``: the epoch this pass is (a job resumed from a checkpoint mid-way through epoch 5 passes
    ``epoch=5``, and its later passes count on from there); default: the passes this process made."""
    if reporter is None:
        reporter = _reporters.get(os.path.abspath(mountpoint), job_name(job), job_rank(rank), interval)
    if epoch is not None:
        if epoch < 0:
            raise ValueError("epoch is the epoch's number, from 0")
        reporter.epochs = epoch
    meter = reporter.meter
    started = (meter.steps, meter.data_wait, meter.compute)
    meter.marks.append((reporter.epochs, *started))
    reporter.flush()  # (the daemon hears at once that a pass began)
    clock = time.perf_counter
    it = iter(loader)
    epoch_start = clock()
    try:
        while True:
            t0 = clock()
            try:
                item = next(it)
            except StopIteration:
                break
            t1 = clock()
            meter.data_wait += t1 - t0
            meter.steps += 1
            yield item
            meter.compute += clock() - t1
    finally:
        reporter.flush()
        steps = meter.steps - started[0]
        waited = meter.data_wait - started[1]
        busy = waited + meter.compute - started[2]
        if steps:
            log.info("epoch %d (%s rank %d): waited for data %.0f%% of step time (%d steps, %.1f s)%s",
                     reporter.epochs, reporter.job, reporter.rank, 100 * waited / busy if busy else 0.0, steps,
                     clock() - epoch_start, "; no epoch order was handed over to the daemon by this job's user, "
                     "so nothing was fetched ahead (epochfs.torch.EpochfsSampler)" if reporter.handed_over is False
                     else "")
            reporter.epochs += 1


@contextmanager
def saving(mountpoint: str | os.PathLike[str], *, job: str | None = None, rank: int | None = None) -> Iterator[None]:
    """Time a checkpoint save as the job sees it (``with saving("/mnt/ckpt", job="resnet50"):
    torch.save(...)``): reported with the job's steps, kept for ``epochfs doctor --compare``. The time
    in the block is neither data wait nor compute of the loop."""
    reporter = _reporters.get(os.path.abspath(mountpoint), job_name(job), job_rank(rank), INTERVAL)
    start = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - start
        for r in _reporters.of_job(reporter):  # this mount's, and the data mounts' the job reports to
            r.meter.save_seconds += took
            r.meter.saves += 1
            r.flush()


class _Reporters:
    """One reporter (and meter) per mount point, job and rank in this process: each epoch's ``watch``
    adds to the same totals."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str, int], Reporter] = {}
        self._lock = threading.Lock()

    def get(self, mountpoint: str, job: str, rank: int, interval: float) -> Reporter:
        with self._lock:
            key = (mountpoint, job, rank)
            reporter = self._by_key.get(key)
            if reporter is None:
                reporter = self._by_key[key] = Reporter(mountpoint, job, rank, Meter(), interval=interval)
            return reporter

    def of_job(self, reporter: Reporter) -> list[Reporter]:
        """``reporter`` and the other mounts' reporters of its job and rank in this process."""
        with self._lock:
            others = [r for r in self._by_key.values() if (r.job, r.rank) == (reporter.job, reporter.rank)]
        return [reporter, *(r for r in others if r is not reporter)]

    def flush_all(self, budget: float = EXIT_BUDGET) -> None:
        """Send what every reporter holds, waiting at most ``budget`` seconds in all (at exit: a process
        that saves a checkpoint and ends still reports it)."""
        with self._lock:
            reporters = list(self._by_key.values())
        if not reporters:
            return
        done = threading.Event()

        def send() -> None:
            for r in reporters:
                r.close()
                r.report()
            done.set()

        threading.Thread(target=send, name="epochfs-watch-exit", daemon=True).start()
        done.wait(budget)


_reporters = _Reporters()
atexit.register(_reporters.flush_all)
