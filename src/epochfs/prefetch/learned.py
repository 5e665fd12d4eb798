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

- **Per user.** Each reading user (the uid and gid the kernel names in each open and read) has a
  pattern, a guess and a budget of its own: another user's reads neither start, end nor steer it, and
  only its own hand-over holds it. The walk takes only the files that user may read (search on every
  directory from the root down, read on the file, from the modes the mount presents: what the kernel
  would let it read), the budget is the user's over its whole time on the mount (``base`` once, then
  ``GAIN`` times what it read of its guesses), and what one user's guess holds fetched and not read is
  within its ``--user-share`` of the cache. ``status`` shows a user its own guess alone; the log names
  the uid, not the directory (debug level has it).

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
from epochfs.core.access import Caller, PathAccess, Presented
from epochfs.core.blocks import extent_blocks
from epochfs.core.records import ObjectInfo, member_location
from epochfs.kernel.abi import ROOT_INODE
from epochfs.meta.namespace import Namespace
from epochfs.meta.nodes import Dir

log = logging.getLogger(__name__)

MiB = 1 << 20


#: Who reads: the (uid, gid) the kernel named in the request (None: not known, and then nothing is learnt).
Reader = tuple[int, int]


@dataclass(frozen=True)
class GuessStats:
    """One user's guess."""

    uid: int
    state: str  # "watching" (no guess), "guessing", "fetched" (all of it), "near" (the endpoint answers at once:
    # nothing fetched ahead), "held" (an order that user handed over rules)
    scope: str | None  # the directory guessed ("" the mount's root)
    guesses: int  # guesses made for this user since the mount started
    read_bytes: int  # bytes the user read of its guesses' scopes while they held (what the guesses earned)
    fetched_bytes: int  # bytes the guesses fetched (all of them: the user's budget counts these)
    used_bytes: int  # of those, bytes the user then read
    inflight: int

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "scope": self.scope, "guesses": self.guesses, "read_bytes": self.read_bytes,
                "fetched_bytes": self.fetched_bytes, "used_bytes": self.used_bytes, "inflight": self.inflight}


@dataclass(frozen=True)
class LearnedStats:
    """Every user's guess, and the totals. What a user is shown is its own guess alone
    (:meth:`as_dict` with ``viewer``): another user's scope, sizes and progress are theirs."""

    enabled: bool
    near: bool  # the endpoint answers at once (nothing is fetched ahead for anybody)
    users: tuple[GuessStats, ...]

    @property
    def fetched_bytes(self) -> int:
        return sum(u.fetched_bytes for u in self.users)

    @property
    def used_bytes(self) -> int:
        return sum(u.used_bytes for u in self.users)

    def as_dict(self, viewer: int | None = None) -> dict[str, Any]:
        """For an operator (``viewer`` None): the totals, the state and scope of the latest guess, and
        each user's guess; for user ``viewer``: that user's guess alone."""
        users = [u for u in self.users if viewer is None or u.uid == viewer]
        if not self.enabled:
            state = "off"
        else:
            busiest = next((u for u in reversed(users) if u.state not in ("watching", "held")), None)
            state = busiest.state if busiest else users[-1].state if users else "near" if self.near else "watching"
        scoped = [u for u in users if u.scope is not None]
        out = {"state": state, "scope": scoped[-1].scope if scoped else None,
               "guesses": sum(u.guesses for u in users), "read_bytes": sum(u.read_bytes for u in users),
               "fetched_bytes": sum(u.fetched_bytes for u in users), "used_bytes": sum(u.used_bytes for u in users),
               "inflight": sum(u.inflight for u in users)}
        if viewer is None:
            out["users"] = [{"uid": u.uid, **u.as_dict()} for u in self.users]
        return out


class Pattern:
    """Which files the job reads for the first time in this epoch, and whether it reads a directory's
    files each once (pure: fed the reads, it says what the guess is)."""

    START_FILES = 8
    MAX_TRACKED = 1 << 17  # files remembered in one epoch; past this the epoch is forgotten and learned again

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
    user_share: int | None = None  # bytes one user's guess may hold fetched and not yet read (--user-share)


