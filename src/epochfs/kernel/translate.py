"""The requests: one row each (:data:`ROWS`): its opcode, the handler it calls (a method of
:class:`~epochfs.kernel.operations.Operations`), how its typed arguments (:mod:`epochfs.kernel.abi`'s
``*In`` tuples) become the call and the handler's answer the reply's bytes, and whether it may wait
(then it runs as a task). Adding a request is a row here, its arguments' row in ``abi.PARSERS``, and a
method of the interface; ``tests/test_kernel.py`` checks that every row's handler exists there with
the arguments the row passes. The session (:mod:`epochfs.kernel.session`) reads requests and routes
them here."""

from __future__ import annotations

import errno
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epochfs.kernel import abi
from epochfs.kernel.types import (
    EntryAttributes,
    FileInfo,
    FUSEError,
    ReaddirToken,
    RequestContext,
    SetattrFields,
)

Reply = list[bytes | memoryview]


def _ctx(req: abi.Request, umask: int = 0) -> RequestContext:
    return RequestContext(req.uid, req.gid, req.pid, umask)


def _entry(req: abi.Request, attr: EntryAttributes) -> Reply:
    return abi.reply(req.unique, abi.entry_out(attr))


def _done(req: abi.Request) -> Reply:
    return abi.reply(req.unique)


