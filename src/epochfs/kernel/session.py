"""One FUSE mount: ``/dev/fuse`` opened and mounted, its requests read and answered on the trio thread,
notifications sent from any thread.

The handlers are the methods of an operations object (:class:`epochfs.fs.Operations`) named as the
requests are (``lookup``, ``open``, ``read``...). A plain method is called as its request is read and
answered at once, with no task and no scheduling; a coroutine method (``read``, ``fsync``: those that
may wait for the network or a disk) runs as its own trio task. A method the object lacks is answered
ENOSYS, which for FLUSH and OPEN tells the kernel not to send them again. A handler that raises
:class:`FUSEError` answers that errno; any other exception is logged and answered EIO: a request
never ends the session, and neither does a request whose bytes cannot be parsed.

What this gives over a binding to libfuse: the inode of every request (a READ names its inode even
when the open was not sent: zero-message opens), replies written straight from the handler's buffer,
and the kernel's protocol in one module (:mod:`epochfs.kernel.abi`) where it can be fuzzed.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import errno
import inspect
import logging
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import trio

from epochfs.kernel import abi
from epochfs.kernel.types import (
    EntryAttributes,
    FileInfo,
    FUSEError,
    ReaddirToken,
    RequestContext,
    SetattrFields,
)

log = logging.getLogger(__name__)

MAX_WRITE = 1 << 20
BUFFER = MAX_WRITE + (64 << 10)  # the largest request: a WRITE of MAX_WRITE bytes and its header
MAX_PAGES = 256
#: File systems stacked under a backing file (a passthrough mount's cache is on a plain local one).
PASSTHROUGH_DEPTH = 1

WANT = (abi.ASYNC_READ | abi.ATOMIC_O_TRUNC | abi.BIG_WRITES | abi.AUTO_INVAL_DATA | abi.DO_READDIRPLUS
        | abi.ASYNC_DIO | abi.PARALLEL_DIROPS | abi.MAX_PAGES)

_MS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "sync": 16, "dirsync": 128, "noatime": 1024,
       "nodiratime": 2048}
_NO_FLAG = {"rw", "suid", "dev", "exec", "atime", "diratime", "async"}
_KERNEL = {"default_permissions", "allow_other"}
_MNT_DETACH = 2

#: Requests answered at most this many in a row before other trio tasks get a turn.
BATCH = 32


class MountError(RuntimeError):
    """The file system could not be mounted."""


class Session:
    """``ops`` mounted at ``mountpoint`` with ``options`` (mount(8)-style: ``ro``, ``nosuid``,
    ``default_permissions``, ``allow_other``, ``fsname=``, ``subtype=``, ``debug``...)."""

    def __init__(self, ops: Any, mountpoint: str, options: Iterable[str]) -> None:
        self.ops = ops
        self.mountpoint = os.path.abspath(mountpoint)
        self.flags, self.data, self.source, self.fstype, self.debug = _options(options)
        self.fd = -1
        self.negotiated = 0  # the INIT flags both sides have
        self.kernel_minor = 0
        self.minor = abi.MINOR  # the protocol minor spoken: the lower of the kernel's and ours
        self._root_mounted = False
        self._cancel: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._terminated = False
        self._handlers = _handlers(ops)
        # A plain ``read_now`` answers the reads whose bytes are at hand with no task (see _answer_read).
        self._read_now: Callable[..., Any] | None = getattr(ops, "read_now", None)
        self._unmounted = threading.Event()

    # -- mounting ---------------------------------------------------------------------------------------

    def mount(self) -> None:
        """Open ``/dev/fuse`` and mount it (directly as root, through ``fusermount3`` otherwise)."""
        try:
            st = os.stat(self.mountpoint)
        except OSError as exc:
            raise MountError(f"{self.mountpoint}: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise MountError(f"{self.mountpoint} is not a directory")
        if os.geteuid() == 0:
            self._mount_direct(st.st_mode)
        else:
            self._mount_fusermount()

    def _mount_direct(self, mode: int) -> None:
        try:
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise MountError(f"cannot open /dev/fuse: {exc.strerror}") from None
        data = ",".join([f"fd={fd}", f"rootmode={stat.S_IFMT(mode):o}", f"user_id={os.getuid()}",
                         f"group_id={os.getgid()}", *self.data])
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        rc = libc.mount(self.source.encode(), self.mountpoint.encode(), self.fstype.encode(),
                        ctypes.c_ulong(self.flags), data.encode())
        if rc != 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise MountError(f"mount {self.mountpoint}: {os.strerror(err)}")
        self.fd = fd
        self._root_mounted = True

    def _mount_fusermount(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        opts = [o for o, bit in _MS.items() if self.flags & bit] + list(self.data)
        fsname = self.source.replace("\\", "\\\\").replace(",", "\\,")  # (its option parser splits at commas)
        opts += [f"fsname={fsname}", f"subtype={self.fstype.removeprefix('fuse.')}"]
        try:
            proc = subprocess.run(["fusermount3", "-o", ",".join(opts), "--", self.mountpoint],
                                  env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())},
                                  pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MountError(f"fusermount3: {exc}") from None
        finally:
            theirs.close()
        try:
            if proc.returncode != 0:
                raise MountError(proc.stderr.strip() or f"fusermount3 exited {proc.returncode}")
            fds = array.array("i")
            _, anc, _, _ = ours.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:fds.itemsize])
            if not fds:
                raise MountError("fusermount3 passed no /dev/fuse descriptor")
            self.fd = fds[0]
            os.set_inheritable(self.fd, False)
        finally:
            ours.close()

    def close(self, unmount: bool = True) -> None:
        """Unmount (lazily: open files keep the mount until closed) and close the device."""
        if unmount and self.fd >= 0 and not self._unmounted.is_set():
            self._unmounted.set()
            if self._root_mounted:
                libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
                libc.umount2(self.mountpoint.encode(), _MNT_DETACH)
            else:
                subprocess.run(["fusermount3", "-u", "-q", "-z", "--", self.mountpoint],
                               capture_output=True, timeout=60, check=False)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- serving ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Answer requests until unmounted or :meth:`terminate` is called."""
        os.set_blocking(self.fd, False)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            with trio.CancelScope() as self._cancel:
                if not self._terminated:
                    await self._serve()
            nursery.cancel_scope.cancel()
        self._nursery = None

    def terminate(self) -> None:
        """End :meth:`run` (from the trio thread)."""
        self._terminated = True
        if self._cancel is not None:
            self._cancel.cancel()

    async def _serve(self) -> None:
        fd = self.fd
        buf = bytearray(BUFFER)
        view = memoryview(buf)
        in_row = 0
        while True:
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                in_row = 0
                await trio.lowlevel.wait_readable(fd)
                continue
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # interrupted before it was read
                    continue
                if exc.errno == errno.ENODEV:  # unmounted
                    return
                raise
            try:
                self._handle(view[:n])
            except Exception:  # (each handler's errors are answered; this is the last guard)
                log.exception("a request could not be answered")
            in_row += 1
            if in_row >= BATCH:
                in_row = 0
                await trio.lowlevel.checkpoint()

    def _handle(self, view: memoryview) -> None:
        try:
            req = abi.parse(view, self.minor)
        except abi.Malformed as exc:
            log.warning("a request that does not parse (%s): answered EIO", exc)
            if len(view) >= abi.IN_HEADER.size:
                self._send([abi.error(abi.IN_HEADER.unpack_from(view)[2], errno.EIO)])
            return
        if self.debug:
            log.debug("request %d: opcode %d inode %d %s", req.unique, req.opcode, req.nodeid,
                      {k: v for k, v in req.args.items() if k != "data"})
        op = req.opcode
        if op == abi.INIT:
            self._init(req)
            return
        if op in (abi.FORGET, abi.BATCH_FORGET):
            forget = self._handlers.get("forget")
            if forget is not None:
                try:
                    forget[0](req.args["forgets"])
                except Exception:
                    log.exception("forget failed")
            return
        if op == abi.INTERRUPT:  # a handler finishes what it started: nothing to cancel
            return
        if op == abi.DESTROY:
            self._send(abi.reply(req.unique))
            self.terminate()
            return
        if op == abi.READ and self._read_now is not None:
            self._answer_read(req)
            return
        entry = _DISPATCH.get(op)
        if entry is None:
            self._send([abi.error(req.unique, errno.ENOSYS)])
            return
        name, call = entry
        handler = self._handlers.get(name)
        if handler is None:
            self._send([abi.error(req.unique, errno.ENOSYS)])
            return
        fn, is_async = handler
        if is_async:
            assert self._nursery is not None
            self._nursery.start_soon(self._answer_async, req, fn, call)
            return
        try:
            reply = call(self, req, fn)
        except FUSEError as exc:
            self._send([abi.error(req.unique, exc.errno)])
        except Exception:
            log.exception("%s failed", name)
            self._send([abi.error(req.unique, errno.EIO)])
        else:
            self._send(reply)

    def _answer_read(self, req: abi.Request) -> None:
        """A READ through the handler's ``read_now``: answered at once if it has the bytes, else the
        coroutine function it returns runs as a task."""
        a = req.args
        assert self._read_now is not None
        try:
            answer = self._read_now(a["fh"], a["offset"], a["size"], req.nodeid, req.pid)
        except FUSEError as exc:
            self._send([abi.error(req.unique, exc.errno)])
            return
        except Exception:
            log.exception("read failed")
            self._send([abi.error(req.unique, errno.EIO)])
            return
        if callable(answer):
            assert self._nursery is not None
            self._nursery.start_soon(self._answer_async, req, answer, _waited_read)
            return
        try:
            reply = _read_reply(req, answer)
        except Exception:
            log.exception("read answered with %s", type(answer).__name__)
            reply = [abi.error(req.unique, errno.EIO)]
        self._send(reply)

    async def _answer_async(self, req: abi.Request, fn: Callable[..., Any], call: Callable[..., Any]) -> None:
        try:
            reply = await call(self, req, fn)
        except FUSEError as exc:
            reply = [abi.error(req.unique, exc.errno)]
        except Exception:  # (trio.Cancelled is not an Exception: the session is ending)
            log.exception("request %d (opcode %d) failed", req.unique, req.opcode)
            reply = [abi.error(req.unique, errno.EIO)]
        self._send(reply)

    def _send(self, iov: list[bytes | memoryview]) -> None:
        try:
            os.writev(self.fd, iov)
        except TypeError:  # a handler's answer of the wrong kind: still an answer
            log.exception("a reply could not be written")
            os.writev(self.fd, [abi.error(abi.OUT_HEADER.unpack_from(iov[0])[2], errno.EIO)])
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV: unmounted
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                log.warning("reply failed: %s", exc)

    def _init(self, req: abi.Request) -> None:
        a = req.args
        if a["major"] != abi.MAJOR:
            if a["major"] > abi.MAJOR:  # tell it ours and wait for its INIT of that version
                self._send(abi.reply(req.unique, abi.INIT_OUT.pack(abi.MAJOR, abi.MINOR, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)))
            else:
                log.error("the kernel speaks FUSE %d.%d; this daemon needs 7.31 or later", a["major"], a["minor"])
                self._send([abi.error(req.unique, errno.EPROTO)])
            return
        if a["minor"] < abi.OLDEST:
            log.error("the kernel speaks FUSE 7.%d; this daemon needs 7.%d or later", a["minor"], abi.OLDEST)
            self._send([abi.error(req.unique, errno.EPROTO)])
            return
        self.kernel_minor = a["minor"]
        self.minor = min(abi.MINOR, a["minor"])
        writeback = getattr(self.ops, "enable_writeback_cache", False)
        want = WANT | (abi.WRITEBACK_CACHE if writeback else 0)
        if getattr(self.ops, "want_passthrough", False) and not writeback:  # (the kernel refuses both)
            want |= abi.INIT_EXT | abi.PASSTHROUGH
        flags = want & a["flags"]
        if flags & abi.PASSTHROUGH and not flags & abi.INIT_EXT:
            flags &= ~abi.PASSTHROUGH
        if flags & abi.PASSTHROUGH:
            self.minor = min(abi.PASSTHROUGH_MINOR, a["minor"])
        self.negotiated = flags | (a["flags"] & abi.NO_OPEN_SUPPORT)
        out = abi.INIT_OUT.pack(abi.MAJOR, self.minor, a["max_readahead"], flags & 0xFFFFFFFF,
                                0, 0, MAX_WRITE, 1, MAX_PAGES if flags & abi.MAX_PAGES else 0, 0, flags >> 32,
                                PASSTHROUGH_DEPTH if flags & abi.PASSTHROUGH else 0)
        self._send(abi.reply(req.unique, out))

    def can(self, flag: int) -> bool:
        """Whether the kernel offered INIT ``flag`` (e.g. ``NO_OPEN_SUPPORT``: it takes ENOSYS to an OPEN
        as "open without asking from now on")."""
        return bool(self.negotiated & flag)

    # -- passthrough (7.40; root) ------------------------------------------------------------------------

    def backing_open(self, fd: int) -> int:
        """Register the open file ``fd`` as a backing file: its id, for :class:`FileInfo`'s
        ``backing_id`` (the kernel then reads it itself). Raises OSError: EPERM without CAP_SYS_ADMIN,
        EOPNOTSUPP/ENOTTY where passthrough was not negotiated or the kernel has none."""
        if not self.can(abi.PASSTHROUGH):
            raise OSError(errno.EOPNOTSUPP, "passthrough was not negotiated")
        return _ioctl_int(self.fd, abi.BACKING_OPEN, abi.BACKING_MAP.pack(fd, 0, 0))

    def backing_close(self, backing_id: int) -> None:
        """Let a backing id go (opens already given it keep their file until they are released)."""
        _ioctl_int(self.fd, abi.BACKING_CLOSE, backing_id.to_bytes(4, "little"))

    # -- notifications (any thread) ---------------------------------------------------------------------

    def _notify(self, iov: list[bytes | memoryview]) -> None:
        if self.fd < 0:
            raise OSError(errno.ENOTCONN, "not mounted")
        os.writev(self.fd, iov)

    def notify_store(self, inode: int, offset: int, data: bytes | memoryview) -> None:
        """Put ``data`` into the kernel's page cache of ``inode`` at ``offset``; OSError(ENOENT) if the
        kernel does not hold the inode. Blocks while a READ of those pages is in flight: never call it
        from the trio thread."""
        self._notify(abi.notify(abi.NOTIFY_STORE, abi.NOTIFY_STORE_OUT.pack(inode, offset, len(data), 0), data))

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None:
        """Have the kernel drop ``inode``'s attributes and (unless ``attr_only``) its cached pages."""
        self._notify(abi.notify(abi.NOTIFY_INVAL_INODE, abi.NOTIFY_INVAL_INODE_OUT.pack(inode, -1 if attr_only else 0, 0)))

    def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Have the kernel forget the name ``name`` in directory ``parent``."""
        self._notify(abi.notify(abi.NOTIFY_INVAL_ENTRY, abi.NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0),
                                bytes(name) + b"\0"))


def _options(options: Iterable[str]) -> tuple[int, list[str], str, str, bool]:
    flags, data, source, subtype, debug = 0, [], "epochfs", "", False
    for opt in sorted(set(options)):
        key, _, value = opt.partition("=")
        if key in _MS and not value:
            flags |= _MS[key]
        elif key in _NO_FLAG and not value:
            pass
        elif key in _KERNEL and not value:
            data.append(key)
        elif key in ("max_read", "blksize") and value.isdigit():
            data.append(opt)
        elif key == "fsname" and value:
            source = value.replace("\\,", ",").replace("\\\\", "\\")
        elif key == "subtype" and value:
            subtype = value
        elif key == "debug" and not value:
            debug = True
        else:
            raise MountError(f"unknown mount option {opt!r}")
    return flags, data, source, f"fuse.{subtype}" if subtype else "fuse", debug


# -- the requests: each turns a parsed request into a handler call and its reply ------------------------

def _ctx(req: abi.Request, umask: int = 0) -> RequestContext:
    return RequestContext(req.uid, req.gid, req.pid, umask)


def _entry(s: Session, req: abi.Request, attr: EntryAttributes) -> list[bytes | memoryview]:
    return abi.reply(req.unique, abi.entry_out(attr))


def _done(req: abi.Request) -> list[bytes | memoryview]:
    return abi.reply(req.unique)


def _lookup(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return _entry(s, req, fn(req.nodeid, req.args["name"], _ctx(req)))


def _getattr(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return abi.reply(req.unique, abi.attr_out(fn(req.nodeid, _ctx(req))))


def _setattr(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
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


_LIBC = ctypes.CDLL(None, use_errno=True)


def _ioctl_int(fd: int, request: int, arg: bytes) -> int:
    """An ioctl whose answer is its return value (``fcntl.ioctl`` gives back the buffer instead)."""
    buf = ctypes.create_string_buffer(arg, len(arg))
    rc = _LIBC.ioctl(ctypes.c_int(fd), ctypes.c_ulong(request), buf)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(rc)


def _open(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    info: FileInfo = fn(req.nodeid, req.args["flags"], _ctx(req))
    return abi.reply(req.unique, abi.open_out(info.fh, info.flags(), info.backing_id))


def _opendir(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return abi.reply(req.unique, abi.open_out(fn(req.nodeid, _ctx(req)), 0))


def _readdir(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    token = ReaddirToken(req.args["size"], req.opcode == abi.READDIRPLUS)
    fn(req.args["fh"], req.args["offset"], token)
    return abi.reply(req.unique, b"".join(token.parts))


def _fh(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    fn(req.args["fh"])
    return _done(req)


def _create(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    info, attr = fn(req.nodeid, a["name"], a["mode"], a["flags"], _ctx(req, a["umask"]))
    return abi.reply(req.unique, abi.entry_out(attr), abi.open_out(info.fh, info.flags()))


def _write(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    n = fn(req.args["fh"], req.args["offset"], req.args["data"])
    return abi.reply(req.unique, abi.WRITE_OUT.pack(n, 0))


def _mkdir(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    return _entry(s, req, fn(req.nodeid, a["name"], a["mode"], _ctx(req, a["umask"])))


def _mknod(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    return _entry(s, req, fn(req.nodeid, a["name"], a["mode"], a["rdev"], _ctx(req, a["umask"])))


def _symlink(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return _entry(s, req, fn(req.nodeid, req.args["name"], req.args["target"], _ctx(req)))


def _link(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return _entry(s, req, fn(req.args["oldnodeid"], req.nodeid, req.args["name"], _ctx(req)))


def _name(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    fn(req.nodeid, req.args["name"], _ctx(req))
    return _done(req)


def _rename(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    fn(req.nodeid, a["old"], a["newdir"], a["new"], a["flags"], _ctx(req))
    return _done(req)


def _statfs(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return abi.reply(req.unique, abi.statfs_out(fn(_ctx(req))))


def _getxattr(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    value = bytes(fn(req.nodeid, req.args["name"], _ctx(req)))
    return _sized(req, value)


def _listxattr(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    return _sized(req, abi.xattr_names(fn(req.nodeid, _ctx(req))))


def _sized(req: abi.Request, value: bytes) -> list[bytes | memoryview]:
    size = req.args["size"]
    if size == 0:
        return abi.reply(req.unique, abi.XATTR_SIZE_OUT.pack(len(value), 0))
    if len(value) > size:
        raise FUSEError(errno.ERANGE)
    return abi.reply(req.unique, value)


async def _read(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    a = req.args
    return _read_reply(req, await fn(a["fh"], a["offset"], a["size"], req.nodeid, req.pid))


async def _waited_read(s: Session, req: abi.Request, rest: Callable[[], Any]) -> Any:
    return _read_reply(req, await rest())


def _read_reply(req: abi.Request, data: bytes | memoryview) -> list[bytes | memoryview]:
    if len(data) > req.args["size"]:
        data = memoryview(data)[:req.args["size"]]
    return abi.reply(req.unique, data)


async def _fsync(s: Session, req: abi.Request, fn: Callable[..., Any]) -> Any:
    await fn(req.args["fh"], req.args["datasync"])
    return _done(req)


_DISPATCH: dict[int, tuple[str, Callable[..., Any]]] = {
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

_ASYNC_CALLS = {_read, _fsync}  # (READ goes through read_now where the handler has one)


def _handlers(ops: Any) -> dict[str, tuple[Callable[..., Any], bool]]:
    """The handlers ``ops`` has, and whether each is a coroutine function (then its request runs as a
    task; the request kinds that may wait must have one)."""
    found: dict[str, tuple[Callable[..., Any], bool]] = {}
    names = {name for name, _ in _DISPATCH.values()} | {"forget"}
    for name in names:
        fn = getattr(ops, name, None)
        if fn is None:
            continue
        is_async = inspect.iscoroutinefunction(fn)
        needs_async = any(call in _ASYNC_CALLS for n, call in _DISPATCH.values() if n == name)
        if is_async != needs_async and name != "forget":
            raise TypeError(f"{type(ops).__name__}.{name} must be {'a coroutine' if needs_async else 'a plain'} function")
        if name == "forget" and is_async:
            raise TypeError(f"{type(ops).__name__}.forget must be a plain function")
        found[name] = (fn, is_async)
    return found
