"""Files the kernel writes itself: an open of a file written on this node is answered with the file's data
file as its backing file (FUSE passthrough, Linux 6.9+, a root daemon), and the kernel writes and reads
it with no request per write. The daemon sees the open, flush, fsync, setattr and release, not the bytes.

What the daemon did at each write is done otherwise:

- **Size and time** are the data file's (``fstat``): taken when the kernel asks for the file's attributes,
  at fsync, at release, and every :data:`POLL` seconds while it is open for writing.
- **Room.** A file opened for writing is lent a *lease* of the cache's room (:data:`LEASE`, then as much
  again as the file holds, up to :data:`MAX_LEASE`), pinned as written bytes are and preallocated on the
  cache disk, so that a write inside it cannot fail for space; the poll renews it as the file grows. A
  file is opened this way only while the cache has room for its first lease (else through the daemon,
  which refuses a write at the limit with ENOSPC) and only where no ``--writeback-user-quota`` is set (a
  quota is enforced write by write: those files are written through the daemon). Once open, the
  cache's limit does not cut the file short: past its lease it takes what room the cache can make by
  evicting blocks, past that the disk's own free space (the bytes pinned may then exceed ``--cache-size``
  until the file is uploaded).
- **A write that failed.** A file that grew past what was preallocated for it while the disk was found
  full (a lease that could not be preallocated, or less than :data:`FULL` free at its release) may have had
  a write fail with ENOSPC: it is taken as a file a write of which failed (kept here, never uploaded as it
  is, ``sync`` says so), as a failed write through the daemon is.

The kernel's rule of one mode per inode (its opens all pass through one backing file, or all go through
the daemon) is kept by the caller: a file with daemon handles open gets daemon handles until they are
released (:meth:`KernelWrites.holds` says which files have a backing file). Runs on the trio thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from epochfs.core.text import human
from epochfs.kernel.types import Backings, let_backing_go
from epochfs.writeback.owed import Owed
from epochfs.writeback.tree import LocalFile

log = logging.getLogger(__name__)

LEASE = 64 << 20  # the first room lent to a file opened for writing
MAX_LEASE = 4 << 30  # the most lent at once (a file holding more is lent this much ahead)
POLL = 0.05  # seconds between looks at the files open for writing
FULL = 16 << 20  # a cache disk with less than this free at a release was full

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


def _fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    """0, or the errno of ``fallocate(2)``."""
    return 0 if length <= 0 or _libc.fallocate(fd, mode, offset, length) == 0 else ctypes.get_errno()


def _free_tail(fd: int, size: int, length: int, path: str) -> None:
    """Free what was preallocated past a file's end: punched (tmpfs), and the file truncated to its own
    size (ext4 and XFS punch nothing past the end; a truncate frees it)."""
    try:
        _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, size, length)
        os.ftruncate(fd, size)
    except OSError as exc:
        log.warning("%s: the room preallocated past its end was not freed: %s", path, exc)


@dataclass
class _Backed:
    """A file with a backing file registered: the kernel reads and writes it itself."""

    inode: int
    backing_id: int
    fd: int  # our descriptor of its data file (the one registered)
    uid: int  # whose room its lease is
    handles: int = 0  # opens outstanding
    writers: int = 0  # of them, open for writing
    lease: int = 0  # bytes pinned for it past its size
    allocated: int | None = 0  # its data file is preallocated up to here (None: the file system cannot)
    full: bool = False  # a lease could not be preallocated: the disk was full
    seen_mtime: int = 0  # the data file's mtime last taken (a later one is a write)
    dropped: bool = False  # removed while open: nothing of it is owed any more
    outgrown: bool = False  # it grew past the room the cache could lend (said once)


@dataclass(frozen=True)
class KernelWriteStats:
    active: bool
    opens: int  # opens of written files answered with a backing file
    open_files: int  # files with a backing file now
    bytes: int  # bytes the kernel wrote into them (seen growing)
    outgrown: int  # files that grew past the room the cache could lend
    off: str = ""  # why the kernel writes nothing itself, when it does not


class KernelWrites:
    def __init__(self, kernel: Callable[[], Backings | None], owed: Owed,
                 wrote: Callable[[int], None] = lambda n: None) -> None:
        self._kernel = kernel
        self.owed = owed
        self._wrote = wrote  # told the bytes each file grew by (the uploads give way to a fast writer)
        self.active = True
        self.why_off = ""
        self._files: dict[str, _Backed] = {}  # file id -> its backing file
        self._wake = trio.Event()
        self.opens = self.bytes = self.outgrown = 0

    def off(self, why: str) -> bool:
        """Files are written through the daemon from now on (those open stay as they are); False."""
        if self.active:
            self.active = False
            self.why_off = why
            log.warning("the kernel does not write files itself: %s; they are written through the daemon", why)
        return False

    def holds(self, f: LocalFile) -> bool:
        """Whether ``f`` has a backing file (every open of it must have it too, until the last is released)."""
        return f.id in self._files

    def holds_inode(self, inode: int) -> bool:
        return any(b.inode == inode for b in self._files.values())

    # -- opens and releases --------------------------------------------------------------------------

    def admit(self, f: LocalFile, writable: bool, open_fd: Callable[[], int]) -> int:
        """The backing id to answer an open of ``f`` with, or 0: through the daemon (no kernel, no room
        for a first lease, no room on the disk). ``open_fd`` opens its data file for reading and writing."""
        b = self._files.get(f.id)
        if b is not None:
            if writable and not b.writers and self.owed.reserve(f, LEASE) is None:
                b.lease, b.uid = LEASE, f.uid
                self._preallocate(b, f.size + LEASE)
            b.handles += 1
            b.writers += writable
            self.opens += 1
            self._wake.set()
            return b.backing_id
        kernel = self._kernel() if self.active else None
        if kernel is None:
            return 0
        if writable and self.owed.reserve(f, LEASE) is not None:
            return 0  # (the daemon refuses its writes at the limit, one by one)
        fd = open_fd()
        b = _Backed(f.inode, 0, fd, f.uid, lease=LEASE if writable else 0, allocated=f.size,
                    seen_mtime=os.fstat(fd).st_mtime_ns)
        if writable and not self._preallocate(b, f.size + LEASE):
            self._close(b, f)
            return 0  # (no room on the disk for a lease: the daemon says ENOSPC at the first write that fails)
        try:
            b.backing_id = kernel.backing_open(fd)
        except OSError as exc:
            self._close(b, f)
            self.off(f"the kernel refused a backing file ({'the daemon lacks CAP_SYS_ADMIN' if exc.errno == errno.EPERM else exc.strerror})")
            return 0
        b.handles, b.writers = 1, int(writable)
        self._files[f.id] = b
        self.opens += 1
        self._wake.set()
        return b.backing_id

    def release(self, f: LocalFile, writable: bool) -> str | None:
        """One of its backed opens released; why a write of it may have failed (its last writer gone), or None."""
        b = self._files.get(f.id)
        if b is None:
            return None
        b.handles -= 1
        why = None
        if writable:
            b.writers -= 1
            if not b.writers:
                why = self._settle(f, b)
        if not b.handles:
            del self._files[f.id]
            let_backing_go(self._kernel(), b.backing_id)
            os.close(b.fd)
        return why

    def _settle(self, f: LocalFile, b: _Backed) -> str | None:
        """Its last writer gone: its size taken, its lease given back, its preallocated tail freed."""
        self.refresh(f)
        if b.dropped:
            return None
        self.owed.unreserve(b.uid, b.lease)
        b.lease = 0
        past = b.allocated is None or f.size > b.allocated
        why = None
        if past and (b.full or self._disk_full(b.fd)):
            why = "the cache disk filled while the kernel wrote it (a write of it may have failed with ENOSPC)"
        if b.allocated is not None and b.allocated > f.size:
            _free_tail(b.fd, f.size, b.allocated - f.size, f.path)
            b.allocated = f.size
            b.seen_mtime = os.fstat(b.fd).st_mtime_ns  # (that is not a write)
        b.full = False
        return why

    def forget(self, f: LocalFile) -> None:
        """``f`` was removed (its bytes are owed no more): its lease goes back now; its opens stay."""
        b = self._files.get(f.id)
        if b is not None and not b.dropped:
            self.owed.unreserve(b.uid, b.lease)
            b.lease, b.dropped = 0, True

    def truncated(self, f: LocalFile, size: int) -> None:
        """Its data file was cut to ``size`` (what was preallocated past it is gone with it)."""
        b = self._files.get(f.id)
        if b is not None and b.allocated is not None:
            b.allocated = min(b.allocated, size)

    def close(self) -> None:
        """Unmounting: our descriptors go (the backing ids go with the session)."""
        for b in self._files.values():
            os.close(b.fd)
        self._files.clear()

    # -- what the kernel wrote ----------------------------------------------------------------------

    def refresh(self, f: LocalFile) -> None:
        """``f``'s size and time as its data file has them, the growth charged to the cache's room."""
        b = self._files.get(f.id)
        if b is None or b.dropped:
            return
        st = os.fstat(b.fd)
        if st.st_size > f.size:
            grow = st.st_size - f.size
            self.bytes += grow
            self._wrote(grow)
            take = min(grow, b.lease)
            b.lease -= take
            if grow > take:
                self.owed.take(b.uid, grow - take)
        elif st.st_size < f.size:
            self.owed.unreserve(b.uid, f.size - st.st_size)
        if st.st_size != f.size or st.st_mtime_ns != b.seen_mtime:
            f.size, f.mtime_ns, b.seen_mtime = st.st_size, st.st_mtime_ns, st.st_mtime_ns
            f.generation += 1

    def _renew(self, f: LocalFile, b: _Backed) -> None:
        """Lend more room to a growing file: as much as it holds, ahead of it."""
        want = min(MAX_LEASE, max(LEASE, f.size))
        if b.lease >= want // 2 or b.full:
            return
        if self.owed.reserve(f, want - b.lease) is None:
            b.lease = want
            self._preallocate(b, f.size + want)
        elif b.lease == 0 and not b.outgrown:
            self.outgrown += 1
            b.outgrown = True
            log.warning("%s grows past the room the cache can lend (it holds %s): the disk's free space bounds it "
                        "now", f.path, human(f.size))

    def _preallocate(self, b: _Backed, end: int) -> bool:
        """The data file's blocks up to ``end`` taken on the disk; False (and the disk marked full) if
        there was no room."""
        if b.allocated is None or end <= b.allocated:
            return True
        err = _fallocate(b.fd, _FALLOC_FL_KEEP_SIZE, b.allocated, end - b.allocated)
        if err in (errno.ENOSPC, errno.EDQUOT):
            b.full = True
            return False
        if err:
            b.allocated = None  # (a file system that cannot: only the free space at release tells)
        else:
            b.allocated = end
        return True

    @staticmethod
    def _disk_full(fd: int) -> bool:
        st = os.fstatvfs(fd)
        return st.f_bfree * st.f_frsize < FULL

    def _close(self, b: _Backed, f: LocalFile) -> None:
        """An open not answered with it after all: its lease back, what was preallocated freed."""
        self.owed.unreserve(b.uid, b.lease)
        _free_tail(b.fd, f.size, LEASE, f.path)
        os.close(b.fd)

    async def run(self, files: Callable[[], Mapping[str, LocalFile]]) -> None:
        """Every :data:`POLL` seconds while files are open for writing: their growth charged, their leases
        renewed."""
        while True:
            writing = [(fid, b) for fid, b in self._files.items() if b.writers and not b.dropped]
            if not writing:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            owed = files()
            for fid, b in writing:
                f = owed.get(fid)
                if f is not None:
                    self.refresh(f)
                    self._renew(f, b)
            await trio.sleep(POLL)

    def statistics(self) -> KernelWriteStats:
        return KernelWriteStats(self.active, self.opens, len(self._files), self.bytes, self.outgrown, self.why_off)
