"""The requests: each row of :data:`DISPATCH` turns a parsed request (:mod:`epochfs.kernel.abi`) into a
call of its handler and the handler's answer into the reply's bytes. The session
(:mod:`epochfs.kernel.session`) reads requests and routes them here."""

from __future__ import annotations

import errno
import inspect
import time
from collections.abc import Callable
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


def _ctx(req: abi.Request, umask: int = 0) -> RequestContext:
    return RequestContext(req.uid, req.gid, req.pid, umask)


def _entry(s: Any, req: abi.Request, attr: EntryAttributes) -> list[bytes | memoryview]:
    return abi.reply(req.unique, abi.entry_out(attr))


def _done(req: abi.Request) -> list[bytes | memoryview]:
    return abi.reply(req.unique)


def _lookup(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return _entry(s, req, fn(req.nodeid, req.args["name"], _ctx(req)))


def _getattr(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return abi.reply(req.unique, abi.attr_out(fn(req.nodeid, _ctx(req))))


def _setattr(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    valid = a["valid"]
    attr = EntryAttributes(st_ino=req.nodeid, st_mode=a["mode"], st_uid=a["uid"], st_gid=a["gid"], st_size=a["size"],
                           st_atime_ns=a["atime"] * 10**9 + a["atimensec"],
                           st_mtime_ns=a["mtime"] * 10**9 + a["mtimensec"],
                           st_ctime_ns=a["ctime"] * 10**9 + a["ctimensec"])
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
    fh = a["fh"] if valid & abi.FATTR_FH else None
    return abi.reply(req.unique, abi.attr_out(fn(req.nodeid, attr, fields, fh, _ctx(req))))


def _open(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    info: FileInfo = fn(req.nodeid, req.args["flags"], _ctx(req))
    return abi.reply(req.unique, abi.open_out(info.fh, info.flags(), info.backing_id))


def _opendir(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return abi.reply(req.unique, abi.open_out(fn(req.nodeid, _ctx(req)), 0))


def _readdir(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    token = ReaddirToken(req.args["size"], req.opcode == abi.READDIRPLUS)
    fn(req.args["fh"], req.args["offset"], token)
    return abi.reply(req.unique, b"".join(token.parts))


def _fh(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    fn(req.args["fh"])
    return _done(req)


def _create(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    info, attr = fn(req.nodeid, a["name"], a["mode"], a["flags"], _ctx(req, a["umask"]))
    return abi.reply(req.unique, abi.entry_out(attr), abi.open_out(info.fh, info.flags()))


def _write(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    n = fn(req.args["fh"], req.args["offset"], req.args["data"])
    return abi.reply(req.unique, abi.WRITE_OUT.pack(n, 0))


def _mkdir(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    return _entry(s, req, fn(req.nodeid, a["name"], a["mode"], _ctx(req, a["umask"])))


def _mknod(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    return _entry(s, req, fn(req.nodeid, a["name"], a["mode"], a["rdev"], _ctx(req, a["umask"])))


def _symlink(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return _entry(s, req, fn(req.nodeid, req.args["name"], req.args["target"], _ctx(req)))


def _link(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return _entry(s, req, fn(req.args["oldnodeid"], req.nodeid, req.args["name"], _ctx(req)))


def _name(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    fn(req.nodeid, req.args["name"], _ctx(req))
    return _done(req)


def _rename(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    fn(req.nodeid, a["old"], a["newdir"], a["new"], a["flags"], _ctx(req))
    return _done(req)


def _statfs(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return abi.reply(req.unique, abi.statfs_out(fn(_ctx(req))))


def _getxattr(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    value = bytes(fn(req.nodeid, req.args["name"], _ctx(req)))
    return _sized(req, value)


def _listxattr(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return _sized(req, abi.xattr_names(fn(req.nodeid, _ctx(req))))


def _sized(req: abi.Request, value: bytes) -> list[bytes | memoryview]:
    size = req.args["size"]
    if size == 0:
        return abi.reply(req.unique, abi.XATTR_SIZE_OUT.pack(len(value), 0))
    if len(value) > size:
        raise FUSEError(errno.ERANGE)
    return abi.reply(req.unique, value)


async def _read(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    return read_reply(req, await fn(a["fh"], a["offset"], a["size"], req.nodeid, req.pid))


async def waited_read(s: Any, req: abi.Request, rest: Callable[[], Any]) -> Any:
    return read_reply(req, await rest())


def read_reply(req: abi.Request, data: bytes | memoryview) -> list[bytes | memoryview]:
    if len(data) > req.args["size"]:
        data = memoryview(data)[:req.args["size"]]
    return abi.reply(req.unique, data)


async def _fsync(s: Any, req: abi.Request, fn: Callable[..., Any]) -> Any:
    await fn(req.args["fh"], req.args["datasync"])
    return _done(req)


DISPATCH: dict[int, tuple[str, Callable[..., Any]]] = {
    abi.LOOKUP: ("lookup", _lookup), abi.GETATTR: ("getattr", _getattr), abi.SETATTR: ("setattr", _setattr),
    abi.OPEN: ("open", _open), abi.READ: ("read", _read), abi.WRITE: ("write", _write),
    abi.RELEASE: ("release", _fh), abi.FLUSH: ("flush", _fh), abi.FSYNC: ("fsync", _fsync),
    abi.OPENDIR: ("opendir", _opendir), abi.READDIR: ("readdir", _readdir),
    abi.READDIRPLUS: ("readdir", _readdir), abi.RELEASEDIR: ("releasedir", _fh),
    abi.CREATE: ("create", _create), abi.MKDIR: ("mkdir", _mkdir), abi.MKNOD: ("mknod", _mknod),
    abi.SYMLINK: ("symlink", _symlink), abi.LINK: ("link", _link), abi.UNLINK: ("unlink", _name),
    abi.RMDIR: ("rmdir", _name), abi.RENAME: ("rename", _rename), abi.RENAME2: ("rename", _rename),
    abi.STATFS: ("statfs", _statfs), abi.GETXATTR: ("getxattr", _getxattr),
    abi.LISTXATTR: ("listxattr", _listxattr),
}

ASYNC_CALLS = {_read, _fsync}  # (READ goes through read_now where the handler has one)


def handlers_of(ops: Any) -> dict[str, tuple[Callable[..., Any], bool]]:
    """The handlers ``ops`` has, and whether each is a coroutine function (then its request runs as a
    task; the request kinds that may wait must have one)."""
    found: dict[str, tuple[Callable[..., Any], bool]] = {}
    names = {name for name, _ in DISPATCH.values()} | {"forget"}
    for name in names:
        fn = getattr(ops, name, None)
        if fn is None:
            continue
        is_async = inspect.iscoroutinefunction(fn)
        needs_async = any(call in ASYNC_CALLS for n, call in DISPATCH.values() if n == name)
        if is_async != needs_async and name != "forget":
            raise TypeError(f"{type(ops).__name__}.{name} must be {'a coroutine' if needs_async else 'a plain'} function")
        if name == "forget" and is_async:
            raise TypeError(f"{type(ops).__name__}.forget must be a plain function")
        found[name] = (fn, is_async)
    return found
