"""The epoch learned on a plain mount: a job that hands over no order (DLIO, a loader without our
sampler, ``cp -r``, ``grep -r``) still reads a directory's files each once, in its own shuffled order.
Seen, that is an epoch: the files of that directory it has not read yet are the ones it reads next,
in an order nobody knows. :class:`Learner` fetches them ahead while the job computes.

- **The pattern** (:class:`Pattern`, pure): ``START_FILES`` files read for the first time, none of them
  read before in this epoch, and the deepest directory holding them all (its subtree: a dataset split by
  class holds its files in subdirectories) is the guess's scope. ``START_FILES`` files read again, each
  long after its first read and with no new file read between them, start a new epoch: the guess ends
  and the pattern is learned again from them. A re-read of a file just read (a header, then its body),
  or a straggling reader of the epoch's end among new files, is not one. ``START_FILES`` first reads in a row outside the scope end the guess too: the job moved on.
- **The budget.** A guess may fetch ``base`` bytes (64 MiB, at most a sixteenth of the cache) plus
  ``GAIN`` times what the job has read of the scope since the guess began: what it has earned, by the
  job reading what it guessed. A wrong guess (a job that reads a tenth of a directory and stops, one
  that reads only each file's first bytes) therefore costs at most ``base`` plus twice the job's own
  reads of that directory; ``find`` and ``du`` read no file and never start one. Fetched bytes not yet
  read stay within half of what the cache keeps in memory for its readers (they wait there, as a
  demand fetch's block does), and a block is fetched only if the store admits it (never past what
  fits), in the order of the directory's listing (as good as any for a shuffled reader, and exactly
  right for one that reads in listing order).
- **Stopped** when the pattern stops: no read of the scope for ``IDLE`` seconds, the guess's files
  done, or a handed-over order (the job told us: :mod:`.scheduler` follows that one). **Held** while
  the endpoint is near (a first byte in under ``NEAR``, 10 ms, or nothing fetched from it yet: the
  first files of a cold epoch measure it): its demand fetches wait about as little
  as fetching ahead would save, and on a small machine the fetches ahead only add their work to the
  reads' (measured on DLIO at 0 ms on 2 cores: 56% first-epoch AU at 2 accelerators with the guess,
  66% without; at 20 ms 58% against 49%).
- **Never in the reader's way.** Fetches in flight follow the job's rate (Little's law over the observed
  fetch latency, as the plan's), within ``--prefetch-concurrency``, and wait while a demand fetch is
  queued.

All state lives on the trio thread; :meth:`Learner.touched` is called from the read path for every
block read and does a dictionary lookup or two.
"""

from __future__ import annotations

import logging
import math
import posixpath
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from epochfs.cache.service import BlockCache, Fetch
from epochfs.core.blocks import extent_blocks
from epochfs.core.records import ObjectInfo, member_location
from epochfs.kernel.abi import ROOT_INODE
from epochfs.meta.namespace import Namespace
from epochfs.meta.nodes import Dir

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class LearnedStats:
    state: str  # "watching" (no guess), "guessing", "fetched" (all of it), "near" (the endpoint answers at once:
    # nothing fetched ahead), "held" (a handed-over order rules), "off"
    scope: str | None  # the directory guessed ("" the mount's root)
    guesses: int  # guesses made since the mount started
    read_bytes: int  # bytes the job read of a guess's scope while it held (what the guesses earned)
    fetched_bytes: int  # bytes the guesses fetched
    used_bytes: int  # of those, bytes the job then read
    inflight: int

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "scope": self.scope, "guesses": self.guesses, "read_bytes": self.read_bytes,
                "fetched_bytes": self.fetched_bytes, "used_bytes": self.used_bytes, "inflight": self.inflight}


