"""Checkpoint write-back: files written through the mount are saved at local-disk speed and uploaded in
the background. Concurrency contract: every method runs on the trio thread, except the uploads and
deletes themselves, which run in worker threads and touch no state.

**Writing.** A new file (``create``, or an existing object opened with ``O_TRUNC``) is a
:class:`~epochfs.writeback.tree.LocalFile` whose bytes go to a data file in the cache directory; its
journal record is written at once, with its creator's uid, gid and mode. Its bytes are pinned in the
block store (never evicted; cached blocks make room for them), and a write that cannot be pinned gets
ENOSPC (EDQUOT past ``--writeback-user-quota`` for its owner). ``close`` and ``fsync`` return as soon
as the bytes are in the data file (``fsync`` also makes it and the journal durable). A closed file reads
at local speed from its data file until it is uploaded.

**When a file is done.** Only the release of its last writable handle ends a write: a ``close()`` of one
descriptor (FLUSH) is not the end when the description is shared (a writer that forked, a ``dup``), so
a file whose writer is cut off after a child's close is still unfinished and is dropped at recovery,
never uploaded half-written. A file a write of which failed (no space, a disk error) is not a finished
file either: it stays readable here and is never uploaded (``sync`` says so and fails) until it is
written again from the start (``O_TRUNC``) or removed.

**Who may do what.** The kernel checks permissions against what the mount presents
(``default_permissions``): files and directories made here have their creator's uid, gid and mode, the
sticky bit works, and the owner (or root) may chmod and chown them; uploaded files keep their owner and
mode in the journal, the snapshot and the object's metadata.

**Uploading.** A file closed for ``SETTLE`` seconds (the time a write-then-rename needs) is uploaded
under its final key: whole, multipart and parallel for large files, capped by ``--upload-bandwidth``,
started only while no demand read waits for the backend. The object appears under its key only when
complete. A file changed, renamed or removed while it uploads has its upload cancelled, or, if the
upload finished first, the stale object deleted. A failed upload is retried with backoff; nothing is
lost meanwhile (the journal keeps it across restarts). Once uploaded, the file becomes an entry of the
object (``Stored``), its data file goes and its bytes are unpinned.

**Publishing.** Uploaded objects and deletes are published to the metadata store every
``PUBLISH_INTERVAL`` seconds (a new snapshot version: other nodes see them on refresh or poll); then
the overlay entries give way to the snapshot's.

What the mount does not do (it says so with an errno): modify an existing object in place (open it
with ``O_TRUNC`` to replace it: EOPNOTSUPP), rename an object that is already in the backend or a
directory that holds one (EXDEV: ``mv`` then copies), hard links, symlinks, special files (EPERM).
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import trio

from epochfs.backend.base import Backend
from epochfs.core.errors import EpochfsError, NoSpace, NotFound, Refused
from epochfs.core.records import MAX_OBJECT_SIZE
from epochfs.kernel.types import Backings
from epochfs.meta.nodes import File
from epochfs.writeback.giveway import GiveWay
from epochfs.writeback.journal import DirRecord, FileRecord, Journal
from epochfs.writeback.kernel import KernelWrites
from epochfs.writeback.owed import Owed, Pending, Room, WritebackStats
from epochfs.writeback.renames import Renames, check_key, path_in
from epochfs.writeback.tree import LocalDir, LocalFile, Node, Stored, Tree, parent_of
from epochfs.writeback.uploads import Keep, Publish, Uploads

log = logging.getLogger(__name__)




@dataclass
class Handle:
    file: LocalFile
    fd: int
    writable: bool
    backing_id: int = 0  # the kernel reads and writes its data file itself (:mod:`epochfs.writeback.kernel`)


@dataclass(frozen=True)
class WritebackSettings:
    """What write-back needs of the mount's options."""

    upload_bandwidth: float | None  # cap on all uploads together, bytes/s (None: none)
    upload_concurrency: int  # files uploaded at once
    user_quota: int | None  # bytes one owner may hold not yet uploaded (None: no quota)


