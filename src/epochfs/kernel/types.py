"""What a file system's handlers take and return: attributes, an open file's answer, a request's
caller, directory listings, and the error that answers an errno; and what a user of backing files
needs of the session (:class:`Backings`)."""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field
from typing import Protocol

from epochfs.kernel import abi

ENOATTR = errno.ENODATA

log = logging.getLogger(__name__)


class Backings(Protocol):
    """The session's backing files (passthrough: :meth:`epochfs.kernel.Session.backing_open`)."""

    def backing_open(self, fd: int) -> int: ...

    def backing_close(self, backing_id: int) -> None: ...


def let_backing_go(session: Backings | None, backing_id: int) -> None:
    """Let a backing id go where the session is still there (an unmounted one has let them all go)."""
    if session is None:
        return
    try:
        session.backing_close(backing_id)
    except OSError as exc:  # (unmounted)
        log.debug("backing id %d not closed: %s", backing_id, exc)


class FUSEError(Exception):
    """Answer the request with ``errno``."""

    __slots__ = ("errno",)

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_

    def __str__(self) -> str:
        return f"FUSEError({errno.errorcode.get(self.errno, self.errno)})"


@dataclass(slots=True)
class EntryAttributes:
    st_ino: int = 0
    generation: int = 0
    entry_timeout: float = 300.0
    attr_timeout: float = 300.0
    st_mode: int = 0
    st_nlink: int = 0
    st_uid: int = 0
    st_gid: int = 0
    st_rdev: int = 0
    st_size: int = 0
    st_blksize: int = 4096
    st_blocks: int = 0
    st_atime_ns: int = 0
    st_mtime_ns: int = 0
    st_ctime_ns: int = 0


@dataclass(slots=True)
class FileInfo:
    fh: int = 0
    keep_cache: bool = True
    direct_io: bool = False
    nonseekable: bool = False
    #: A passthrough open (:meth:`Session.backing_open`): the kernel reads this backing file itself.
    backing_id: int = 0

    def flags(self) -> int:
        if self.backing_id:
            return abi.FOPEN_PASSTHROUGH
        return ((abi.FOPEN_KEEP_CACHE if self.keep_cache else 0) | (abi.FOPEN_DIRECT_IO if self.direct_io else 0)
                | (abi.FOPEN_NONSEEKABLE if self.nonseekable else 0))


@dataclass(slots=True)
class RequestContext:
    uid: int = 0
    gid: int = 0
    pid: int = 0
    umask: int = 0


@dataclass(slots=True)
class SetattrFields:
    update_atime: bool = False
    update_mtime: bool = False
    update_ctime: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_size: bool = False


@dataclass(slots=True)
class StatvfsData:
    f_bsize: int = 0
    f_frsize: int = 0
    f_blocks: int = 0
    f_bfree: int = 0
    f_bavail: int = 0
    f_files: int = 0
    f_ffree: int = 0
    f_favail: int = 0
    f_namemax: int = 255


@dataclass(slots=True)
class ReaddirToken:
    """Where :func:`readdir_reply` puts the entries of one READDIR(PLUS) reply, at most ``size`` bytes."""

    size: int
    plus: bool
    parts: list[bytes] = field(default_factory=list)
    used: int = 0


def readdir_reply(token: ReaddirToken, name: bytes, attr: EntryAttributes, next_id: int) -> bool:
    """Add an entry; False (and nothing added) if the reply is full. ``next_id`` is where a later
    READDIR continues after this entry."""
    size = abi.dirent_size(name, token.plus)
    if token.used + size > token.size:
        return False
    token.parts.append(abi.dirent(name, attr, next_id, token.plus))
    token.used += size
    return True