def _lookup(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.NameIn = req.args
    return _entry(req, fn(req.nodeid, a.name, _ctx(req)))


def _getattr(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    return abi.reply(req.unique, abi.attr_out(fn(req.nodeid, _ctx(req))))


def _setattr(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.SetattrIn = req.args
    valid = a.valid
    attr = EntryAttributes(st_ino=req.nodeid, st_mode=a.mode, st_uid=a.uid, st_gid=a.gid, st_size=a.size,
                           st_atime_ns=a.atime * 10**9 + a.atimensec,
                           st_mtime_ns=a.mtime * 10**9 + a.mtimensec,
                           st_ctime_ns=a.ctime * 10**9 + a.ctimensec)
    now = time.time_ns()
    if valid & abi.FATTR_ATIME_NOW:
        attr.st_atime_ns = now
    if valid & abi.FATTR_MTIME_NOW:
        attr.st_mtime_ns = now
    fields = SetattrFields(update_atime=bool(valid & (abi.FATTR_ATIME | abi.FATTR_ATIME_NOW)),
                           update_mtime=bool(valid & (abi.FATTR_MTIME | abi.FATTR_MTIME_NOW)),
                           update_ctime=bool(valid & abi.FATTR_CTIME), update_mode=bool(valid & abi.FATTR_MODE),
                           update_uid=bool(valid & abi.FATTR_UID), update_gid=bool(valid & abi.FATTR_GID),
                           update_size=bool(valid & abi.FATTR_SIZE))
    fh = a.fh if valid & abi.FATTR_FH else None
    return abi.reply(req.unique, abi.attr_out(fn(req.nodeid, attr, fields, fh, _ctx(req))))


def _open(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.OpenIn = req.args
    info: FileInfo = fn(req.nodeid, a.flags, _ctx(req))
    return abi.reply(req.unique, abi.open_out(info.fh, info.flags(), info.backing_id))


def _opendir(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    return abi.reply(req.unique, abi.open_out(fn(req.nodeid, _ctx(req)), 0))


def _readdir(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.ReadIn = req.args
    token = ReaddirToken(a.size, req.opcode == abi.READDIRPLUS)
    fn(a.fh, a.offset, token)
    return abi.reply(req.unique, b"".join(token.parts))


def _release(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.ReleaseIn = req.args
    fn(a.fh)
    return _done(req)


def _flush(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.FlushIn = req.args
    fn(a.fh)
    return _done(req)


def _create(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.CreateIn = req.args
    info, attr = fn(req.nodeid, a.name, a.mode, a.flags, _ctx(req, a.umask))
    return abi.reply(req.unique, abi.entry_out(attr), abi.open_out(info.fh, info.flags(), info.backing_id))


def _write(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.WriteIn = req.args
    n = fn(a.fh, a.offset, a.data)
    return abi.reply(req.unique, abi.WRITE_OUT.pack(n, 0))


def _mkdir(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.MkdirIn = req.args
    return _entry(req, fn(req.nodeid, a.name, a.mode, _ctx(req, a.umask)))


def _mknod(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.MknodIn = req.args
    return _entry(req, fn(req.nodeid, a.name, a.mode, a.rdev, _ctx(req, a.umask)))


def _symlink(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.SymlinkIn = req.args
    return _entry(req, fn(req.nodeid, a.name, a.target, _ctx(req)))


def _link(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.LinkIn = req.args
    return _entry(req, fn(a.oldnodeid, req.nodeid, a.name, _ctx(req)))


def _unlink(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.NameIn = req.args
    fn(req.nodeid, a.name, _ctx(req))
    return _done(req)


def _rename(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.RenameIn = req.args
    fn(req.nodeid, a.old, a.newdir, a.new, a.flags, _ctx(req))
    return _done(req)


def _statfs(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    return abi.reply(req.unique, abi.statfs_out(fn(_ctx(req))))


def _getxattr(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.GetxattrIn = req.args
    return _sized(req.unique, a.size, bytes(fn(req.nodeid, a.name, _ctx(req))))


def _listxattr(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.ListxattrIn = req.args
    return _sized(req.unique, a.size, abi.xattr_names(fn(req.nodeid, _ctx(req))))


def _sized(unique: int, size: int, value: bytes) -> Reply:
    if size == 0:
        return abi.reply(unique, abi.XATTR_SIZE_OUT.pack(len(value), 0))
    if len(value) > size:
        raise FUSEError(errno.ERANGE)
    return abi.reply(unique, value)


async def _read(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.ReadIn = req.args
    return read_reply(req, await fn(a.fh, a.offset, a.size, req.nodeid, req.pid, (req.uid, req.gid)))


async def waited_read(req: abi.Request, rest: Callable[[], Any]) -> Reply:
    """A READ whose handler's ``read_now`` gave a coroutine function to wait for."""
    return read_reply(req, await rest())


def read_reply(req: abi.Request, data: bytes | memoryview) -> Reply:
    a: abi.ReadIn = req.args
    if len(data) > a.size:
        data = memoryview(data)[:a.size]
    return abi.reply(req.unique, data)


async def _ioctl(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.IoctlIn = req.args
    out = bytes(await fn(req.nodeid, a.fh, a.cmd, a.data, a.out_size, _ctx(req)))
    if len(out) > a.out_size:
        raise FUSEError(errno.EOVERFLOW)
    return abi.reply(req.unique, abi.IOCTL_OUT.pack(0, 0, 0, 0), out)


async def _fsync(req: abi.Request, fn: Callable[..., Any]) -> Reply:
    a: abi.FsyncIn = req.args
    await fn(a.fh, a.datasync)
    return _done(req)


@dataclass(frozen=True)
class Row:
    """One request: the handler it calls, how (``call``: the arguments in, the reply out), the number of
    arguments ``call`` passes the handler, and whether the handler may wait (a coroutine, run as a task)."""

    handler: str
    call: Callable[[abi.Request, Callable[..., Any]], Any]
    arity: int
    waits: bool = False


#: Every request the daemon answers (FORGET, BATCH_FORGET, INTERRUPT, INIT and DESTROY are the
#: session's own; any other opcode is answered ENOSYS).
ROWS: dict[int, Row] = {
    abi.LOOKUP: Row("lookup", _lookup, 3),
    abi.GETATTR: Row("getattr", _getattr, 2),
    abi.SETATTR: Row("setattr", _setattr, 5),
    abi.OPEN: Row("open", _open, 3),
    abi.READ: Row("read", _read, 6, waits=True),
    abi.WRITE: Row("write", _write, 3),
    abi.RELEASE: Row("release", _release, 1),
    abi.FLUSH: Row("flush", _flush, 1),
    abi.FSYNC: Row("fsync", _fsync, 2, waits=True),
    abi.OPENDIR: Row("opendir", _opendir, 2),
    abi.READDIR: Row("readdir", _readdir, 3),
    abi.READDIRPLUS: Row("readdir", _readdir, 3),
    abi.RELEASEDIR: Row("releasedir", _release, 1),
    abi.CREATE: Row("create", _create, 5),
    abi.MKDIR: Row("mkdir", _mkdir, 4),
    abi.MKNOD: Row("mknod", _mknod, 5),
    abi.SYMLINK: Row("symlink", _symlink, 4),
    abi.LINK: Row("link", _link, 4),
    abi.UNLINK: Row("unlink", _unlink, 3),
    abi.RMDIR: Row("rmdir", _unlink, 3),
    abi.RENAME: Row("rename", _rename, 6),
    abi.RENAME2: Row("rename", _rename, 6),
    abi.STATFS: Row("statfs", _statfs, 1),
    abi.GETXATTR: Row("getxattr", _getxattr, 3),
    abi.LISTXATTR: Row("listxattr", _listxattr, 2),
    abi.IOCTL: Row("ioctl", _ioctl, 6, waits=True),
}


def handlers_of(ops: Any) -> dict[str, tuple[Callable[..., Any], bool]]:
    """The handlers ``ops`` has, and whether each is a coroutine function (then its request runs as a
    task: a row that may wait needs one, a row that may not needs a plain one)."""
    found: dict[str, tuple[Callable[..., Any], bool]] = {}
    waits = {row.handler: row.waits for row in ROWS.values()}
    for name, must_wait in [*waits.items(), ("forget", False)]:
        fn = getattr(ops, name, None)
        if fn is None:
            continue
        is_async = inspect.iscoroutinefunction(fn)
        if is_async != must_wait:
            raise TypeError(f"{type(ops).__name__}.{name} must be {'a coroutine' if must_wait else 'a plain'} function")
        found[name] = (fn, is_async)
    return found