class WriteBack(Renames):
    PUBLISH_INTERVAL = 2.0
    RETRY_MIN, RETRY_MAX = 1.0, 60.0  # backoff of a failed upload or delete

    def __init__(self, journal: Journal, store: Room, backend: Backend, tree: Tree, settings: WritebackSettings, *,
                 demand_waiting: Callable[[], bool], publish: Publish, keep: Keep | None = None,
                 kernel: Callable[[], Backings | None] | None = None) -> None:
        self.journal = journal
        self.tree = tree
        if tree.overlay is None:
            raise ValueError("write-back needs a tree with an overlay (Tree(namespace, Overlay()))")
        self.overlay = tree.overlay
        self.backend = backend
        self.owed = Owed(store, user_quota=settings.user_quota)
        self.give_way = GiveWay()  # (the uploads wait while a file is written fast)
        self.uploads = Uploads(self.owed, journal, backend, tree, self.overlay, bandwidth=settings.upload_bandwidth,
                               concurrency=settings.upload_concurrency, demand_waiting=demand_waiting,
                               publish=publish, fail=self._fail, keep=keep, give_way=self.give_way)
        self._handles: dict[int, Handle] = {}
        self._through_daemon: Counter[str] = Counter()  # file id -> its opens read and written through us
        self._daemon_inodes: Counter[int] = Counter()  # the same, by inode
        # The kernel writes files itself where it can (None: it never does, ``kernel`` not given).
        self.kernel = KernelWrites(kernel, self.owed, self.give_way.wrote) if kernel is not None else None
        if self.kernel is not None and settings.user_quota is not None:
            self.kernel.off("--writeback-user-quota is enforced write by write")

    # -- start-up -------------------------------------------------------------------------------------------

    def recover(self) -> None:
        """Take up what the journal owes: closed files (uploaded next), uploaded entries (published next),
        deletes. Files that were still being written when the daemon died are dropped."""
        owed = self.journal.load()
        files, uploaded, deletes = owed.files, owed.uploaded, owed.deletes
        for d in sorted(owed.dirs.values(), key=lambda d: d.path.count("/")):
            existing = self.tree.resolve(d.path)
            if existing is not None and not existing.is_dir:
                self.journal.drop_dir(d.path)  # a file took the name meanwhile (another node's)
                continue
            self._add_parents(d.path)
            self.overlay.put(LocalDir(self.overlay.new_inode(), d.path, d.mtime_ns, d.mode, d.uid, d.gid))
        for rec in files:
            path = self.journal.data_path(rec.id)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                size = -1
            if not rec.closed or size != rec.size:
                why = "was being written when the daemon stopped" if not rec.closed else "has lost its data"
                log.warning("dropping %r from the write-back journal: it %s", rec.key, why)
                self.journal.drop_file(rec.id)
                self.journal.remove_data(rec.id)
                continue
            self.owed.hold(rec.uid, rec.size)  # owed: pinned even past the capacity (it was admitted before)
            f = LocalFile(self.overlay.new_inode(), rec.key, rec.id, rec.size, rec.mtime_ns, rec.mode, rec.uid,
                          rec.gid, since=time.monotonic() - self.owed.SETTLE, closed=True, failed=rec.failed)
            self._add_parents(rec.key)
            self.overlay.put(f)
            self.owed.files[f.id] = f
        for key, obj in uploaded.items():
            self._add_parents(key)
            self.overlay.put(Stored(self.overlay.new_inode(), key, obj))
            self.owed.uploaded[key] = obj
        for key in deletes:
            self.overlay.hidden.add(key)
            self.owed.deletes[key] = 0.0
        self.owed.aborts = dict(owed.multipart)  # cut off by the crash: nobody will complete them
        for name in os.listdir(self.journal.data_dir):  # data files no record owns (a crash mid-create, or
            # after an upload, while its bytes were being kept in the cache)
            if name not in self.owed.files:
                self.journal.remove_data(name)
        if files or uploaded or deletes or self.owed.aborts:
            log.info("write-back: %d files to upload, %d uploads to publish, %d deletes, %d unfinished multipart "
                     "uploads to abort from the journal", len(self.owed.files), len(uploaded), len(deletes),
                     len(self.owed.aborts))

    def _add_parents(self, key: str) -> None:
        """Directories of a key that the snapshot does not have yet."""
        parent, _ = parent_of(key)
        missing = []
        while parent and self.tree.resolve(parent) is None:
            missing.append(parent)
            parent, _ = parent_of(parent)
        for path in reversed(missing):
            self.overlay.put(LocalDir(self.overlay.new_inode(), path, time.time_ns()))

    # -- the file system's operations ---------------------------------------------------------------------

    def node(self, inode: int) -> Node:
        try:
            return self.tree.node(inode)
        except KeyError:
            raise NotFound(f"inode {inode}") from None

    def _new_file(self, path: str, mode: int, uid: int, gid: int, inode: int | None = None) -> LocalFile:
        f = LocalFile(self.overlay.new_inode() if inode is None else inode, path, uuid.uuid4().hex, 0, time.time_ns(),
                      mode & 0o777, uid, gid)
        os.close(self.journal.open_data(f.id, os.O_RDWR | os.O_CREAT | os.O_EXCL))
        self.owed.files[f.id] = f
        self._save(f, closed=False)
        return f

    def _save(self, f: LocalFile, *, closed: bool) -> None:
        f.closed = closed
        self.journal.put_file(FileRecord(f.id, f.path, f.size, f.mtime_ns, f.mode, f.uid, f.gid, closed, time.time(),
                                         f.failed))

    def create(self, parent: Node, name: bytes, mode: int, uid: int, gid: int, *,
               kernel: bool = False) -> tuple[int, LocalFile]:
        """A new file (or an existing one replaced), open for writing: (handle, file). ``kernel``: the
        kernel may write it itself (:meth:`backing` says whether it does)."""
        path = path_in(parent, name)
        check_key(self.backend, path)
        existing = self.tree.resolve(path)
        if existing is not None and existing.is_dir:
            raise Refused(f"{path} is a directory", errno.EISDIR)
        if existing is not None and existing.written_here:
            return self.open(existing, os.O_WRONLY | os.O_TRUNC, kernel=kernel), existing
        f = self._new_file(path, mode, uid, gid)
        self._replace(path, f)
        return self._open_handle(f, writable=True, kernel=kernel), f

    def open(self, node: Node, flags: int, *, kernel: bool = False) -> int:
        """A handle on a file this node wrote (reading or writing), or on an existing object replaced
        (``O_TRUNC``). ``kernel``: as for :meth:`create`."""
        write = bool(flags & (os.O_WRONLY | os.O_RDWR))
        if node.written_here:
            if flags & os.O_TRUNC:
                self._truncate(node, 0)
            return self._open_handle(node, writable=write, kernel=kernel)
        if not node.in_backend:
            raise Refused(f"{node.path} is a directory", errno.EISDIR)
        if not write:
            raise Refused(f"{node.path} is read through the cache", errno.EINVAL)  # the adapter does this
        if not flags & os.O_TRUNC:
            raise Refused(f"{node.path}: an object in the backend can be replaced (open it with O_TRUNC), "
                          "not modified", errno.EOPNOTSUPP)
        return self._open_handle(self._replace_object(node), writable=True, kernel=kernel)

    def _replace_object(self, node: File | Stored) -> LocalFile:
        """An empty local file in place of an object (it keeps the inode number the kernel knows)."""
        mode = node.obj.mode & 0o777 if node.obj.mode is not None else 0o644
        f = self._new_file(node.path, mode, os.getuid(), os.getgid(), inode=node.inode)
        self._replace(node.path, f)
        return f

    def _replace(self, path: str, f: LocalFile) -> None:
        # An object already under that key stays what other nodes see until the new file's upload
        # replaces it; a delete of the key still pending is void (the upload overwrites the key).
        self._cancel_delete(path)
        self.overlay.hidden.discard(path)  # (unlinked before: the new file's object will be listed)
        self._add_parents(path)
        self.overlay.put(f)
        self.owed.touch()

    def _in_backend(self, path: str) -> bool:
        """Whether the backend holds (or is about to publish) an object under ``path``."""
        node = self.tree.namespace.resolve(path)
        return path in self.owed.uploaded or (node is not None and node.in_backend)

    def _delete_key(self, path: str) -> None:
        """The object under ``path`` is gone for this mount: hidden now, deleted in the backend next."""
        self.owed.uploaded.pop(path, None)
        self.overlay.hidden.add(path)
        self.journal.put_delete(path)
        self.owed.deletes[path] = 0.0
        self.owed.kick()

    def _cancel_delete(self, path: str) -> None:
        if self.owed.deletes.pop(path, None) is not None:
            self.journal.cancel_delete(path)

    def _open_handle(self, f: LocalFile, *, writable: bool, kernel: bool = False) -> int:
        fd = self.journal.open_data(f.id, os.O_RDWR if writable else os.O_RDONLY)
        backing = 0
        k = self.kernel
        if k is not None and (kernel or k.holds(f)) and not self._through_daemon[f.id]:
            try:
                backing = k.admit(f, writable, lambda: self.journal.open_data(f.id, os.O_RDWR))
            except BaseException:
                os.close(fd)
                raise
        if not backing:
            self._through_daemon[f.id] += 1
            self._daemon_inodes[f.inode] += 1
        if writable:
            f.writers += 1
            f.generation += 1
            self.owed.cancel_upload(f)
        self._handles[fd] = Handle(f, fd, writable, backing)
        return fd

    def holds(self, inode: int) -> str | None:
        """How the kernel reads ``inode`` through opens of a file made here still outstanding: "passed" (its
        data file as a backing file), "cached" (through the daemon), or None."""
        if self.kernel is not None and self.kernel.holds_inode(inode):
            return "passed"
        return "cached" if self._daemon_inodes[inode] else None

    def backing(self, fh: int) -> int:
        """The backing id of a handle the kernel reads and writes itself, or 0 (through the daemon)."""
        return self._handles[fh].backing_id

    def refresh(self, node: Node) -> None:
        """A file the kernel writes: its size and time as its data file has them now."""
        if self.kernel is not None and node.written_here:
            self.kernel.refresh(node)

    def write(self, fh: int, offset: int, data: bytes) -> int:
        h = self._handles[fh]
        if not h.writable:
            raise Refused("not open for writing", errno.EBADF)
        f = h.file
        end = offset + len(data)
        if end > MAX_OBJECT_SIZE:
            raise Refused("file too large", errno.EFBIG)
        old_size = f.size
        grow = max(0, end - old_size)
        if grow:
            self._reserve(f, grow)
        if f.closed:  # written again through a handle opened after its release
            self._save(f, closed=False)
        try:
            written = os.pwrite(fh, data, offset)
        except OSError as exc:
            self._unreserve(f, grow)
            self._fail(f, f"a write failed: {exc.strerror or exc}")
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(f"{f.path}: the cache disk is full") from None
            raise Refused(f"{f.path}: {exc.strerror or exc}", exc.errno or errno.EIO) from None
        reached = offset + written
        if grow and reached < end:  # a short write: only what was written counts
            self._unreserve(f, end - max(old_size, reached))
        f.size = max(old_size, reached)
        f.mtime_ns = time.time_ns()
        f.generation += 1
        self.give_way.wrote(written)
        return written

    def _reserve(self, f: LocalFile, size: int) -> None:
        """Pin ``size`` more bytes for ``f`` (its owner's quota, then the cache), or fail the file."""
        refused = self.owed.reserve(f, size)
        if refused is not None:
            why, error = refused
            self._fail(f, why)
            raise error

    def _unreserve(self, f: LocalFile, size: int) -> None:
        self.owed.unreserve(f.uid, size)

    def _fail(self, f: LocalFile, why: str) -> None:
        """A write of ``f`` failed: it is not a finished file and is never uploaded as it is."""
        if not f.failed:
            log.warning("%s will not be uploaded: %s (write it again from the start, or remove it)", f.path, why)
        f.failed = why
        f.generation += 1
        self.owed.cancel_upload(f)
        try:
            self._save(f, closed=f.closed)
        except EpochfsError as exc:  # (a full disk: the record stays "not closed", dropped at recovery)
            log.warning("could not record that %s failed: %s", f.path, exc)

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return os.pread(fh, size, offset)

    def truncate(self, node: Node, size: int) -> None:
        self.refresh(node)
        if node.in_backend and size == 0:
            self._replace_object(node)  # open(O_TRUNC) by a kernel that truncates before it opens
            return
        if not node.written_here:
            raise Refused(f"{node.path}: an object in the backend can be replaced, not truncated",
                          errno.EISDIR if node.is_dir else errno.EOPNOTSUPP)
        self._truncate(node, size)

    def _truncate(self, f: LocalFile, size: int) -> None:
        if size > f.size:
            self._reserve(f, size - f.size)
        else:
            self._unreserve(f, f.size - size)
        fd = self.journal.open_data(f.id, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        if self.kernel is not None:
            self.kernel.truncated(f, size)
        if size == 0:
            f.failed = ""  # written again from the start: what failed before is gone
        f.size, f.mtime_ns = size, time.time_ns()
        f.generation += 1
        self.owed.cancel_upload(f)
        self._save(f, closed=f.writers == 0)
        f.since = time.monotonic()

    def set_attrs(self, node: Node, *, mtime_ns: int | None = None, mode: int | None = None,
                  uid: int | None = None, gid: int | None = None) -> None:
        """chmod, chown and utimes of a file or directory made here (the kernel has checked that the
        caller may); objects and directories of the backend cannot change."""
        if node.made_here and node.is_dir:
            node.mtime_ns = mtime_ns if mtime_ns is not None else node.mtime_ns
            node.mode = mode & 0o1777 if mode is not None else node.mode if node.mode is not None else 0o755
            node.uid = uid if uid is not None else node.uid if node.uid is not None else os.getuid()
            node.gid = gid if gid is not None else node.gid if node.gid is not None else os.getgid()
            self._save_dir(node)
            return
        if not node.written_here:
            raise Refused(f"{node.path}: only files and directories made here can change", errno.EPERM)
        node.mtime_ns = mtime_ns if mtime_ns is not None else node.mtime_ns
        node.mode = mode & 0o777 if mode is not None else node.mode
        if uid is not None and uid != node.uid and self.owed.files.get(node.id) is node:
            self.owed.owe(node.uid, -node.size)  # what it owes moves to its new owner
            self.owed.owe(uid, node.size)
        node.uid = uid if uid is not None else node.uid
        node.gid = gid if gid is not None else node.gid
        if self.owed.files.get(node.id) is node:
            self._save(node, closed=node.closed)

    def _save_dir(self, d: LocalDir) -> None:
        if d.mode is not None and d.uid is not None and d.gid is not None:
            self.journal.put_dir(DirRecord(d.path, d.mode, d.uid, d.gid, d.mtime_ns))

    async def fsync(self, fh: int) -> None:
        """Make a written file's bytes and its journal record durable (worker thread)."""
        h = self._handles[fh]
        self.refresh(h.file)
        self._save(h.file, closed=h.file.closed)
        try:
            await trio.to_thread.run_sync(os.fsync, fh)
        except OSError as exc:
            self._fail(h.file, f"fsync failed: {exc.strerror or exc}")
            raise Refused(f"{h.file.path}: {exc.strerror or exc}", exc.errno or errno.EIO) from None
        await trio.to_thread.run_sync(self.journal.sync)

    def flush(self, fh: int) -> None:
        """``close()`` of one descriptor. It does not end the write: the description may be shared (a
        forked writer, a ``dup``) and written on; only the last release does (:meth:`release`)."""

    def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        os.close(fh)
        f = h.file
        if h.backing_id:
            assert self.kernel is not None
            why = self.kernel.release(f, h.writable)
            if why is not None and self.owed.files.get(f.id) is f:
                self._fail(f, why)
        else:
            for table, key in ((self._through_daemon, f.id), (self._daemon_inodes, f.inode)):
                table[key] -= 1
                if not table[key]:
                    del table[key]
        if not h.writable:
            return
        f.writers -= 1
        if f.writers == 0 and self.owed.files.get(f.id) is f:
            f.since = time.monotonic()
            self._save(f, closed=True)
            if not f.failed:
                self.owed.kick()

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> LocalDir:
        path = path_in(parent, name)
        check_key(self.backend, path + "/")
        if self.tree.resolve(path) is not None:
            raise Refused(f"{path} exists", errno.EEXIST)
        d = LocalDir(self.overlay.new_inode(), path, time.time_ns(), mode & 0o1777, uid, gid)
        self.overlay.hidden.discard(path)
        self.overlay.put(d)
        self._save_dir(d)
        return d

    def rmdir(self, parent: Node, name: bytes) -> None:
        path = path_in(parent, name)
        node = self.tree.resolve(path)
        if node is None:
            raise NotFound(path)
        if not node.is_dir:
            raise Refused(f"{path} is not a directory", errno.ENOTDIR)
        if not self.tree.is_empty_dir(node):
            raise Refused(f"{path} is not empty", errno.ENOTEMPTY)
        self.overlay.remove(path)
        if node.in_snapshot:
            self.overlay.hidden.add(path)
        else:
            self.journal.drop_dir(path)
        self.owed.touch()

    def unlink(self, parent: Node, name: bytes) -> None:
        path = path_in(parent, name)
        node = self.tree.resolve(path)
        if node is None:
            raise NotFound(path)
        if node.is_dir:
            raise Refused(f"{path} is a directory", errno.EISDIR)
        self._remove_file(path, node)
        self.owed.touch()

    def _remove_file(self, path: str, node: Node) -> None:
        """Forget the file at ``path``: its local bytes, and the object in the backend if there is one."""
        self.overlay.remove(path)
        if node.written_here:
            self._drop_local(node)
        if node.in_backend or self._in_backend(path):
            self._delete_key(path)

    def _drop_local(self, f: LocalFile) -> None:
        self.owed.cancel_upload(f)
        if self.kernel is not None:
            self.kernel.forget(f)
        f.generation += 1
        if self.owed.files.pop(f.id, None) is not None:
            self._unreserve(f, f.size)
        for table in (self.owed.retry, self.owed.not_before, self.owed.last_error):
            table.pop(f.id, None)
        self.journal.remove_data(f.id)  # first: on a full disk, that is what makes room for the commit
        self.journal.drop_file(f.id)  # (open handles keep reading the unlinked data file)

    # -- the background work, and what is owed ------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.kernel is not None:
                nursery.start_soon(self.kernel.run, lambda: self.owed.files)
            await self.uploads.run(task_status=task_status)
            nursery.cancel_scope.cancel()

    async def publish_pending(self) -> None:
        await self.uploads.publish_pending()

    def pending(self, prefixes: Iterable[str] = ()) -> list[Pending]:
        """What is not yet in the backend (under ``prefixes``, if given), by key."""
        return self.owed.pending(prefixes)

    def owned(self, uid: int, prefixes: Iterable[str] = ()) -> list[str]:
        """The paths of the files owed to the backend that ``uid`` owns (under ``prefixes``, if given)."""
        mine = {f.path for f in self.owed.files.values() if f.uid == uid}
        return sorted(p.key for p in self.owed.pending(prefixes) if p.key in mine)

    async def sync(self, prefixes: list[str], seconds: float) -> list[Pending]:
        """See :meth:`Uploads.sync`."""
        return await self.uploads.sync(prefixes, seconds)

    @property
    def publish_error(self) -> str | None:
        """Why the metadata store refused the last publication (None: it did not)."""
        return self.uploads.publish_error

    def room(self) -> int:
        """Bytes that may still be written before writers get ENOSPC."""
        return self.owed.room()

    def statistics(self) -> WritebackStats:
        g = self.give_way.statistics()
        stats = replace(self.owed.statistics(), gave_way=g.pauses, gave_way_seconds=g.paused_seconds)
        if self.kernel is None:
            return stats
        k = self.kernel.statistics()
        return replace(stats, kernel_writes=k.active, kernel_opens=k.opens, kernel_bytes=k.bytes,
                                   kernel_off=k.off)

    def close(self, wait: float = 5.0) -> None:
        """Stop: every upload is cancelled and waited for at most ``wait`` seconds (the journal keeps what
        is owed); the handles still open are closed."""
        self.uploads.close(wait)
        for fh in list(self._handles):  # (a writer cut off by the shutdown has not finished its file)
            os.close(fh)
        self._handles.clear()
        if self.kernel is not None:
            self.kernel.close()
