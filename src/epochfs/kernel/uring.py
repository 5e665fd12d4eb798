"""FUSE over io_uring: the kernel hands requests to buffers the daemon registered, through an io_uring,
instead of through ``read``/``write`` on ``/dev/fuse`` (Linux 6.14 and later, ``CONFIG_FUSE_IO_URING``,
and only while root has set ``/sys/module/fuse/parameters/enable_uring``).

The protocol (``fs/fuse/dev_uring.c``, ``Documentation/filesystems/fuse/fuse-io-uring.rst``): the INIT
reply carries ``FUSE_OVER_IO_URING``; then, for every queue (one per possible CPU: the kernel puts a
request on the queue of the CPU its caller runs on, and uses the ring only once every queue has an
entry waiting), the daemon submits ``IORING_OP_URING_CMD`` entries on an ``IORING_SETUP_SQE128`` ring:
``FUSE_IO_URING_CMD_REGISTER`` with two buffers (the headers: ``fuse_in_header``, the operation's own
header, the entry's ``commit_id`` and payload size; and the payload, as large as the largest WRITE or
READ). An entry completes when the kernel has put a request in its buffers; the daemon answers in the
same buffers and submits ``FUSE_IO_URING_CMD_COMMIT_AND_FETCH``, which hands the answer over and waits
for the next request in one step. FORGETs, INTERRUPTs and the daemon's notifications still go through
``/dev/fuse``.

Here one ring carries every queue's entries, driven from the trio thread (no thread hop per request):
its completions are signalled on an eventfd trio waits on, and answers are submitted in batches. The
rings' memory is ``queues x depth x (4 KiB + the payload buffer)``: 2 CPUs x 8 x 1 MiB = 16 MiB here.

The ring's shared memory is read and written through ``mmap`` in program order; that is enough on
x86-64 (stores are not reordered with stores, nor loads with loads), the only architecture this
module accepts.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import struct
from collections.abc import Callable

log = logging.getLogger(__name__)

# io_uring's system calls and constants (x86-64; include/uapi/linux/io_uring.h)
SYS_SETUP, SYS_ENTER, SYS_REGISTER = 425, 426, 427
SETUP_CQSIZE = 1 << 3
SETUP_SQE128 = 1 << 10
FEAT_SINGLE_MMAP = 1 << 0
ENTER_GETEVENTS = 1 << 0
REGISTER_EVENTFD = 4
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
OP_URING_CMD = 46
SQE_SIZE = 128  # (SQE128)
CQE = struct.Struct("<QiI")  # user_data res flags

# FUSE over io_uring (include/uapi/linux/fuse.h)
CMD_REGISTER = 1
CMD_COMMIT_AND_FETCH = 2
CMD_REQ = struct.Struct("<QQH6x")  # flags commit_id qid: in the SQE's 80-byte command area
HEADER_IN_OUT = 128  # fuse_in_header / fuse_out_header
HEADER_OP = 128  # the operation's own header
ENT_IN_OUT = struct.Struct("<QQII8x")  # flags commit_id payload_sz padding reserved
HEADERS_SIZE = HEADER_IN_OUT + HEADER_OP + ENT_IN_OUT.size  # struct fuse_uring_req_header: 288 bytes
IN_HEADER_SIZE = 40
OUT_HEADER = struct.Struct("<IiQ")

SQ_OFF = struct.Struct("<IIIIIIIIQ")  # head tail ring_mask ring_entries flags dropped array resv1 user_addr
CQ_OFF = struct.Struct("<IIIIIIIIQ")  # head tail ring_mask ring_entries overflow cqes flags resv1 user_addr
PARAMS = struct.Struct("<IIIIIII12x40s40s")  # sq_entries cq_entries flags sq_thread_cpu/idle features wq_fd

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


DEPTH = 8  # entries per queue


def memory_needed(payload_size: int, depth: int = DEPTH, queues: int | None = None) -> int:
    """The bytes a channel's entries hold: each a page of headers and a payload buffer (what
    ``--memory-limit`` sets aside for them before it splits the rest)."""
    return (queues or possible_cpus()) * depth * (mmap.PAGESIZE + payload_size)


class Unavailable(Exception):
    """FUSE over io_uring cannot be used here (said why)."""


def possible_cpus(path: str = "/sys/devices/system/cpu/possible") -> int:
    """The kernel's ``nr_cpu_ids``: the number of queues a FUSE ring has."""
    try:
        text = open(path).read().strip()
    except OSError:
        return os.cpu_count() or 1
    last = 0
    for part in text.split(","):
        last = max(last, int(part.split("-")[-1]))
    return last + 1


