"""The on-disk block store: the cache directory's life cycle, reads and fills, and the byte budget.

It owns the directory (its lock, the clean marker, ``tmp/``), the admission of blocks against the
bound (``--cache-size`` and the disk's free space, with the eviction policy), reads of resident blocks
(verified chunk by chunk) and fills (written in worker threads, installed on the trio thread). Its
rooms: the index (:mod:`.index`), the objects' files (:mod:`.objects`), the small blocks' pack files
(:mod:`.packs`), the entry format and checksums (:mod:`.format`), the write path (:mod:`.writes`), what
the kernel's reads of cached files need (:mod:`.lending`), how much it may hold (:mod:`.room`), and
recovery after an unclean shutdown and ``fsck`` (:mod:`.recovery`).

Layout under the cache directory::

    lock                 flock held by the one daemon that owns this directory
    clean                present while no daemon runs, if the last one shut down cleanly
    blocks/ab/<id>       one file per object version, its blocks at their own offsets, holes where a
                         block is not cached, named by its first block's id (see :mod:`.objects`)
    packs/<n>            small objects' blocks where the kernel does not read the cache itself, at
                         4 KiB-aligned offsets (see :mod:`.packs`)
    tmp/                 emptied at start-up
    index/               LMDB: block id -> (sequence, length, pack or object file, offset, xxh3-64 per
                         64 KiB chunk); object id -> the fingerprint of its whole file

Concurrency contract: every method except :meth:`BlockStore.write_temp` and :meth:`BlockStore.pread_range`
runs on the trio thread, so the index, the byte accounting and the policy are never touched
concurrently. ``write_temp`` runs in a worker thread and only writes the block's range of its object's
file (or of a pack); it is indexed by :meth:`BlockStore.install` on the trio thread, which first makes
sure the range is still the one written (the file was not replaced, the block not removed meanwhile).
``pread_range`` only reads; its bytes are verified by :meth:`BlockStore.finish_read` on the trio thread.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from epochfs.blockstore import pagecache, recovery
from epochfs.blockstore.content import alone
from epochfs.blockstore.descriptors import Descriptors
from epochfs.blockstore.format import BlockMeta, missing, verify, where
from epochfs.blockstore.index import Index, OtherFormat
from epochfs.blockstore.keys import block_relpath, chunk_span
from epochfs.blockstore.lending import Lending
from epochfs.blockstore.objects import ObjectFiles, Print
from epochfs.blockstore.packs import Packs, discard, punch_hole
from epochfs.blockstore.room import Room
from epochfs.blockstore.writes import Writes, boot_id
from epochfs.core.errors import CacheUnreadable, ConfigError
from epochfs.core.private import open_private, private_dir, private_subdir, touch_private
from epochfs.eviction import EvictionPolicy, make_room

log = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_BLOCK_FDS = 64  # object files kept open for the trio thread's reads
_REMOVALS_KEPT = 4096  # recent removals remembered, for fills written before them (see install)
WOULD_BLOCK = object()  # BlockStore.read(nowait=True): the bytes are on disk, not in memory


@dataclass(frozen=True)
class StoreStats:
    used_bytes: int
    capacity_bytes: int  # what it can hold now: --cache-size, or less where the disk holds less
    configured_bytes: int  # --cache-size
    blocks: int
    evictions: int
    corrupt_blocks: int
    fill_errors: int
    read_errors: int
    not_admitted: int
    pinned_bytes: int
    advice_dropped: int = 0  # read-ahead advice the adviser's queue had no room for (a hint let go)
    object_files: int = 0
    whole_objects: int = 0  # object files that hold every block of their object
    whole_bytes: int = 0
    unchecked_objects: int = 0  # whole, waiting to be hashed before the kernel may read them
    lent_objects: int = 0  # with a backing file open in the kernel


class CacheLocked(ConfigError):
    """Another process owns the cache directory."""


class BlockStore(Lending, Writes, Room):
    def __init__(self, cache_dir: Path, capacity: int, free_space_ratio: float, policy: EvictionPolicy):
        self.cache_dir = Path(cache_dir)
        self.capacity = capacity  # --cache-size
        self.limit: int | None = None  # less, while the node's mounts split one capacity (cache/nodeshare.py)
        self.linked: dict[bytes, int] = {}  # objects linked from another store of the node -> size (not charged)
        self.linked_bytes = 0
        self.free_space_ratio = free_space_ratio
        self.policy = policy
        self.blocks_dir = self.cache_dir / "blocks"
        self.tmp_dir = self.cache_dir / "tmp"
        self.index_dir = self.cache_dir / "index"
        self.packs_dir = self.cache_dir / "packs"
        self._blocks, self._tmp, self._packs = str(self.blocks_dir), str(self.tmp_dir), str(self.packs_dir)
        self._dirs: set[str] = set()  # block subdirectories known to exist
        self.used = 0
        self.pending = 0
        self.pinned = 0  # written data not yet uploaded (write-back): never evicted
        self._count = 0
        self._seq = 0
        self._evictions = 0
        self._corrupt = 0
        self._fill_errors = 0
        self._read_errors = 0
        self._not_admitted = 0
        self._lock_fd: int | None = None
        self._consistent = False  # the index and the block files agree (checked or shut down cleanly)
        self._nowait_works = True
        self._direct_works = True
        self.index = Index(self.index_dir)  # block id -> entry (blockstore/index.py)
        self.packs = Packs(self._packs)  # the small blocks' files (blockstore/packs.py)
        self._block_fds: Descriptors[bytes] = Descriptors(self._open_block, _BLOCK_FDS)  # by object id
        self.objects = ObjectFiles()  # what is known of each object's file (blockstore/objects.py)
        self._removals = 0  # blocks removed so far
        self._removed: OrderedDict[bytes, int] = OrderedDict()  # block id -> removals when it was removed
        self._forgotten = 0  # the newest removal no longer in _removed
        self.digests = False  # hash each block at fill (BLAKE3): set where the node serves other members
        self._sending: dict[bytes, int] = {}  # block id -> its ranges being sent by the kernel (extent)
        self._after_send: dict[bytes, BlockMeta] = {}  # removed while sent: let go of at the last
        self._writing = 0  # writes into object files in progress (worker threads, under _write_lock)
        self._write_lock = threading.Lock()
        self._closed = False  # no write starts once closed
        self.adviser = pagecache.Adviser()  # (read-ahead advice, off the trio thread)
        self._inspect = False  # open(inspect=True): nothing in the directory is changed
        self.malformed = 0  # malformed index entries found when loaded (dropped unless inspecting)
        self.strays: set[str] = set()  # entries in blocks/ or packs/ that are not ours (removed unless inspecting)

    # -- life cycle ------------------------------------------------------------------------------------

    def open(self, reconcile: bool = True, inspect: bool = False) -> None:
        """Lock the directory, clear leftovers of interrupted fills, open and load the index. After an
        unclean shutdown, also reconcile the index with the block files (unless ``reconcile`` is False:
        ``fsck`` reports the differences instead).

        ``inspect`` (``fsck`` without ``--repair``): change nothing in the directory. An index that
        cannot be used raises :class:`ConfigError` instead of being discarded; malformed entries and
        entries that do not belong in ``blocks/`` or ``packs/`` are counted (:attr:`malformed`,
        :attr:`strays`), not removed."""
        self._inspect = inspect
        self._closed = False
        private_dir(self.cache_dir)
        self._lock()
        for name in ("blocks", "tmp", "index", "packs"):
            private_subdir(self.cache_dir, name)
        if not inspect:
            shutil.rmtree(self.tmp_dir)
            private_subdir(self.cache_dir, "tmp")
        with os.scandir(self._blocks) as entries:  # block subdirectories; nothing else belongs there
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    self.stray(entry.path)
        clean = self.cache_dir / "clean"
        self._consistent = os.path.lexists(clean)
        if self._consistent and not inspect:
            clean.unlink()
        try:
            known = self._open_index()
        except lmdb.Error as exc:
            why = "is of another version" if isinstance(exc, OtherFormat) else "is damaged"
            if inspect:
                self.close()
                raise ConfigError(f"cache index in {self.index_dir} {why} ({exc}): a mount (or fsck --repair) "
                                  "discards it with the cached blocks and starts empty; nothing was changed") from None
            log.warning("cache index in %s %s (%s); discarding the cached blocks", self.index_dir, why, exc)
            self._reset()
            known = self._open_index()
        self.packs.enabled = not inspect and Packs.can_punch(self._tmp)
        if not self._consistent and reconcile:
            recovery.reconcile(self, known)
            self._consistent = True
        on_disk = self.packs.on_disk(self.stray)
        for pack in on_disk:
            if reconcile and pack not in self.packs.live:  # no indexed block (all evicted, or none indexed)
                discard(self.packs.path(pack))
        self.packs.start_after(on_disk)

    @property
    def packing(self) -> bool:
        """Whether small blocks go to packs (the file system punches holes)."""
        return self.packs.enabled

    @packing.setter
    def packing(self, value: bool) -> None:
        self.packs.enabled = value

    def stray(self, path: str) -> None:
        """Something that does not belong where it is in the cache directory: counted, and removed
        unless inspecting."""
        self.strays.add(path)
        if not self._inspect:
            discard(path)

    def close(self) -> None:
        self._block_fds.close()
        if self.index.is_open:
            for bid, meta in self._after_send.items():  # (a send still running reads what its fd holds)
                self._let_go(bid, meta)
            self._after_send.clear()
            with self._write_lock:  # (a fill still writing may leave a range no entry knows: reconciled)
                writing, self._closed = self._writing, True
            self._consistent = self.packs.close() and not writing and self._consistent
            self.index.close(sync=not self._inspect)
            if self._consistent and not self._inspect:
                touch_private(self.cache_dir / "clean")
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _lock(self) -> None:
        fd = open_private(self.cache_dir / "lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CacheLocked(
                f"cache directory {self.cache_dir} is in use by pid {owner}; "
                "use another --cache-dir or unmount the other mount first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _open_index(self) -> dict[bytes, BlockMeta]:
        """Open the index and load it into the policy; return block id -> entry."""
        loaded, bad = self.index.open(readonly=self._inspect)
        self.malformed = len(bad)
        boot = boot_id()
        # Fingerprints are trusted after a clean stop, or a death in this same boot (what was written is
        # in the page cache); after a machine's crash a file's bytes may not be what its inode says.
        trusted = self._consistent or bool(boot) and self.index.boot == boot
        if not self._inspect:
            self.index.mark(drop=bad, boot=boot)
            for key in bad:  # and their files, if the key can name one
                if len(key) == 16:
                    discard(f"{self._blocks}/{block_relpath(key)}")
            if bad:
                log.warning("dropped %d malformed cache index entries and their files", len(bad))
        for seq, bid, meta in loaded:
            self.policy.inserted(bid, meta.length)
            self.used += meta.length
            self._seq = max(self._seq, seq)
            if meta.pack:
                self.packs.counted(meta.pack)
            else:
                self.objects.added(meta.obj, bid, meta.offset, meta.length, meta.size)
        stale = self.objects.load_prints(self.index.prints(), trusted)
        if stale and not self._inspect:
            for oid in stale:
                self.index.set_print(oid, None)
        self._count = len(loaded)
        log.info("cache %s: %d blocks, %d bytes of %d", self.cache_dir, self._count, self.used, self.capacity)
        return {bid: meta for _, bid, meta in loaded}

    def _reset(self) -> None:
        self._block_fds.close()
        self.index.close(sync=False)
        shutil.rmtree(self.index_dir, ignore_errors=True)
        shutil.rmtree(self.blocks_dir, ignore_errors=True)
        shutil.rmtree(self.packs_dir, ignore_errors=True)
        self.packs.clear()
        self.objects = ObjectFiles()
        self._dirs.clear()
        private_subdir(self.cache_dir, "index")
        private_subdir(self.cache_dir, "blocks")
        private_subdir(self.cache_dir, "packs")
        self.used = self._count = self._seq = 0

    # -- reads -----------------------------------------------------------------------------------------

    def lookup(self, bid: bytes) -> BlockMeta | None:
        return self.index.get(bid)

    def read(self, bid: bytes, meta: BlockMeta, lo: int, hi: int, nowait: bool = False) -> Any:
        """Bytes [lo, hi) of a resident block, verified, as a memoryview; None (and the block dropped)
        if it is damaged. With ``nowait``, :data:`WOULD_BLOCK` when the bytes are not in memory (the
        caller then reads them with :meth:`pread_range` in a worker thread and hands them to
        :meth:`finish_read`), so the event loop never waits for the disk."""
        start, end = chunk_span(lo, hi, meta.length)
        try:
            data = self._pread(bid, meta, start, end, nowait)
        except BlockingIOError:
            return WOULD_BLOCK
        except OSError as exc:
            data = exc
        if data is None:
            return WOULD_BLOCK
        return self.finish_read(bid, meta, lo, hi, data)

    def pread_range(self, bid: bytes, meta: BlockMeta, lo: int, hi: int) -> bytes | OSError:
        """The raw chunks covering [lo, hi), unverified (worker thread: no state is touched; a packed
        block is read through a descriptor of its own, never one the trio thread may close)."""
        start, end = chunk_span(lo, hi, meta.length)
        try:
            data = self._pread(bid, meta, start, end, False, shared=False)
        except OSError as exc:
            return exc
        assert data is not None
        return data

    def finish_read(self, bid: bytes, meta: BlockMeta, lo: int, hi: int, data: bytes | bytearray | OSError
                    ) -> memoryview | None:
        """Verify what :meth:`pread_range` read; drop the block if it is damaged (a missing file, a
        wrong length or a checksum mismatch). Any other read error (EMFILE, EIO, ENOMEM) says nothing
        about the block: it raises :class:`CacheUnreadable` and the block stays."""
        start, _ = chunk_span(lo, hi, meta.length)
        if isinstance(data, OSError) and not missing(data):
            self._read_errors += 1
            raise CacheUnreadable(f"cannot read cached block {bid.hex()}: {data.strerror or data}")
        why = self.verify(bid, meta, lo, hi, data)
        if why:
            return self.drop_corrupt(bid, meta, why)
        self.policy.accessed(bid)
        assert not isinstance(data, OSError)
        return memoryview(data)[lo - start:hi - start]

    def advise(self, bid: bytes, meta: BlockMeta, lo: int = 0, hi: int | None = None) -> None:
        """Ask the kernel to start reading bytes [lo, hi) of a resident block (default: all of it; whole
        checksum chunks) into memory: a reader comes next (trio thread). The advice is made on the
        adviser's thread, which opens the block file itself unless the trio thread holds it open: both
        the open (after the page cache was dropped, half as dear as the advice) and the advice wait for
        the disk (warm 512 MiB stream, 4 paired runs: 1.17x the rate with the advice moved), and the
        reader's own open then finds the file's inode in memory."""
        hi = meta.length if hi is None else min(hi, meta.length)
        if lo >= hi:
            return
        start, end = chunk_span(lo, hi, meta.length)
        try:
            if meta.pack:
                self.adviser.advise(self.packs.fd(meta.pack), meta.offset + start, end - start)
            elif (fd := self._block_fds.peek(meta.obj)) is not None:
                self.adviser.advise(fd, meta.offset + start, end - start)
            else:  # (opened by the adviser: the reader's open then finds the inode in memory)
                self.adviser.advise_path(self.object_path(meta.obj), meta.offset + start, end - start)
        except OSError:
            return

    def _pread(self, bid: bytes, meta: BlockMeta, start: int, end: int, nowait: bool,
               shared: bool = True) -> bytes | bytearray | None:
        if meta.pack:
            at = meta.offset
            fd = self.packs.fd(meta.pack) if shared else self.packs.own_fd(meta.pack)
        else:
            at = meta.offset
            fd = self._block_fds.get(meta.obj) if shared else self._open_block(meta.obj)
        try:
            if nowait and pagecache.available():
                if pagecache.resident(fd, at + start, end - start) is False:
                    return None  # (a worker thread reads it; asking the kernel to try would start the read here)
            elif nowait and self._nowait_works:
                buf = bytearray(end - start)
                try:
                    n = os.preadv(fd, [buf], at + start, os.RWF_NOWAIT)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    # Some file systems (tmpfs, some network ones) cannot say "not in memory":
                    # read normally from now on.
                    log.info("the cache file system does not support RWF_NOWAIT (%s); reading inline", exc)
                    self._nowait_works = False
                else:
                    return buf if n == len(buf) else None
            return os.pread(fd, end - start, at + start)
        finally:
            if not shared:
                os.close(fd)

    def _open_block(self, oid: bytes) -> int:
        return os.open(self.object_path(oid), _READ_FLAGS)

    def object_path(self, oid: bytes) -> str:
        """The file of object ``oid``'s blocks."""
        return f"{self._blocks}/{block_relpath(oid)}"

    verify = staticmethod(verify)

    def fsck(self, repair: bool) -> dict[str, int]:
        """See :func:`epochfs.blockstore.recovery.fsck`; after a repair the directory is consistent."""
        found = recovery.fsck(self, repair)
        self._consistent = self._consistent or repair
        return found

    @property
    def inspecting(self) -> bool:
        """Opened to inspect (``fsck`` without ``--repair``): nothing in the directory is changed."""
        return self._inspect

    def drop_corrupt(self, bid: bytes, meta: BlockMeta, why: str) -> None:
        """Drop a damaged block (counted as corrupt); the next read fetches it again."""
        log.warning("cache block %s is damaged (%s); dropping it", bid.hex(), why)
        self._corrupt += 1
        if meta.in_file and (f := self.objects.get(meta.obj)) is not None:
            f.tainted = True  # (what else changed in its file is not known: hashed before it is lent)
        self.remove(bid, meta.length)
        return None

    # -- fills and eviction ----------------------------------------------------------------------------

    def pin(self, nbytes: int) -> bool:
        """Room for ``nbytes`` of written data that may not be evicted (write-back, until uploaded):
        cached blocks are evicted for it, as the policy orders them. False when even that is not enough.
        Bound by ``--cache-size`` only: what a job writes is never refused for the node's split (the
        split counts it, and the mount's cached blocks give way to it)."""
        bound = self.capacity
        if self.used + self.pending + self.pinned + nbytes > bound and \
                self.pending + self.pinned + nbytes > bound:
            return False
        while not self.has_room(nbytes, bound):
            victim = self.policy.victim()
            if victim is None:
                return False
            self._evict(victim)
        self.pinned += nbytes
        return True

    def unpin(self, nbytes: int) -> None:
        self.pinned = max(0, self.pinned - nbytes)

    def hold(self, nbytes: int) -> None:
        """Pin ``nbytes`` even past the capacity: written data admitted before a restart."""
        self.pinned += nbytes

    def would_admit(self, bid: bytes, nbytes: int) -> bool:
        """Whether :meth:`reserve` would cache this block now (it may evict to do so). No side effects."""
        if nbytes > self.cap:
            return False
        if self.has_room(nbytes):
            return True
        victim = self.policy.victim()
        return victim is not None and self.policy.prefer(bid, victim)

    def reserve(self, bid: bytes, nbytes: int, in_use: bool = False, shared: bool = False) -> bool:
        """Make room for block ``bid`` of ``nbytes``, evicting what the policy gives up for it.

        False (and nothing evicted beyond what the policy chose) when the block should not or cannot be
        cached now: the caller then reads through. ``in_use``: a demand miss the reader is using now.
        ``shared``: a block of an object to be linked from another store of the node (no new byte on
        disk, not charged to this mount's part of the node: bound by ``--cache-size`` only).
        """
        bound = self.capacity if shared else self.cap
        if nbytes > bound or not make_room(self.policy, bid, lambda: self.has_room(nbytes, bound), self._evict,
                                           in_use):
            self._not_admitted += 1
            return False
        self.pending += nbytes
        return True

    def _evict(self, bid: bytes) -> None:
        meta = self.lookup(bid)
        self.remove(bid, meta.length if meta else 0)
        self._evictions += 1

    def release(self, nbytes: int, failed: bool = True) -> None:
        """Give back a reservation that will not be filled (``failed``: because writing it failed)."""
        self.pending -= nbytes
        self._fill_errors += failed

    def commit(self, bid: bytes, meta: BlockMeta, st: os.stat_result | None = None) -> None:
        """Index a block whose bytes are in place, consuming its reservation; an object whose last block
        this is takes its fingerprint from ``st`` (its file as it is after the write)."""
        self._seq += 1
        self.index.put(bid, meta._replace(seq=self._seq))
        self.pending -= meta.length
        self.used += meta.length
        self._count += 1
        if meta.in_file:
            f = self.objects.added(meta.obj, bid, meta.offset, meta.length, meta.size)
            if not f.held:  # (a block refetched into a file the kernel reads is not evictable while it is)
                self.policy.inserted(bid, meta.length)
            if f.whole and not f.held:
                fp = Print.of(st) if st is not None and not f.tainted else None
                self.objects.became_whole(meta.obj, fp)
                if fp is not None:
                    self.index.set_print(meta.obj, fp.encode())
            return
        self.policy.inserted(bid, meta.length)

    def remove(self, bid: bytes, length: int) -> None:
        existed, meta = self.index.pop(bid)
        self._removal(bid)
        if meta is not None and meta.in_file:
            f = self.objects.get(meta.obj)
            had_print = f is not None and f.print is not None
            self.objects.removed(meta.obj, meta.offset, meta.length)
            if had_print:
                self.index.set_print(meta.obj, None)
        if meta is None:  # (a malformed entry: its id may name a file)
            self._unlink_object(bid)
        elif bid in self._sending:  # (the kernel sends its range to a member: let go of it after)
            self._after_send[bid] = meta
        else:
            self._let_go(bid, meta)
        if existed:
            self.used -= length
            self._count -= 1
        self.policy.removed(bid)

    def _removal(self, bid: bytes) -> None:
        """Count a removal of ``bid``'s bytes: a write of it that began before is not indexed (install)."""
        self._removals += 1
        self._removed[bid] = self._removals
        if len(self._removed) > _REMOVALS_KEPT:
            self._forgotten = self._removed.popitem(last=False)[1]

    def _let_go(self, bid: bytes, meta: BlockMeta) -> None:
        """Free the disk range of a block no longer indexed: its pack range, or its range of its object's
        file (after the kernel's last read of a file it has open; unless the block was indexed again),
        or the file once it holds no block."""
        if meta.pack:
            self.packs.free(meta.pack, meta.offset, meta.length)
            return
        f = self.objects.get(meta.obj)
        if f is not None and f.held:
            f.deferred.append((bid, meta.offset, meta.length))  # (a hole would read as zeros now)
        elif f is None or not f.have:
            self._unlink_object(meta.obj)
        elif f.blocks.get(meta.offset) is None and not f.dropping:
            self._punch(meta.obj, meta.offset, meta.length)

    def _punch(self, oid: bytes, offset: int, length: int) -> None:
        shared = False
        try:
            fd = os.open(self.object_path(oid), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                shared = not alone(fd)  # (another store of the node links it: never punched)
                if not shared:
                    punch_hole(fd, offset, length)
            finally:
                os.close(fd)
        except OSError as exc:
            if not missing(exc):
                log.warning("could not free a cached block's range of %s: %s", oid.hex(), exc)
        if shared:
            self._drop_shared(oid)

    def _drop_shared(self, oid: bytes) -> None:
        """An object whose file another store of the node links too (:mod:`epochfs.cache.shared`) loses a
        block: all its blocks leave this store and its name here goes, no byte of it is punched (the
        other store's name keeps them)."""
        f = self.objects.get(oid)
        if f is not None and not f.dropping:
            f.dropping = True
            for offset, bid in list(f.blocks.items()):
                meta = self.index.get(bid)
                self.remove(bid, meta.length if meta is not None else f.length(offset))
        if self.objects.get(oid) is None or not self.objects.files[oid].have:
            self._unlink_object(oid)

    def _unlink_object(self, oid: bytes) -> None:
        self.alone_now(oid)
        self._block_fds.forget(oid)
        self.objects.forget(oid)
        discard(self.object_path(oid))

    def block_location(self, bid: bytes) -> tuple[Path, int, int] | None:
        """Where a cached block's bytes are: (file, offset, length); None if it is not cached."""
        return where(self.cache_dir, bid, self.lookup(bid))

    def statistics(self) -> StoreStats:
        return StoreStats(
            used_bytes=self.used,
            capacity_bytes=self.bound(),
            configured_bytes=self.capacity,
            blocks=self._count,
            evictions=self._evictions,
            corrupt_blocks=self._corrupt,
            fill_errors=self._fill_errors,
            read_errors=self._read_errors,
            not_admitted=self._not_admitted,
            pinned_bytes=self.pinned,
            advice_dropped=self.adviser.dropped,
            object_files=len(self.objects),
            whole_objects=self.objects.whole(),
            whole_bytes=self.objects.whole_size,
            unchecked_objects=self.objects.unchecked(),
            lent_objects=self.objects.lent,
        )
