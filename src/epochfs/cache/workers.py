"""The cache's worker-thread calls: :func:`trio.to_thread.run_sync` without the renaming.

trio names the OS thread after every job it runs and back again after it (``prctl`` through
:mod:`ctypes`, twice per job), and each of those calls gives up the GIL. On the cold small-file path,
where sixteen fetch threads and the trio thread take turns at the GIL, nearly every release is paid
for with a wait to get it back (two context switches). The cache's fetches and block reads run here,
in trio's own thread cache (:func:`trio.lowlevel.start_thread_soon`), with the same limiter and
cancellation rules and the threads' names left alone.

What the threads hand back to the trio thread (a fetched block for its readers, a job's end) goes
through the run's :class:`Mailbox`: one wake-up of the trio thread for all the calls posted before it
got to them, where ``TrioToken.run_sync_soon`` writes to trio's wake-up socket for each. Measured
together (cold 100 KiB files, 16 readers, ``benchmarks/profiles/results/2026-12-04-cold-small-gil.md``): 9.4-9.8
voluntary context switches of the daemon per file against 11.8-12.7 without the mailbox.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

log = logging.getLogger(__name__)


class Mailbox:
    """Calls posted from worker threads to the trio thread, run there in order, with one wake-up of the
    trio thread for all those posted before it got to them (``TrioToken.run_sync_soon`` writes to its
    wake-up socket for every call: a system call each, in a thread that lets go of the GIL for it)."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._calls: collections.deque[tuple[Callable[..., object], tuple[Any, ...]]] = collections.deque()
        self._scheduled = False

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """(Any thread) have the trio thread call ``fn(*args)``. Once the run is over,
        trio.RunFinishedError, or, where the run ended with a wake-up still pending, the call is
        dropped unseen (as trio drops the callbacks it had not run)."""
        with self._lock:
            self._calls.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._token.run_sync_soon(self._run)
        except BaseException:
            with self._lock:
                self._scheduled = False
            raise

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    self._scheduled = False
                    return
                calls = list(self._calls)
                self._calls.clear()
            for fn, args in calls:
                try:
                    fn(*args)
                except Exception:  # (as a call of its own would: the others still run)
                    log.exception("a call from a worker thread failed")


_MAILBOX: trio.lowlevel.RunVar[Mailbox] = trio.lowlevel.RunVar("epochfs.cache.workers.mailbox")


def mailbox() -> Mailbox:
    """(Trio thread) the current run's :class:`Mailbox`."""
    try:
        return _MAILBOX.get()
    except LookupError:
        box = Mailbox(trio.lowlevel.current_trio_token())
        _MAILBOX.set(box)
        return box


async def run_sync(fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter,
                   abandon_on_cancel: bool = False) -> T:
    """``fn(*args)`` in a worker thread, holding one of ``limiter``'s tokens until the thread is done
    (also when the caller was cancelled and did not wait). Cancelled while it runs: with
    ``abandon_on_cancel`` the caller gets :class:`trio.Cancelled` at once and the thread finishes
    alone; without, the caller waits for the thread (and is cancelled at its next checkpoint)."""
    await trio.lowlevel.checkpoint_if_cancelled()
    placeholder = object()
    await limiter.acquire_on_behalf_of(placeholder)
    task = trio.lowlevel.current_task()
    box = mailbox()
    abandoned = False

    def back(result: Any) -> None:  # (trio thread)
        limiter.release_on_behalf_of(placeholder)
        if not abandoned:
            trio.lowlevel.reschedule(task, result)

    def deliver(result: Any) -> None:  # (worker thread)
        try:
            box.post(back, result)
        except trio.RunFinishedError:
            pass  # the run ended meanwhile: nobody waits, and the limiter is gone with it

    try:
        trio.lowlevel.start_thread_soon(lambda: fn(*args), deliver)
    except BaseException:
        limiter.release_on_behalf_of(placeholder)
        raise

    def abort(_: Any) -> trio.lowlevel.Abort:
        nonlocal abandoned
        if abandon_on_cancel:
            abandoned = True
            return trio.lowlevel.Abort.SUCCEEDED
        return trio.lowlevel.Abort.FAILED

    return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]  # (the outcome, unwrapped)