ENABLE = "/sys/module/fuse/parameters/enable_uring"


def enabled(path: str = ENABLE) -> bool:
    """Whether root has let FUSE servers use io_uring (the kernel offers it in INIT only then)."""
    try:
        return open(path).read().strip() in ("Y", "1")
    except OSError:
        return False


def _syscall(*args: int) -> int:
    r = _libc.syscall(*[ctypes.c_long(a) for a in args])
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(r)


class _Ring:
    """A minimal io_uring with 128-byte SQEs: set up, its rings mapped, entries written, submitted and
    their completions read."""

    def __init__(self, entries: int) -> None:
        params = bytearray(PARAMS.size + 40)  # (struct io_uring_params: 120 bytes)
        struct.pack_into("<II", params, 0, 0, entries * 2)
        struct.pack_into("<I", params, 8, SETUP_SQE128 | SETUP_CQSIZE)
        buf = ctypes.create_string_buffer(bytes(params), len(params))
        self.fd = _syscall(SYS_SETUP, entries, ctypes.addressof(buf))
        raw = buf.raw
        sq_entries, cq_entries, _, _, _, features, _ = struct.unpack_from("<IIIIIII", raw, 0)
        sq = SQ_OFF.unpack_from(raw, 40)
        cq = CQ_OFF.unpack_from(raw, 80)
        sq_size = sq[6] + sq_entries * 4
        cq_size = cq[5] + cq_entries * CQE.size
        if features & FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        self.sq_map = mmap.mmap(self.fd, sq_size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                mmap.PROT_READ | mmap.PROT_WRITE, offset=OFF_SQ_RING)
        self.cq_map = self.sq_map if features & FEAT_SINGLE_MMAP else mmap.mmap(
            self.fd, cq_size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE,
            offset=OFF_CQ_RING)
        self.sqes = mmap.mmap(self.fd, sq_entries * SQE_SIZE, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                              mmap.PROT_READ | mmap.PROT_WRITE, offset=OFF_SQES)
        self.sq_head, self.sq_tail, self.sq_mask, self.sq_array = sq[0], sq[1], sq[2], sq[6]
        self.cq_head, self.cq_tail, self.cq_mask, self.cq_cqes = cq[0], cq[1], cq[2], cq[5]
        self.sq_entries = sq_entries
        self.pending = 0  # SQEs written and not yet submitted

    def _u32(self, m: mmap.mmap, off: int) -> int:
        return int.from_bytes(m[off:off + 4], "little")

    def push(self, sqe: bytes) -> None:
        """Write one SQE at the tail (submitted by :meth:`submit`)."""
        tail = self._u32(self.sq_map, self.sq_tail)
        head = self._u32(self.sq_map, self.sq_head)
        if tail - head >= self.sq_entries:
            self.submit()
            head = self._u32(self.sq_map, self.sq_head)
            if tail - head >= self.sq_entries:
                raise OSError(errno.EBUSY, "the submission ring is full")
        index = tail & self._u32(self.sq_map, self.sq_mask)
        self.sqes[index * SQE_SIZE:(index + 1) * SQE_SIZE] = sqe
        self.sq_map[self.sq_array + index * 4:self.sq_array + index * 4 + 4] = index.to_bytes(4, "little")
        self.sq_map[self.sq_tail:self.sq_tail + 4] = ((tail + 1) & 0xFFFFFFFF).to_bytes(4, "little")
        self.pending += 1

    def submit(self) -> None:
        while self.pending:
            try:
                done = _syscall(SYS_ENTER, self.fd, self.pending, 0, 0, 0, 0)
            except InterruptedError:
                continue
            self.pending -= done
            if not done:
                break

    def completions(self) -> list[tuple[int, int]]:
        """The completions waiting (user_data, res), taken off the ring."""
        head = self._u32(self.cq_map, self.cq_head)
        tail = self._u32(self.cq_map, self.cq_tail)
        mask = self._u32(self.cq_map, self.cq_mask)
        out = []
        while head != tail:
            off = self.cq_cqes + (head & mask) * CQE.size
            user_data, res, _ = CQE.unpack_from(self.cq_map, off)
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        self.cq_map[self.cq_head:self.cq_head + 4] = head.to_bytes(4, "little")
        return out

    def register_eventfd(self, efd: int) -> None:
        arg = ctypes.c_int(efd)
        _syscall(SYS_REGISTER, self.fd, REGISTER_EVENTFD, ctypes.addressof(arg), 1)

    def close(self) -> None:
        for m in {id(x): x for x in (self.sq_map, self.cq_map, self.sqes)}.values():
            m.close()
        os.close(self.fd)


