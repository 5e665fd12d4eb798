"""Pack files: the small blocks of the store, appended at aligned offsets to shared files.

A block under :data:`PACK_BELOW` bytes goes to the current pack (``packs/<n>``) at the next offset
aligned to :data:`ALIGN`; the range is the writer's alone, so writers never wait for each other's
bytes. An evicted block's range is punched out (its disk space freed at once), and a pack that holds no
block any more, and is not being written, is deleted. Packing is used only where the file system can
punch holes (:meth:`Packs.can_punch`); elsewhere every block gets a file.

Why packs: a small block in a file of its own costs a file creation and a rename to fill, and an open,
a directory block and an inode to read when the kernel's caches are cold; in a pack it costs one
``pwrite`` and one ``pread`` on a file whose inode stays in memory.

Owned by :class:`epochfs.blockstore.store.BlockStore`, which keeps the index; this room keeps the packs'
counts and write position. Concurrency: :meth:`Packs.write` runs in worker threads; the counts and the
write position are shared with them under one lock. Read descriptors and deletions belong to the trio
thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable

from epochfs.blockstore.descriptors import Descriptors
from epochfs.transport.buffers import ALIGN

log = logging.getLogger(__name__)

PACK_BELOW = 1 << 20  # blocks smaller than this go to pack files
PACK_SIZE = 64 << 20  # a pack file takes blocks until this long, then the next one is started
MAX_PACK = 0xFFFFFFFE  # pack numbers are 1 to this (an index entry holds 32 bits)
# ALIGN (O_DIRECT: buffer address, file offset and length aligned to the device's block size): packed
# blocks start at multiples of it too (a punched hole frees whole pages).
_PACK_FDS = 64  # pack files kept open for reads
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the disk space of [offset, offset + length) of a file, keeping its size (reads give zeros)."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def padded(n: int) -> int:
    """``n`` rounded up to the alignment."""
    return -(-n // ALIGN) * ALIGN


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def pack_name(pack: int) -> str:
    """The file name of pack ``pack`` under ``packs/``."""
    return f"{pack:08x}"


def discard(path: str) -> None:
    """Remove what is at ``path`` in the cache directory (a file, a link, or a directory that should
    not be there); a failure is logged, never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.EPERM) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            log.warning("could not remove %s: %s", path, exc)


