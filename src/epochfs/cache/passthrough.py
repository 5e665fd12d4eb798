"""Passthrough opens (by default where the dataset's bytes are mostly in large files: :func:`small_files`):
the kernel reads a fully cached object from its file in the store.

An object whose blocks are all cached is, in the store, one file that is the object byte for byte
(:mod:`epochfs.blockstore.objects`); an open of it is answered with that file as its backing file and the
kernel reads it itself (FUSE passthrough, Linux 6.9+, a root daemon): no daemon work per read, no
second copy. Opens of an object not yet whole are read through the daemon, and its later opens pass
through once it is.

The kernel's rules: an inode is read either through the daemon (cached opens) or through one backing
file (passthrough opens), never both at once (the kernel fails the open that would mix them), so an
inode with cached opens outstanding gets cached opens until they are released, and one with a backing
file gets that same backing file for every open until the last is released. A backing file registered
with the kernel is kept for the next open of its object (at most :attr:`Passthrough.KEPT`, the least
recently opened let go, and at once when its object stops being whole, so that an evicted object's bytes
are freed), so a hot small file costs an open and a release, not a file opened and registered each
time; the object's file is checked against its fingerprint at every open all the same.

Reads the kernel serves never reach the daemon: each passthrough open counts the object's size as
bytes read from the cache (a reader that reads part of a file counts it whole; per open, not per read).

The scrub (:meth:`Passthrough.run`) hashes every whole object against its chunk checksums at a bounded
rate, those whose fingerprint is to be taken first. Runs on the trio thread.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from epochfs.cache.service import BlockCache
from epochfs.core.records import ObjectInfo, stored_extent
from epochfs.kernel.types import Backings, let_backing_go

log = logging.getLogger(__name__)

#: Files from this size are what passthrough pays for: the daemon's CPU per byte read goes, an open costs
#: a request (the zero-message opens a mount of small files uses cost none).
LARGE = 1 << 20
_SAMPLE = 100_000  # objects looked at, at most, to decide


def small_files(objects: Iterable[ObjectInfo]) -> str | None:
    """Why passthrough does not pay on a dataset of these objects, or None if it does: most of its bytes
    are in files under :data:`LARGE` or in packed members (which the kernel cannot read from a file of
    their own). Passthrough answers every open with a request (the kernel sends OPEN, RELEASE), where a
    mount without it opens files with no request at all: measured on 100 KiB files, a hot open costs
    the daemon ~0.2 ms and a hot read ran at a tenth of the page cache's rate, the warm read at 0.7x,
    while for large files it takes the daemon's 0.7 s of CPU per warm GiB to none."""
    total = large = 0
    for obj in itertools.islice(objects, _SAMPLE):  # (the first: a namespace of millions is not read whole)
        total += obj.size
        if obj.size >= LARGE and stored_extent(obj)[0] is obj:
            large += obj.size
    if not total or 2 * large >= total:
        return None
    return (f"most of the dataset's bytes ({1 - large / total:.0%}) are in files under {LARGE >> 20} MiB or packed "
            "members, which are opened with no request instead (--passthrough: the kernel reads them too)")


class BackingChanged(Exception):
    """An open of an inode the kernel reads through a backing file that is no longer known right: it is
    failed (EIO) rather than served from that file, until the inode's other opens are released."""


@dataclass
class _Inode:
    obj: ObjectInfo
    cached: set[int] = field(default_factory=set)  # handles read through the daemon
    passed: set[int] = field(default_factory=set)  # handles the kernel reads itself
    backing: _Backing | None = None


@dataclass
class _Backing:
    oid: bytes
    id: int  # the kernel's backing id
    fd: int  # our descriptor of the same file (its fingerprint is checked at each open)
    users: int = 0


