"""One FUSE mount: ``/dev/fuse`` mounted (:mod:`epochfs.kernel.mounting`), INIT, its requests read and
routed on the trio thread (each request's translation: :mod:`epochfs.kernel.translate`), notifications
sent from any thread, backing files registered for passthrough.

The handlers are the methods of an operations object (:class:`epochfs.vfs.fs.Operations`) named as the
requests are (``lookup``, ``open``, ``read``...). A plain method is called as its request is read and
answered at once, with no task and no scheduling; a coroutine method (``read``, ``fsync``: those that
may wait for the network or a disk) runs as its own trio task. A method the object lacks is answered
ENOSYS, which for FLUSH and OPEN tells the kernel not to send them again. IOCTL is answered ENOTTY as
soon as its header is read, unless it carries one of the commands the handlers name
(``ioctl_commands``: the control channel through the mount): the kernel sends one whenever a process asks
whether a file of the mount is a terminal, which Python's ``open()`` does on every open of a file with
default buffering (before 3.14), so it is the commonest request after READ and LOOKUP. A handler that raises
:class:`FUSEError` answers that errno; any other exception is logged and answered EIO: a request
never ends the session, and neither does a request whose bytes cannot be parsed.

What this gives over a binding to libfuse: the inode of every request (a READ names its inode even
when the open was not sent: zero-message opens), replies written straight from the handler's buffer,
and the kernel's protocol in one module (:mod:`epochfs.kernel.abi`) where it can be fuzzed.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import trio

from epochfs.kernel import abi, mounting
from epochfs.kernel.operations import Operations
from epochfs.kernel.translate import ROWS, handlers_of, read_reply, waited_read
from epochfs.kernel.types import FUSEError

if TYPE_CHECKING:
    from epochfs.kernel.uring import Channel

log = logging.getLogger(__name__)

PAGE = 4096
#: Pages of one request, at least (the kernel's default limit) and at most (a 2 MiB folio on x86-64,
#: the largest the page cache makes: a kernel that gives FUSE files large folios sizes them from the
#: connection's max_write, max_read and max_pages; docs/kernel-paths.md).
MIN_PAGES, MAX_PAGES = 256, 512
MAX_PAGES_LIMIT = "/proc/sys/fs/fuse/max_pages_limit"
HEADROOM = 64 << 10  # a WRITE's header beside its max_write bytes, in the read buffer


def request_pages(limit_path: str | None = None) -> int:
    """Pages of one request: as many as the kernel lets a server ask for (``fs.fuse.max_pages_limit``,
    256 unless an administrator raised it), within [``MIN_PAGES``, ``MAX_PAGES``]."""
    try:
        with open(limit_path or MAX_PAGES_LIMIT) as f:
            limit = int(f.read().strip())
    except (OSError, ValueError):
        return MIN_PAGES
    return max(MIN_PAGES, min(MAX_PAGES, limit))
#: File systems stacked under a backing file (a passthrough mount's cache is on a plain local one).
PASSTHROUGH_DEPTH = 1

WANT = (abi.ASYNC_READ | abi.ATOMIC_O_TRUNC | abi.BIG_WRITES | abi.AUTO_INVAL_DATA | abi.DO_READDIRPLUS
        | abi.ASYNC_DIO | abi.PARALLEL_DIROPS | abi.MAX_PAGES)

#: Requests answered at most this many in a row before other trio tasks get a turn.
BATCH = 32


class Session:
    """``ops`` mounted at ``mountpoint`` with ``options`` (mount(8)-style: ``ro``, ``nosuid``,
    ``default_permissions``, ``allow_other``, ``fsname=``, ``subtype=``, ``debug``...)."""

    def __init__(self, ops: Operations, mountpoint: str, options: Iterable[str], *, io_uring: bool = False) -> None:
        self.ops = ops
        self.io_uring = io_uring  # asked for: requests through an io_uring where the kernel offers it
        self.uring: Channel | None = None  # once INIT set it up
        self.mountpoint = os.path.abspath(mountpoint)
        self.max_pages = request_pages()
        self.max_write = self.max_pages * PAGE  # (the read buffer holds the largest WRITE and its header)
        self.options = mounting.parse_options(options)
        self.debug = self.options.debug
        self.fd = -1
        self.negotiated = 0  # the INIT flags both sides have
        self.kernel_minor = 0
        self.minor = abi.MINOR  # the protocol minor spoken: the lower of the kernel's and ours
        self._root_mounted = False
        self._cancel: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._terminated = False
        self.isatty_asks = 0  # IOCTL requests answered (a process asking whether a file is a terminal)
        self._handlers = handlers_of(ops)
        self._ioctl_commands = frozenset(getattr(ops, "ioctl_commands", ()))
        # A plain ``read_now`` answers the reads whose bytes are at hand with no task (see _answer_read).
        self._read_now: Callable[..., Any] | None = getattr(ops, "read_now", None)
        self._unmounted = threading.Event()

    # -- mounting ---------------------------------------------------------------------------------------

    def mount(self) -> None:
        """Open ``/dev/fuse`` and mount it (directly as root, through ``fusermount3`` otherwise)."""
        self.fd, self._root_mounted = mounting.mount(self.mountpoint, self.options)

    def close(self, unmount: bool = True) -> None:
        """Unmount (lazily: open files keep the mount until closed) and close the device."""
        if unmount and self.fd >= 0 and not self._unmounted.is_set():
            self._unmounted.set()
            mounting.unmount(self.mountpoint, self._root_mounted)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.uring is not None:
            self.uring.close()

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
        buf = bytearray(self.max_write + HEADROOM)
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
        if len(view) >= abi.IN_HEAD.size:
            length, opcode, unique = abi.IN_HEAD.unpack_from(view)
            if opcode == abi.IOCTL and length == len(view) and not self._ioctl_wanted(view):
                self.isatty_asks += 1  # (isatty: no file of the mount is a terminal)
                self._send([abi.error(unique, errno.ENOTTY)])
                return
        try:
            req = abi.parse(view, self.minor)
        except abi.Malformed as exc:
            log.warning("a request that does not parse (%s): answered EIO", exc)
            if len(view) >= abi.IN_HEADER.size:
                self._send([abi.error(abi.IN_HEADER.unpack_from(view)[2], errno.EIO)])
            return
        if self.debug:
            log.debug("request %d: opcode %d inode %d %s", req.unique, req.opcode, req.nodeid,
                      {k: v for k, v in req.args._asdict().items() if k != "data"})
        op = req.opcode
        if op == abi.INIT:
            self._init(req)
            return
        if op in (abi.FORGET, abi.BATCH_FORGET):
            forget = self._handlers.get("forget")
            if forget is not None:
                try:
                    forget[0](req.args.forgets)
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
        row = ROWS.get(op)
        if row is None:
            self._send([abi.error(req.unique, errno.ENOSYS)])
            return
        name, call = row.handler, row.call
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
            reply = call(req, fn)
        except FUSEError as exc:
            self._send([abi.error(req.unique, exc.errno)])
        except Exception:
            log.exception("%s failed", name)
            self._send([abi.error(req.unique, errno.EIO)])
        else:
            self._send(reply)

    def _ioctl_wanted(self, view: memoryview) -> bool:
        """Whether the IOCTL in ``view`` carries a command the handlers answer (read from its bytes
        before anything else is: every other one is a process asking whether a file is a terminal)."""
        if not self._ioctl_commands or len(view) < abi.IN_HEADER.size + abi.IOCTL_IN.size:
            return False
        return abi.IOCTL_IN.unpack_from(view, abi.IN_HEADER.size)[2] in self._ioctl_commands

    def _answer_read(self, req: abi.Request) -> None:
        """A READ through the handler's ``read_now``: answered at once if it has the bytes, else the
        coroutine function it returns runs as a task."""
        a: abi.ReadIn = req.args
        assert self._read_now is not None
        try:
            answer = self._read_now(a.fh, a.offset, a.size, req.nodeid, req.pid, (req.uid, req.gid))
        except FUSEError as exc:
            self._send([abi.error(req.unique, exc.errno)])
            return
        except Exception:
            log.exception("read failed")
            self._send([abi.error(req.unique, errno.EIO)])
            return
        if callable(answer):
            assert self._nursery is not None
            self._nursery.start_soon(self._answer_async, req, answer, waited_read)
            return
        try:
            reply = read_reply(req, answer)
        except Exception:
            log.exception("read answered with %s", type(answer).__name__)
            reply = [abi.error(req.unique, errno.EIO)]
        self._send(reply)

    async def _answer_async(self, req: abi.Request, fn: Callable[..., Any], call: Callable[..., Any]) -> None:
        try:
            reply = await call(req, fn)
        except FUSEError as exc:
            reply = [abi.error(req.unique, exc.errno)]
        except Exception:  # (trio.Cancelled is not an Exception: the session is ending)
            log.exception("request %d (opcode %d) failed", req.unique, req.opcode)
            reply = [abi.error(req.unique, errno.EIO)]
        self._send(reply)

    def _send(self, iov: list[bytes | memoryview]) -> None:
        """A reply, to ``/dev/fuse`` or, for a request the io_uring channel gave, into its entry."""
        write = self._write
        if self.uring is not None and self.uring.owns(abi.OUT_HEADER.unpack_from(iov[0])[2]):
            write = self.uring.answer
        try:
            write(iov)
        except TypeError:  # a handler's answer of the wrong kind: still an answer
            log.exception("a reply could not be written")
            write([abi.error(abi.OUT_HEADER.unpack_from(iov[0])[2], errno.EIO)])
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV: unmounted
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                log.warning("reply failed: %s", exc)

    def _write(self, iov: list[bytes | memoryview]) -> None:
        os.writev(self.fd, iov)

    def _init(self, req: abi.Request) -> None:
        a: abi.InitIn = req.args
        if a.major != abi.MAJOR:
            if a.major > abi.MAJOR:  # tell it ours and wait for its INIT of that version
                self._send(abi.reply(req.unique, abi.INIT_OUT.pack(abi.MAJOR, abi.MINOR, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)))
            else:
                log.error("the kernel speaks FUSE %d.%d; this daemon needs 7.31 or later", a.major, a.minor)
                self._send([abi.error(req.unique, errno.EPROTO)])
            return
        if a.minor < abi.OLDEST:
            log.error("the kernel speaks FUSE 7.%d; this daemon needs 7.%d or later", a.minor, abi.OLDEST)
            self._send([abi.error(req.unique, errno.EPROTO)])
            return
        self.kernel_minor = a.minor
        self.minor = min(abi.MINOR, a.minor)
        writeback = getattr(self.ops, "enable_writeback_cache", False)
        want = WANT | (abi.WRITEBACK_CACHE if writeback else 0)
        if getattr(self.ops, "want_passthrough", False) and not writeback:  # (the kernel refuses both)
            want |= abi.INIT_EXT | abi.PASSTHROUGH
        flags = want & a.flags  # (a kernel offers PASSTHROUGH only in flags2, which comes with INIT_EXT)
        if flags & abi.PASSTHROUGH:
            self.minor = min(abi.PASSTHROUGH_MINOR, a.minor)
        uring = self._uring_channel(a.flags)
        if uring is not None:
            flags |= abi.INIT_EXT | abi.OVER_IO_URING
        self.negotiated = flags | (a.flags & abi.NO_OPEN_SUPPORT)
        out = abi.INIT_OUT.pack(abi.MAJOR, self.minor, a.max_readahead, flags & 0xFFFFFFFF,
                                0, 0, self.max_write, 1, self.max_pages if flags & abi.MAX_PAGES else 0, 0, flags >> 32,
                                PASSTHROUGH_DEPTH if flags & abi.PASSTHROUGH else 0)
        self._send(abi.reply(req.unique, out))
        if uring is not None:
            self.uring = uring
            assert self._nursery is not None
            self._nursery.start_soon(self._serve_uring, uring)

    # -- FUSE over io_uring (6.14; root lets servers use it) ----------------------------------------------

    def _uring_channel(self, offered: int) -> Channel | None:
        """The io_uring channel if it was asked for and the kernel offers it, else None (said why)."""
        if not self.io_uring:
            return None
        from epochfs.kernel import uring

        if not offered & abi.OVER_IO_URING:
            log.warning("--io-uring: the kernel does not offer FUSE over io_uring (Linux 6.14 and later, "
                        "and root must set %s to Y): requests go through /dev/fuse", uring.ENABLE)
            return None
        try:
            return uring.Channel(self.fd, self.max_write, self._handle)
        except uring.Unavailable as exc:
            log.warning("--io-uring: %s: requests go through /dev/fuse", exc)
            return None

    async def _serve_uring(self, channel: Channel) -> None:
        """The channel's requests, as its eventfd says they came (the kernel moves every request to it
        once each of its queues has an entry registered)."""
        try:
            channel.start()
        except OSError as exc:  # (the kernel refused the entries: requests stay on /dev/fuse)
            log.warning("--io-uring: the ring's entries were refused (%s): requests go through /dev/fuse", exc)
            return
        log.info("requests through io_uring: %d queues of %d entries", channel.queues, channel.depth)
        while True:
            await trio.lowlevel.wait_readable(channel.eventfd)
            if not channel.ready():
                return
            await trio.lowlevel.checkpoint()

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


_LIBC = ctypes.CDLL(None, use_errno=True)


def _ioctl_int(fd: int, request: int, arg: bytes) -> int:
    """An ioctl whose answer is its return value (``fcntl.ioctl`` gives back the buffer instead)."""
    buf = ctypes.create_string_buffer(arg, len(arg))
    rc = _LIBC.ioctl(ctypes.c_int(fd), ctypes.c_ulong(request), buf)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(rc)


