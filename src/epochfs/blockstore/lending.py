"""What the kernel's reads of cached files need of the block store: for passthrough, a descriptor of a
whole object's file checked against its fingerprint, the blocks of a file the kernel has open kept out
of the eviction policy, and the scrub's hash of an object against its chunk checksums; for a member's
answer, a block's range of its file for the kernel to send (:class:`Extent`), kept on disk while it is. A part of
:class:`epochfs.blockstore.store.BlockStore` (its state: :mod:`epochfs.blockstore.objects`); the trio
thread, but :meth:`Lending.check_object` (a worker thread, reads only).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from epochfs.blockstore.format import BlockMeta, missing
from epochfs.blockstore.objects import Print

if TYPE_CHECKING:
    from epochfs.blockstore.index import Index
    from epochfs.blockstore.objects import ObjectFiles
    from epochfs.blockstore.packs import Packs
    from epochfs.eviction import EvictionPolicy

log = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class Extent(NamedTuple):
    """A cached block's bytes as a range of an open file, for the kernel to send (``sendfile``) without
    reading them into Python, bound by the BLAKE3 ``digest`` taken when it was fetched (the receiver
    checks the bytes against it); handed back with :meth:`Lending.sent`."""

    fd: int
    offset: int
    length: int
    digest: bytes
    bid: bytes


class Lending:
    objects: ObjectFiles
    index: Index
    policy: EvictionPolicy
    packs: Packs
    _sending: dict[bytes, int]
    _after_send: dict[bytes, BlockMeta]

    def _removal(self, bid: bytes) -> None: ...

    def _let_go(self, bid: bytes, meta: BlockMeta) -> None: ...

    def object_path(self, oid: bytes) -> str: ...  # (BlockStore's)

    def _punch(self, oid: bytes, offset: int, length: int) -> None: ...

    def _unlink_object(self, oid: bytes) -> None: ...

    def remove(self, bid: bytes, length: int) -> None: ...

    def pread_range(self, bid: bytes, meta: BlockMeta, lo: int, hi: int) -> bytes | OSError: ...

    def drop_corrupt(self, bid: bytes, meta: BlockMeta, why: str) -> None: ...

    verify: Any

    def backing_fd(self, oid: bytes) -> int | None:
        """A read-only descriptor of ``oid``'s file for the kernel to read itself, if the object is whole
        and its file is exactly the one whose fingerprint was taken; else None (the object is then read
        through the daemon). A file that is not what its fingerprint says (written, truncated, replaced
        since) loses its fingerprint and is hashed before it is lent again."""
        f = self.objects.get(oid)
        if f is None or not f.whole or f.print is None:
            return None
        try:
            fd = os.open(self.object_path(oid), _READ_FLAGS)
        except OSError as exc:
            self.suspect(oid, f"it cannot be opened ({exc.strerror})")
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not self.known_right(oid, st):
            os.close(fd)
            self.suspect(oid, "it was changed since its fingerprint was taken")
            return None
        return fd

    def known_right(self, oid: bytes, st: os.stat_result) -> bool:
        """Whether ``oid``'s file, seen as ``st``, is still the one whose fingerprint was taken (a change of
        its links alone, another store of the node linking it or letting go, is taken into the
        fingerprint: :meth:`Print.holds`)."""
        f = self.objects.get(oid)
        if f is None or not f.whole or f.print is None:
            return False
        now = Print.of(st)
        if now == f.print:
            return True
        if not f.print.holds(now):
            return False
        f.print = now
        self.index.set_print(oid, now.encode())
        return True

    def suspect(self, oid: bytes, why: str) -> None:
        """``oid``'s file may not be what was written: read through the daemon until it is hashed again."""
        f = self.objects.get(oid)
        if f is None or not f.whole:
            return
        log.warning("cached object file %s: %s; read through the daemon until its blocks are checked again",
                    oid.hex(), why)
        self.objects.suspected += 1
        if f.print is not None:
            self.index.set_print(oid, None)
        f.tainted = True
        self.objects.became_whole(oid, None)

    def lend(self, oid: bytes) -> None:
        """The kernel opened a backing file on ``oid``: its blocks are not evicted until :meth:`returned`."""
        f = self.objects.files[oid]
        if not f.held:
            for bid in f.blocks.values():
                self.policy.removed(bid)
        self.objects.lend(oid)

    def returned(self, oid: bytes) -> None:
        """A backing file on ``oid`` was closed: the last one gives its blocks back to the policy, and
        punches the ranges of blocks dropped meanwhile."""
        deferred = self.objects.returned(oid)
        f = self.objects.get(oid)
        if f is None or f.held:
            return
        for bid, offset, length in deferred:
            if f.blocks.get(offset) is None:
                self._removal(bid)  # (a fill of it that began before this punch is not indexed)
                self._punch(oid, offset, length)
        for offset, bid in f.blocks.items():
            self.policy.inserted(bid, f.length(offset))
        if not f.have:
            self._unlink_object(oid)
        elif f.whole and f.print is None:
            self.objects.became_whole(oid, None)  # (refilled while lent: hashed before it is lent again)

    def extent(self, bid: bytes, meta: BlockMeta) -> Extent | None:
        """Block ``bid``'s range of its file (``meta``: its index entry, just looked up), opened for the
        kernel to send to a member, if it has its digest (else None: it is read, checked and hashed
        instead). Until :meth:`sent`, its bytes stay on disk: a removal meanwhile (eviction) punches or
        frees the range only then. The bytes are not checked here; the receiver checks them against the
        digest (the scrub finds what rotted)."""
        if not meta.digest:
            return None
        path = self.object_path(meta.obj) if meta.in_file else self.packs.path(meta.pack)
        try:
            fd = os.open(path, _READ_FLAGS)
        except OSError:
            return None  # (damage, if it is, is found by the read that follows)
        self._sending[bid] = self._sending.get(bid, 0) + 1
        return Extent(fd, meta.offset, meta.length, meta.digest, bid)

    def sent(self, extent: Extent) -> None:
        """An :meth:`extent` was sent (or given up): the last of a removed block's lets go of its range."""
        os.close(extent.fd)
        left = self._sending.pop(extent.bid, 1) - 1
        if left:
            self._sending[extent.bid] = left
        elif (meta := self._after_send.pop(extent.bid, None)) is not None:
            self._removal(extent.bid)  # (a fill of it that began before this punch is not indexed)
            self._let_go(extent.bid, meta)

    @property
    def sending(self) -> int:
        """Block ranges being sent by the kernel now."""
        return sum(self._sending.values())

    def check_plan(self, oid: bytes) -> list[tuple[bytes, BlockMeta]]:
        """The blocks of whole object ``oid`` to hash (:meth:`check_object`), in order."""
        f = self.objects.get(oid)
        if f is None or not f.whole:
            return []
        plan = []
        for offset in sorted(f.blocks):
            bid = f.blocks[offset]
            meta = self.index.get(bid)
            if meta is None or meta.obj != oid or meta.offset != offset:
                log.warning("cached object file %s: its index entries do not say what it holds; dropping it",
                            oid.hex())
                for other in list(f.blocks.values()):
                    entry = self.index.get(other)
                    self.remove(other, entry.length if entry is not None else 0)
                self._unlink_object(oid)
                return []
            plan.append((bid, meta))
        return plan

    def check_object(self, oid: bytes, plan: list[tuple[bytes, BlockMeta]], rate: float) -> tuple[
            Print | None, list[tuple[bytes, BlockMeta, str]]]:
        """(a worker thread) Hash every block of ``plan`` against its checksums, at most ``rate`` bytes a
        second: the file's fingerprint if it did not change while it was read (None if it did, or
        cannot be read), and the blocks that failed (id, entry, why)."""
        try:
            before = os.stat(self.object_path(oid), follow_symlinks=False)
        except OSError as exc:
            if not missing(exc):
                return None, []  # (not evidence of damage: checked again later)
            return None, [(bid, meta, "its file is missing") for bid, meta in plan]
        bad = []
        started, done = time.monotonic(), 0
        for bid, meta in plan:
            data = self.pread_range(bid, meta, 0, meta.length)
            if isinstance(data, OSError) and not missing(data):
                return None, []  # (not evidence of damage: checked again later)
            why = self.verify(bid, meta, 0, meta.length, data)
            if why:
                bad.append((bid, meta, why))
            done += meta.length
            ahead = done / rate - (time.monotonic() - started) if rate > 0 else 0
            if ahead > 0:
                time.sleep(ahead)
        try:
            after = os.stat(self.object_path(oid), follow_symlinks=False)
        except OSError:
            return None, bad
        size = plan[0][1].size if plan else 0
        if not stat.S_ISREG(after.st_mode) or after.st_size != size:
            why = "its file is not the object's (not a plain file, or not the object's size)"
            return None, [(bid, meta, why) for bid, meta in plan]  # (refetched into a file of its own)
        if not Print.of(before).holds(Print.of(after)):
            return None, bad
        return Print.of(after), bad

    def checked(self, oid: bytes, plan: list[tuple[bytes, BlockMeta]], fp: Print | None,
                bad: list[tuple[bytes, BlockMeta, str]]) -> bool:
        """(the trio thread) What :meth:`check_object` found: damaged blocks are dropped; an object that
        is still whole, as planned, with a fingerprint, is known right again. Whether it is."""
        for bid, meta, why in bad:
            if self.index.get(bid) == meta:
                self.drop_corrupt(bid, meta, why)
        f = self.objects.get(oid)
        if bad or f is None or not f.whole or fp is None or fp.size != f.size:
            if f is not None and f.whole and not bad and fp is None:
                self.objects.became_whole(oid, None)  # (changed while it was read: hashed again)
            return False
        if any(f.blocks.get(meta.offset) != bid for bid, meta in plan):
            return False
        f.tainted = False
        self.objects.became_whole(oid, fp)
        self.index.set_print(oid, fp.encode())
        return True

