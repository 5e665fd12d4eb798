"""Whether the page cache holds a range of a file, asked without reading it: ``cachestat(2)`` (Linux 6.5).

A read that would wait for the disk is better made on a worker thread, and one the page cache can
answer is quicker inline. ``preadv2(RWF_NOWAIT)`` answers that only by trying, and a try that fails
has already started the disk read on the calling thread (measured: 0.14 ms of the event loop per
100 KiB not in memory). ``cachestat`` only looks. And advice that the kernel read a range ahead,
made off the calling thread (:class:`Adviser`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading

_SYS_CACHESTAT = 451  # the same number on every architecture (asm-generic)
_PAGE = os.sysconf("SC_PAGE_SIZE")


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64)
                for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # not a C library that has syscall(2)
    _syscall = None

_works = _syscall is not None
_mine = threading.local()


def available() -> bool:
    """Whether this kernel answers :func:`resident` (it is asked once; ENOSYS turns it off)."""
    return _works


def resident(fd: int, offset: int, length: int) -> bool | None:
    """Whether every page of [offset, offset + length) of ``fd`` is in the page cache; None where the
    kernel cannot say (no ``cachestat``: ask :func:`available` first)."""
    if length <= 0:
        return True if _works else None
    asked = _ask(fd, offset, length)
    return None if asked is None else asked[1].nr_cache >= asked[0]


def counts(fd: int, offset: int, length: int) -> tuple[int, int, int] | None:
    """(pages, cached, evicted) of the pages covering [offset, offset + length) of ``fd``: how many
    there are, how many the page cache holds, how many it held and the kernel reclaimed since (clean
    pages read ahead and not yet touched are the first it takes back; an invalidation such as
    ``POSIX_FADV_DONTNEED`` is not counted). None where the kernel cannot say."""
    asked = _ask(fd, offset, max(length, 1))
    return None if asked is None else (asked[0], asked[1].nr_cache, asked[1].nr_evicted)


def _ask(fd: int, offset: int, length: int) -> tuple[int, _Stat] | None:
    global _works
    if not _works:
        return None
    first, last = offset // _PAGE, (offset + length - 1) // _PAGE
    asked = getattr(_mine, "asked", None)
    if asked is None:  # each thread's own structures, made once (the call is on the hot path)
        asked = _mine.asked = (_Range(), _Stat())
        _mine.refs = (ctypes.byref(asked[0]), ctypes.byref(asked[1]))
    span, stat = asked
    span.off, span.len = first * _PAGE, (last - first + 1) * _PAGE
    rc = _syscall(_SYS_CACHESTAT, fd, *_mine.refs, 0)
    if rc != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an old kernel, or a seccomp filter
            _works = False
        return None
    return last - first + 1, stat


class Adviser:
    """``POSIX_FADV_WILLNEED`` off the calling thread. The advice starts the disk reads that fill the
    pages, and its call waits while it submits them (measured on a warm 512 MiB stream: a tenth of the
    event loop's samples, during which the next request waited); here one thread of its own makes the
    calls. Each advice carries a duplicate of the descriptor, closed once used (the caller may close
    its own at once), or a path the thread opens itself (after the caches were dropped, opening a
    block file waits for the disk too). Advice is a hint: at most ``BOUND`` wait, and more are
    dropped (counted)."""

    BOUND = 64

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[int | str, int, int]] = queue.Queue(self.BOUND)
        self._pid = 0  # (the thread is started in the process that advises: a fork leaves it behind)
        self._lock = threading.Lock()
        self.dropped = 0

    def advise(self, fd: int, offset: int, length: int) -> None:
        """Advice on an open file (a duplicate of ``fd`` goes with it)."""
        try:
            dup = os.dup(fd)
        except OSError:
            return
        self._hand(dup, offset, length)

    def advise_path(self, path: str, offset: int, length: int) -> None:
        """Advice on a file the thread opens (and closes) itself."""
        self._hand(path, offset, length)

    def _hand(self, target: int | str, offset: int, length: int) -> None:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._queue = queue.Queue(self.BOUND)
                    threading.Thread(target=self._run, args=(self._queue,), daemon=True, name="advise").start()
                    self._pid = os.getpid()
        try:
            self._queue.put_nowait((target, offset, length))
        except queue.Full:
            if isinstance(target, int):
                os.close(target)
            self.dropped += 1

    def drain(self) -> None:
        """Wait until every advice handed over was made (tests; a store that closes)."""
        if self._pid == os.getpid():
            self._queue.join()

    @staticmethod
    def _run(q: queue.Queue[tuple[int | str, int, int]]) -> None:
        while True:
            target, offset, length = q.get()
            try:
                fd = target if isinstance(target, int) else os.open(target, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            except OSError:
                pass
            finally:
                q.task_done()