class Pattern:
    """Which files the job reads for the first time in this epoch, and whether it reads a directory's
    files each once (pure: fed the reads, it says what the guess is)."""

    START_FILES = 8
    MAX_TRACKED = 1 << 18  # files remembered in one epoch; past this the epoch is forgotten and learned again

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        #: key -> (serial of its first read, the lowest and the highest block index read of it)
        self.read: dict[str, tuple[int, int, int]] = {}
        self.serial = 0
        self.stale: dict[str, tuple[ObjectInfo, int]] = {}  # files read again long after, since the last new one
        self.recent: deque[str] = deque(maxlen=self.START_FILES)  # keys of the last first reads, no guess held
        self.scope: str | None = None
        self.outside = 0
        self.earned = 0  # bytes read of the scope since the guess began

    def saw(self, obj: ObjectInfo, index: int) -> int:
        """A block of ``obj`` was read: the bytes it adds to what the guess earned (0 if none holds).
        Changes :attr:`scope` where the guess begins or ends. A file's blocks count once each, as the
        span from the lowest to the highest read (a zip's directory at its end, then its members)."""
        key = obj.key
        was = self.read.get(key)
        if was is not None:
            first, lo, hi = was
            if lo <= index <= hi:
                if self.serial - first > self.START_FILES and key not in self.stale:
                    # Read again well after its first read: the next epoch, if START_FILES such files are
                    # read again before any new one (one alone is a reader of the epoch finishing late).
                    self.stale[key] = (obj, index)
                    if len(self.stale) >= self.START_FILES:
                        again = list(self.stale.values())
                        self.new_epoch()
                        return sum(self.saw(o, i) for o, i in again)
                return 0  # (a re-read within the file, or of one just read)
            self.read[key] = (first, min(lo, index), max(hi, index))
            if self.scope is None or not _under(key, self.scope):
                return 0
            return self._earn(obj.size, range(index, lo) if index < lo else range(hi + 1, index + 1))
        if len(self.read) >= self.MAX_TRACKED:
            self.new_epoch()
        self.stale.clear()
        self.serial += 1
        self.read[key] = (self.serial, index, index)
        if self.scope is not None:
            if _under(key, self.scope):
                self.outside = 0
                return self._earn(obj.size, range(index, index + 1))
            self.outside += 1
            if self.outside < self.START_FILES:
                return 0
            self.scope = None  # the job moved on
        self.recent.append(key)
        if len(self.recent) == self.START_FILES:
            self.scope = _common_dir(self.recent)
            self.recent.clear()
            self.outside = self.earned = 0
        return 0

    def _earn(self, size: int, blocks: range) -> int:
        bs = self.block_size
        nbytes = sum(max(0, min(bs, size - i * bs)) for i in blocks)
        self.earned += nbytes
        return nbytes

    def new_epoch(self) -> None:
        self.read.clear()
        self.stale.clear()
        self.recent.clear()
        self.scope = None
        self.outside = self.earned = 0

    def end(self) -> None:
        """The guess is over (idle, or all its files read); the epoch's reads are remembered."""
        self.scope = None
        self.recent.clear()
        self.outside = self.earned = 0


def _under(key: str, scope: str) -> bool:
    return not scope or key.startswith(scope) and key[len(scope)] == "/"


def _common_dir(keys: deque[str]) -> str:
    """The deepest directory holding every one of ``keys`` ("" the root): component by component, so
    "a/b1/x" and "a/b2/y" give "a", never "a/b"."""
    dirs = [posixpath.dirname(k) for k in keys]
    return posixpath.commonpath(dirs) if all(dirs) else ""


@dataclass(frozen=True)
class LearnSettings:
    """What the learner needs of the mount's options."""

    capacity: int  # the cache's size
    max_inflight: int  # fetches at once, at most (--prefetch-concurrency)
    enabled: bool = True