class _Guess:
    """One user's pattern, guess and budget. The budget is the user's over its whole time on the mount,
    not a guess's: ``fetched`` never goes back, ``earned`` is what the user read of its guesses' scopes."""

    def __init__(self, who: Reader, block_size: int) -> None:
        self.who = who
        self.pattern = Pattern(block_size)
        self.scope: str | None = None  # the scope being fetched
        # Where the walk of the scope stands: (directory path, last cookie read) from the scope down (None:
        # walked). Paths, not a namespace: holding a version's iterator would pin that version's pages
        # in the index while the mount refreshes; each batch reads the version current then.
        self.files: list[tuple[str, int]] | None = None
        self.batch: deque[ObjectInfo] = deque()  # files of the walk not looked at yet (each readable by who)
        self.blocks: deque[tuple[ObjectInfo, int, int]] = deque()  # the next file's blocks to fetch
        self.pending: dict[tuple[str, int], int] = {}  # (key, index) fetched by the guess, not read yet
        self.outstanding = 0
        self.inflight = 0
        self.fetched = self.earned = 0  # over the user's whole time here: what the budget weighs
        self.guesses = self.read_bytes = self.used_bytes = 0
        self.began = self.last = time.monotonic()

    def clear(self) -> None:
        self.blocks.clear()
        self.pending.clear()
        self.outstanding = 0
        self.files = None
        self.batch.clear()


