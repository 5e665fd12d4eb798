"""When uploads give way to a writer (:mod:`epochfs.writeback.giveway`), on a clock the test moves:
a burst pauses them, a slow writer does not, a pause is bounded and comes back only after a quiet
spell, a job waiting in sync is never made to wait; and the counts hold with threads asking at once."""

from __future__ import annotations

import random
import threading

from epochfs.writeback import giveway
from epochfs.writeback.giveway import GiveWay


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def write_for(g: GiveWay, clock: Clock, seconds: float, rate: float, step: float = 0.05) -> list[bool]:
    """Write at ``rate`` bytes/s for ``seconds``, asking after each step whether to wait."""
    asked = []
    for _ in range(round(seconds / step)):
        clock.t += step
        g.wrote(int(rate * step))
        asked.append(g.now())
    return asked


def test_a_burst_pauses_uploads_and_its_end_lets_them_go():
    clock = Clock()
    g = GiveWay(clock)
    assert not g.now()
    asked = write_for(g, clock, 1.0, 4 * giveway.RATE)
    assert asked[2:] == [True] * (len(asked) - 2)  # (once the window holds a burst's bytes)
    clock.t += giveway.WINDOW + 0.01  # the writer stopped
    assert not g.now()
    s = g.statistics()
    assert s.pauses == 1 and 0.8 <= s.paused_seconds <= 1.0 + giveway.WINDOW + 0.05 and not s.paused  # (until told to go)


def test_a_writer_slower_than_a_burst_pauses_nothing():
    clock = Clock()
    g = GiveWay(clock)
    assert not any(write_for(g, clock, 30.0, giveway.RATE / 2))
    assert g.statistics().pauses == 0


def test_a_pause_is_bounded_and_comes_back_only_after_a_quiet_spell():
    clock = Clock()
    g = GiveWay(clock)
    asked = write_for(g, clock, giveway.MOST + 3.0, 4 * giveway.RATE)
    waited = sum(asked) * 0.05
    assert giveway.MOST - 0.2 <= waited <= giveway.MOST + 0.1  # then uploads run beside the writer
    assert not any(asked[-40:])
    clock.t += giveway.QUIET / 2  # a pause shorter than QUIET: still the same burst, no new pause
    assert not any(write_for(g, clock, 1.0, 4 * giveway.RATE))
    clock.t += giveway.QUIET + 0.1
    g.now()  # (seen quiet)
    assert write_for(g, clock, 1.0, 4 * giveway.RATE)[-1]  # a new burst: a new pause
    assert g.statistics().pauses == 2


def test_no_pause_while_a_job_waits_in_sync():
    clock = Clock()
    g = GiveWay(clock)
    g.syncing += 1
    assert not any(write_for(g, clock, 2.0, 4 * giveway.RATE))
    g.syncing -= 1
    assert write_for(g, clock, 0.5, 4 * giveway.RATE)[-1]


def test_writers_and_uploads_on_threads_at_once():
    """Random writes and asks from several threads, on the real clock: no error, and what is counted
    stays consistent (a pause counted for every burst the asks saw)."""
    g = GiveWay()
    rng = random.Random(7)
    sizes = [rng.choice([0, -1, 1, 4096, 1 << 20, 64 << 20]) for _ in range(2000)]
    errors: list[BaseException] = []

    def writer(part: list[int]) -> None:
        try:
            for n in part:
                g.wrote(n)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def asker() -> None:
        try:
            for _ in range(2000):
                g.now()
                g.statistics()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(sizes[i::2],)) for i in range(2)]
    threads += [threading.Thread(target=asker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = g.statistics()
    assert s.pauses >= 1 and s.paused_seconds >= 0
