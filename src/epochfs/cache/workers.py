"""The cache's worker-thread calls: :func:`trio.to_thread.run_sync` without the renaming.

trio names the OS thread after every job it runs and back again after it (``prctl`` through
:mod:`ctypes`, twice per job), and each of those calls gives up the GIL. On the cold small-file path,
where sixteen fetch threads and the trio thread take turns at the GIL, nearly every release is paid
for with a wait to get it back (two context switches). The cache's fetches and block reads run here,
in trio's own thread cache (:func:`trio.lowlevel.start_thread_soon`), with the same limiter and
cancellation rules and the threads' names left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


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
    token = trio.lowlevel.current_trio_token()
    abandoned = False

    def back(result: Any) -> None:  # (trio thread)
        limiter.release_on_behalf_of(placeholder)
        if not abandoned:
            trio.lowlevel.reschedule(task, result)

    def deliver(result: Any) -> None:  # (worker thread)
        try:
            token.run_sync_soon(back, result)
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
