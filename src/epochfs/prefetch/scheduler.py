"""Prefetch by epoch manifest.

The training job hands the daemon the order in which this rank will read files (:mod:`.manifest`).
The :class:`Prefetcher` expands it into a block sequence (:class:`~epochfs.prefetch.plan.Plan`), tells
the eviction policy the future, follows the reader through it, and keeps fetching the blocks ahead of
the reader:

- **Position.** Opening or reading a file of the plan moves the reader's position to that file (only
  forward: a file opened out of order moves it ahead; re-reads of past files and files outside the plan
  do not move it and are served normally). A file of the *next* hand-over moves the position there only
  once the current one is nearly done, so a re-read is not mistaken for the start of the next epoch.
- **Window.** The cursor walks ahead of the position, starting fetches, until the bytes between the two
  reach the window, or until the store would not admit the next block — under the manifest policy that
  means every resident block is needed sooner, so fetching further ahead would only evict something
  used earlier. The window is sized by time: the reader's observed rate times a lead of twenty fetch
  latencies (at least 0.25 s, at most ``lead`` seconds), at least what is in flight, at most a quarter
  of the cache. A backend that answers in 2 ms needs a quarter of a second of lead, not two seconds:
  a longer one is fetched in a burst at the epoch's start that crowds the first reads (measured: up to
  5 points of first-epoch AU on 2 cores). A window as large as the cache would be wrong:
  blocks fetched far ahead displace blocks that the next epoch reuses (Belady keeps those), so the
  window holds what hides the backend's latency and leaves the rest of the cache to the policy. A
  short lead also spreads the fetching over the epoch at the reader's pace: fetching as fast as
  possible front-loads the daemon's CPU and slows the very reads it is meant to speed up (measured:
  the first epoch's AU fell to 75% with a 10 s lead on 2 cores, all reads being hits).
- **In flight.** The number of concurrent prefetch fetches is sized by time (Little's law): twice the
  reader's rate x the observed fetch latency (with a bandwidth cap, the cap's rate), at most
  ``--prefetch-concurrency`` (the plan's and warmups' own slots in the cache, apart from readahead's and
  demand's). A backend that answers in milliseconds gets a couple of prefetches at a
  time, one 50 ms away gets many: measured, 16 prefetches in flight against a fast local backend cost
  the reader up to 10 points of AU by crowding its demand fetches on a CPU-bound endpoint. Prefetch
  never delays demand: it waits while a demand fetch is queued, and uses its own capacity limiter.
- **A reader that pauses keeps its lead.** A training loop stops reading for validation and checkpoints,
  and may hand an epoch over before it starts: time when fetching costs the reads nothing. Once the
  reader has not moved for ``PAUSE`` seconds (or has not started), the window opens to a quarter of
  the cache (still only what the policy admits), so the bytes it will read next keep arriving; when it
  reads again, the window is its rate's once more and the cursor stays where the pause took it.
- **Warm blocks come into memory ahead.** A block that is cached still waits for the cache disk when
  the page cache no longer holds it (a later epoch), and a read that waits goes to a worker thread. So
  the bytes the reader reads next of cached blocks (a packed member's own range, a whole object's
  block) are read into memory ahead of it (``posix_fadvise`` WILLNEED: the kernel reads them in the
  background), up to the window or ``WARM_AHEAD`` ahead, whichever is less; the reads are then
  answered as they come. Measured on a packed dataset's second epoch (local order, 20 ms, 2 cores):
  AU 90% against 74%, as high as the local disk's.
- **Hand-over.** A new manifest is appended after the rest of the current one (``epochfs prefetch`` while
  an epoch is finishing), or replaces it.

All state lives on the trio thread; the hooks ``opened``/``touched`` are called from the read path and
only update the position and wake the scheduler.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from epochfs.cache.service import BlockCache, Fetch
from epochfs.core.blocks import extent_blocks
from epochfs.core.errors import NotPermitted
from epochfs.core.records import ObjectInfo, stored_extent
from epochfs.core.text import human
from epochfs.prefetch.plan import DEFAULT_LEAD, MAX_PREFETCH_CONCURRENCY, Plan, count_blocks
from epochfs.prefetch.warmups import WarmupJob, WarmupShare, left_cached, resident

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefetchStats:
    active: bool
    epoch: int | None
    files: int
    file_position: int
    blocks: int
    position: int
    plan_bytes: int
    position_bytes: int
    lead_bytes: int
    lead_seconds: float | None
    queued_bytes: int
    inflight: int
    fetched_blocks: int
    fetched_bytes: int
    bandwidth_limit: float | None
    reader_bytes_per_second: float
    #: Fetches in flight that keep ahead of the reader at the fetches' latency (Little's law, before
    #: the cap; None until the reader's rate is known), the cap (``--prefetch-concurrency``), and where
    #: the cap is what binds, the cap that would let the plan keep ahead (twice it, or what is wanted,
    #: within the flag's bounds; None where it does not bind or is at its most).
    wanted_inflight: int | None = None
    max_inflight: int = 0
    advised_inflight: int | None = None


@dataclass
class Handover:
    """The files handed over for one segment of the plan: one reader's, or (``parts`` by rank) those of
    the ranks of one epoch, read side by side."""

    segment: int
    epoch: int | None
    parts: dict[int | None, list[ObjectInfo]] = field(default_factory=dict)
    owners: dict[int | None, int | None] = field(default_factory=dict)  # each part's uid (None: the daemon's)
    blocks: dict[int | None, int] = field(default_factory=dict)  # each part's blocks

    def others(self, uid: int | None) -> set[int | None]:
        """The uids other than ``uid`` whose parts it holds."""
        return {o for o in self.owners.values() if o != uid}

    def files(self) -> list[ObjectInfo]:
        if len(self.parts) == 1:
            return next(iter(self.parts.values()))
        shares = [self.parts[r] for r in sorted(self.parts, key=lambda r: -1 if r is None else r)]
        return [share[i] for i in range(max(map(len, shares))) for share in shares if i < len(share)]


@dataclass(frozen=True)
class PrefetchSettings:
    """What the prefetcher needs of the mount's options."""

    capacity: int  # the cache's size: the window stays within a quarter of it
    max_inflight: int  # prefetch fetches at once, at most
    bandwidth: float | None = None  # cap on prefetch and warmup traffic, bytes/s
    lead: float = DEFAULT_LEAD  # seconds of reading the window covers, at most


