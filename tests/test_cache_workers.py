"""The cache's worker-thread calls (epochfs.cache.workers): trio.to_thread's rules (the limiter's
token held until the thread ends, cancellation abandons or waits), without renaming the threads."""

import threading

import pytest
import trio

from epochfs.cache import workers


def test_the_result_and_the_error_come_back_and_the_thread_keeps_its_name():
    names = []

    def job(x):
        names.append(threading.current_thread().name)
        return x * 2

    def failing():
        raise OSError(5, "disk")

    async def main():
        limiter = trio.CapacityLimiter(2)
        assert await workers.run_sync(job, 21, limiter=limiter) == 42
        with pytest.raises(OSError, match="disk"):
            await workers.run_sync(failing, limiter=limiter)
        assert limiter.borrowed_tokens == 0

    trio.run(main)
    assert names and not names[0].startswith("job")  # (trio.to_thread would have named it after the job)


def test_the_limiter_bounds_the_threads_running_at_once():
    running, most = [0], [0]
    lock = threading.Lock()
    gate = threading.Event()

    def job():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        gate.wait(5)
        with lock:
            running[0] -= 1

    async def main():
        limiter = trio.CapacityLimiter(3)
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(lambda: workers.run_sync(job, limiter=limiter))
            await trio.sleep(0.3)
            assert limiter.borrowed_tokens == 3
            gate.set()

    trio.run(main)
    assert most[0] == 3


def test_an_abandoned_call_returns_at_once_and_keeps_its_token_until_the_thread_ends():
    release = threading.Event()
    ended = threading.Event()

    def job():
        release.wait(5)
        ended.set()

    async def main():
        limiter = trio.CapacityLimiter(1)
        with trio.move_on_after(0.2) as scope:
            await workers.run_sync(job, limiter=limiter, abandon_on_cancel=True)
        assert scope.cancelled_caught and not ended.is_set()
        assert limiter.borrowed_tokens == 1  # the thread still runs: its slot is not given to another
        release.set()
        with trio.fail_after(5):
            async with limiter:  # (the token comes back when the thread ends)
                assert ended.is_set()

    trio.run(main)


def test_a_call_not_abandoned_waits_for_its_thread_when_cancelled():
    ended = threading.Event()

    def job():
        threading.Event().wait(0.3)
        ended.set()
        return "done"

    async def main():
        limiter = trio.CapacityLimiter(1)
        with trio.move_on_after(0.05):
            await workers.run_sync(job, limiter=limiter)
        assert ended.is_set() and limiter.borrowed_tokens == 0

    trio.run(main)


def test_a_cancelled_caller_starts_no_thread():
    started = threading.Event()

    async def main():
        limiter = trio.CapacityLimiter(1)
        with trio.CancelScope() as scope:
            scope.cancel()
            await workers.run_sync(started.set, limiter=limiter)
        assert limiter.borrowed_tokens == 0

    trio.run(main)
    assert not started.is_set()


def test_the_mailbox_runs_posted_calls_in_order_with_one_wakeup_for_a_burst(monkeypatch):
    """Calls posted from threads before the trio thread gets to them share one run_sync_soon; a call
    that raises is logged and the others still run."""
    ran, wakeups = [], []

    def boom():
        raise RuntimeError("a bad call")

    real = workers.Mailbox._run
    monkeypatch.setattr(workers.Mailbox, "_run", lambda self: (wakeups.append(1), real(self))[1])

    async def main():
        box = workers.mailbox()
        assert workers.mailbox() is box  # (one per run)

        done = trio.Event()

        def burst():
            for i in range(50):
                box.post(ran.append, i)
                if i == 25:
                    box.post(boom)
            box.post(done.set)

        await trio.to_thread.run_sync(burst)
        with trio.fail_after(5):
            await done.wait()

    trio.run(main)
    assert ran == list(range(50))
    assert len(wakeups) < 26  # (one per call without the mailbox: 52)


def test_the_mailbox_says_when_the_run_is_over():
    boxes = []

    async def main():
        boxes.append(workers.mailbox())

    trio.run(main)
    with pytest.raises(trio.RunFinishedError):
        boxes[0].post(print, "late")
