"""Object files: the blocks of an object's version in one file, each at its own offset, for the kernel.

A block of an object is written at ``index * block size`` of the object's file ``blocks/ab/<id>``
(``id``: the object's first block's id, so another version, another geometry or another source is
another file), which is created sparse at the object's size: where a block is not cached the file has
a hole, and evicting a block punches its range out. Once every block of the object is indexed the file
is the object, byte for byte, and the kernel reads it itself (FUSE passthrough,
:mod:`epochfs.cache.passthrough`): no second copy.

The kernel's reads of a passed-through file never reach the daemon, so they are not checked one by
one. What keeps a wrong byte from being served instead:

- every chunk is checked when it enters the cache (its xxh3-64 is taken from the bytes received, and
  the block's bytes and checksums are bound to its id);
- when the last block of an object is installed the file's **fingerprint** is taken (inode, size,
  change and modification time, as ``fstat`` gives them right after our writes) and kept in the index;
  at every passthrough open the file opened must have exactly that fingerprint: a write, a truncate, a
  hole punched, a rename over it, a replace all change the inode or the change time;
- a **scrub** hashes every whole object again against its chunk checksums at a bounded rate
  (:class:`ObjectFiles` keeps them oldest-checked first), so media corruption is found within a stated
  time; a file whose fingerprint was lost (a change seen at open, a machine that rebooted without a
  clean stop) is hashed before the kernel reads it again, first in the scrub's order.

A block that fails is dropped (its range punched); its object is then not whole, is read through the
daemon (verified on every read) and becomes a passthrough object again once refetched and whole.

While the kernel has a backing file open on an object (:meth:`ObjectFiles.lend`), its blocks are out of
the eviction policy (never evicted), and a block dropped meanwhile (the scrub found it damaged) has its
range punched only once the last backing file is closed (a hole would read as zeros). Owned by
:class:`epochfs.blockstore.store.BlockStore`; the trio thread only.
"""

from __future__ import annotations

import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Place:
    """Where a block goes: its object's id, its offset in the object, the object's size."""

    obj: bytes
    offset: int
    size: int


_PRINT = struct.Struct("<QQqq")  # (as written before files could have a second name: one link)
_PRINT_LINKS = struct.Struct("<QQqqI")


class Print(NamedTuple):
    """An object file as ``fstat`` saw it when it was last known right."""

    ino: int
    size: int
    ctime_ns: int
    mtime_ns: int
    links: int = 1

    @classmethod
    def of(cls, st: object) -> Print:
        return cls(st.st_ino, st.st_size, st.st_ctime_ns, st.st_mtime_ns, st.st_nlink)  # type: ignore[attr-defined]

    def encode(self) -> bytes:
        return _PRINT_LINKS.pack(*self)

    @classmethod
    def decode(cls, raw: bytes) -> Print | None:
        if len(raw) == _PRINT_LINKS.size:
            return cls(*_PRINT_LINKS.unpack(raw))
        return cls(*_PRINT.unpack(raw)) if len(raw) == _PRINT.size else None

    def holds(self, now: Print) -> bool:
        """Whether the file, seen now as ``now``, still holds what it held when this print was taken: the
        same in every field, or only its links changed (another store of the node linked it or let its
        name go, :mod:`epochfs.cache.shared`: that moves the ctime and nothing else; a write, a truncate
        or a hole punched moves the mtime too)."""
        return now == self or (now.links != self.links and now[:2] == self[:2] and now.mtime_ns == self.mtime_ns)


class ObjectFile:
    """What the store knows of one object's file."""

    __slots__ = ("size", "step", "have", "blocks", "print", "checked", "held", "deferred", "tainted", "dropping")

    def __init__(self, size: int) -> None:
        self.size = size  # the object's size: the file's
        self.step = 0  # the length of its blocks (all but the last; the largest one indexed)
        self.have = 0  # bytes of its blocks indexed
        self.blocks: dict[int, bytes] = {}  # offset -> block id
        self.print: Print | None = None  # set while whole and known right
        self.checked = 0.0  # when its bytes were last known right (monotonic; 0: to be hashed first)
        self.held = 0  # backing files the kernel has open on it
        self.deferred: list[tuple[bytes, int, int]] = []  # (block, offset, length) to punch once not held
        self.tainted = False  # found changed or damaged: hashed before it is lent again, even once refilled
        self.dropping = False  # shared with another store of the node: all its blocks go, none is punched

    @property
    def whole(self) -> bool:
        return self.have == self.size

    def length(self, offset: int) -> int:
        """The length of its block at ``offset``."""
        return min(self.step, self.size - offset)