@dataclass(frozen=True)
class PassthroughStats:
    active: bool  # False where the kernel reads nothing itself (see ``off``)
    opens: int  # opens the kernel read itself
    cached_opens: int  # opens read through the daemon
    open_files: int  # objects with a passthrough open now
    whole_files: int  # objects whole in the cache (the kernel may read them)
    whole_bytes: int
    unchecked: int  # whole, to be hashed before the kernel reads them (a change seen, a crash)
    damaged: int  # objects found changed or damaged (at open or by the scrub)
    bytes_opened: int  # what passthrough opens counted as read (each open: the object's size)
    off: str = ""  # why it is off, when it is
    kept: int = 0  # backing files registered with the kernel now (each an open descriptor; at most KEPT)


class Passthrough:
    #: How often every whole object is hashed again, and how fast (bytes a second).
    SCRUB_EVERY = 86400.0
    SCRUB_RATE = 64 << 20
    #: An object whose fingerprint is to be taken is read through the daemon meanwhile: hashed faster.
    FIRST_CHECK_RATE = 256 << 20
    #: Backing files kept registered with the kernel for the next open of their object.
    KEPT = 1024

    def __init__(self, cache: BlockCache, kernel: Callable[[], Backings | None], *,
                 scrub_every: float | None = None, on_off: Callable[[], None] | None = None) -> None:
        self.cache = cache
        self.store = cache.store
        self._kernel = kernel
        self.scrub_every = self.SCRUB_EVERY if scrub_every is None else scrub_every
        self.active = True
        self.why_off = ""
        self._on_off = on_off
        self._inodes: dict[int, _Inode] = {}
        self._handles: dict[int, int] = {}  # fh -> inode
        self._backings: OrderedDict[bytes, _Backing] = OrderedDict()  # object id -> registered backing file
        self.opens = self.cached_opens = self.damaged = self.bytes_opened = 0
        self.store.objects.watchers.append(self._not_whole)

    def _not_whole(self, oid: bytes) -> None:
        """An object stopped being whole (evicted, dropped, refetched): a kept backing file no open uses
        lets go now, or the kernel would hold its file, and the bytes an eviction freed, until the next
        open of the object or the trim (one in use lets go at its last release)."""
        b = self._backings.get(oid)
        if b is not None and not b.users:
            self._let_go(b)

    # -- opens -------------------------------------------------------------------------------------------

    def open(self, inode: int, obj: ObjectInfo, fh: int) -> int:
        """The backing id to answer this open with (the kernel reads the object's file), or 0: read it
        through the daemon. Either way the handle is remembered until :meth:`release`. Raises
        :class:`BackingChanged` for an inode the kernel reads from a file no longer known right."""
        st = self._inodes.get(inode)
        if st is None or st.obj is not obj:
            if st is not None and (st.cached or st.passed):
                self._handles[fh] = inode  # (a new version while the old is open: through the daemon)
                st.cached.add(fh)
                self.cached_opens += 1
                return 0
            st = self._inodes[inode] = _Inode(obj)
        if st.backing is not None:  # (opens outstanding read this file: this one must too)
            if not self._still_right(st.backing):
                log.warning("%s: an open refused (EIO): the kernel reads it from a cached file found changed or "
                            "damaged while other opens of it are outstanding", obj.key)
                raise BackingChanged(obj.key)
            return self._passed(st, fh, inode)
        if not st.cached and self.active and self._eligible(obj):
            backing = self._backing(obj)
            if backing is not None:
                st.backing = backing
                backing.users += 1
                self.store.lend(backing.oid)
                return self._passed(st, fh, inode)
        self._handles[fh] = inode
        st.cached.add(fh)
        self.cached_opens += 1
        return 0

    def mode(self, inode: int) -> str | None:
        """How the kernel reads ``inode`` now: "passed" (a backing file), "cached" (through the daemon), or
        None (no open of it here): an open the caller answers itself must not mix the two."""
        st = self._inodes.get(inode)
        if st is None:
            return None
        return "passed" if st.passed else "cached" if st.cached else None

    def _passed(self, st: _Inode, fh: int, inode: int) -> int:
        assert st.backing is not None
        self._handles[fh] = inode
        st.passed.add(fh)
        self.opens += 1
        self.bytes_opened += st.obj.size
        self.cache.count_hit(st.obj.size)
        return st.backing.id

    def _still_right(self, b: _Backing) -> bool:
        f = self.store.objects.get(b.oid)
        try:
            st = os.fstat(b.fd)
        except OSError:
            return False
        return f is not None and self.store.known_right(b.oid, st)

    def _backing(self, obj: ObjectInfo) -> _Backing | None:
        oid = self.cache.place(obj, 0).obj
        kept = self._backings.get(oid)
        if kept is not None:
            if self._still_right(kept):
                self._backings.move_to_end(oid)
                return kept
            if not kept.users:
                self._let_go(kept)  # (evicted from, refilled or changed since: looked at afresh)
        f = self.store.objects.get(oid)
        if f is None or not f.whole or f.print is None or f.size != obj.size:
            return None
        kernel = self._kernel()
        if kernel is None:
            return None
        fd = self.store.backing_fd(oid)
        if fd is None:
            return None
        try:
            backing_id = kernel.backing_open(fd)
        except OSError as exc:
            os.close(fd)
            self.off(f"the kernel refused a backing file ({'the daemon lacks CAP_SYS_ADMIN' if exc.errno == errno.EPERM else exc.strerror})")
            return None
        b = self._backings[oid] = _Backing(oid, backing_id, fd)
        self._trim()
        return b

    def _trim(self) -> None:
        if len(self._backings) <= self.KEPT:
            return
        for oid in list(self._backings):
            if len(self._backings) <= self.KEPT:
                break
            b = self._backings[oid]
            if not b.users:
                self._let_go(b)

    def _let_go(self, b: _Backing) -> None:
        if self._backings.get(b.oid) is b:
            del self._backings[b.oid]
        let_backing_go(self._kernel(), b.id)
        os.close(b.fd)

    def off(self, why: str) -> bool:
        """The kernel reads nothing itself on this mount: every open reads through the daemon from now on
        (False, for the caller's flag)."""
        if self.active:
            self.active = False
            self.why_off = why
            log.warning("passthrough is off: %s; files are read through the daemon", why)
            if self._on_off is not None:
                self._on_off()
        return False

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
        b = st.backing
        if b is not None:
            b.users -= 1
            self.store.returned(b.oid)
            if not b.users and (self._backings.get(b.oid) is not b or not self._still_right(b)):
                self._let_go(b)
            else:
                self._trim()

    def _eligible(self, obj: ObjectInfo) -> bool:
        return obj.size > 0 and stored_extent(obj)[0] is obj

    def close(self) -> None:
        """Let every kept backing file go (unmounting)."""
        if self._not_whole in self.store.objects.watchers:
            self.store.objects.watchers.remove(self._not_whole)
        for b in list(self._backings.values()):
            self._let_go(b)

    # -- the scrub ---------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        objects = self.store.objects
        while True:
            oid = objects.due(self.scrub_every)
            if oid is None:
                await trio.sleep(1.0)
                continue
            f = objects.get(oid)
            first = f is not None and not f.checked
            plan = self.store.check_plan(oid)
            if not plan:  # (its entries do not say what it holds: its blocks were dropped)
                continue
            if first:
                log.info("checking cached object file %s before the kernel reads it", oid.hex())
            try:
                fp, bad = await trio.to_thread.run_sync(self.store.check_object, oid, plan,
                                                        self.FIRST_CHECK_RATE if first else self.SCRUB_RATE)
            except Exception as exc:  # noqa: BLE001 - a scrub never takes the mount down
                log.warning("checking cached object file %s failed: %r", oid.hex(), exc)
                fp, bad = None, []
            if bad:
                self.damaged += 1
            if not self.store.checked(oid, plan, fp, bad):
                await trio.sleep(1.0)  # (changed while read, or unreadable: again, not at once)

    def statistics(self) -> PassthroughStats:
        s = self.store.statistics()
        return PassthroughStats(self.active, self.opens, self.cached_opens,
                                sum(1 for b in self._backings.values() if b.users), s.whole_objects, s.whole_bytes,
                                s.unchecked_objects, self.damaged + self.store.objects.suspected, self.bytes_opened,
                                self.why_off, len(self._backings))