class _Entry:
    """One registered request slot: its header and payload buffers (page-aligned anonymous maps the
    kernel pins while it copies) and the iovec pair that names them."""

    __slots__ = ("index", "qid", "headers", "payload", "iov", "commit_id", "last")

    def __init__(self, index: int, qid: int, payload_size: int) -> None:
        self.index, self.qid = index, qid
        self.headers = mmap.mmap(-1, mmap.PAGESIZE)
        self.payload = mmap.mmap(-1, payload_size)
        self.iov = (ctypes.c_uint64 * 4)(_address(self.headers), mmap.PAGESIZE, _address(self.payload), payload_size)
        self.commit_id = 0
        self.last = CMD_REGISTER

    def sqe(self, fuse_fd: int) -> bytes:
        sqe = bytearray(SQE_SIZE)
        struct.pack_into("<BBHi", sqe, 0, OP_URING_CMD, 0, 0, fuse_fd)
        struct.pack_into("<I", sqe, 8, self.last)  # cmd_op
        if self.last == CMD_REGISTER:
            struct.pack_into("<QI", sqe, 16, ctypes.addressof(self.iov), 2)  # addr len
        struct.pack_into("<Q", sqe, 32, self.index)  # user_data
        CMD_REQ.pack_into(sqe, 48, 0, self.commit_id if self.last == CMD_COMMIT_AND_FETCH else 0, self.qid)
        return bytes(sqe)

    def close(self) -> None:
        self.headers.close()
        self.payload.close()


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


