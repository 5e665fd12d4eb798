"""Passthrough opens (``--passthrough``): the kernel reads a cached object's whole file itself.

Which open gets a backing file, and the bookkeeping the kernel's rules ask for: an inode is read either
through the daemon (cached opens) or through one backing file (passthrough opens), never both at once
(the kernel fails the open that would mix them), so an inode with cached opens outstanding gets cached
opens until they are released, and one with a backing file gets that same backing file for every open
until the last is released (then its id is let go). Objects are assembled whole in the background
(:mod:`epochfs.blockstore.whole`) once all their blocks are cached: at an open that finds them so, and when
the last open of an object that was read through the daemon is released. One at a time, in the order
asked. Runs on the trio thread.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from epochfs.blockstore.keys import whole_id
from epochfs.blockstore.whole import Whole, WholeFiles, hasher
from epochfs.cache.service import BlockCache
from epochfs.core.blocks import block_count
from epochfs.core.records import ObjectInfo, stored_extent

log = logging.getLogger(__name__)

#: Objects smaller than this are not held whole: the page cache serves them as well, with no copy.
MIN_SIZE = 1 << 20


class Kernel(Protocol):
    """What passthrough needs of the session (:class:`epochfs.kernel.Session`)."""

    def backing_open(self, fd: int) -> int: ...

    def backing_close(self, backing_id: int) -> None: ...


@dataclass
class _Inode:
    obj: ObjectInfo
    cached: set[int] = field(default_factory=set)  # handles read through the daemon
    passed: set[int] = field(default_factory=set)  # handles the kernel reads itself
    backing: int = 0
    whole: Whole | None = None


@dataclass(frozen=True)
class PassthroughStats:
    active: bool  # False once the kernel refused a backing file
    opens: int  # opens the kernel read itself
    cached_opens: int  # opens read through the daemon
    open_files: int  # files open in passthrough now
    whole_files: int
    whole_bytes: int
    whole_limit: int
    assembled: int
    damaged: int
    evicted: int
    unchecked: int = 0  # copies a run before left, not hashed yet (read through the daemon until they are)


class Passthrough:
    #: How often every whole file is hashed again, and how fast (bytes a second).
    SCRUB_EVERY = 86400.0
    SCRUB_RATE = 64 << 20
    #: A copy a run before left is not served until hashed, and its object is read through the daemon
    #: meanwhile: it is checked faster (16 s per GiB at the scrub's rate, 4 s at this one).
    FIRST_CHECK_RATE = 256 << 20

    def __init__(self, whole: WholeFiles, cache: BlockCache, kernel: Callable[[], Kernel | None], *,
                 scrub_every: float | None = None) -> None:
        self.whole = whole
        self.cache = cache
        self._kernel = kernel
        self.scrub_every = self.SCRUB_EVERY if scrub_every is None else scrub_every
        self.active = True  # False once the kernel has refused a backing file (not root, no passthrough)
        self._inodes: dict[int, _Inode] = {}
        self._handles: dict[int, int] = {}  # fh -> inode
        self._queue: dict[str, ObjectInfo] = {}  # whole id -> object, to assemble (in order)
        self._wake = trio.Event()
        self.opens = self.cached_opens = 0

    def _wid(self, obj: ObjectInfo) -> str:
        return whole_id(self.cache.source_id, obj.key, obj.etag, obj.size)

    # -- opens -------------------------------------------------------------------------------------------

    def open(self, inode: int, obj: ObjectInfo, fh: int) -> int:
        """The backing id to answer this open with (the kernel reads the whole file), or 0: read it
        through the daemon. Either way the handle is remembered until :meth:`release`."""
        st = self._inodes.get(inode)
        if st is None or st.obj is not obj:
            if st is not None and (st.cached or st.passed):
                self._handles[fh] = inode  # (a new version while the old is open: through the daemon)
                st.cached.add(fh)
                self.cached_opens += 1
                return 0
            st = self._inodes[inode] = _Inode(obj)
        self._handles[fh] = inode
        if st.backing:
            st.passed.add(fh)
            self.opens += 1
            return st.backing
        if not st.cached and self.active:
            backing = self._backing(st)
            if backing:
                st.passed.add(fh)
                self.opens += 1
                return backing
        elif self.active and self._eligible(obj):
            self._consider(obj)  # (for the opens after these)
        st.cached.add(fh)
        self.cached_opens += 1
        return 0

    def _backing(self, st: _Inode) -> int:
        obj = st.obj
        if not self._eligible(obj):
            return 0
        w = self.whole.get(self._wid(obj), obj.size)
        if w is None:
            self._consider(obj)
            return 0
        kernel = self._kernel()
        fd = self.whole.open_file(w) if kernel is not None else None
        if kernel is None or fd is None:
            return 0
        try:
            st.backing = kernel.backing_open(fd)
        except OSError as exc:
            self.off(f"the kernel refused a backing file ({'the daemon lacks CAP_SYS_ADMIN' if exc.errno == errno.EPERM else exc.strerror})")
            return 0
        finally:
            os.close(fd)
        st.whole = w
        w.users += 1
        return st.backing

    def off(self, why: str) -> None:
        """Passthrough is not to be had on this mount: every open reads through the daemon from now on."""
        if self.active:
            self.active = False
            log.warning("passthrough is off: %s; files are read through the daemon", why)

    def release(self, fh: int) -> None:
        inode = self._handles.pop(fh, None)
        if inode is None:
            return
        st = self._inodes[inode]
        st.cached.discard(fh)
        st.passed.discard(fh)
        if st.passed or st.cached:
            return
        del self._inodes[inode]
        if st.backing:
            kernel = self._kernel()
            if kernel is not None:
                try:
                    kernel.backing_close(st.backing)
                except OSError as exc:  # (unmounted)
                    log.debug("backing id %d not closed: %s", st.backing, exc)
            if st.whole is not None:
                st.whole.users -= 1
        elif self.active and self._eligible(st.obj):
            self._consider(st.obj)  # (read through the daemon: held whole for the next open, if all cached)

    def _eligible(self, obj: ObjectInfo) -> bool:
        return obj.size >= MIN_SIZE and stored_extent(obj)[0] is obj

    # -- assembly ----------------------------------------------------------------------------------------

    def _consider(self, obj: ObjectInfo) -> None:
        wid = self._wid(obj)
        if wid in self._queue or wid in self.whole.files or obj.size > self.whole.limit:
            return
        if all(self.cache.is_cached(self.cache.block_id(obj, i)) for i in range(self._blocks(obj))):
            self._queue[wid] = obj
            self._wake.set()

    def _blocks(self, obj: ObjectInfo) -> int:
        return block_count(obj.size, self.cache.block_size)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._assemble_loop)
            nursery.start_soon(self._scrub_loop)  # (with no scrub: the copies a run before left, once)
            task_status.started()

    async def _assemble_loop(self) -> None:
        while True:
            while not self._queue:
                await self._wake.wait()
                self._wake = trio.Event()
            wid = next(iter(self._queue))
            obj = self._queue[wid]
            try:
                await self.assemble(wid, obj)
            finally:
                self._queue.pop(wid, None)

    async def assemble(self, wid: str, obj: ObjectInfo) -> Whole | None:
        """Write ``obj`` whole from its cached blocks (each verified as it is read); None if a block is
        no longer cached or there is no room."""
        if wid in self.whole.files or not self.whole.admit(obj.size):
            return None
        tmp = self.whole.temp_path(wid)
        h = hasher(wid)
        blocks = self._blocks(obj)
        try:
            for index in range(blocks):
                data = await self.cache.read_stored(obj, index)
                if data is None:
                    raise LookupError(index)
                h.update(data)
                await trio.to_thread.run_sync(self.whole.write, tmp, data, index == blocks - 1)
        except (LookupError, OSError) as exc:
            if not isinstance(exc, LookupError):
                log.warning("could not hold %s whole: %s", obj.key, exc)
            self.whole.abandon(wid, obj.size)
            return None
        except BaseException:
            self.whole.abandon(wid, obj.size)
            raise
        return self.whole.install(wid, h.hexdigest(), obj.size)

    async def _scrub_loop(self) -> None:
        while True:
            w = self.whole.due(self.scrub_every)
            if w is None:
                await trio.sleep(min(60.0, self.scrub_every / 4 or 60.0))
                continue
            if not w.verified:
                log.info("checking whole cached file %s, left by a run before, before it is served", w.name)
            try:
                answer = await trio.to_thread.run_sync(self.whole.verify, w,
                                                       self.SCRUB_RATE if w.verified else self.FIRST_CHECK_RATE)
            except Exception as exc:  # noqa: BLE001 - a scrub never takes the mount down: the copy goes
                answer = OSError(errno.EIO, f"checking it failed: {exc!r}")
            self.whole.verified(w, answer)

    def statistics(self) -> PassthroughStats:
        w = self.whole.statistics()
        return PassthroughStats(self.active, self.opens, self.cached_opens,
                                sum(1 for st in self._inodes.values() if st.backing), w.files, w.bytes, w.limit,
                                w.assembled, w.damaged, w.evicted, w.unchecked)