class ObjectFiles:
    def __init__(self) -> None:
        self.files: dict[bytes, ObjectFile] = {}
        self._order: OrderedDict[bytes, None] = OrderedDict()  # whole objects, least recently checked first
        self.lent = 0  # object files with a backing file open
        self.whole_size = 0  # bytes of the whole ones
        self.suspected = 0  # fingerprints found not to match (a file changed under the cache)
        #: Called with an object's id when it stops being whole (a block evicted, dropped or refetched):
        #: a backing file kept registered for it must let go, or it would keep the file's bytes on disk.
        self.watchers: list[Callable[[bytes], None]] = []

    def __len__(self) -> int:
        return len(self.files)

    def get(self, oid: bytes) -> ObjectFile | None:
        return self.files.get(oid)

    def added(self, oid: bytes, bid: bytes, offset: int, length: int, size: int) -> ObjectFile:
        """A block of ``oid`` was indexed (its fingerprint is the caller's to set once whole)."""
        f = self.files.get(oid)
        if f is None:
            f = self.files[oid] = ObjectFile(size)
        if f.blocks.get(offset) != bid:
            f.blocks[offset] = bid
            f.have += length
            f.step = max(f.step, length)
        self._not_whole(oid, f)
        return f

    def load_prints(self, prints: dict[bytes, bytes], trusted: bool) -> list[bytes]:
        """At start-up, once every block is loaded: the whole objects take their kept fingerprints (if
        ``trusted``; else each is hashed first). The fingerprints that no longer apply."""
        stale = []
        for oid, raw in prints.items():
            f = self.files.get(oid)
            fp = Print.decode(raw) if trusted else None
            if f is None or not f.whole or fp is None or fp.size != f.size:
                stale.append(oid)
        for oid, f in self.files.items():
            if f.whole:
                self.became_whole(oid, Print.decode(prints[oid]) if oid in prints and oid not in stale else None)
        return stale

    def became_whole(self, oid: bytes, fp: Print | None, checked: float | None = None) -> None:
        """``oid`` is whole and, with a fingerprint, known right (``checked``: when; default now);
        without one it is hashed first."""
        f = self.files[oid]
        f.print = fp
        f.checked = 0.0 if fp is None else time.monotonic() if checked is None else checked
        if oid not in self._order:
            self.whole_size += f.size
        self._order[oid] = None
        self._order.move_to_end(oid, last=bool(f.checked))  # (to be hashed first, or last checked)

    def _not_whole(self, oid: bytes, f: ObjectFile) -> None:
        f.print = None
        if self._order.pop(oid, 0) is None:
            self.whole_size -= f.size
            for watcher in self.watchers:
                watcher(oid)

    def removed(self, oid: bytes, offset: int, length: int) -> ObjectFile | None:
        """A block of ``oid`` left the index; the object's file, or None if it was not known."""
        f = self.files.get(oid)
        if f is None:
            return None
        if offset in f.blocks:
            del f.blocks[offset]
            f.have -= length
        self._not_whole(oid, f)
        return f

    def forget(self, oid: bytes) -> None:
        f = self.files.pop(oid, None)
        if f is not None:
            self._not_whole(oid, f)
            self.lent -= f.held > 0

    def lend(self, oid: bytes) -> None:
        f = self.files[oid]
        f.held += 1
        self.lent += f.held == 1

    def returned(self, oid: bytes) -> list[tuple[bytes, int, int]]:
        """A backing file of ``oid`` was closed: the ranges to punch now, if that was the last."""
        f = self.files.get(oid)
        if f is None or not f.held:
            return []
        f.held -= 1
        if f.held:
            return []
        self.lent -= 1
        deferred, f.deferred = f.deferred, []
        return deferred

    def due(self, every: float) -> bytes | None:
        """The whole object to hash next: one whose fingerprint is to be taken, else the one checked
        longest ago if that is at least ``every`` seconds (``every`` 0: only the former)."""
        oid = next(iter(self._order), None)
        if oid is None:
            return None
        f = self.files[oid]
        if not f.checked or (every > 0 and time.monotonic() - f.checked >= every):
            return oid
        return None

    def unchecked(self) -> int:
        """Whole objects waiting for their first hash (read through the daemon meanwhile)."""
        n = 0
        for oid in self._order:
            if self.files[oid].checked:
                break
            n += 1
        return n

    def whole(self) -> int:
        return len(self._order)
