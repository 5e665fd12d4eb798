"""The FUSE adapter: inode and name bookkeeping over a :class:`Namespace`, reads through a
:class:`BlockCache`. It adapts only; every domain error becomes an errno through
:func:`epochfs.core.errors.errno_for`, and any other exception is logged and answered with EIO so that a
bug fails one request, never the mount.

Differences from a plain read-only filesystem:

- the namespace is an immutable snapshot, so entries and attributes carry long kernel timeouts and
  open files keep the kernel page cache (``keep_cache``);
- extended attributes ``user.epochfs.*`` on the root describe the daemon (pid, control socket,
  snapshot version) for the command-line tools;
- a control file at the root (:class:`ControlFile`: ``.epochfs``, found by name, never listed) carries
  the control channel as ioctls, for callers who see only the mount;
- with write-back (:class:`~epochfs.writeback.service.WriteBack`), the tree is the snapshot with this
  node's changes on top (:class:`~epochfs.writeback.tree.Tree`), and the write operations go to the
  write-back service; without it they answer EROFS.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import os
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from epochfs import kernel
from epochfs.cache.members import MemberStream
from epochfs.cache.passthrough import BackingChanged
from epochfs.cache.service import BlockCache
from epochfs.cache.streams import ReadStream
from epochfs.core.errors import Answered, EpochfsError, NotFound, Refused, errno_for
from epochfs.core.stats import Histogram, HistogramSnapshot
from epochfs.meta.entries import COOKIE_MAX
from epochfs.meta.namespace import ROOT_INODE, Namespace
from epochfs.vfs.presentation import Presentation
from epochfs.vfs.seams import BackingFiles, ControlFile
from epochfs.writeback.access import writes_in
from epochfs.writeback.service import WriteBack
from epochfs.writeback.tree import Node, Tree, parent_of

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


@dataclass(frozen=True)
class FsStats:
    read_seconds: HistogramSnapshot
    errors: dict[str, int]  # errno name -> count of requests answered with it (ENOENT excluded)
    isatty_asks: int = 0  # requests asking whether a file is a terminal (default-buffered Python opens)
    uring_requests: int | None = None  # requests taken through io_uring (None: the mount reads /dev/fuse)


def _translated(fn: F) -> F:
    """Turn domain errors into FUSEError through the one mapping; never let an exception escape. Wraps
    plain handlers and coroutine ones alike (the session answers a plain one as it reads the request)."""

    def answer(self: Operations, exc: Exception) -> kernel.FUSEError:
        if isinstance(exc, EpochfsError):
            code = errno_for(exc)
            if isinstance(exc, Answered):
                return kernel.FUSEError(code)
            if not isinstance(exc, NotFound):
                self.errors[errno.errorcode.get(code, str(code))] += 1
            log.log(logging.DEBUG if isinstance(exc, (NotFound, Refused)) else logging.WARNING,
                    "%s: %s (%s)", fn.__name__, exc, errno.errorcode.get(code, code))
            return kernel.FUSEError(code)
        self.errors["internal"] += 1
        log.error("unexpected error in %s", fn.__name__, exc_info=exc)
        return kernel.FUSEError(errno.EIO)

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def waiting(self: Operations, *args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(self, *args, **kwargs)
            except Exception as exc:
                raise answer(self, exc) from None

        return waiting  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(self: Operations, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:
            raise answer(self, exc) from None

    return wrapper  # type: ignore[return-value]


#: The control file's inode number (above the snapshot's and the overlay's numbers).
CONTROL_INODE = 1 << 62


class Operations(kernel.Operations):
    enable_writeback_cache = False

    def __init__(
        self,
        namespace: Namespace,
        cache: BlockCache,
        *,
        attr_timeout: float,
        root_xattrs: Mapping[bytes, Callable[[], bytes]],
        presentation: Presentation | None = None,
        tree: Tree | None = None,
        writeback: WriteBack | None = None,
        zero_open: bool = False,
        passthrough: BackingFiles | None = None,
        control: ControlFile | None = None,
    ) -> None:
        self.control = control
        self.ioctl_commands = frozenset({control.command}) if control is not None else frozenset()
        self.tree = tree or Tree(namespace)
        self.tree.namespace = namespace
        self.writeback = writeback
        self.cache = cache
        self.attr_timeout = attr_timeout
        self.root_xattrs = dict(root_xattrs)
        self.present = presentation or Presentation()
        self.session: kernel.Session | None = None  # the mount serving these operations
        self.errors: Counter[str] = Counter()
        self.read_latency = Histogram()
        self._streams: dict[int, ReadStream | MemberStream] = {}
        # Zero-message opens (read-only mounts): OPEN answers ENOSYS once and the kernel then opens files
        # without asking; reads come with file handle 0 and are bound to a reader here instead.
        # (Not while passthrough is on: the kernel reads a file itself only through an answered open.)
        self.zero_open = zero_open and writeback is None
        # Passthrough: a cached object's open is answered with its file in the store, which the kernel
        # then reads itself; asked for at INIT (the session reads this attribute).
        self.passthrough = passthrough
        # Write-back mounts: the kernel writes files made here itself where it can (their data files as
        # backing files: :mod:`epochfs.writeback.kernel`); asked for at INIT as well.
        self.kernel_writes = getattr(writeback, "kernel", None) is not None
        self.want_passthrough = self.passthrough is not None or self.kernel_writes
        self._bound: OrderedDict[tuple[int, int], ReadStream | MemberStream] = OrderedDict()
        self._retired: OrderedDict[int, Node] = OrderedDict()
        self._local: dict[int, int] = {}  # fh -> write-back handle (a file written on this node)
        self._dirs: dict[int, Node] = {}  # open directories: only the node (no version of the tree is held)
        self._next_fh = 1
        self._file_default, self._dir_default = (0o644, 0o755) if self.present.writable else (0o444, 0o555)

    @property
    def namespace(self) -> Namespace:
        return self.tree.namespace

    @namespace.setter
    def namespace(self, namespace: Namespace) -> None:
        self.tree.namespace = namespace

    #: Files of earlier snapshots kept for the kernel's inodes of them (at most this many).
    RETIRED = 1 << 16

    def switch(self, namespace: Namespace, inodes: Sequence[int]) -> None:
        """Serve ``namespace``; of the changed ``inodes``, the files it no longer has under their number
        (removed, or a new version under a new number) stay readable by that number until the kernel
        forgets it: a file held open across the change reads the version it opened."""
        gone = []
        for inode in inodes:
            try:
                node = self.tree.node(inode)
            except KeyError:
                continue
            if node.in_backend and not node.is_dir:
                gone.append((inode, node))
        self.namespace = namespace
        for inode, node in gone:
            try:
                self.tree.node(inode)
            except KeyError:
                self._retired[inode] = node
                self._retired.move_to_end(inode)
        while len(self._retired) > self.RETIRED:
            self._retired.popitem(last=False)

    # -- attributes ------------------------------------------------------------------------------------

    def _attrs(self, node: Node) -> kernel.EntryAttributes:
        attr = kernel.EntryAttributes()
        attr.st_ino = node.inode
        attr.generation = 0
        attr.entry_timeout = self.attr_timeout
        attr.attr_timeout = self.attr_timeout
        attr.st_blksize = 128 << 10
        p = self.present
        if node.written_here and self.kernel_writes:
            self._writer().refresh(node)  # (the kernel writes it: its size is its data file's)
        info = node.record()
        if node.is_dir:
            default = p.root_mode if node.inode == ROOT_INODE and p.root_mode is not None else self._dir_default
            attr.st_mode = stat.S_IFDIR | p.mode(info, p.dir_mode, default, directory=True)
            attr.st_nlink = 2
            attr.st_size = 0
        else:
            assert info is not None  # (a file always has a record)
            attr.st_mode = stat.S_IFREG | p.mode(info, p.file_mode, self._file_default)
            attr.st_nlink = 1
            attr.st_size = info.size
            attr.st_blocks = -(-info.size // 512)
        mtime = info.mtime_ns if info is not None else self.namespace.mtime_ns
        attr.st_uid = p.owner(info.uid if info is not None else None, p.uid, p.default_uid)
        attr.st_gid = p.owner(info.gid if info is not None else None, p.gid, p.default_gid)
        attr.st_mtime_ns = attr.st_ctime_ns = attr.st_atime_ns = mtime
        return attr

    def presented(self, node: Node) -> tuple[int, int, int]:
        """The mode, owner and group the mount presents ``node`` with (what the kernel checks)."""
        attr = self._attrs(node)
        return attr.st_mode, attr.st_uid, attr.st_gid

    def _control_attrs(self) -> kernel.EntryAttributes:
        attr = kernel.EntryAttributes()
        attr.st_ino = CONTROL_INODE
        attr.entry_timeout = attr.attr_timeout = self.attr_timeout
        attr.st_mode = stat.S_IFREG | 0o444
        attr.st_nlink = 1
        attr.st_uid, attr.st_gid = self.present.default_uid, self.present.default_gid
        attr.st_mtime_ns = attr.st_ctime_ns = attr.st_atime_ns = self.namespace.mtime_ns
        return attr

    def _node(self, inode: int) -> Node:
        try:
            return self.tree.node(inode)
        except KeyError:
            node = self._retired.get(inode)
            if node is None:
                raise NotFound(f"inode {inode}") from None
            return node

    def _writer(self) -> WriteBack:
        if self.writeback is None:
            raise Refused("read-only mount (mount with --writeback to write)", errno.EROFS)
        return self.writeback

    @_translated
    def lookup(self, parent_inode: int, name: bytes, ctx: kernel.RequestContext) -> kernel.EntryAttributes:
        if parent_inode == ROOT_INODE and self.control is not None and name == self.control.name:
            return self._control_attrs()
        if self.tree.overlay is None:
            node: Node | None = self.namespace.lookup(parent_inode, name)
        else:
            node = self.tree.lookup(self._node(parent_inode), name)
        if node is None:
            raise NotFound(name.decode(errors="replace"))
        return self._attrs(node)

    @_translated
    def getattr(self, inode: int, ctx: kernel.RequestContext | None = None) -> kernel.EntryAttributes:
        if inode == CONTROL_INODE and self.control is not None:
            return self._control_attrs()
        return self._attrs(self._node(inode))

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """The snapshot's inodes live as long as it does; a file of an earlier one is let go."""
        for inode, _ in inode_list:
            self._retired.pop(inode, None)

    # -- directories -----------------------------------------------------------------------------------

    @_translated
    def opendir(self, inode: int, ctx: kernel.RequestContext) -> int:
        node = self._node(inode)
        if not node.is_dir:
            raise Answered(errno.ENOTDIR)
        fh = self._new_fh()
        self._dirs[fh] = node
        return fh

    @_translated
    def readdir(self, fh: int, start_id: int, token: kernel.ReaddirToken) -> None:
        """A listing is the directory as it is now, in cookie order; the offset of each entry is its
        cookie (the one before it where two names share one, so the second is repeated at worst, never
        lost). A handle holds no version of the tree, and continuing from any offset is one lookup."""
        here = self._dirs[fh]
        held: tuple[int, bytes, Node] | None = None
        if start_id <= COOKIE_MAX:
            for entry in self.tree.entries(here, start_id):
                if held is not None:
                    cookie, name, child = held
                    if not kernel.readdir_reply(token, name, self._attrs(child),
                                                cookie if entry[0] != cookie else cookie - 1):
                        return
                held = entry
            if held is not None and not kernel.readdir_reply(token, held[1], self._attrs(held[2]), held[0]):
                return
        # "." and ".." last, past every name's cookie (so no name's offset is taken): `ls -a` lists them.
        if start_id <= COOKIE_MAX and not kernel.readdir_reply(token, b".", self._attrs(here), COOKIE_MAX + 1):
            return
        if start_id <= COOKIE_MAX + 1:
            up = here if here.inode == ROOT_INODE else self.tree.resolve(parent_of(here.path)[0]) or here
            kernel.readdir_reply(token, b"..", self._attrs(up), COOKIE_MAX + 2)

    @_translated
    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # -- files -----------------------------------------------------------------------------------------

    @_translated
    def open(self, inode: int, flags: int, ctx: kernel.RequestContext) -> kernel.FileInfo:
        if inode == CONTROL_INODE and self.control is not None:
            if flags & _WRITE_FLAGS:
                raise Refused("the control file is not written: its channel is ioctls", errno.EPERM)
            if self.zero_open and (self.session is None or self.session.can(kernel.NO_OPEN_SUPPORT)):
                raise Answered(errno.ENOSYS)
            return kernel.FileInfo(fh=self._new_fh(), keep_cache=False)
        node = self._node(inode)
        if node.is_dir:
            raise Answered(errno.EISDIR)
        passing = self.passthrough is not None and self.passthrough.active and self.session is not None
        if passing and not self.session.can(kernel.PASSTHROUGH):
            passing = self.passthrough.off("the kernel offers no FUSE passthrough (Linux 6.9 and later)")
        if self.zero_open and not passing and not flags & _WRITE_FLAGS and (
                self.session is None or self.session.can(kernel.NO_OPEN_SUPPORT)):
            # The kernel stops sending OPEN and RELEASE for this mount and keeps the page cache across
            # opens: a file in the page cache is then read with no request at all.
            raise Answered(errno.ENOSYS)
        if flags & _WRITE_FLAGS and self.writeback is not None:
            parent = self.tree.resolve(parent_of(node.path)[0])
            if parent is not None:
                self._writes_in(parent, ctx)
        fh = self._new_fh()
        # The kernel reads an inode one way at a time (a backing file, or through the daemon): an object
        # replaced here keeps its inode, and a file uploaded keeps its own, while opens of the other kind
        # may be outstanding; such an open is answered the way they read, or uncached (direct I/O).
        held = self.passthrough.mode(inode) if self.passthrough is not None else None
        if node.written_here or flags & _WRITE_FLAGS:
            local = self._local[fh] = self._writer().open(node, flags, kernel=self._kernel_writes() and held is None)
            return self._local_info(fh, local, uncached=held == "passed")
        written = self.writeback.holds(inode) if self.writeback is not None else None
        if written is not None:  # (uploaded while opens of it as a file made here are outstanding)
            self._streams[fh] = self.cache.open_stream(node.obj, inode, (ctx.uid, ctx.gid))
            return kernel.FileInfo(fh=fh, keep_cache=False, direct_io=written == "passed")
        if passing:
            try:
                backing = self.passthrough.open(inode, node.obj, fh)
            except BackingChanged:  # (its cached file was found changed while other opens read it)
                raise Answered(errno.EIO) from None
            if backing:
                self.cache.opened(node.obj, (ctx.uid, ctx.gid))  # (what the prefetch plan learns from an open)
                return kernel.FileInfo(fh=fh, keep_cache=False, backing_id=backing)
        self._streams[fh] = self.cache.open_stream(node.obj, inode, (ctx.uid, ctx.gid))
        return kernel.FileInfo(fh=fh, keep_cache=True)

    def _kernel_writes(self) -> bool:
        """Whether the kernel may write a file made here itself (it negotiated passthrough)."""
        if not self.kernel_writes or self.session is None:
            return False
        wb = self._writer()
        assert wb.kernel is not None
        if not wb.kernel.active:
            return False
        if not self.session.can(kernel.PASSTHROUGH):
            return wb.kernel.off("the kernel offers no FUSE passthrough (Linux 6.9 and later)")
        return True

    def _local_info(self, fh: int, local: int, *, uncached: bool = False) -> kernel.FileInfo:
        """The answer to an open of a file made here: its backing file, or through the daemon (the page
        cache kept across opens only where the kernel never writes the data file behind it)."""
        backing = self._writer().backing(local)
        return kernel.FileInfo(fh=fh, keep_cache=not self.kernel_writes and not uncached, backing_id=backing,
                               direct_io=uncached and not backing)

    @_translated
    def read_now(self, fh: int, off: int, size: int, inode: int = 0, pid: int = 0,
                 reader: tuple[int, int] | None = None) -> bytes | memoryview | Callable[[], Awaitable[bytes | memoryview]]:
        """The bytes of a read if they are at hand (answered as the request is read), else the coroutine
        function that waits for them (run as a task). ``fh`` 0: a read with no open handle (``reader``,
        the READ's uid and gid, then stands for the open's)."""
        if inode == CONTROL_INODE:
            return b""  # (the control file reads empty: its channel is ioctls)
        started = time.perf_counter()
        stream = self._streams.get(fh) if fh else self._bound_stream(inode, pid, off, reader)
        if stream is None and fh not in self._local:  # (a passthrough open the kernel reads through us after all)
            node = self._node(inode)
            stream = self._streams[fh] = self.cache.open_stream(node.obj, inode)
        if stream is None:
            data = self._writer().read(self._local[fh], off, size)
        else:
            data = stream.read_now(off, size)
            if data is None:
                return functools.partial(self._read_rest, stream, off, size, started)
        self.read_latency.observe(time.perf_counter() - started)
        return data

    @_translated
    async def _read_rest(self, stream: ReadStream | MemberStream, off: int, size: int,
                         started: float) -> bytes | memoryview:
        try:
            return await stream.read(off, size)
        finally:
            self.read_latency.observe(time.perf_counter() - started)

    async def read(self, fh: int, off: int, size: int, inode: int = 0, pid: int = 0,
                   reader: tuple[int, int] | None = None) -> bytes | memoryview:
        """:meth:`read_now`, waiting for what it could not answer at once."""
        answer = self.read_now(fh, off, size, inode, pid, reader)
        return await answer() if callable(answer) else answer

    #: Readers kept at once with zero-message opens (the least recently used is let go).
    BOUND = 256

    def _bound_stream(self, inode: int, pid: int, off: int,
                      reader: tuple[int, int] | None = None) -> ReadStream | MemberStream:
        """The reader of a read with no open handle (zero-message opens): one per file and reading thread
        (the request's pid), for what a handle carried: sequential detection and readahead, the small
        file read whole, the prefetch plan told the file was opened (at each read from its start). The
        version read is the inode's: such a mount gives a changed file a new number, and keeps the old
        number readable while the kernel holds it (:meth:`switch`)."""
        key = (inode, pid)
        stream = self._bound.get(key)
        if stream is not None and off != 0:  # (an inode's version never changes on such a mount)
            self._bound.move_to_end(key)
            return stream
        node = self._node(inode)
        if node.is_dir or not node.in_backend:
            raise Answered(errno.EBADF)
        if stream is not None:
            stream.close()
        stream = self._bound[key] = self.cache.open_stream(node.obj, inode, reader)
        self._bound.move_to_end(key)
        while len(self._bound) > self.BOUND:
            _, old = self._bound.popitem(last=False)
            old.close()
        return stream

    @_translated
    def release(self, fh: int) -> None:
        if self.passthrough is not None:
            self.passthrough.release(fh)
        stream = self._streams.pop(fh, None)
        if stream is not None:
            stream.close()
        local = self._local.pop(fh, None)
        if local is not None:
            self._writer().release(local)

    # -- writing (write-back mounts) -------------------------------------------------------------------

    def _writes_in(self, parent: Node, ctx: kernel.RequestContext) -> None:
        """A name is written only in a directory of the caller's, root's or the mount's (:func:`writes_in`)."""
        writes_in(self._attrs(parent).st_uid, ctx.uid, self.present.default_uid, parent.path)

    @_translated
    def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: kernel.RequestContext) -> tuple[kernel.FileInfo, kernel.EntryAttributes]:
        parent = self._node(parent_inode)
        self._writes_in(parent, ctx)
        handle, f = self._writer().create(parent, name, mode & ~ctx.umask, ctx.uid, ctx.gid,
                                          kernel=self._kernel_writes())
        fh = self._new_fh()
        self._local[fh] = handle
        return self._local_info(fh, handle), self._attrs(f)

    @_translated
    def write(self, fh: int, off: int, buf: bytes) -> int:
        return self._writer().write(self._local[fh], off, buf)

    @_translated
    def flush(self, fh: int) -> None:
        if self.writeback is None:
            # Nothing to do at close() on a read-only mount: ENOSYS tells the kernel never to send FLUSH
            # again, one request less per file read.
            raise Answered(errno.ENOSYS)
        local = self._local.get(fh)
        if local is not None:
            self._writer().flush(local)

    @_translated
    async def fsync(self, fh: int, datasync: bool) -> None:
        local = self._local.get(fh)
        if local is not None:
            await self._writer().fsync(local)

    @_translated
    def setattr(self, inode: int, attr: kernel.EntryAttributes, fields: kernel.SetattrFields,
                      fh: int | None, ctx: kernel.RequestContext) -> kernel.EntryAttributes:
        wb = self._writer()
        node = self._node(inode)
        if fields.update_size:
            wb.truncate(node, attr.st_size)
            node = self._node(inode)  # an object truncated to 0 is a new local file
        if fields.update_mode or fields.update_uid or fields.update_gid or fields.update_mtime:
            wb.set_attrs(node, mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
                         mode=attr.st_mode if fields.update_mode else None,
                         uid=attr.st_uid if fields.update_uid else None,
                         gid=attr.st_gid if fields.update_gid else None)
        return self._attrs(node)

    @_translated
    def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: kernel.RequestContext) -> kernel.EntryAttributes:
        parent = self._node(parent_inode)
        self._writes_in(parent, ctx)
        return self._attrs(self._writer().mkdir(parent, name, mode & ~ctx.umask, ctx.uid, ctx.gid))

    @_translated
    def rmdir(self, parent_inode: int, name: bytes, ctx: kernel.RequestContext) -> None:
        self._writer().rmdir(self._node(parent_inode), name)

    @_translated
    def unlink(self, parent_inode: int, name: bytes, ctx: kernel.RequestContext) -> None:
        self._writer().unlink(self._node(parent_inode), name)

    @_translated
    def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: kernel.RequestContext) -> kernel.EntryAttributes:
        self._writer()
        raise Refused("objects cannot be hard-linked", errno.EPERM)

    @_translated
    def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: kernel.RequestContext) -> kernel.EntryAttributes:
        self._writer()
        raise Refused("the mount holds files and directories only", errno.EPERM)

    @_translated
    def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: kernel.RequestContext) -> kernel.EntryAttributes:
        self._writer()
        raise Refused("the mount holds files and directories only", errno.EPERM)

    @_translated
    def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: kernel.RequestContext) -> None:
        target = self._node(parent_inode_new)
        self._writes_in(target, ctx)
        self._writer().rename(self._node(parent_inode_old), name_old, target, name_new, flags)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def statistics(self) -> FsStats:
        session = self.session
        uring = getattr(session, "uring", None)
        return FsStats(self.read_latency.snapshot(), dict(self.errors),
                       session.isatty_asks if session is not None else 0,
                       uring.requests if uring is not None else None)

    # -- file system -----------------------------------------------------------------------------------

    @_translated
    def statfs(self, ctx: kernel.RequestContext) -> kernel.StatvfsData:
        st = kernel.StatvfsData()
        st.f_bsize = st.f_frsize = 4096
        st.f_blocks = -(-self.namespace.total_bytes // 4096)
        st.f_bfree = st.f_bavail = 0
        if self.writeback is not None:  # what may still be written: the cache not held by pending data
            free = self.writeback.room() // 4096
            st.f_blocks += free
            st.f_bfree = st.f_bavail = free
        st.f_files = len(self.namespace)
        st.f_ffree = st.f_favail = 0
        st.f_namemax = 255
        return st

    @_translated
    async def ioctl(self, inode: int, fh: int, cmd: int, data: bytes, out_size: int,
                    ctx: kernel.RequestContext) -> bytes:
        """The control channel's frames (:class:`ControlFile`), on the control file only."""
        if self.control is None or inode != CONTROL_INODE or cmd != self.control.command:
            raise Answered(errno.ENOTTY)
        return await self.control.call(ctx.uid, ctx.gid, ctx.pid, data)

    @_translated
    def getxattr(self, inode: int, name: bytes, ctx: kernel.RequestContext) -> bytes:
        if inode == CONTROL_INODE:
            raise Answered(kernel.ENOATTR)
        self._node(inode)
        getter = self.root_xattrs.get(bytes(name)) if inode == ROOT_INODE else None
        if getter is None:
            raise Answered(kernel.ENOATTR)
        return getter()

    @_translated
    def listxattr(self, inode: int, ctx: kernel.RequestContext) -> Sequence[bytes]:
        if inode == CONTROL_INODE:
            return []
        self._node(inode)
        return list(self.root_xattrs) if inode == ROOT_INODE else []
