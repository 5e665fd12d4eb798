"""How the block store writes a block (a worker thread): into its range of its object's file, created
sparse at the object's size, or a small object's block into a pack where small blocks are packed.
A part of :class:`epochfs.blockstore.store.BlockStore`, with what becomes of a write on the trio thread:
:meth:`Writes.install` indexes it, :meth:`Writes.abandon` undoes it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import stat
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

from epochfs.blockstore import packs as pk
from epochfs.blockstore.direct import write_direct
from epochfs.blockstore.format import BlockMeta, checksums, digest
from epochfs.blockstore.objects import Place
from epochfs.blockstore.packs import Packs, punch_hole

if TYPE_CHECKING:
    from epochfs.blockstore.objects import ObjectFiles

log = logging.getLogger(__name__)

DIRECT_MIN = 1 << 20  # write_temp(around=True) writes blocks at least this large with O_DIRECT


class Written(NamedTuple):
    """What :meth:`BlockStore.write_temp` wrote a block into: the file's inode (0: a pack), and how many
    blocks the store had removed when the write began."""

    ino: int
    removals: int


Filled = tuple[Written, BlockMeta]  # what a write hands to install (or to abandon)


_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _rename_noreplace(src: str, dst: str) -> int:
    """``rename(src, dst)`` unless ``dst`` exists (renameat2 RENAME_NOREPLACE): 0, or the errno."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return 0
    return ctypes.get_errno()


