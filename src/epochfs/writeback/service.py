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
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import trio

from epochfs.backend.base import Backend
from epochfs.cache.store import BlockStore
from epochfs.errors import BackendError, EpochfsError, NoSpace, NotFound, Refused
from epochfs.meta.namespace import NAME_MAX, Dir, File, unsafe_reason
from epochfs.records import MAX_OBJECT_SIZE, ObjectInfo
from epochfs.writeback.journal import DirRecord, FileRecord, Journal
from epochfs.writeback.tree import LocalDir, LocalFile, Node, Overlay, Stored, Tree, parent_of

log = logging.getLogger(__name__)

Publish = Callable[[dict[str, ObjectInfo], set[str]], Awaitable[None]]


@dataclass
class WritebackStats:
    pending_files: int
    pending_bytes: int
    oldest_pending_seconds: float
    uploading: int
    uploaded_files: int
    uploaded_bytes: int
    upload_errors: int
    deletes_pending: int
    unpublished: int


@dataclass(frozen=True, order=True)
class Pending:
    key: str
    bytes: int
    state: str  # open for writing, waiting, uploading, retrying, to delete, to publish


@dataclass
class Handle:
    file: LocalFile
    fd: int
    writable: bool


def _path(parent: Node, name: bytes) -> str:
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("names must be UTF-8", errno.EINVAL) from None
    if len(name) > NAME_MAX:
        raise Refused("name too long", errno.ENAMETOOLONG)
    path = f"{parent.path}/{text}" if parent.path else text
    if unsafe_reason(path):
        raise Refused(f"{path!r} cannot be an object key ({unsafe_reason(path)})", errno.EINVAL)
    return path


