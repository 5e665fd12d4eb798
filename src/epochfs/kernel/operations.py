"""What a file system answers the kernel: one method per request (:data:`epochfs.kernel.translate.ROWS`),
typed, each answering ENOSYS until a file system overrides it (for OPEN and FLUSH, ENOSYS tells the
kernel not to send them again). A handler raises :class:`~epochfs.kernel.types.FUSEError` to answer an
errno; the session answers anything else EIO. ``read`` and ``fsync`` are coroutines (they may wait; each
runs as a task); every other handler is called as its request is read.

A file system may also have ``read_now(fh, offset, size, inode, pid, reader)``: the bytes of a READ if
they are at hand, else a coroutine function to wait on; the session then answers READ through it.
``reader`` is the (uid, gid) the kernel named in the READ's header."""

from __future__ import annotations

import errno
from collections.abc import Sequence

from epochfs.kernel.types import (
    EntryAttributes,
    FileInfo,
    FUSEError,
    ReaddirToken,
    RequestContext,
    SetattrFields,
    StatvfsData,
)


def _unsupported() -> FUSEError:
    return FUSEError(errno.ENOSYS)


class Operations:
    # -- names and attributes
    def lookup(self, parent_inode: int, name: bytes, ctx: RequestContext) -> EntryAttributes:
        raise _unsupported()

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """The kernel forgot these (inode, lookups) (no reply)."""

    def getattr(self, inode: int, ctx: RequestContext) -> EntryAttributes:
        raise _unsupported()

    def setattr(self, inode: int, attr: EntryAttributes, fields: SetattrFields, fh: int | None,
                ctx: RequestContext) -> EntryAttributes:
        raise _unsupported()

    def statfs(self, ctx: RequestContext) -> StatvfsData:
        raise _unsupported()

    def getxattr(self, inode: int, name: bytes, ctx: RequestContext) -> bytes:
        raise _unsupported()

    def listxattr(self, inode: int, ctx: RequestContext) -> Sequence[bytes]:
        raise _unsupported()

    # -- directories
    def opendir(self, inode: int, ctx: RequestContext) -> int:
        raise _unsupported()

    def readdir(self, fh: int, start_id: int, token: ReaddirToken) -> None:
        raise _unsupported()

    def releasedir(self, fh: int) -> None:
        raise _unsupported()

    def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: RequestContext) -> EntryAttributes:
        raise _unsupported()

    def rmdir(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        raise _unsupported()

    def unlink(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        raise _unsupported()

    def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int,
               ctx: RequestContext) -> None:
        raise _unsupported()

    def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: RequestContext) -> EntryAttributes:
        raise _unsupported()

    def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: RequestContext) -> EntryAttributes:
        raise _unsupported()

    def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: RequestContext) -> EntryAttributes:
        raise _unsupported()

    # -- files
    def open(self, inode: int, flags: int, ctx: RequestContext) -> FileInfo:
        raise _unsupported()

    def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
               ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        raise _unsupported()

    async def read(self, fh: int, off: int, size: int, inode: int = 0, pid: int = 0,
                   reader: tuple[int, int] | None = None) -> bytes | memoryview:
        raise _unsupported()

    def write(self, fh: int, off: int, buf: bytes) -> int:
        raise _unsupported()

    def flush(self, fh: int) -> None:
        raise _unsupported()

    async def fsync(self, fh: int, datasync: bool) -> None:
        raise _unsupported()

    def release(self, fh: int) -> None:
        raise _unsupported()

    #: The ioctl commands :meth:`ioctl` answers; any other is answered ENOTTY as its request is read
    #: (the kernel asks whether a file is a terminal on every buffered open).
    ioctl_commands: frozenset[int] = frozenset()

    async def ioctl(self, inode: int, fh: int, cmd: int, data: bytes, out_size: int,
                    ctx: RequestContext) -> bytes:
        """A restricted ioctl: ``data`` in (as many bytes as ``cmd``'s size says), at most ``out_size``
        bytes back."""
        raise FUSEError(errno.ENOTTY)