class Learner:
    """Fetches ahead the rest of a directory a job reads each file of once (see the module's text), for
    each reading user apart: a user's own reads alone start, steer and end its guess, the walk takes
    only files that user may read (as the kernel decides, from the modes the mount presents), and what
    it fetches is counted against that user's budget and share."""

    GAIN = 2
    BASE = 64 * MiB
    IDLE = 10.0  # seconds without a read of the scope after which the guess ends
    NEAR = 0.010  # an endpoint that sends a first byte sooner (mean) is not worth fetching ahead of
    START_INFLIGHT = 4
    MIN_INFLIGHT = 2
    MAX_USERS = 4  # users learnt at once; another's reads are learnt once one of them has been idle IDLE s
    _SKIP = 256  # files passed over between two checkpoints

    def __init__(self, cache: BlockCache, namespace: Callable[[], Namespace], settings: LearnSettings,
                 held: Callable[[int], bool] = lambda uid: False,
                 first_byte: Callable[[], float | None] = lambda: None,
                 presented: Presented | None = None) -> None:
        self.cache = cache
        self.first_byte = first_byte
        self._near = (-1.0, False)  # (when looked at, whether near)
        self.namespace = namespace
        self.settings = settings
        self.held = held
        self.presented = presented  # node -> (mode, uid, gid) as the mount presents it (None: root reads alone)
        self.base = min(self.BASE, settings.capacity // 16)
        self._users: dict[int, _Guess] = {}  # uid -> its guess, the least recently reading first
        self._latency = 0.05
        self._wake = trio.Event()

    # -- the read path -----------------------------------------------------------------------------------

    def opened(self, obj: ObjectInfo, reader: Reader | None = None) -> None:
        self.touched(obj, 0, reader)

    def touched(self, obj: ObjectInfo, index: int, reader: Reader | None = None) -> None:
        if not self.settings.enabled or reader is None:
            return
        g = self._user(reader)
        if g is None:
            return
        earned = g.pattern.saw(obj, index)
        if g.pending:
            size = g.pending.pop((obj.key, index), None)
            if size is not None:
                g.outstanding -= size
                g.used_bytes += size
        if earned:
            g.read_bytes += earned
            g.earned += earned
            g.last = time.monotonic()
        if g.pattern.scope != g.scope or earned:
            self._wake.set()

    def _user(self, reader: Reader) -> _Guess | None:
        uid = reader[0]
        g = self._users.pop(uid, None)
        if g is None:
            if len(self._users) >= self.MAX_USERS:
                idle = next((u for u, x in self._users.items() if not x.inflight and x.scope is None
                             and time.monotonic() - x.last > self.IDLE), None)
                if idle is None:
                    return None  # (every user learnt is reading now: this one's reads are not learnt yet)
                del self._users[idle]
            g = _Guess(reader, self.cache.block_size)
        g.who = reader
        self._users[uid] = g  # (the most recent last)
        return g

    # -- the fetches -------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                with trio.move_on_after(1.0):
                    await self._wake.wait()
                self._wake = trio.Event()
                for g in list(self._users.values()):
                    self._steer(g)
                if self.near():
                    continue  # (the guesses stand; nothing is fetched while the endpoint answers at once)
                await self._fill(nursery)

    def _steer(self, g: _Guess) -> None:
        """Begin, follow or end ``g``'s guess as its own reads (and its own hand-overs) say."""
        uid = g.who[0]
        held = self.held(uid)
        if held or g.scope is not None and time.monotonic() - g.last > self.IDLE:
            if g.scope is not None:
                log.info("learned order: the guess for uid %d ends (%s)", uid,
                         "it handed an order over" if held else "it stopped reading its directory")
                g.pattern.end()
                self._begin(g, None)
            return  # (a job that hands its order over is never guessed for)
        if g.pattern.scope != g.scope:
            self._begin(g, g.pattern.scope)

    def _begin(self, g: _Guess, scope: str | None) -> None:
        g.scope = scope
        g.clear()
        if scope is None:
            return
        ns = self.namespace()
        node = ns.resolve(scope) if scope else ns.node(ROOT_INODE)
        if not isinstance(node, Dir):
            g.scope = None  # (a directory of packed shards, gone since: nothing to guess)
            g.pattern.end()
            return
        g.guesses += 1
        g.began = g.last = time.monotonic()
        g.files = [(scope, 0)]
        # (the scope is the user's to know, not the log's readers': it is named at debug level only)
        log.info("learned order: uid %d reads a directory's files each once in an order of its own; fetching the "
                 "rest it may read ahead (within %d MiB, then twice what it reads of them)", g.who[0], self.base >> 20)
        log.debug("learned order: uid %d's scope is %r", g.who[0], scope or "/")

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
        """Bytes fetched ahead and not read yet, at most, over all users: half what the cache keeps in
        memory for its readers (a quarter of the cache, if less): what is fetched ahead waits there for
        its reader (measured on DLIO at 0 ms on 2 cores: a lead of a quarter of the cache, written
        through the page cache and read back, cost 1-2 s of daemon CPU a GiB and up to 14 points of
        first-epoch AU)."""
        return min(self.settings.capacity // 4, self.cache.recent_max // 2)

    def _user_lead(self) -> int:
        """Bytes one user's guess may hold fetched and not read: the lead, within its --user-share."""
        share = self.settings.user_share
        return self._lead() if share is None else min(self._lead(), share)

    def _allowed(self, g: _Guess) -> int:
        return self.base + self.GAIN * g.earned

    def _fetching(self) -> list[_Guess]:
        return [g for g in self._users.values() if g.scope is not None and (g.files is not None or g.batch or g.blocks)]

    async def _fill(self, nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.checkpoint()
            if sum(g.inflight for g in self._users.values()) >= self._target_inflight():
                return  # woken when a fetch completes or a job reads
            if sum(g.outstanding for g in self._users.values()) >= self._lead():
                return
            ready = [g for g in self._fetching() if g.outstanding < self._user_lead() and g.fetched < self._allowed(g)]
            if not ready:
                return  # woken as the jobs earn more
            if self.cache.demand_waiting():
                await trio.sleep(0.002)
                continue
            g = min(ready, key=lambda x: x.inflight)  # (the users take turns)
            nxt = self._next(g)
            if nxt is None:
                if g.files is None and not g.batch and not g.blocks:
                    log.info("learned order: every file uid %d may read in its directory is fetched or read", g.who[0])
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
            g.fetched += length
            g.pending[(obj.key, index)] = length
            g.outstanding += length
            g.inflight += 1
            nursery.start_soon(self._watch, g, fetch)

    def _next(self, g: _Guess) -> tuple[ObjectInfo, int, int] | None:
        """The next block of the scope's files the user has not read and may read (listing order); None
        when there is none (``files`` None), or after a run of ``_SKIP`` files passed over (the caller
        checkpoints)."""
        for _ in range(self._SKIP):
            if g.blocks:
                break
            if not g.batch:
                if g.files is not None:
                    self._refill(g)
                if not g.batch:
                    g.files = None
                    return None
            obj = g.batch.popleft()
            if obj.key in g.pattern.read or not obj.size or member_location(obj) is not None:
                continue  # read already, empty (or a packed member: its shard is read through its own plan)
            g.blocks.extend((obj, index, length) for index, length, _ in
                            extent_blocks(0, obj.size, obj.size, self.cache.block_size))
        return g.blocks.popleft() if g.blocks else None

    def _refill(self, g: _Guess, most: int = 1024) -> None:
        """The next ``most`` files of the scope's walk that the user may read (depth first, each
        directory in its listing's order), from the namespace current now; the walk goes on from where
        it stands, and descends only into directories the user may search."""
        ns, walk = self.namespace(), g.files
        access = PathAccess(ns.resolve, self.presented or (lambda node: (0, 0, 0)), Caller(*g.who))
        while walk and len(g.batch) < most:
            path, after = walk[-1]
            node = ns.resolve(path) if path else ns.node(ROOT_INODE)
            if not isinstance(node, Dir) or not access.searchable(path):
                walk.pop()  # (gone in this version, or not the user's to pass)
                continue
            for cookie, _, kid in ns.entries_after(node.inode, after):
                walk[-1] = (path, cookie)
                if isinstance(kid, Dir):
                    walk.append((kid.path, 0))
                    break
                if kid.obj is not None and access.readable(kid):
                    g.batch.append(kid.obj)
                if len(g.batch) >= most:
                    break
            else:
                walk.pop()
        if not walk:
            g.files = None

    async def _watch(self, g: _Guess, fetch: Fetch) -> None:
        started = time.monotonic()
        try:
            error = await fetch.wait()
        finally:
            g.inflight -= 1
            self._wake.set()
        if error is None:
            self._latency = 0.8 * self._latency + 0.2 * (time.monotonic() - started)

    def _target_inflight(self) -> int:
        """Twice what carries the jobs' reading rate of their scopes at the observed fetch latency
        (Little's law), within ``--prefetch-concurrency``; a few until the rate is known."""
        rate = 0.0
        for g in self._fetching():
            seconds = time.monotonic() - g.began
            if seconds >= 0.5 and g.pattern.earned:
                rate += g.pattern.earned / seconds
        if not rate:
            return min(self.settings.max_inflight, self.START_INFLIGHT)
        need = math.ceil(2 * rate * self._latency / self.cache.block_size) + 1
        return max(self.MIN_INFLIGHT, min(self.settings.max_inflight, need))

    def statistics(self) -> LearnedStats:
        near = self.settings.enabled and self.near()
        users = []
        for uid, g in self._users.items():
            state = ("held" if self.held(uid) else "watching" if g.scope is None else "near" if near
                     else "guessing" if g.files is not None or g.batch or g.blocks else "fetched")
            users.append(GuessStats(uid, state, g.scope, g.guesses, g.read_bytes, g.fetched, g.used_bytes, g.inflight))
        return LearnedStats(self.settings.enabled, near, tuple(users))


class Observers:
    """Tells each of several read observers (the handed-over plan's prefetcher, the learner) of a read."""

    def __init__(self, *observers: Any) -> None:
        self.observers = observers

    def opened(self, obj: ObjectInfo, reader: Reader | None = None) -> None:
        for o in self.observers:
            o.opened(obj, reader)

    def touched(self, obj: ObjectInfo, index: int, reader: Reader | None = None) -> None:
        for o in self.observers:
            o.touched(obj, index, reader)