class Packs:
    """The pack files under ``directory``: which hold indexed blocks (``live``) and blocks being
    written (``pending``), where the next block goes, and the read descriptors kept open."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.enabled = False  # the file system can punch holes (set when the store opens)
        self._lock = threading.Lock()
        self.live: dict[int, int] = {}  # pack -> indexed blocks in it
        self.pending: dict[int, int] = {}  # pack -> blocks written to it, not yet indexed
        self._write_pack = 0  # the pack new blocks go to (0: none yet)
        self._write_off = 0
        self._last = 0  # the newest pack a block was installed in (to notice when it rolls over)
        self._fds: Descriptors[int] = Descriptors(self._open_pack, _PACK_FDS)
        # pack -> [descriptor, writes using it]: the packs being written keep one write descriptor
        # (made when the pack is created), closed once the pack is no longer the current one and its
        # last write ended. A pack with a write running is never deleted (it has a pending block).
        self._writers: dict[int, list[int]] = {}
        self._closed = False

    def path(self, pack: int) -> str:
        return f"{self.directory}/{pack_name(pack)}"

    @staticmethod
    def can_punch(scratch_dir: str) -> bool:
        """Whether the file system of ``scratch_dir`` punches holes (probed with a file there)."""
        probe = f"{scratch_dir}/punch-probe"
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, bytes(2 * ALIGN), 0)
            punch_hole(fd, 0, ALIGN)
            return True
        except OSError as exc:
            log.info("the cache file system cannot punch holes (%s): one file per block", exc)
            return False
        finally:
            os.close(fd)
            os.unlink(probe)

    def on_disk(self, stray: Callable[[str], None]) -> list[int]:
        """The packs in the directory; anything else there (another name, a link, a directory) is not
        ours and goes to ``stray``."""
        packs = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    pack = int(entry.name, 16)
                except ValueError:
                    pack = 0
                if 0 < pack <= MAX_PACK and entry.name == pack_name(pack) and entry.is_file(follow_symlinks=False):
                    packs.append(pack)
                else:
                    stray(entry.path)
        return packs

    def start_after(self, packs: Iterable[int]) -> None:
        """The next block starts a new pack, numbered past ``packs`` (those on disk) and every pack an
        indexed block is in: an entry whose pack is gone must not come to point into a new one."""
        self._write_pack = max([*packs, *self.live], default=0)
        self._write_off = PACK_SIZE

    def counted(self, pack: int) -> None:
        """An indexed block found in ``pack`` when the index is loaded."""
        self.live[pack] = self.live.get(pack, 0) + 1

    def clear(self) -> None:
        """The index was discarded with the blocks: no pack holds one."""
        self.live.clear()

    # -- reads (trio thread) -----------------------------------------------------------------------------

    def fd(self, pack: int) -> int:
        """A descriptor of a pack, kept open for the next reads (:class:`Descriptors`)."""
        return self._fds.get(pack)

    def _open_pack(self, pack: int) -> int:
        fd = os.open(self.path(pack), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # blocks are read whole: no readahead past them
        return fd

    def own_fd(self, pack: int) -> int:
        """A read descriptor of a pack for a worker thread (never one the trio thread may close); the
        caller closes it."""
        return os.open(self.path(pack), _READ_FLAGS)

    def close_fds(self) -> None:
        self._fds.close()

    # -- writes -------------------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray) -> tuple[int, int]:
        """Append a block to the current pack (starting a new one when it is full) at an aligned offset
        (worker thread): (pack, offset). Raises OSError, and then leaves the range punched out and
        uncounted."""
        size = padded(len(data))
        retired: list[int] = []
        with self._lock:
            if self._closed:  # a fill abandoned at shutdown, finishing after close(): nothing lands
                raise OSError(errno.ESHUTDOWN, "the block store is closed")
            if self._write_off + size > PACK_SIZE:
                old = self._write_pack
                self._write_pack, self._write_off = self._new_pack(), 0
                retired = self._retire(old)
            pack, offset = self._write_pack, self._write_off
            self._write_off += size
            self.pending[pack] = self.pending.get(pack, 0) + 1
            writer = self._writers[pack]  # (the current pack's, kept since _new_pack made it)
            writer[1] += 1
        _close_all(retired)
        fd = writer[0]
        try:
            try:
                view, at = memoryview(data), offset
                while view:
                    n = os.pwrite(fd, view, at)
                    view, at = view[n:], at + n
            except BaseException:
                punch_hole(fd, offset, size)
                raise
        except BaseException:
            with self._lock:
                self.pending[pack] -= 1
                retired = self._write_ended(pack)
            _close_all(retired)
            raise
        with self._lock:
            retired = self._write_ended(pack)
        _close_all(retired)
        return pack, offset

    def _write_ended(self, pack: int) -> list[int]:
        """(Under the lock) a write to ``pack`` ended: the descriptors to close now."""
        self._writers[pack][1] -= 1
        return self._retire(pack) if pack != self._write_pack or self._closed else []

    def _retire(self, pack: int) -> list[int]:
        """(Under the lock) ``pack`` is no longer written to: its write descriptor, to be closed, once
        no write uses it (else the last write's end retires it)."""
        writer = self._writers.get(pack)
        if writer is None or writer[1] > 0:
            return []
        del self._writers[pack]
        return [writer[0]]

    def _new_pack(self) -> int:
        """Create the pack after the current one (under the lock): the next number that no pack on disk
        or in the index has, from 1 again after :data:`MAX_PACK`."""
        pack = self._write_pack
        for _ in range(64):
            pack = pack + 1 if pack < MAX_PACK else 1
            if pack in self.live or pack in self.pending:
                continue
            try:
                fd = os.open(self.path(pack), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600)
            except FileExistsError:
                continue
            self._writers[pack] = [fd, 0]
            return pack
        raise OSError(errno.EEXIST, "no free pack number after the current one")

    def installed(self, pack: int) -> None:
        """A block written to ``pack`` is indexed now (trio thread)."""
        with self._lock:
            self.pending[pack] -= 1
            self.live[pack] = self.live.get(pack, 0) + 1

    def rolled_over(self, pack: int) -> None:
        """A block was installed in ``pack``: when that is a newer pack than the last one, the last one
        may hold nothing any more."""
        if pack != self._last:
            self.drop_if_empty(self._last)
            self._last = pack

    def free(self, pack: int, offset: int, length: int, *, indexed: bool = True) -> None:
        """A block leaves its pack (trio thread), counted out of the pack's indexed blocks (or, not
        ``indexed``, of those being written): its range is punched out; the pack is deleted once no
        block is in it or being written to it."""
        counts = self.live if indexed else self.pending
        with self._lock:
            counts[pack] = counts.get(pack, 0) - 1
            if self._closed:
                return  # (a write abandoned at shutdown: the store was closed unclean, see close())
        try:
            punch_hole(self.fd(pack), offset, padded(length))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("could not free the space of a block in pack %08x: %s", pack, exc)
        self.drop_if_empty(pack)

    def drop_if_empty(self, pack: int) -> None:
        with self._lock:
            if (not pack or pack == self._write_pack or self.live.get(pack, 0) > 0
                    or self.pending.get(pack, 0) > 0):
                return
            self.live.pop(pack, None)
            self.pending.pop(pack, None)
        self._fds.forget(pack)
        discard(self.path(pack))

    def free_unreferenced(self, used: dict[int, list[tuple[int, int]]]) -> None:
        """Punch out every range of the packs in ``used`` that none of its (offset, length) refers to
        (blocks written but never indexed before a crash)."""
        for pack, blocks in used.items():
            try:
                fd = os.open(self.path(pack), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                at, size = 0, os.fstat(fd).st_size
                for lo, hi in sorted((o, o + padded(n)) for o, n in blocks) + [(size, size)]:
                    if lo > at:
                        punch_hole(fd, at, lo - at)
                    at = max(at, hi)
            except OSError as exc:
                log.warning("could not free unused space of pack %08x: %s", pack, exc)
            finally:
                os.close(fd)

    def close(self) -> bool:
        """Stop writing (a write that finishes later lands nothing) and close the descriptors; whether
        every block written is indexed (else the store was not shut down consistent)."""
        with self._lock:  # (a write that takes the lock after this finds the store closed, never pack 0)
            pack, self._write_pack = self._write_pack, 0
            self._closed = True
            retired = self._retire(pack)
        _close_all(retired)
        self.drop_if_empty(pack)
        with self._lock:
            # A packed write still running (a fill abandoned at shutdown) may land in a pack unindexed:
            # then the next start reconciles, which frees the ranges no entry refers to.
            settled = not any(n > 0 for n in self.pending.values())
        self.close_fds()
        return settled