class Prefetcher:
    START_INFLIGHT = 4  # fetches in flight before the reader's rate is known
    MIN_INFLIGHT = 2
    MIN_LEAD = 0.25  # seconds of reading kept ahead, at the least
    LATENCY_LEADS = 20  # the lead in fetch latencies: a fast backend needs little lead
    PAUSE = 1.0  # seconds without the reader moving after which it counts as paused
    WARM_AHEAD = 256 << 20  # bytes of cached blocks read into memory ahead of the reader, at most
    _WARM_BATCH = 64  # positions warmed between two checkpoints
    MAX_JOBS = 1024  # warmup jobs remembered (finished ones are forgotten, oldest first, past this)
    RECENT = 600.0  # seconds after a hand-over during which no order is guessed

    def __init__(self, cache: BlockCache, settings: PrefetchSettings) -> None:
        self.cache = cache
        self.policy = cache.policy
        self.capacity = settings.capacity
        self.max_inflight = max(1, settings.max_inflight)
        self.bandwidth = settings.bandwidth
        self.lead = settings.lead
        self._plan: Plan | None = None
        self._segments = itertools.count()
        self._file_pos = 0
        self._position = 0
        self._cursor = 0
        self._warmed = 0  # positions below this were read into memory ahead of the reader (or skipped)
        self._inflight = 0
        self._fetched_blocks = 0
        self._fetched_bytes = 0
        self._latency = 0.05  # EWMA of prefetch fetch latency, seconds
        self._tokens = 0.0
        self._tokens_at = time.monotonic()
        self._advances: deque[tuple[float, int]] = deque(maxlen=256)  # (seconds, bytes) of each move while reading
        self._active = [0.0, 0]  # their sums: the reader's rate is over the time it was reading, not its pauses
        self._moved = time.monotonic()  # when the reader last moved, or the plan changed
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._jobs: dict[int, WarmupJob] = {}
        self._loading = trio.Lock()
        self._handovers: list[Handover] = []
        self._job_ids = itertools.count(1)
        #: When each uid last handed over an order (what the job view tells a job that did not).
        self.handed_by: dict[int | None, float] = {}
        self._share = WarmupShare()  # what each user's warmups that ended filled, for a while

    # -- plan hand-over ------------------------------------------------------------------------------

    async def load(self, objs: Sequence[ObjectInfo], *, epoch: int | None = None, replace: bool = False,
                   rank: int | None = None, uid: int | None = None, operator: bool = True,
                   share_blocks: int | None = None, blocks: int | None = None) -> dict[str, Any]:
        """Hand over the files one reader will read, in order (already partitioned for its rank).

        A hand-over is queued after the ones not yet read (or replaces them all). Hand-overs that name
        a ``rank`` and the same ``epoch`` are merged into one segment, their files interleaved rank by
        rank: the ranks of one node read their shares side by side. The plan is built in a worker
        thread; hand-overs are applied one at a time, in the order they arrive.

        ``uid`` hands it over; unless an ``operator``, it never replaces, merges into or rewrites
        another uid's hand-over (a replace is refused, a merge becomes a segment of its own, queued
        after), and its hand-overs not yet read hold at most ``share_blocks`` blocks
        (:class:`~epochfs.core.errors.NotPermitted` otherwise, nothing changed). ``blocks``: the blocks of
        ``objs``, where the caller counted them already."""
        async with self._loading:
            new_blocks = blocks if blocks is not None else await trio.to_thread.run_sync(
                count_blocks, objs, self.cache.block_size)
            plan = self._plan
            current = None if plan is None or replace or self._finished() else plan.files[self._file_pos]
            reading = None if plan is None or self._finished() else plan.files[self._file_pos].segment
            unread = [] if reading is None else [h for h in self._handovers if h.segment >= reading]
            if replace and not operator and any(h.others(uid) for h in unread):
                raise NotPermitted("the plan being read holds another user's order; a replace would cancel it "
                                   "(hand over without replace: yours is queued after it)")
            if share_blocks is not None and not operator:
                held = sum(b for h in unread for r, b in h.blocks.items() if h.owners.get(r) == uid
                           and not (h.epoch == epoch and r == rank))
                if held + new_blocks > share_blocks:
                    raise NotPermitted(f"uid {uid}'s orders not yet read would hold {held + new_blocks} blocks, over "
                                       f"the {share_blocks} one user may queue (--user-share); hand over one "
                                       "epoch at a time")
            if current is None:
                self._handovers = []
            else:  # forget the hand-overs the reader has finished
                self._handovers = [h for h in self._handovers if h.segment >= current.segment]

            def joins(h: Handover) -> bool:
                """Its part of ``rank`` (a rank's share of the epoch, side by side with the others'), or
                the whole of it (one reader's order of the epoch), is replaced: a job that hands an epoch
                over again (resumed mid-way: what is left of it) never queues a second copy."""
                if h.epoch != epoch or epoch is None or not (operator or not h.others(uid)):
                    return False
                return None not in h.parts if rank is not None else set(h.parts) == {None}
            target = next((h for h in self._handovers if joins(h)), None)
            merged = target is not None
            if target is None:
                target = Handover(next(self._segments), epoch)
                self._handovers.append(target)
            target.parts[rank] = list(objs)
            target.owners[rank] = uid
            target.blocks[rank] = new_blocks
            self.handed_by[uid] = time.time()
            entries = [(o, h.epoch, h.segment) for h in self._handovers for o in h.files()]
            built = await trio.to_thread.run_sync(Plan, entries, self.cache.block_size, self.cache.block_id)
            file_pos = built.locate_in_segment(current.obj.key, current.segment) if current is not None else None
            within = 0  # the reader stays where it is within its file: the merge moves only what follows
            if current is not None and file_pos is not None:
                within = max(0, min(self._position - current.first, built.files[file_pos].blocks - 1))
            self._plan = built
            self._file_pos = file_pos or 0
            self._position = self._cursor = built.files[self._file_pos].first + within if built.files else 0
            self._warmed = self._position
            self.policy.plan(built.blocks, built.uses)
            self.policy.advance(self._position)
            self._moved = time.monotonic()
            self._wake.set()
        how = ("merged with the other ranks' shares" if merged and rank is not None else "replaced the epoch's earlier "
               "hand-over" if merged else "appended" if current else "loaded")
        log.info("prefetch plan: %d files %s (%d files, %d blocks, %d bytes in the plan)", len(objs), how,
                 len(built.files), len(built), built.total_bytes)
        return {"files": len(objs), "queued_files": len(built.files), "appended": current is not None,
                "merged": merged, "plan_bytes": built.total_bytes}

    def _finished(self) -> bool:
        return self._plan is None or self._position >= len(self._plan) - 1

    def holds_order(self, uid: int | None = None) -> bool:
        """Whether an order ``uid`` handed over is being read, or ``uid`` handed one over in the last
        ``RECENT`` seconds (a job that hands its epochs over hands the next one soon): that user's
        guessed order then waits (another user's does not: one user's hand-over steers nobody else's
        guess). Each node of a job reads its own share of a directory, so between two hand-overs the
        rest of it is other nodes' (measured in the cluster box: guessing there fetched 0.23 datasets
        more). ``uid`` None: anybody's."""
        if uid is None:
            return not self._finished() or time.time() - max(self.handed_by.values(), default=0.0) < self.RECENT
        reading = not self._finished() and any(uid in h.owners.values() for h in self._handovers)
        return reading or time.time() - self.handed_by.get(uid, 0.0) < self.RECENT

    # -- the reader ----------------------------------------------------------------------------------

    def opened(self, obj: ObjectInfo, reader: tuple[int, int] | None = None) -> None:
        self.touched(obj, 0)

    def touched(self, obj: ObjectInfo, index: int, reader: tuple[int, int] | None = None) -> None:
        plan = self._plan
        if plan is None:
            return
        fi = plan.locate(obj.key, self._file_pos)
        if fi is None:
            return
        cur = plan.files[self._file_pos]
        if plan.files[fi].segment != cur.segment:
            end = plan.segment_end[cur.segment]
            size = end - plan.segment_start(cur.segment) + 1
            if end - self._file_pos > max(64, size // 50):
                return  # most likely a re-read in the current epoch, not the start of the next one
        pos = plan.files[fi].first + index
        if pos <= self._position or pos >= len(plan):
            return
        moved = plan.offsets[pos] - plan.offsets[self._position]
        self._file_pos = fi
        self._position = pos
        self.policy.advance(pos)
        now = time.monotonic()
        gap, self._moved = now - self._moved, now
        if gap <= self.PAUSE:  # (a move after a pause: the pause is not reading time)
            if len(self._advances) == self._advances.maxlen:
                old_seconds, old_bytes = self._advances[0]
                self._active[0] -= old_seconds
                self._active[1] -= old_bytes
            self._advances.append((gap, moved))
            self._active[0] += gap
            self._active[1] += moved
        self._wake.set()

    # -- the scheduler ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                with trio.move_on_after(self.PAUSE):  # (also: notice the reader pausing)
                    await self._wake.wait()
                self._wake = trio.Event()
                await self._warm()
                await self._fill()

    def _avg_block(self) -> float:
        """The mean size of a fetch: what the window's floor and the fetches in flight are counted in
        (members of a packed dataset share their shard's blocks: a fetch is a block, not a member)."""
        plan = self._plan
        return plan.fetch_size if plan is not None and len(plan) else self.cache.block_size

    def _window(self) -> int:
        """Bytes to keep fetched ahead of the reader: its rate times a lead of ``LATENCY_LEADS`` fetch
        latencies (at least ``MIN_LEAD`` seconds, at most ``--prefetch-lead``), at least what is in
        flight, at most a quarter of the cache."""
        if self.paused():
            return self.capacity // 4
        seconds = min(self.lead, max(self.MIN_LEAD, self.LATENCY_LEADS * self._latency))
        floor = self._target_inflight() * self._avg_block()
        return int(min(self.capacity // 4, max(floor, seconds * self._reader_rate())))

    def paused(self) -> bool:
        """Whether the reader has not moved for ``PAUSE`` seconds (or not yet started) with a plan ahead."""
        return self._plan is not None and not self._finished() and time.monotonic() - self._moved > self.PAUSE

    def _target_inflight(self) -> int:
        """Fetches to keep in flight: :meth:`_wanted_inflight` within the cap; a few until the reader's
        rate is known."""
        wanted = self._wanted_inflight()
        if wanted is None:
            return min(self.max_inflight, self.START_INFLIGHT)
        return max(self.MIN_INFLIGHT, min(self.max_inflight, wanted))

    def _advised_inflight(self, wanted: int | None) -> int | None:
        """The cap that would let the plan keep ahead, where ``wanted`` (:meth:`_wanted_inflight`) is
        over the cap; None where the cap does not bind or is at its most."""
        if wanted is None or wanted <= self.max_inflight or self.max_inflight >= MAX_PREFETCH_CONCURRENCY:
            return None
        return min(MAX_PREFETCH_CONCURRENCY, max(2 * self.max_inflight, wanted))

    def _wanted_inflight(self) -> int | None:
        """What Little's law asks for: twice what carries the reader's rate at the observed fetch latency
        (or the bandwidth cap's rate), so the prefetcher gains on the reader without crowding a backend
        that answers fast; None while the reader's rate is not known."""
        if self.bandwidth:
            need = self.bandwidth * self._latency / self.cache.block_size
        else:
            rate = self._reader_rate()
            if rate <= 0:
                return None
            need = 2 * rate * self._latency / self._avg_block()
        return math.ceil(need) + 1

    async def _fill(self) -> None:
        while True:
            await trio.lowlevel.checkpoint()
            plan = self._plan
            if plan is None:
                return
            self._cursor = max(self._cursor, self._position)
            if self._cursor >= len(plan):
                return
            if plan.offsets[self._cursor] - plan.offsets[self._position] >= self._window():
                return
            if self._inflight >= self._target_inflight():
                return  # woken when a fetch completes
            if self.cache.demand_waiting():
                await trio.sleep(0.002)
                continue
            obj, index, bid, size = plan.block(self._cursor)
            if self.cache.is_cached(bid):
                self._cursor += 1
                continue
            if not self.cache.would_admit(bid, size):
                return  # everything resident is needed sooner; woken when the reader moves
            await self._throttle(size)
            if plan is not self._plan:
                continue
            fetch = self.cache.fetch(obj, index, bid)
            self._cursor += 1
            if fetch is not None:
                self._inflight += 1
                assert self._nursery is not None
                self._nursery.start_soon(self._watch, fetch, size)

    async def _warm(self) -> None:
        """Have the kernel read the cached bytes the reader reads next from the cache disk into memory
        (``WARM_AHEAD`` or the window ahead, whichever is less), so its reads are answered as they come
        instead of each waiting for the disk in a worker thread: a packed member's own range, a whole
        object's block. Blocks not cached yet are left to the fetches."""
        plan = self._plan
        if plan is None:
            return
        self._warmed = max(self._warmed, self._position)
        limit = plan.offsets[self._position] + min(self.WARM_AHEAD, self._window())
        while self._warmed < len(plan) and plan.offsets[self._warmed] < limit:
            for pos in range(self._warmed, min(len(plan), self._warmed + self._WARM_BATCH)):
                if plan.offsets[pos] >= limit:
                    break
                lo, hi = plan.span(pos)
                self.cache.warm(plan.blocks[pos], lo, hi)
                self._warmed = pos + 1
            await trio.lowlevel.checkpoint()
            if plan is not self._plan:
                return

    async def _watch(self, fetch: Fetch, size: int) -> None:
        started = time.monotonic()
        try:
            error = await fetch.wait()
        finally:
            self._inflight -= 1
            self._wake.set()
        if error is None:
            self._fetched_blocks += 1
            self._fetched_bytes += size
            self._latency = 0.8 * self._latency + 0.2 * (time.monotonic() - started)

    async def _throttle(self, size: int) -> None:
        if not self.bandwidth:
            return
        now = time.monotonic()
        self._tokens = min(self._tokens + (now - self._tokens_at) * self.bandwidth, float(self.cache.block_size))
        self._tokens_at = now
        self._tokens -= size
        if self._tokens < 0:
            await trio.sleep(-self._tokens / self.bandwidth)

    # -- warmup ----------------------------------------------------------------------------------------

    def warmup(self, objs: Sequence[ObjectInfo], *, uid: int | None = None, operator: bool = True,
               share_bytes: int | None = None) -> WarmupJob:
        """Fetch every block of ``objs`` now; progress in the returned job. A block is cached if the store
        admits it (evicting only what the policy gives up for it: under the manifest policy, blocks the
        handed-over order does not read; under LRU, the least recently used), and the job never fills
        more than the cache holds (it would evict what it warmed): the rest is skipped. Unless an
        ``operator``, what ``uid``'s warmups fill (those running, and those that ended in the last
        :attr:`WarmupShare.window` seconds: back to back they cannot cycle the cache) is at most ``share_bytes``
        (:class:`~epochfs.core.errors.NotPermitted`)."""
        total = sum(o.size for o in objs)
        if share_bytes is not None and not operator:
            held = self.warmed_by(uid)
            if held + total > share_bytes:
                wait = self._share.frees_in(uid, held + total - share_bytes)
                raise NotPermitted(
                    f"uid {uid}'s warmups would fill {human(held + total)}, over the {human(share_bytes)} one user "
                    f"may warm in {self._share.window / 60:g} minutes (--user-share); "
                    + (f"enough of it frees in {wait:.0f}s, or " if wait is not None else "")
                    + "warm fewer files at a time, or ask an operator (root, --control-group) to warm them")
        job = WarmupJob(next(self._job_ids), total, len(objs), owner=uid)
        self._jobs[job.id] = job
        for old in [j for j in self._jobs.values() if j.finished][:max(0, len(self._jobs) - self.MAX_JOBS)]:
            del self._jobs[old.id]  # (the oldest finished jobs are forgotten)
        assert self._nursery is not None
        self._nursery.start_soon(self._run_warmup, job, list(objs))
        return job

    def warmed_by(self, uid: int | None) -> int:
        """Bytes ``uid``'s warmups fill now (those running: all they may still fill) or filled in the
        share's window (those that ended)."""
        running = sum(j.total_bytes - j.skipped_bytes - j.failed_bytes for j in self._jobs.values()
                      if j.owner == uid and not j.finished)
        return running + self._share.held(uid)

    def job(self, job_id: int, *, uid: int | None = None, operator: bool = True) -> WarmupJob | None:
        """Warmup ``job_id``, if it is ``uid``'s (or the caller an ``operator``): another user's warmup
        (its files, sizes, errors naming keys) is answered as one that does not exist."""
        job = self._jobs.get(job_id)
        return job if job is not None and (operator or job.owner == uid) else None

    def cancel(self, job_id: int, *, uid: int | None = None, operator: bool = True) -> WarmupJob | None:
        """Stop a warmup job: no new fetch is started; those in flight finish. Only its starter or an
        ``operator`` may: to anyone else another user's warmup is one that does not exist (None), as
        :meth:`job` answers it (a refusal would say which ids are in use)."""
        job = self.job(job_id, uid=uid, operator=operator)
        if job is not None and not job.finished:
            job.cancelled = True
        return job

    async def _run_warmup(self, job: WarmupJob, objs: list[ObjectInfo]) -> None:
        slots = trio.Semaphore(self.max_inflight)
        bs = self.cache.block_size
        filled = 0  # bytes this job has had cached
        async def one(obj: ObjectInfo, fetch: Fetch, size: int) -> None:
            try:
                error = await fetch.wait()
                if error is not None:
                    job.errors.append(f"{obj.key}: {error}")
                    job.failed_bytes += size
                else:
                    job.done_bytes += size
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            for obj in objs:
                if job.cancelled:
                    break
                stored, base = stored_extent(obj)
                for index, length, size in extent_blocks(base, obj.size, stored.size, bs):
                    await trio.lowlevel.checkpoint()  # a long run of cached blocks must not hold the loop
                    if job.cancelled:
                        break
                    bid = self.cache.block_id(stored, index)
                    if self.cache.is_cached(bid):
                        job.done_bytes += size
                        continue
                    await slots.acquire()
                    # (a started fetch has reserved its room; a block kept at its owner only costs none here)
                    if self.cache.keeps(bid):
                        if filled + length > self.capacity or not self.cache.would_admit(bid, length):
                            slots.release()
                            job.skipped_bytes += size
                            continue
                        filled += length
                    await self._throttle(length)  # --prefetch-bandwidth caps warmup too
                    fetch = self.cache.fetch(stored, index, bid)
                    if fetch is None:  # cached meanwhile
                        slots.release()
                        job.done_bytes += size
                        continue
                    nursery.start_soon(one, obj, fetch, size)
                job.done_files += 1
        await self.cache.wait_idle()
        if not job.cancelled:
            await left_cached(self.cache, job, objs)
        job.finished = True
        self._share.ended(job.owner, job.done_bytes)
        job.done.set()

    async def resident(self, objs: Sequence[ObjectInfo]) -> dict[str, int]:
        """How much of ``objs`` is cached (yielding to the loop as it goes)."""
        return await resident(self.cache, objs)

    # -- statistics ------------------------------------------------------------------------------------

    def _reader_rate(self) -> float:
        """Bytes per second the reader reads while it reads (its last 256 moves; pauses left out)."""
        seconds, nbytes = self._active
        if len(self._advances) < 2 or seconds <= 0 or time.monotonic() - self._moved > 30:
            return 0.0
        return nbytes / seconds

    def statistics(self) -> PrefetchStats:
        plan = self._plan
        rate = self._reader_rate()
        if plan is None or not len(plan):
            return PrefetchStats(False, None, 0, 0, 0, 0, 0, 0, 0, None, 0, self._inflight, self._fetched_blocks,
                                 self._fetched_bytes, self.bandwidth, rate, None, self.max_inflight)
        pos = self._position
        end = pos
        limit = min(len(plan), pos + 10_000)  # bounded work per status request
        while end < limit and self.cache.is_cached(plan.blocks[end]):
            end += 1
        lead = plan.offsets[end] - plan.offsets[pos]
        ahead = plan.offsets[min(self._cursor, len(plan))] - plan.offsets[pos]
        wanted = self._wanted_inflight()
        return PrefetchStats(
            active=not self._finished() and (self._cursor < len(plan) or self._inflight > 0),
            epoch=plan.files[self._file_pos].epoch,
            files=len(plan.files),
            file_position=self._file_pos,
            blocks=len(plan),
            position=pos,
            plan_bytes=plan.total_bytes,
            position_bytes=plan.offsets[pos],
            lead_bytes=lead,
            lead_seconds=lead / rate if rate > 0 else None,
            queued_bytes=max(0, plan.total_bytes - plan.offsets[pos] - ahead),
            inflight=self._inflight,
            fetched_blocks=self._fetched_blocks,
            fetched_bytes=self._fetched_bytes,
            bandwidth_limit=self.bandwidth,
            reader_bytes_per_second=rate,
            wanted_inflight=wanted,
            max_inflight=self.max_inflight,
            advised_inflight=self._advised_inflight(wanted),
        )