class Channel:
    """FUSE requests through an io_uring: ``depth`` entries for each of the kernel's queues, every
    request handed to ``handle`` as the bytes ``/dev/fuse`` would have given (a ``fuse_in_header`` and
    its arguments), every answer taken by :meth:`answer` (an out header and its parts)."""

    def __init__(self, fuse_fd: int, payload_size: int, handle: Callable[[memoryview], None], *,
                 depth: int = DEPTH, queues: int | None = None) -> None:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise Unavailable(f"FUSE over io_uring is implemented for x86-64 only (this is {platform.machine()})")
        self.fuse_fd = fuse_fd
        self.handle = handle
        self.queues = queues or possible_cpus()
        self.depth = depth
        self.payload_size = payload_size
        try:
            self.ring = _Ring(self.queues * depth + 1)
        except OSError as exc:
            raise Unavailable(f"io_uring could not be set up: {exc.strerror}") from exc
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.ring.register_eventfd(self.eventfd)
        self.entries = [_Entry(i, i // depth, payload_size) for i in range(self.queues * depth)]
        self._waiting: dict[int, _Entry] = {}  # unique -> the entry its answer goes to
        self._batching = False  # (answers given while ready() runs are submitted together at its end)
        self.requests = 0
        self.closed = False

    def start(self) -> None:
        """Register every entry (after the INIT reply: before it the kernel answers EAGAIN, and the
        entry is registered again)."""
        for e in self.entries:
            e.last = CMD_REGISTER
            self.ring.push(e.sqe(self.fuse_fd))
        self.ring.submit()

    def owns(self, unique: int) -> bool:
        return unique in self._waiting

    def ready(self) -> bool:
        """Take what the kernel completed: each request to ``handle``; an entry the kernel refused for
        now (EAGAIN, EINTR) registered again. False once the connection is gone (unmounted)."""
        try:
            os.eventfd_read(self.eventfd)
        except BlockingIOError:
            pass
        alive = True
        self._batching = True
        try:
            alive = self._take()
        finally:
            self._batching = False
        self.ring.submit()
        return alive

    def _take(self) -> bool:
        alive = True
        for index, res in self.ring.completions():
            if index >= len(self.entries):
                continue
            e = self.entries[index]
            if res == 0:
                try:
                    self._request(e)
                except Exception:  # (the session answers what it can parse; this is the last guard)
                    log.exception("FUSE over io_uring: a request could not be taken: answered EIO")
                    unique = int.from_bytes(e.headers[8:16], "little")
                    if self.owns(unique):  # (never left unanswered: its caller would wait for ever)
                        self.answer([OUT_HEADER.pack(OUT_HEADER.size, -errno.EIO, unique)])
            elif res in (-errno.EAGAIN, -errno.EINTR):
                self.ring.push(e.sqe(self.fuse_fd))
            elif res in (-errno.ENOTCONN, -errno.ECANCELED, -errno.ENODEV, -errno.ECONNABORTED):
                alive = False  # (unmounted: the connection is gone)
            else:  # (this entry only: the others keep serving, and until the ring is ready, /dev/fuse)
                log.warning("FUSE over io_uring: entry %d of queue %d refused: %s", e.index, e.qid,
                            os.strerror(-res))
        return alive

    def _request(self, e: _Entry) -> None:
        h = e.headers
        length = int.from_bytes(h[0:4], "little")
        _, commit_id, payload_sz, = ENT_IN_OUT.unpack_from(h, HEADER_IN_OUT + HEADER_OP)[:3]
        e.commit_id = commit_id
        op_len = length - IN_HEADER_SIZE - payload_sz
        unique = int.from_bytes(h[8:16], "little")
        self.requests += 1
        if not 0 <= op_len <= HEADER_OP or payload_sz > self.payload_size:
            log.warning("FUSE over io_uring: a request of %d bytes with a payload of %d: answered EIO",
                        length, payload_sz)
            self._waiting[unique] = e
            self.answer([OUT_HEADER.pack(OUT_HEADER.size, -errno.EIO, unique)])
            return
        self._waiting[unique] = e
        request = bytearray(length)
        request[:IN_HEADER_SIZE] = h[:IN_HEADER_SIZE]
        request[IN_HEADER_SIZE:IN_HEADER_SIZE + op_len] = h[HEADER_IN_OUT:HEADER_IN_OUT + op_len]
        request[IN_HEADER_SIZE + op_len:] = e.payload[:payload_sz]
        self.handle(memoryview(request))

    def answer(self, iov: list[bytes | memoryview]) -> None:
        """The answer to a request this channel gave (``iov[0]`` its out header): into its entry's
        buffers, committed with the next submission."""
        _, error, unique = OUT_HEADER.unpack_from(iov[0])
        e = self._waiting[unique]  # (kept until committed: an answer that fails here can be answered again)
        if self.closed:  # (unmounted while the request was answered: the kernel has let it go)
            del self._waiting[unique]
            return
        size = 0
        if not error:
            for part in iov[1:]:
                n = len(part)
                if size + n > self.payload_size:
                    error, size = -errno.EIO, 0
                    log.warning("FUSE over io_uring: an answer larger than the payload buffer: EIO")
                    break
                e.payload[size:size + n] = part
                size += n
        e.headers[0:OUT_HEADER.size] = OUT_HEADER.pack(OUT_HEADER.size + size, error, unique)
        ENT_IN_OUT.pack_into(e.headers, HEADER_IN_OUT + HEADER_OP, 0, e.commit_id, size, 0)
        del self._waiting[unique]
        e.last = CMD_COMMIT_AND_FETCH
        self.ring.push(e.sqe(self.fuse_fd))
        if not self._batching:
            self.ring.submit()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.ring.close()
        os.close(self.eventfd)
        for e in self.entries:
            e.close()
