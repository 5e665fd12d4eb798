"""The daemon's memory, bounded (``--memory-limit``).

What a FUSE cache holds in memory grows with its load: blocks being fetched (one buffer each, the size
of a block), blocks kept for their readers' next requests, small files kept whole by open handles, idle
buffers kept for reuse. Left alone these follow the concurrency flags (96 prefetches of 4 MiB are
384 MiB), not the machine; a training node's OOM killer then takes the daemon or the job.

:func:`split` divides a limit among them once, at start, after what the daemon holds by itself (its
``baseline``: the interpreter, its libraries, the namespace's memory map, measured then) and a margin
for what is not counted one by one (the kernel channel's buffer, control sessions, the Python heap's
slack). Demand fetches get slots that fit in their share and never wait for memory (a read is never
failed nor held back by the limit); readahead, the prefetch plan, a learned order and warmups share
what is left and wait for room (:class:`MemoryBudget`): under pressure the daemon fetches less ahead,
it never fails a read. Every use is counted, and the time fetches waited for room.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import trio

MiB = 1 << 20
MARGIN = 48 * MiB  # what is not counted use by use: the kernel channel, reads from the store (16 at once), heap slack
MIN_DEFAULT, MAX_DEFAULT = 512 * MiB, 8 << 30


class MemoryTooSmall(ValueError):
    """A limit that cannot hold the daemon's baseline and the least it needs to read."""


@dataclass(frozen=True)
class MemorySplit:
    """How a limit is spent (bytes; ``demand_slots`` in fetches)."""

    limit: int
    baseline: int  # what the daemon held by itself at start
    demand_slots: int  # demand fetches at once (each a block in memory): they never wait for memory
    ahead: int  # readahead, prefetch, learned order and warmups together, in flight (they wait for room)
    recent: int  # blocks kept for their readers' next requests
    whole: int  # small files kept whole by open handles
    pool: int  # idle receive buffers kept for reuse

    def as_dict(self) -> dict[str, int]:
        return {"limit": self.limit, "baseline": self.baseline, "demand_slots": self.demand_slots,
                "ahead": self.ahead, "recent": self.recent, "whole": self.whole, "pool": self.pool}


def split(limit: int, baseline: int, block_size: int, concurrency: int) -> MemorySplit:
    """The shares of ``limit``: demand fetches up to ``concurrency`` of a quarter of what is left after
    the baseline and the margin, kept blocks a quarter (at least a block), whole files an eighth (at most
    64 MiB), idle buffers an eighth (at most 128 MiB), the rest for fetching ahead (at least a block).
    :class:`MemoryTooSmall` where the limit cannot hold the baseline, the margin, one demand fetch, one
    block kept and one fetched ahead."""
    room = limit - baseline - MARGIN
    least = 3 * block_size
    if room < least:
        raise MemoryTooSmall(
            f"--memory-limit {limit / MiB:.0f}M cannot hold what the daemon needs: {baseline / MiB:.0f} MiB it "
            f"holds by itself, {MARGIN / MiB:.0f} MiB of margin and three blocks of {block_size / MiB:g} MiB "
            f"(one read, one kept, one fetched ahead): at least {(baseline + MARGIN + least) / MiB:.0f}M, "
            "or a smaller --block-size")
    demand = max(1, min(concurrency, room // 4 // block_size))
    recent = max(block_size, room // 4)
    whole = min(64 * MiB, room // 8)
    pool = min(128 * MiB, room // 8)
    ahead = max(block_size, room - demand * block_size - recent - whole - pool)
    return MemorySplit(limit, baseline, demand, ahead, recent, whole, pool)


def default_limit(total: int | None = None) -> int:
    """A sixteenth of the machine's memory, within [512 MiB, 8 GiB]: what the ``--memory-limit``
    default is (a training node's memory is the job's)."""
    if total is None:
        total = machine_memory()
    return max(MIN_DEFAULT, min(MAX_DEFAULT, total // 16))


def machine_memory() -> int:
    """The machine's memory, or the cgroup's limit where it is smaller (a pod's)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text != "max":
            total = min(total, int(text))
    except (OSError, ValueError):
        pass
    return total


def few_arenas(arenas: int = 2) -> bool:
    """Have glibc's allocator serve every thread from ``arenas`` arenas (called before the daemon starts
    its threads): by default each worker thread that allocates a block-sized buffer gets an arena of its
    own, and what such arenas free is kept from the system, so the resident set wanders tens of MiB above
    what is held (measured under 16 readers at a 160 MiB limit: peaks of 137-177 MiB with the default,
    148-152 MiB with two arenas). Whether it was set (False off glibc)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return bool(libc.mallopt(-8, arenas))  # M_ARENA_MAX
    except (OSError, AttributeError):
        return False


def resident() -> int:
    """This process's resident set, bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryBudget:
    """The bytes fetched ahead (readahead, the prefetch plan, a learned order, warmups) in flight
    within their share: :meth:`acquire` waits for room, first come first served, unless the fetch
    becomes one a reader waits for (then it goes, counted). On the trio thread."""

    POLL = 0.02  # seconds between looks at whether a waiting fetch became urgent

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self.throttled_seconds = 0.0
        self._waiting = 0
        self._freed = trio.Event()

    async def acquire(self, nbytes: int, urgent=lambda: False) -> None:
        if self.held + nbytes <= self.capacity and not self._waiting or urgent():
            self.held += nbytes
            return
        started = time.monotonic()
        self._waiting += 1
        try:
            while self.held + nbytes > self.capacity and self.held and not urgent():
                with trio.move_on_after(self.POLL):
                    await self._freed.wait()
        finally:
            self._waiting -= 1
            self.throttled_seconds += time.monotonic() - started
        self.held += nbytes

    def release(self, nbytes: int) -> None:
        self.held -= nbytes
        self._freed.set()
        self._freed = trio.Event()
