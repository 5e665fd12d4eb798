"""The FUSE kernel protocol, versions 7.31 to 7.38, and 7.40's passthrough where it is negotiated
(``linux/fuse.h``): request parsing and reply encoding, pure.

Every minor from 7.31 (Linux 5.4: Ubuntu 20.04) on is spoken, each as that minor's kernel expects it:
the replies this module encodes have the same layout in all of them (``fuse_entry_out``, ``fuse_attr_out``
and ``fuse_open_out`` since 7.9, ``fuse_init_out`` with ``max_pages`` since 7.28; ``fuse_attr.flags``,
7.32, and ``flags2``, 7.36, are written 0), and what a minor adds is used only where it is negotiated:
``fuse_init_in``'s ``flags2`` only with ``FUSE_INIT_EXT`` (7.36), ``fuse_in_header.total_extlen`` only
from 7.38 (before, that field is padding), INIT flags only those the kernel offers
(:data:`FLAG_MINOR` says where each appeared). Passthrough (7.40, :data:`PASSTHROUGH`): the INIT reply's
``max_stack_depth`` and an open reply's ``backing_id`` (both were unused fields before, and are read
only when the flag is negotiated); the backing ids themselves come from ioctls on ``/dev/fuse``
(:data:`BACKING_OPEN`, :data:`BACKING_CLOSE`).

A request is the 40-byte ``fuse_in_header`` and the opcode's arguments; a reply is the 16-byte
``fuse_out_header`` and the opcode's result. Nothing here touches ``/dev/fuse``: :func:`parse` turns a
request's bytes into a :class:`Request` (raising :class:`Malformed` on anything it cannot trust), the
``encode_*`` functions build replies and notifications. :mod:`epochfs.kernel.session` does the I/O.
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

MAJOR = 7
MINOR = 38  # what this module speaks; the kernel adapts to it

ROOT_INODE = 1  # FUSE_ROOT_ID: the inode number of the mount's root (the namespace numbers from it)

# opcodes
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE, STATFS, RELEASE = 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18
FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = 20, 21, 22, 23, 24, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, GETLK, SETLK, SETLKW, ACCESS, CREATE = 27, 28, 29, 30, 31, 32, 33, 34, 35
INTERRUPT, BMAP, DESTROY, IOCTL, POLL, NOTIFY_REPLY, BATCH_FORGET, FALLOCATE = 36, 37, 38, 39, 40, 41, 42, 43
READDIRPLUS, RENAME2, LSEEK, COPY_FILE_RANGE = 44, 45, 46, 47

# INIT flags (fuse_init_in.flags, and flags2 << 32)
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37  # (flags2 bit 5)
OVER_IO_URING = 1 << 41  # (flags2 bit 9; 6.14: requests through an io_uring, kernel/uring.py)
#: The minor each INIT flag this module knows appeared in (a kernel of an earlier one never offers it).
FLAG_MINOR = {ASYNC_READ: 6, ATOMIC_O_TRUNC: 9, BIG_WRITES: 9, AUTO_INVAL_DATA: 20, DO_READDIRPLUS: 21,
              ASYNC_DIO: 22, WRITEBACK_CACHE: 23, NO_OPEN_SUPPORT: 23, PARALLEL_DIROPS: 25, MAX_PAGES: 28,
              INIT_EXT: 36, PASSTHROUGH: 40, OVER_IO_URING: 42}
#: The oldest minor spoken.
OLDEST = 31
#: The minor where the in-header's padding became ``total_extlen``.
EXTLEN_MINOR = 38
#: The minor spoken when passthrough is negotiated (its fields are 7.40's).
PASSTHROUGH_MINOR = 40

# open reply flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

# ioctls on /dev/fuse (7.40): register an open file as a backing file (an id back), and let one go
BACKING_MAP = struct.Struct("<iIQ")  # fd, flags, padding
BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32_t)

# setattr valid bits
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH, FATTR_ATIME_NOW, FATTR_MTIME_NOW = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
FATTR_CTIME = 1 << 10

# notification codes
NOTIFY_INVAL_INODE, NOTIFY_INVAL_ENTRY, NOTIFY_STORE = 2, 3, 4

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
IN_HEAD = struct.Struct("<IIQ")  # IN_HEADER's first fields (len opcode unique): what an answer before parsing needs
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
_ATTR = "QQQQQQIIIIIIIIII"
ATTR_OUT = struct.Struct("<QII" + _ATTR)
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
WRITE_OUT = struct.Struct("<II")
XATTR_SIZE_OUT = struct.Struct("<II")
IOCTL_IN = struct.Struct("<QIIQII")  # fh flags cmd arg in_size out_size
IOCTL_OUT = struct.Struct("<iIII")  # result flags in_iovs out_iovs
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
INIT_IN = struct.Struct("<IIII")
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # ... max_pages map_alignment flags2 max_stack_depth
DIRENT = struct.Struct("<QQII")
NOTIFY_STORE_OUT = struct.Struct("<QQII")
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")

_READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
_WRITE_IN = _READ_IN
_OPEN_IN = struct.Struct("<II")
_CREATE_IN = struct.Struct("<IIII")
_MKDIR_IN = struct.Struct("<II")
_MKNOD_IN = struct.Struct("<IIII")
_RELEASE_IN = struct.Struct("<QIIQ")
_FLUSH_IN = struct.Struct("<QIIQ")
_FSYNC_IN = struct.Struct("<QII")
_GETATTR_IN = struct.Struct("<IIQ")
_SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
_FORGET_IN = struct.Struct("<Q")
_BATCH_FORGET_IN = struct.Struct("<II")
_FORGET_ONE = struct.Struct("<QQ")
_RENAME_IN = struct.Struct("<Q")
_RENAME2_IN = struct.Struct("<QII")
_LINK_IN = struct.Struct("<Q")
_XATTR_IN = struct.Struct("<II")
_INTERRUPT_IN = struct.Struct("<Q")

MAX_NAME = 4096  # longer names are refused (the kernel's own limit is 1024 for a component)


class Malformed(ValueError):
    """A request whose bytes do not hold what its opcode needs."""


@dataclass(slots=True)
class Request:
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    args: Any = None  #: the opcode's arguments: one of the ``*In`` tuples below (``NoArgs`` where it has none)


def _names(data: memoryview, count: int) -> list[bytes]:
    """``count`` NUL-terminated names from ``data``."""
    raw = bytes(data)
    out: list[bytes] = []
    start = 0
    for _ in range(count):
        end = raw.find(b"\0", start)
        if end < 0:
            raise Malformed("name without its terminating NUL")
        name = raw[start:end]
        if len(name) > MAX_NAME:
            raise Malformed("name too long")
        out.append(name)
        start = end + 1
    return out


def _fixed(st: struct.Struct, data: memoryview) -> tuple[Any, ...]:
    if len(data) < st.size:
        raise Malformed(f"{len(data)} bytes of arguments, {st.size} needed")
    return st.unpack_from(data)


def parse(buf: memoryview | bytes, minor: int = MINOR) -> Request:
    """The request in ``buf`` (one read of ``/dev/fuse``) of protocol 7.``minor``. Names and written data
    are copied out, so ``buf`` may be reused at once. Raises :class:`Malformed`."""
    view = memoryview(buf)
    if len(view) < IN_HEADER.size:
        raise Malformed("shorter than a request header")
    length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = IN_HEADER.unpack_from(view)
    if minor < EXTLEN_MINOR:
        extlen = 0  # (padding before 7.38)
    if length != len(view):
        raise Malformed(f"header says {length} bytes, {len(view)} read")
    end = length - extlen * 8
    if end < IN_HEADER.size:
        raise Malformed("extensions longer than the request")
    data = view[IN_HEADER.size:end]
    parse_args = PARSERS.get(opcode)
    args = parse_args(data, nodeid) if parse_args is not None else NoArgs()
    return Request(opcode, unique, nodeid, uid, gid, pid, args)


# -- each request's arguments: one typed row per opcode (:data:`PARSERS`) ---------------------------------

class NoArgs(NamedTuple):
    """A request with no arguments the daemon reads (GETATTR's flags aside, STATFS, DESTROY...)."""


class NameIn(NamedTuple):  # LOOKUP, UNLINK, RMDIR
    name: bytes


class ReadIn(NamedTuple):  # READ, READDIR, READDIRPLUS
    fh: int
    offset: int
    size: int


class WriteIn(NamedTuple):
    fh: int
    offset: int
    write_flags: int
    data: bytes


class IoctlIn(NamedTuple):
    """A restricted ioctl of a file of the mount: its command (whose size field the kernel copied
    ``data`` in by, and will copy at most ``out_size`` bytes back by) and its input bytes."""

    fh: int
    flags: int
    cmd: int
    in_size: int
    out_size: int
    data: bytes


class OpenIn(NamedTuple):  # OPEN, OPENDIR
    flags: int


class ReleaseIn(NamedTuple):  # RELEASE, RELEASEDIR
    fh: int
    flags: int
    release_flags: int


class FlushIn(NamedTuple):
    fh: int


class FsyncIn(NamedTuple):  # FSYNC, FSYNCDIR
    fh: int
    datasync: bool


class GetattrIn(NamedTuple):
    fh: int | None  # the open file the kernel asks through, if it says


class SetattrIn(NamedTuple):
    valid: int  # FATTR_* bits: which of the rest to set
    fh: int
    size: int
    atime: int
    mtime: int
    ctime: int
    atimensec: int
    mtimensec: int
    ctimensec: int
    mode: int
    uid: int
    gid: int


class CreateIn(NamedTuple):
    flags: int
    mode: int
    umask: int
    name: bytes


class MkdirIn(NamedTuple):
    mode: int
    umask: int
    name: bytes


class MknodIn(NamedTuple):
    mode: int
    rdev: int
    umask: int
    name: bytes


class SymlinkIn(NamedTuple):
    name: bytes
    target: bytes


class RenameIn(NamedTuple):  # RENAME, RENAME2
    newdir: int
    flags: int
    old: bytes
    new: bytes


class LinkIn(NamedTuple):
    oldnodeid: int
    name: bytes


class GetxattrIn(NamedTuple):
    size: int
    name: bytes


class ListxattrIn(NamedTuple):
    size: int


class ForgetIn(NamedTuple):  # FORGET, BATCH_FORGET
    forgets: list[tuple[int, int]]  # (inode, lookups to forget)


class InitIn(NamedTuple):
    major: int
    minor: int
    max_readahead: int
    flags: int  # flags | flags2 << 32 (with INIT_EXT)


class InterruptIn(NamedTuple):
    target: int


def _none(data: memoryview, nodeid: int) -> NoArgs:
    return NoArgs()


def _name(data: memoryview, nodeid: int) -> NameIn:
    return NameIn(*_names(data, 1))


def _read_in(data: memoryview, nodeid: int) -> ReadIn:
    fh, offset, size, *_ = _fixed(_READ_IN, data)
    return ReadIn(fh, offset, size)


def _write_in(data: memoryview, nodeid: int) -> WriteIn:
    fh, offset, size, write_flags, *_ = _fixed(_WRITE_IN, data)
    payload = data[_WRITE_IN.size:]
    if len(payload) != size:
        raise Malformed(f"write of {size} bytes carries {len(payload)}")
    return WriteIn(fh, offset, write_flags, bytes(payload))


def _ioctl_in(data: memoryview, nodeid: int) -> IoctlIn:
    fh, flags, cmd, _arg, in_size, out_size = _fixed(IOCTL_IN, data)
    payload = data[IOCTL_IN.size:]
    if len(payload) != in_size:
        raise Malformed(f"ioctl of {in_size} input bytes carries {len(payload)}")
    return IoctlIn(fh, flags, cmd, in_size, out_size, bytes(payload))


def _open_in(data: memoryview, nodeid: int) -> OpenIn:
    return OpenIn(_fixed(_OPEN_IN, data)[0])


def _release_in(data: memoryview, nodeid: int) -> ReleaseIn:
    fh, flags, release_flags, _ = _fixed(_RELEASE_IN, data)
    return ReleaseIn(fh, flags, release_flags)


def _flush_in(data: memoryview, nodeid: int) -> FlushIn:
    return FlushIn(_fixed(_FLUSH_IN, data)[0])


def _fsync_in(data: memoryview, nodeid: int) -> FsyncIn:
    fh, flags, _ = _fixed(_FSYNC_IN, data)
    return FsyncIn(fh, bool(flags & 1))


def _getattr_in(data: memoryview, nodeid: int) -> GetattrIn:
    flags, _, fh = _fixed(_GETATTR_IN, data)
    return GetattrIn(fh if flags & 1 else None)


def _setattr_in(data: memoryview, nodeid: int) -> SetattrIn:
    (valid, _, fh, size, _, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, _, uid, gid,
     _) = _fixed(_SETATTR_IN, data)
    return SetattrIn(valid, fh, size, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, uid, gid)


def _create_in(data: memoryview, nodeid: int) -> CreateIn:
    flags, mode, umask, _ = _fixed(_CREATE_IN, data)
    return CreateIn(flags, mode, umask, *_names(data[_CREATE_IN.size:], 1))


def _mkdir_in(data: memoryview, nodeid: int) -> MkdirIn:
    mode, umask = _fixed(_MKDIR_IN, data)
    return MkdirIn(mode, umask, *_names(data[_MKDIR_IN.size:], 1))


def _mknod_in(data: memoryview, nodeid: int) -> MknodIn:
    mode, rdev, umask, _ = _fixed(_MKNOD_IN, data)
    return MknodIn(mode, rdev, umask, *_names(data[_MKNOD_IN.size:], 1))


def _symlink_in(data: memoryview, nodeid: int) -> SymlinkIn:
    return SymlinkIn(*_names(data, 2))


def _rename_in(data: memoryview, nodeid: int) -> RenameIn:
    newdir, = _fixed(_RENAME_IN, data)
    return RenameIn(newdir, 0, *_names(data[_RENAME_IN.size:], 2))


def _rename2_in(data: memoryview, nodeid: int) -> RenameIn:
    newdir, flags, _ = _fixed(_RENAME2_IN, data)
    return RenameIn(newdir, flags, *_names(data[_RENAME2_IN.size:], 2))


def _link_in(data: memoryview, nodeid: int) -> LinkIn:
    oldnodeid, = _fixed(_LINK_IN, data)
    return LinkIn(oldnodeid, *_names(data[_LINK_IN.size:], 1))


def _getxattr_in(data: memoryview, nodeid: int) -> GetxattrIn:
    size, _ = _fixed(_XATTR_IN, data)
    return GetxattrIn(size, *_names(data[_XATTR_IN.size:], 1))


def _listxattr_in(data: memoryview, nodeid: int) -> ListxattrIn:
    return ListxattrIn(_fixed(_XATTR_IN, data)[0])


def _forget_in(data: memoryview, nodeid: int) -> ForgetIn:
    nlookup, = _fixed(_FORGET_IN, data)
    return ForgetIn([(nodeid, nlookup)])


def _batch_forget_in(data: memoryview, nodeid: int) -> ForgetIn:
    count, _ = _fixed(_BATCH_FORGET_IN, data)
    body = data[_BATCH_FORGET_IN.size:]
    if count * _FORGET_ONE.size > len(body):
        raise Malformed(f"batch of {count} forgets in {len(body)} bytes")
    return ForgetIn([_FORGET_ONE.unpack_from(body, i * _FORGET_ONE.size) for i in range(count)])


def _init_in(data: memoryview, nodeid: int) -> InitIn:
    major, minor, max_readahead, flags = _fixed(INIT_IN, data)
    if flags & INIT_EXT and len(data) >= INIT_IN.size + 4:
        flags |= struct.unpack_from("<I", data, INIT_IN.size)[0] << 32
    return InitIn(major, minor, max_readahead, flags)


def _interrupt_in(data: memoryview, nodeid: int) -> InterruptIn:
    return InterruptIn(_fixed(_INTERRUPT_IN, data)[0])


#: How each opcode's arguments are read (an opcode not here has none the daemon reads: :class:`NoArgs`).
PARSERS: dict[int, Callable[[memoryview, int], Any]] = {
    LOOKUP: _name, UNLINK: _name, RMDIR: _name,
    READ: _read_in, READDIR: _read_in, READDIRPLUS: _read_in, WRITE: _write_in,
    OPEN: _open_in, OPENDIR: _open_in, RELEASE: _release_in, RELEASEDIR: _release_in, FLUSH: _flush_in,
    FSYNC: _fsync_in, FSYNCDIR: _fsync_in, GETATTR: _getattr_in, SETATTR: _setattr_in,
    CREATE: _create_in, MKDIR: _mkdir_in, MKNOD: _mknod_in, SYMLINK: _symlink_in,
    RENAME: _rename_in, RENAME2: _rename2_in, LINK: _link_in, GETXATTR: _getxattr_in, LISTXATTR: _listxattr_in,
    FORGET: _forget_in, BATCH_FORGET: _batch_forget_in, INIT: _init_in, INTERRUPT: _interrupt_in,
    STATFS: _none, DESTROY: _none, IOCTL: _ioctl_in,
}


# -- replies -------------------------------------------------------------------------------------------

def reply(unique: int, *parts: bytes | memoryview) -> list[bytes | memoryview]:
    """The iovec of a successful reply carrying ``parts``."""
    size = OUT_HEADER.size + sum(len(p) for p in parts)
    return [OUT_HEADER.pack(size, 0, unique), *parts]


def error(unique: int, errno_: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size, -errno_, unique)


def _split(seconds: float) -> tuple[int, int]:
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def _ns(ns: int) -> tuple[int, int]:
    return ns // 1_000_000_000, ns % 1_000_000_000


def _attr_fields(a: Any) -> tuple[int, ...]:
    at, atn = _ns(a.st_atime_ns)
    mt, mtn = _ns(a.st_mtime_ns)
    ct, ctn = _ns(a.st_ctime_ns)
    return (a.st_ino, a.st_size, a.st_blocks, at, mt, ct, atn, mtn, ctn, a.st_mode, a.st_nlink,
            a.st_uid, a.st_gid, a.st_rdev, a.st_blksize, 0)


def entry_out(a: Any) -> bytes:
    """``fuse_entry_out`` of an :class:`~epochfs.kernel.types.EntryAttributes`."""
    ev, evn = _split(a.entry_timeout)
    av, avn = _split(a.attr_timeout)
    return ENTRY_OUT.pack(a.st_ino, a.generation, ev, av, evn, avn, *_attr_fields(a))


def attr_out(a: Any) -> bytes:
    av, avn = _split(a.attr_timeout)
    return ATTR_OUT.pack(av, avn, 0, *_attr_fields(a))


def open_out(fh: int, flags: int, backing_id: int = 0) -> bytes:
    return OPEN_OUT.pack(fh, flags, backing_id)


def statfs_out(s: Any) -> bytes:
    return STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize,
                           s.f_namemax, s.f_frsize, 0)


def dirent_size(name: bytes, plus: bool) -> int:
    return ((ENTRY_OUT.size if plus else 0) + DIRENT.size + len(name) + 7) & ~7


def dirent(name: bytes, a: Any, next_offset: int, plus: bool) -> bytes:
    """One ``fuse_direntplus`` (or ``fuse_dirent``), padded to 8 bytes."""
    head = DIRENT.pack(a.st_ino, next_offset, len(name), stat.S_IFMT(a.st_mode) >> 12)
    body = (entry_out(a) if plus else b"") + head + name
    return body + b"\0" * (-len(body) % 8)


def xattr_names(names: Sequence[bytes]) -> bytes:
    return b"".join(bytes(n) + b"\0" for n in names)


def notify(code: int, *parts: bytes | memoryview) -> list[bytes | memoryview]:
    size = OUT_HEADER.size + sum(len(p) for p in parts)
    return [OUT_HEADER.pack(size, code, 0), *parts]