class Learner:
    """Fetches ahead the rest of a directory a job reads each file of once (see the module's text)."""

    GAIN = 2
    BASE = 64 * MiB
    IDLE = 10.0  # seconds without a read of the scope after which the guess ends
    NEAR = 0.010  # an endpoint that sends a first byte sooner (mean) is not worth fetching ahead of
    START_INFLIGHT = 4
    MIN_INFLIGHT = 2
    _SKIP = 256  # files passed over between two checkpoints

    def __init__(self, cache: BlockCache, namespace: Callable[[], Namespace], settings: LearnSettings,
                 held: Callable[[], bool] = lambda: False,
                 first_byte: Callable[[], float | None] = lambda: None) -> None:
        self.cache = cache
        self.first_byte = first_byte
        self._near = (-1.0, False)  # (when looked at, whether near)
        self.namespace = namespace
        self.settings = settings
        self.held = held
        self.pattern = Pattern(cache.block_size)
        self.base = min(self.BASE, settings.capacity // 16)
        self._scope: str | None = None  # the scope being fetched
        # Where the walk of the scope stands: (directory path, last cookie read) from the scope down (None:
        # walked). Paths, not a namespace: holding a version's iterator would pin that version's pages
        # in the index while the mount refreshes; each batch reads the version current then.
        self._files: list[tuple[str, int]] | None = None
        self._batch: deque[ObjectInfo] = deque()  # files of the walk not looked at yet
        self._blocks: deque[tuple[ObjectInfo, int, int]] = deque()  # the next file's blocks to fetch
        self._fetched = 0  # this guess's
        self._pending: dict[tuple[str, int], int] = {}  # (key, index) fetched by the guess, not read yet
        self._outstanding = 0
        self._inflight = 0
        self._latency = 0.05
        self._began = self._last = time.monotonic()
        self._wake = trio.Event()
        self.guesses = 0
        self.read_bytes = self.fetched_bytes = self.used_bytes = 0

    # -- the read path -----------------------------------------------------------------------------------

    def opened(self, obj: ObjectInfo) -> None:
        self.touched(obj, 0)

    def touched(self, obj: ObjectInfo, index: int) -> None:
        if not self.settings.enabled:
            return
        earned = self.pattern.saw(obj, index)
        if self._pending:
            size = self._pending.pop((obj.key, index), None)
            if size is not None:
                self._outstanding -= size
                self.used_bytes += size
        if earned:
            self.read_bytes += earned
            self._last = time.monotonic()
        if self.pattern.scope != self._scope or earned:
            self._wake.set()

    # -- the fetches -------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                with trio.move_on_after(1.0):
                    await self._wake.wait()
                self._wake = trio.Event()
                held = self.held()
                if held or self._scope is not None and time.monotonic() - self._last > self.IDLE:
                    if self._scope is not None:
                        log.info("learned order: the guess over %r ends (%s)", self._scope,
                                 "an order was handed over" if held else "the job stopped reading it")
                        self.pattern.end()
                        self._begin(None)
                    continue  # (a job that hands its order over is never guessed for)
                if self.pattern.scope != self._scope:
                    self._begin(self.pattern.scope)
                if self._scope is None or self.near():
                    continue  # (the guess stands; nothing is fetched while the endpoint answers at once)
                await self._fill(nursery)

    def _begin(self, scope: str | None) -> None:
        self._scope = scope
        self._blocks.clear()
        self._pending.clear()
        self._outstanding = self._fetched = 0
        self._files = None
        self._batch.clear()
        if scope is None:
            return
        ns = self.namespace()
        node = ns.resolve(scope) if scope else ns.node(ROOT_INODE)
        if not isinstance(node, Dir):
            self._scope = None  # (a directory of packed shards, gone since: nothing to guess)
            self.pattern.end()
            return
        self.guesses += 1
        self._began = self._last = time.monotonic()
        self._files = [(scope, 0)]
        log.info("learned order: files under %r read each once in an order of the job's own; fetching the rest "
                 "ahead (at most %d MiB, then twice what the job reads of it)", scope or "/", self.base >> 20)

    def near(self) -> bool:
        """Whether the endpoint answers a request's first byte in under ``NEAR`` seconds, or has not
        been measured yet (nothing fetched from it: a warm cache, a cache tier): demand fetches then wait
        about as little as a fetch ahead would save, and fetching ahead only adds its work to the
        reads' (measured on DLIO, 0 ms, 2 cores: a first epoch of 56% AU at 2 accelerators against 66%
        without the guess)."""
        now = time.monotonic()
        if now - self._near[0] > 0.5:  # (looked at twice a second at most: it is read on every wake)
            wait = self.first_byte()
            self._near = (now, wait is None or wait < self.NEAR)
        return self._near[1]

    def _lead(self) -> int:
        """Bytes fetched ahead and not read yet, at most: half what the cache keeps in memory for its
        readers (a quarter of the cache, if less): what is fetched ahead waits there for its reader
        (measured on DLIO at 0 ms on 2 cores: a lead of a quarter of the cache, written through the page
        cache and read back, cost 1-2 s of daemon CPU a GiB and up to 14 points of first-epoch AU)."""
        return min(self.settings.capacity // 4, self.cache.recent_max // 2)

    def _allowed(self) -> int:
        return self.base + self.GAIN * self.pattern.earned

    async def _fill(self, nursery: trio.Nursery) -> None:
        while self._files is not None or self._batch or self._blocks:
            await trio.lowlevel.checkpoint()
            if self._inflight >= self._target_inflight() or self._outstanding >= self._lead():
                return  # woken when a fetch completes or the job reads
            if self._fetched >= self._allowed():
                return  # woken as the job earns more
            if self.cache.demand_waiting():
                await trio.sleep(0.002)
                continue
            nxt = self._next()
            if nxt is None:
                if self._files is None:
                    log.info("learned order: every file under %r is fetched or read", self._scope or "/")
                continue  # (or a run of files read already skipped: the loop had its checkpoint)
            obj, index, length = nxt
            bid = self.cache.block_id(obj, index)
            if self.cache.is_cached(bid):
                continue
            if not self.cache.would_admit(bid, length):
                return  # the store keeps what it holds: nothing past what fits
            # Kept in memory for the job until it reads it (as a demand fetch is: no copy through the
            # page cache, no read back and check), so a guessed block costs the CPU a demand miss would.
            fetch = self.cache.fetch(obj, index, bid, near=True)
            if fetch is None:
                continue
            self._fetched += length
            self.fetched_bytes += length
            self._pending[(obj.key, index)] = length
            self._outstanding += length
            self._inflight += 1
            nursery.start_soon(self._watch, fetch)

    def _next(self) -> tuple[ObjectInfo, int, int] | None:
        """The next block of the scope's files the job has not read (listing order); None when there is
        none (``_files`` None), or after a run of ``_SKIP`` files passed over (the caller checkpoints)."""
        for _ in range(self._SKIP):
            if self._blocks:
                break
            if not self._batch:
                if self._files is not None:
                    self._refill()
                if not self._batch:
                    self._files = None
                    return None
            obj = self._batch.popleft()
            if obj.key in self.pattern.read or not obj.size or member_location(obj) is not None:
                continue  # read already, empty (or a packed member: its shard is read through its own plan)
            self._blocks.extend((obj, index, length) for index, length, _ in
                                extent_blocks(0, obj.size, obj.size, self.cache.block_size))
        return self._blocks.popleft() if self._blocks else None

    def _refill(self, most: int = 1024) -> None:
        """The next ``most`` files of the scope's walk (depth first, each directory in its listing's
        order), from the namespace current now; the walk goes on from where it stands."""
        ns, walk = self.namespace(), self._files
        while walk and len(self._batch) < most:
            path, after = walk[-1]
            node = ns.resolve(path) if path else ns.node(ROOT_INODE)
            if not isinstance(node, Dir):
                walk.pop()  # (gone in this version)
                continue
            for cookie, _, kid in ns.entries_after(node.inode, after):
                walk[-1] = (path, cookie)
                if isinstance(kid, Dir):
                    walk.append((kid.path, 0))
                    break
                if kid.obj is not None:
                    self._batch.append(kid.obj)
                if len(self._batch) >= most:
                    break
            else:
                walk.pop()
        if not walk:
            self._files = None

    async def _watch(self, fetch: Fetch) -> None:
        started = time.monotonic()
        try:
            error = await fetch.wait()
        finally:
            self._inflight -= 1
            self._wake.set()
        if error is None:
            self._latency = 0.8 * self._latency + 0.2 * (time.monotonic() - started)

    def _target_inflight(self) -> int:
        """Twice what carries the job's reading rate of the scope at the observed fetch latency (Little's
        law), within ``--prefetch-concurrency``; a few until the rate is known."""
        seconds = time.monotonic() - self._began
        if seconds < 0.5 or not self.pattern.earned:
            return min(self.settings.max_inflight, self.START_INFLIGHT)
        rate = self.pattern.earned / seconds
        need = math.ceil(2 * rate * self._latency / self.cache.block_size) + 1
        return max(self.MIN_INFLIGHT, min(self.settings.max_inflight, need))

    def statistics(self) -> LearnedStats:
        state = ("off" if not self.settings.enabled else "held" if self.held() else "watching" if self._scope is None
                 else "near" if self.near()
                 else "guessing" if self._files is not None or self._batch or self._blocks else "fetched")
        return LearnedStats(state, self._scope, self.guesses, self.read_bytes, self.fetched_bytes, self.used_bytes,
                            self._inflight)


class Observers:
    """Tells each of several read observers (the handed-over plan's prefetcher, the learner) of a read."""

    def __init__(self, *observers: Any) -> None:
        self.observers = observers

    def opened(self, obj: ObjectInfo) -> None:
        for o in self.observers:
            o.opened(obj)

    def touched(self, obj: ObjectInfo, index: int) -> None:
        for o in self.observers:
            o.touched(obj, index)