def boot_id() -> bytes:
    """This boot's id (b"" where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read(64).strip()
    except OSError:
        return b""


class Writes:
    packs: Packs
    _removals: int
    _closed: bool
    _writing: int
    _write_lock: threading.Lock
    _direct_works: bool
    _dirs: set[str]

    objects: ObjectFiles
    digests: bool  # each block's BLAKE3 hash taken at fill (a node that serves other members)
    _removed: OrderedDict[bytes, int]
    _forgotten: int

    def object_path(self, oid: bytes) -> str: ...  # (BlockStore's)

    def commit(self, bid: bytes, meta: BlockMeta, st: os.stat_result | None = None) -> None: ...

    def _punch(self, oid: bytes, offset: int, length: int) -> None: ...

    def _unlink_object(self, oid: bytes) -> None: ...

    def write_temp(self, bid: bytes, data: bytes | bytearray | memoryview, around: bool = False,
                   place: Place | None = None) -> Filled:
        """Write a block into its range of its object's file (``place``; default: an object of that one
        block, named by its id), or a small object's one block into the current pack where small blocks
        are packed, and checksum it (and hash it, :attr:`digests`) (worker thread: touches no state but the packs' write position and
        counts). Raises OSError. :meth:`install` indexes it; :meth:`abandon` undoes it.

        ``around``: the reader has the bytes already (it is served from memory), so a block of at least
        :data:`DIRECT_MIN` bytes is written around the page cache (``O_DIRECT``): for large blocks,
        filling new page-cache pages costs more CPU than the rest of a cold read, and the mount keeps its
        own copy in the page cache anyway. (A small block costs more CPU written directly: a
        synchronous device write per block.)"""
        removals = self._removals
        place = place or Place(bid, 0, len(data))
        if self.packs.enabled and len(data) < pk.PACK_BELOW and place.size == len(data):
            pack, offset = self.packs.write(data)
            return Written(0, removals), BlockMeta(len(data), checksums(bid, data), 0, pack, offset,
                                                   digest=self._digest(data))
        if place.offset % pk.ALIGN or place.offset + len(data) > place.size:
            raise ValueError(f"a block of {len(data)} bytes cannot be at {place.offset} of {place.size}")
        path = self.object_path(place.obj)
        self._made_parent(path)
        with self._write_lock:
            if self._closed:
                raise OSError(errno.ESHUTDOWN, "the cache is closed")
            self._writing += 1
        try:
            ino, meta = self._write_in_file(bid, data, around, place, path)
            return Written(ino, removals), meta
        finally:
            with self._write_lock:
                self._writing -= 1

    def _write_in_file(self, bid: bytes, data: bytes | bytearray | memoryview, around: bool, place: Place,
                       path: str) -> tuple[int, BlockMeta]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        # (An object's last block, of a length not aligned, is written through the page cache: padded, a
        # direct write would make the file longer than the object until truncated.)
        direct = around and self._direct_works and len(data) >= DIRECT_MIN and not len(data) % pk.ALIGN
        try:
            fd = os.open(path, flags | os.O_DIRECT if direct else flags, 0o600)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            log.info("the cache file system does not support O_DIRECT (%s); writing through the page cache", exc)
            self._direct_works = False
            direct = False
            fd = os.open(path, flags, 0o600)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            raise OSError(errno.EPERM, f"{path} is not an object file of this cache")
        try:
            if st.st_size != place.size:
                os.ftruncate(fd, place.size)  # (sparse: a hole where a block is not cached)
            if not (direct and self._wrote_direct(fd, data, place)):
                view, at = memoryview(data), place.offset
                while view:
                    n = os.pwrite(fd, view, at)
                    view, at = view[n:], at + n
        except BaseException:
            try:  # (the range is this fill's alone: nothing of it stays on disk)
                punch_hole(fd, place.offset, len(data))
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        return st.st_ino, BlockMeta(len(data), checksums(bid, data), 0, 0, place.offset, place.obj, place.size,
                                    self._digest(data))

    def _digest(self, data: bytes | bytearray | memoryview) -> bytes:
        return digest(data) if self.digests else b""

    def _wrote_direct(self, fd: int, data: bytes | bytearray | memoryview, place: Place) -> bool:
        """Write ``data`` at its place in ``fd`` (opened with O_DIRECT); False, with O_DIRECT cleared, if
        the file system takes O_DIRECT but not our alignment (EINVAL)."""
        try:
            write_direct(fd, data, place.offset)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.info("direct writes fail on the cache file system (%s); writing through the page cache", exc)
        self._direct_works = False
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        return False

    def take_file(self, oid: bytes, path: str, size: int, linked: bool = False) -> Written | None:
        """Make the file at ``path`` (an object's bytes whole, on the cache's file system, this daemon's,
        written no more: an uploaded write-back file) the object file of ``oid`` where the store has none,
        by renaming it into place: no byte copied. Its blocks are then checked and indexed one by one
        (:meth:`checked_block`, :meth:`install`); until they are, the store reads none of it. None where
        the object has a file here already (or a fill is writing one), or ``path`` is not such a file
        (trio thread). ``linked``: the file is another store's of the node too (a hard link: never
        written, punched or chmod'ed here; :func:`epochfs.blockstore.content.alone`)."""
        if self.objects.get(oid) is not None or (self.packs.enabled and size < pk.PACK_BELOW):
            return None
        target = self.object_path(oid)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size
                or (st.st_nlink != 1 and not linked) or (linked and stat.S_IMODE(st.st_mode) & 0o077)):
            return None
        self._made_parent(target)
        if not linked:
            os.chmod(path, 0o600)
        if _rename_noreplace(path, target) != 0:  # (a fill created it meanwhile: copied instead)
            return None
        return Written(st.st_ino, self._removals)

    def _made_parent(self, path: str) -> None:
        """The directory an object file at ``path`` goes in, made once."""
        parent = path.rsplit("/", 1)[0]
        if parent not in self._dirs:
            try:
                os.mkdir(parent, 0o700)
            except FileExistsError:
                pass
            self._dirs.add(parent)

    def checked_block(self, bid: bytes, written: Written, place: Place, length: int) -> BlockMeta:
        """The checksums (and hash, :attr:`digests`) of a block of a file :meth:`take_file` took, read
        from it (worker thread). Raises OSError."""
        fd = os.open(self.object_path(place.obj), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_ino != written.ino:
                raise OSError(errno.ESTALE, "its object's file was replaced")
            data = os.pread(fd, length, place.offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise OSError(errno.EIO, f"{len(data)} bytes read of {length}")
        return BlockMeta(length, checksums(bid, data), 0, 0, place.offset, place.obj, place.size, self._digest(data))

    def untake(self, oid: bytes, offset: int, size: int) -> None:
        """What :meth:`take_file` took from ``offset`` on is not to be kept (the policy refused a block, a
        check failed): that range freed, the file removed if no block of it was indexed (trio thread)."""
        f = self.objects.get(oid)
        if f is None and not self._writing:
            self._unlink_object(oid)
        elif offset < size:
            self._punch(oid, offset, size - offset)

    def abandon(self, written: Written, meta: BlockMeta) -> None:
        """Undo a :meth:`write_temp` whose block will not be installed (its fill gave up): free its pack
        range, or punch its range of the object's file (unless the block was indexed meanwhile by
        another fill: the same bytes), and remove a file left holding no block (trio thread). The caller
        releases the reservation."""
        if meta.pack:
            self.packs.free(meta.pack, meta.offset, meta.length, indexed=False)
            return
        f = self.objects.get(meta.obj)
        if f is None and not self._writing:
            self._unlink_object(meta.obj)  # (holds no block, and no fill is writing into a file)
        elif f is None or f.blocks.get(meta.offset) is None and not f.held:
            self._punch(meta.obj, meta.offset, meta.length)

    def install(self, bid: bytes, written: Written, meta: BlockMeta) -> None:
        """Index a block written by :meth:`write_temp`, consuming its reservation (trio thread; no
        checkpoint). Raises OSError when the block's range may no longer hold what was written: its
        object's file was replaced or removed since, or the block was removed (evicted, found damaged)
        after its write began (the removal may have punched the range after the write); the caller then
        releases the reservation (the bytes were served from memory)."""
        if meta.pack:
            self.packs.installed(meta.pack)
            try:
                self.commit(bid, meta)
            except BaseException:
                self.packs.free(meta.pack, meta.offset, meta.length)
                raise
            self.packs.rolled_over(meta.pack)
            return
        if self._removed.get(bid, 0) > written.removals or written.removals < self._forgotten:
            raise OSError(errno.ESTALE, "the block was removed while it was being written")
        st = os.stat(self.object_path(meta.obj), follow_symlinks=False)
        if st.st_ino != written.ino or not stat.S_ISREG(st.st_mode) or st.st_size != meta.size:
            raise OSError(errno.ESTALE, "its object's file was replaced while the block was being written")
        self.commit(bid, meta, st)