class WriteBack:
    SETTLE = 1.0  # seconds a closed file waits before its upload starts: a rename usually follows
    PUBLISH_INTERVAL = 2.0
    RETRY_MIN, RETRY_MAX = 1.0, 60.0  # backoff of a failed upload or delete

    def __init__(self, journal: Journal, store: BlockStore, backend: Backend, tree: Tree, *,
                 bandwidth: float | None, concurrency: int, demand_waiting: Callable[[], bool],
                 publish: Publish, user_quota: int | None = None) -> None:
        self.journal = journal
        self.store = store
        self.backend = backend
        self.tree = tree
        self.overlay = tree.overlay = Overlay()
        self.bandwidth = bandwidth
        self.concurrency = max(1, concurrency)
        self.demand_waiting = demand_waiting
        self.publish = publish
        self._handles: dict[int, Handle] = {}
        self._files: dict[str, LocalFile] = {}  # id -> file, every file not yet uploaded
        self._uploaded: dict[str, ObjectInfo] = {}  # key -> object, not yet published
        self._deletes: dict[str, float] = {}  # key -> not before (monotonic): to delete in the backend
        self._deleting: set[str] = set()  # deletes in flight: no upload of those keys starts meanwhile
        self._deleted: set[str] = set()  # deleted in the backend, not yet published
        self._retry: dict[str, float] = {}  # file id -> backoff of its failed upload
        self._not_before: dict[str, float] = {}  # file id -> when to try its upload again (monotonic)
        self._cancels: dict[str, threading.Event] = {}
        self._wake = trio.Event()  # replaced on each kick: a waiter takes it before looking for work
        self._changed = trio.Event()
        self._publish_now = trio.Event()
        self._uploaded_files = self._uploaded_bytes = self._errors = 0
        self.user_quota = user_quota
        self._owed_by_uid: Counter[int] = Counter()  # uid -> bytes of its files not yet uploaded
        self._aborts: dict[str, str] = {}  # multipart upload id -> key: to abort in the backend
        self._uploads_running = 0  # upload threads still running (abandoned ones included)
        self._uploads_done = threading.Condition()

    # -- start-up -------------------------------------------------------------------------------------------

    def recover(self) -> None:
        """Take up what the journal owes: closed files (uploaded next), uploaded entries (published next),
        deletes. Files that were still being written when the daemon died are dropped."""
        owed = self.journal.load()
        files, uploaded, deletes = owed.files, owed.uploaded, owed.deletes
        for d in sorted(owed.dirs.values(), key=lambda d: d.path.count("/")):
            existing = self.tree.resolve(d.path)
            if existing is not None and not isinstance(existing, (Dir, LocalDir)):
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
            self.store.pinned += rec.size  # owed: pinned even past the capacity (it was admitted before)
            self._owe(rec.uid, rec.size)
            f = LocalFile(self.overlay.new_inode(), rec.key, rec.id, rec.size, rec.mtime_ns, rec.mode, rec.uid,
                          rec.gid, since=time.monotonic() - self.SETTLE, closed=True, failed=rec.failed)
            self._add_parents(rec.key)
            self.overlay.put(f)
            self._files[f.id] = f
        for key, obj in uploaded.items():
            self._add_parents(key)
            self.overlay.put(Stored(self.overlay.new_inode(), key, obj))
            self._uploaded[key] = obj
        for key in deletes:
            self.overlay.hidden.add(key)
            self._deletes[key] = 0.0
        self._aborts = dict(owed.multipart)  # cut off by the crash: nobody will complete them
        for name in os.listdir(self.journal.data_dir):  # data files no record owns (a crash mid-create)
            if name not in self._files:
                self.journal.remove_data(name)
        if files or uploaded or deletes or self._aborts:
            log.info("write-back: %d files to upload, %d uploads to publish, %d deletes, %d unfinished multipart "
                     "uploads to abort from the journal", len(self._files), len(uploaded), len(deletes),
                     len(self._aborts))

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
        self._files[f.id] = f
        self._save(f, closed=False)
        return f

    def _save(self, f: LocalFile, *, closed: bool) -> None:
        f.closed = closed
        self.journal.put_file(FileRecord(f.id, f.path, f.size, f.mtime_ns, f.mode, f.uid, f.gid, closed, time.time(),
                                         f.failed))

    def create(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> tuple[int, LocalFile]:
        """A new file (or an existing one replaced), open for writing: (handle, file)."""
        path = _path(parent, name)
        existing = self.tree.resolve(path)
        if isinstance(existing, (Dir, LocalDir)):
            raise Refused(f"{path} is a directory", errno.EISDIR)
        if isinstance(existing, LocalFile):
            return self.open(existing, os.O_WRONLY | os.O_TRUNC), existing
        f = self._new_file(path, mode, uid, gid)
        self._replace(path, f)
        return self._open_handle(f, writable=True), f

    def open(self, node: Node, flags: int) -> int:
        """A handle on a file this node wrote (reading or writing), or on an existing object replaced
        (``O_TRUNC``)."""
        write = bool(flags & (os.O_WRONLY | os.O_RDWR))
        if isinstance(node, LocalFile):
            if flags & os.O_TRUNC:
                self._truncate(node, 0)
            return self._open_handle(node, writable=write)
        if not isinstance(node, (File, Stored)):
            raise Refused(f"{node.path} is a directory", errno.EISDIR)
        if not write:
            raise Refused(f"{node.path} is read through the cache", errno.EINVAL)  # the adapter does this
        if not flags & os.O_TRUNC:
            raise Refused(f"{node.path}: an object in the backend can be replaced (open it with O_TRUNC), "
                          "not modified", errno.EOPNOTSUPP)
        return self._open_handle(self._replace_object(node), writable=True)

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
        self._touch()

    def _in_backend(self, path: str) -> bool:
        """Whether the backend holds (or is about to publish) an object under ``path``."""
        return path in self._uploaded or isinstance(self.tree.namespace.resolve(path), File)

    def _delete_key(self, path: str) -> None:
        """The object under ``path`` is gone for this mount: hidden now, deleted in the backend next."""
        self._uploaded.pop(path, None)
        self.overlay.hidden.add(path)
        self.journal.put_delete(path)
        self._deletes[path] = 0.0
        self._kick()

    def _cancel_delete(self, path: str) -> None:
        if self._deletes.pop(path, None) is not None:
            self.journal.cancel_delete(path)

    def _open_handle(self, f: LocalFile, *, writable: bool) -> int:
        fd = self.journal.open_data(f.id, os.O_RDWR if writable else os.O_RDONLY)
        if writable:
            f.writers += 1
            f.generation += 1
            self._cancel_upload(f)
        self._handles[fd] = Handle(f, fd, writable)
        return fd

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
        return written

    def _reserve(self, f: LocalFile, size: int) -> None:
        """Pin ``size`` more bytes for ``f`` (its owner's quota, then the cache), or fail the file."""
        if self.user_quota is not None and self._owed_by_uid[f.uid] + size > self.user_quota:
            self._fail(f, "its owner's write-back quota is full")
            raise Refused(f"{f.path}: user {f.uid} holds {self._owed_by_uid[f.uid]} bytes not yet uploaded "
                          f"(--writeback-user-quota {self.user_quota})", errno.EDQUOT)
        if not self.store.pin(size):
            self._fail(f, "the cache had no room for it")
            raise NoSpace(f"{f.path}: the cache holds {self.store.pinned} bytes not yet uploaded and has no "
                          "room for more; they drain as they upload")
        self._owe(f.uid, size)

    def _unreserve(self, f: LocalFile, size: int) -> None:
        if size:
            self.store.unpin(size)
            self._owe(f.uid, -size)

    def _owe(self, uid: int, size: int) -> None:
        """``uid``'s files not yet uploaded grew (or, negative, shrank) by ``size`` bytes."""
        self._owed_by_uid[uid] += size
        if self._owed_by_uid[uid] <= 0:
            del self._owed_by_uid[uid]

    def _fail(self, f: LocalFile, why: str) -> None:
        """A write of ``f`` failed: it is not a finished file and is never uploaded as it is."""
        if not f.failed:
            log.warning("%s will not be uploaded: %s (write it again from the start, or remove it)", f.path, why)
        f.failed = why
        f.generation += 1
        self._cancel_upload(f)
        try:
            self._save(f, closed=f.closed)
        except EpochfsError as exc:  # (a full disk: the record stays "not closed", dropped at recovery)
            log.warning("could not record that %s failed: %s", f.path, exc)

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return os.pread(fh, size, offset)

    def truncate(self, node: Node, size: int) -> None:
        if isinstance(node, (File, Stored)) and size == 0:
            self._replace_object(node)  # open(O_TRUNC) by a kernel that truncates before it opens
            return
        if not isinstance(node, LocalFile):
            raise Refused(f"{node.path}: an object in the backend can be replaced, not truncated",
                          errno.EISDIR if isinstance(node, (Dir, LocalDir)) else errno.EOPNOTSUPP)
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
        if size == 0:
            f.failed = ""  # written again from the start: what failed before is gone
        f.size, f.mtime_ns = size, time.time_ns()
        f.generation += 1
        self._cancel_upload(f)
        self._save(f, closed=f.writers == 0)
        f.since = time.monotonic()

    def set_attrs(self, node: Node, *, mtime_ns: int | None = None, mode: int | None = None,
                  uid: int | None = None, gid: int | None = None) -> None:
        """chmod, chown and utimes of a file or directory made here (the kernel has checked that the
        caller may); objects and directories of the backend cannot change."""
        if isinstance(node, LocalDir):
            node.mtime_ns = mtime_ns if mtime_ns is not None else node.mtime_ns
            node.mode = mode & 0o1777 if mode is not None else node.mode if node.mode is not None else 0o755
            node.uid = uid if uid is not None else node.uid if node.uid is not None else os.getuid()
            node.gid = gid if gid is not None else node.gid if node.gid is not None else os.getgid()
            self._save_dir(node)
            return
        if not isinstance(node, LocalFile):
            raise Refused(f"{node.path}: only files and directories made here can change", errno.EPERM)
        node.mtime_ns = mtime_ns if mtime_ns is not None else node.mtime_ns
        node.mode = mode & 0o777 if mode is not None else node.mode
        if uid is not None and uid != node.uid and self._files.get(node.id) is node:
            self._owe(node.uid, -node.size)  # what it owes moves to its new owner
            self._owe(uid, node.size)
        node.uid = uid if uid is not None else node.uid
        node.gid = gid if gid is not None else node.gid
        if self._files.get(node.id) is node:
            self._save(node, closed=node.closed)

    def _save_dir(self, d: LocalDir) -> None:
        if d.mode is not None and d.uid is not None and d.gid is not None:
            self.journal.put_dir(DirRecord(d.path, d.mode, d.uid, d.gid, d.mtime_ns))

    async def fsync(self, fh: int) -> None:
        """Make a written file's bytes and its journal record durable (worker thread)."""
        h = self._handles[fh]
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
        if not h.writable:
            return
        f.writers -= 1
        if f.writers == 0 and self._files.get(f.id) is f:
            f.since = time.monotonic()
            self._save(f, closed=True)
            if not f.failed:
                self._kick()

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> LocalDir:
        path = _path(parent, name)
        if self.tree.resolve(path) is not None:
            raise Refused(f"{path} exists", errno.EEXIST)
        d = LocalDir(self.overlay.new_inode(), path, time.time_ns(), mode & 0o1777, uid, gid)
        self.overlay.hidden.discard(path)
        self.overlay.put(d)
        self._save_dir(d)
        return d

    def rmdir(self, parent: Node, name: bytes) -> None:
        path = _path(parent, name)
        node = self.tree.resolve(path)
        if node is None:
            raise NotFound(path)
        if not isinstance(node, (Dir, LocalDir)):
            raise Refused(f"{path} is not a directory", errno.ENOTDIR)
        if not self.tree.is_empty_dir(node):
            raise Refused(f"{path} is not empty", errno.ENOTEMPTY)
        self.overlay.remove(path)
        if isinstance(node, Dir):
            self.overlay.hidden.add(path)
        else:
            self.journal.drop_dir(path)
        self._touch()

    def unlink(self, parent: Node, name: bytes) -> None:
        path = _path(parent, name)
        node = self.tree.resolve(path)
        if node is None:
            raise NotFound(path)
        if isinstance(node, (Dir, LocalDir)):
            raise Refused(f"{path} is a directory", errno.EISDIR)
        self._remove_file(path, node)
        self._touch()

    def _remove_file(self, path: str, node: Node) -> None:
        """Forget the file at ``path``: its local bytes, and the object in the backend if there is one."""
        self.overlay.remove(path)
        if isinstance(node, LocalFile):
            self._drop_local(node)
        if isinstance(node, (File, Stored)) or self._in_backend(path):
            self._delete_key(path)

    def _drop_local(self, f: LocalFile) -> None:
        self._cancel_upload(f)
        f.generation += 1
        if self._files.pop(f.id, None) is not None:
            self._unreserve(f, f.size)
        self.journal.remove_data(f.id)  # first: on a full disk, that is what makes room for the commit
        self.journal.drop_file(f.id)  # (open handles keep reading the unlinked data file)

    def rename(self, old_parent: Node, old_name: bytes, new_parent: Node, new_name: bytes, flags: int) -> None:
        src_path, dst_path = _path(old_parent, old_name), _path(new_parent, new_name)
        src = self.tree.resolve(src_path)
        if src is None:
            raise NotFound(src_path)
        if flags & ~1:  # RENAME_NOREPLACE (1) is supported; RENAME_EXCHANGE is not
            raise Refused("rename flags not supported", errno.EINVAL)
        if src_path == dst_path:
            return
        if dst_path.startswith(src_path + "/"):
            raise Refused("cannot move a directory into itself", errno.EINVAL)
        dst = self.tree.resolve(dst_path)
        if dst is not None and flags & 1:
            raise Refused(f"{dst_path} exists", errno.EEXIST)
        if isinstance(src, LocalFile):
            if isinstance(dst, (Dir, LocalDir)):
                raise Refused(f"{dst_path} is a directory", errno.EISDIR)
            if dst is not None:
                self._replaced_by_rename(dst_path, dst)
            self._move(src, dst_path)
        elif isinstance(src, LocalDir):
            moved = [e for p, e in self.overlay.entries.items() if p.startswith(src_path + "/")]
            if any(not isinstance(e, (LocalDir, LocalFile)) for e in moved):
                raise Refused(f"{src_path} holds objects already in the backend", errno.EXDEV)
            if dst is not None:
                if not isinstance(dst, (Dir, LocalDir)) or not self.tree.is_empty_dir(dst):
                    raise Refused(f"{dst_path} exists", errno.ENOTEMPTY if isinstance(dst, (Dir, LocalDir))
                                  else errno.ENOTDIR)
                self.overlay.remove(dst_path)
                self.journal.drop_dir(dst_path)
            for e in sorted([src, *moved], key=lambda e: e.path.count("/")):
                self._move(e, dst_path + e.path[len(src_path):])
        else:
            raise Refused(f"{src_path} is already in the backend: it cannot be renamed there", errno.EXDEV)
        self._touch()

    def _replaced_by_rename(self, path: str, dst: Node) -> None:
        if isinstance(dst, LocalFile):
            self.overlay.remove(path)
            self._drop_local(dst)
        # an object in the backend under that key is overwritten by the upload of the renamed file

    def _move(self, e: LocalDir | LocalFile, path: str) -> None:
        self.overlay.remove(e.path)
        old = e.path
        e.path = path
        self._add_parents(path)
        self.overlay.put(e)
        self.overlay.hidden.discard(path)
        if isinstance(e, LocalDir):
            self.journal.drop_dir(old)
            self._save_dir(e)
        if isinstance(e, LocalFile):
            self._cancel_delete(path)
            if self._in_backend(old):  # it had replaced an object: that one goes with the old name
                self._delete_key(old)
            e.generation += 1
            self._cancel_upload(e)
            self._save(e, closed=e.closed)
            self._kick()
        log.debug("renamed %s to %s", old, path)

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _kick(self) -> None:
        """Wake the upload and delete workers: there may be work."""
        self._wake.set()
        self._wake = trio.Event()

    def _cancel_upload(self, f: LocalFile) -> None:
        cancel = self._cancels.get(f.id)
        if cancel is not None:
            cancel.set()

    # -- uploads, deletes, publishing ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.concurrency):
                nursery.start_soon(self._upload_worker)
            nursery.start_soon(self._delete_worker)
            nursery.start_soon(self._publisher)
            task_status.started()

    def _ready(self) -> tuple[LocalFile | None, float]:
        """The next file to upload (oldest first), or how long until one may be."""
        now, best, wait = time.monotonic(), None, 3600.0
        for f in self._files.values():
            if f.writers or f.uploading or f.failed or f.path in self._deleting:
                continue
            at = max(f.since + self.SETTLE, self._not_before.get(f.id, 0.0))
            if at <= now:
                if best is None or f.since < best.since:
                    best = f
            else:
                wait = min(wait, at - now)
        return best, wait

    async def _upload_worker(self) -> None:
        while True:
            wake = self._wake
            f, wait = self._ready()
            if f is None or self.demand_waiting():  # demand reads go first on the backend link
                with trio.move_on_after(wait if f is None else 0.01):
                    await wake.wait()
                continue
            await self._upload(f)

    async def _upload(self, f: LocalFile) -> None:
        f.uploading = True
        generation, key, size = f.generation, f.path, f.size
        cancel = self._cancels[f.id] = threading.Event()
        started: list[str] = []  # multipart upload ids this upload created
        attributes = {"epochfs-mode": f"{f.mode:04o}", "epochfs-uid": str(f.uid), "epochfs-gid": str(f.gid)}

        def multipart_started(upload_id: str) -> None:  # (an s3transfer thread)
            started.append(upload_id)
            self.journal.put_multipart(upload_id, key)

        def upload() -> ObjectInfo:
            try:
                fd = self.journal.open_data(f.id, os.O_RDONLY)  # this very file, whatever is at its name later
                try:
                    return self.backend.upload_file(f"/proc/self/fd/{fd}", key, bandwidth=self.bandwidth,
                                                    cancelled=cancel, metadata=attributes,
                                                    multipart_started=multipart_started)
                finally:
                    os.close(fd)
            finally:
                with self._uploads_done:
                    self._uploads_running -= 1
                    self._uploads_done.notify_all()

        with self._uploads_done:
            self._uploads_running += 1
        try:
            try:
                obj = await trio.to_thread.run_sync(upload, abandon_on_cancel=True)
            except BaseException:
                for upload_id in started:  # s3transfer aborts what it cancels; make sure of it
                    self._aborts[upload_id] = key
                raise
            for upload_id in started:
                self.journal.drop_multipart(upload_id)
        except BackendError as exc:
            if not cancel.is_set():
                self._errors += 1
                backoff = min(self.RETRY_MAX, max(self.RETRY_MIN, 2 * self._retry.get(f.id, 0.5)))
                self._retry[f.id] = backoff
                self._not_before[f.id] = time.monotonic() + backoff
                log.warning("upload of %s failed (%s); retrying in %.0f s", key, exc, backoff)
            return
        except OSError as exc:  # the data file itself: gone or replaced by something else
            self._errors += 1
            log.warning("upload of %s failed: %s; retrying", key, exc)
            self._not_before[f.id] = time.monotonic() + self.RETRY_MAX
            return
        except Exception:
            self._errors += 1
            log.exception("upload of %s failed", key)
            self._not_before[f.id] = time.monotonic() + self.RETRY_MAX
            return
        finally:
            f.uploading = False
            self._cancels.pop(f.id, None)
            if self._aborts:
                self._kick()
        self._retry.pop(f.id, None)
        self._not_before.pop(f.id, None)
        current = self._files.get(f.id) is f and f.generation == generation and f.path == key
        if not current:
            # Renamed, removed or written again while it uploaded: the object under the old key is stale
            # unless the file (or another one) still owns that key; the file itself is uploaded again.
            if self.tree.resolve(key) is None or isinstance(self.tree.resolve(key), (Dir, LocalDir)):
                self.journal.put_delete(key)
                self._deletes[key] = 0.0
            self._kick()
            return
        obj = obj._replace(mode=f.mode, uid=f.uid, gid=f.gid)  # who may read it stays who could before
        self.journal.put_uploaded(obj, f.id)
        self.journal.remove_data(f.id)
        self._files.pop(f.id, None)
        self._unreserve(f, size)
        stored = Stored(f.inode, key, obj)  # the same inode: the kernel's view of it stays valid
        self.overlay.put(stored)
        self._uploaded[key] = obj
        self._deleted.discard(key)  # a delete done before this upload is superseded by it
        self._uploaded_files += 1
        self._uploaded_bytes += size
        self._publish_now.set()
        self._touch()
        log.info("uploaded %s (%d bytes)", key, size)

    async def _abort_unfinished(self) -> None:
        """Abort the multipart uploads nobody will complete (cut off by a crash, failed, cancelled)."""
        for upload_id, key in list(self._aborts.items()):
            try:
                await trio.to_thread.run_sync(self.backend.abort_multipart, key, upload_id, abandon_on_cancel=True)
            except BackendError as exc:
                log.warning("abort of an unfinished upload of %s failed (%s); retrying", key, exc)
                continue
            self._aborts.pop(upload_id, None)
            self.journal.drop_multipart(upload_id)
            log.info("aborted an unfinished multipart upload of %s", key)

    async def _delete_worker(self) -> None:
        while True:
            wake = self._wake
            if self._aborts:
                await self._abort_unfinished()
            now = time.monotonic()
            due = [k for k, at in self._deletes.items() if at <= now]
            if not due:
                later = min((at - now for at in self._deletes.values()), default=3600.0)
                if self._aborts:
                    later = min(later, self.RETRY_MAX / 4)
                with trio.move_on_after(later):
                    await wake.wait()
                continue
            for key in due:
                if key not in self._deletes:
                    continue  # void meanwhile: a new file took the key
                self._deleting.add(key)
                try:
                    await trio.to_thread.run_sync(self.backend.delete, key, abandon_on_cancel=True)
                except BackendError as exc:
                    self._errors += 1
                    if key in self._deletes:
                        self._deletes[key] = time.monotonic() + self.RETRY_MAX / 4
                    log.warning("delete of %s failed (%s); retrying", key, exc)
                    continue
                finally:
                    self._deleting.discard(key)
                    self._kick()
                if key in self._deletes:
                    del self._deletes[key]
                    self._deleted.add(key)
                    self._publish_now.set()
                    self._touch()

    async def _publisher(self) -> None:
        while True:
            await self._publish_now.wait()
            await trio.sleep(self.PUBLISH_INTERVAL)
            self._publish_now = trio.Event()
            await self.publish_pending()

    async def publish_pending(self) -> None:
        """Publish uploads and deletes to the metadata store; keep them for the next try if it fails."""
        added, removed = dict(self._uploaded), set(self._deleted)
        if not added and not removed:
            return
        try:
            await self.publish(added, removed)
        except EpochfsError as exc:
            log.warning("could not publish %d uploads and %d deletes (%s); retrying", len(added), len(removed), exc)
            self._publish_now.set()
            return
        self.journal.published(set(added), removed)
        for key, obj in added.items():
            if self._uploaded.get(key) is obj:
                del self._uploaded[key]
                entry = self.overlay.entries.get(key)
                if isinstance(entry, Stored) and entry.obj is obj:
                    self.overlay.remove(key)
                    self.overlay.by_inode[entry.inode] = entry  # open handles and the kernel may still name it
        for key in removed:
            self._deleted.discard(key)
            if self.tree.namespace.resolve(key) is None:
                self.overlay.hidden.discard(key)
        self._touch()

    # -- waiting for uploads ---------------------------------------------------------------------------------

    def pending(self, prefixes: Iterable[str] = ()) -> list[Pending]:
        """What is not yet in the backend (under ``prefixes``, if given), by key."""
        wanted = [p.strip("/") for p in prefixes]

        def under(key: str) -> bool:
            return not wanted or any(w == "" or key == w or key.startswith(w + "/") for w in wanted)

        def state(f: LocalFile) -> str:
            if f.failed:
                return f"not uploaded: {f.failed}"
            if f.writers:
                return "open for writing"
            if f.uploading:
                return "uploading"
            return "retrying" if f.id in self._retry else "waiting"

        out = [Pending(f.path, f.size, state(f)) for f in self._files.values() if under(f.path)]
        out += [Pending(k, 0, "to delete") for k in self._deletes if under(k)]
        out += [Pending(k, 0, "to publish") for k in (*self._uploaded, *self._deleted) if under(k)]
        return sorted(out)

    async def sync(self, prefixes: list[str], seconds: float) -> list[Pending]:
        """Wait until nothing under ``prefixes`` is owed to the backend (and what was uploaded is
        published), at most ``seconds``; what is still pending. Files closed but settling are uploaded
        at once, and failed ones retried at once (once per request: a caller waiting in rounds retries
        at the pace of its rounds, not faster)."""
        for f in self._files.values():
            self._not_before.pop(f.id, None)
        with trio.move_on_after(seconds):
            while any(p.state != "to publish" and not p.state.startswith("not uploaded")
                      for p in self.pending(prefixes)):
                changed = self._changed
                for f in self._files.values():
                    f.since = min(f.since, time.monotonic() - self.SETTLE)
                self._kick()
                await changed.wait()
            if self._uploaded or self._deleted:
                await self.publish_pending()
        return self.pending(prefixes)

    def room(self) -> int:
        """Bytes that may still be written before writers get ENOSPC."""
        st = self.store
        return max(0, st.capacity - st.pinned - st.pending)

    def statistics(self) -> WritebackStats:
        now = time.monotonic()
        closed = [f for f in self._files.values() if not f.writers]
        return WritebackStats(
            pending_files=len(self._files),
            pending_bytes=sum(f.size for f in self._files.values()),
            oldest_pending_seconds=max((now - f.since for f in closed), default=0.0),
            uploading=sum(f.uploading for f in self._files.values()),
            uploaded_files=self._uploaded_files,
            uploaded_bytes=self._uploaded_bytes,
            upload_errors=self._errors,
            deletes_pending=len(self._deletes),
            unpublished=len(self._uploaded) + len(self._deleted),
        )

    def close(self, wait: float = 5.0) -> None:
        """Stop: every upload is cancelled (the journal keeps what is owed; a multipart upload cut off is
        aborted at the next start), and waited for at most ``wait`` seconds."""
        for cancel in list(self._cancels.values()):
            cancel.set()
        deadline = time.monotonic() + wait
        with self._uploads_done:
            while self._uploads_running and time.monotonic() < deadline:
                self._uploads_done.wait(max(0.01, deadline - time.monotonic()))
            if self._uploads_running:
                log.warning("%d uploads still running at shutdown; they resume at the next start",
                            self._uploads_running)
        for fh in list(self._handles):  # (a writer cut off by the shutdown has not finished its file)
            os.close(fh)
        self._handles.clear()

