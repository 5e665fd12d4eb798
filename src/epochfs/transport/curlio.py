"""libcurl transfers with no Python inside them, for the clients that fetch blocks (the S3 backend's
short ranges, a peer's blocks): the body and the header lines are written by the C library, and the
GIL is given up once for the whole transfer.

pycurl calls back into Python for every header line and every piece of a body, fourteen and about
eight times for a 100 KiB answer from S3, and each call takes the GIL. In the daemon the trio thread
and the other fetch threads want it too, so most of those calls wait for it, and each wait is a pair
of context switches (``strace`` of a fetch thread: the answer arrives in one ``recvfrom``, then the GIL
changes hands a dozen times). Here libcurl's own default writer, the C library's ``fwrite``, writes the
body into a memory stream (``fmemopen``) over the answer's buffer and the header lines into another
over the handle's buffer; the caller reads both once the transfer has ended. Measured on cold 100 KiB
files from 16 readers (with the pack writes and worker calls that no longer give up the GIL either,
``benchmarks/profiles/results/2026-12-04-cold-small-gil.md``): about 0.15 ms less daemon CPU per file.

pycurl stays the library that loads and initialises libcurl (its wheel pins the version); this module
drives the same library through :mod:`ctypes`, with pycurl's option numbers. Every call into it but
the transfer itself keeps the GIL (``ctypes.PyDLL``): they return at once, and letting go of the GIL
for each would cost what this module saves. A handle belongs to one thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Iterable
from typing import Any

import pycurl

from epochfs.transport.buffers import aligned_buffer

#: The most bytes of header lines an answer may have (all of its header blocks together): more is a
#: failed transfer (``CURLE_WRITE_ERROR``). S3's answers carry about a kilobyte.
HEAD_MAX = 64 << 10

_ERROR_SIZE = 256  # CURL_ERROR_SIZE
_IONBF = 2  # setvbuf: unbuffered (each fwrite goes to the memory at once)
_OBJECTPOINT = 10000  # option numbers from here take a pointer (strings, lists, FILE *)
_OFF_T = 30000  # ... from here a curl_off_t
_FUNCTIONPOINT = 20000
_INFO_LONG, _INFO_DOUBLE, _INFO_TYPEMASK = 0x200000, 0x300000, 0xF00000
_ERRORBUFFER = 10010  # CURLOPT_ERRORBUFFER (pycurl keeps its own and does not name it)


class _Library:
    """libcurl and the C library's memory streams, typed. ``held`` calls keep the GIL (they return at
    once); :meth:`perform` gives it up."""

    def __init__(self) -> None:
        path = _loaded_libcurl()
        held = ctypes.PyDLL(path)
        released = ctypes.CDLL(path)
        libc = ctypes.PyDLL(None)  # the C library the process runs on (its memory streams return at once)
        c_void_p, c_int, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self.init = held.curl_easy_init
        self.init.restype, self.init.argtypes = c_void_p, []
        self.cleanup = held.curl_easy_cleanup
        self.cleanup.restype, self.cleanup.argtypes = None, [c_void_p]
        self.setopt = held.curl_easy_setopt  # (variadic: each value is passed typed, see Easy.setopt)
        self.setopt.restype = c_int
        self.getinfo = held.curl_easy_getinfo
        self.getinfo.restype = c_int
        self.perform = released.curl_easy_perform
        self.perform.restype, self.perform.argtypes = c_int, [c_void_p]
        self.strerror = held.curl_easy_strerror
        self.strerror.restype, self.strerror.argtypes = ctypes.c_char_p, [c_int]
        self.slist_append = held.curl_slist_append
        self.slist_append.restype, self.slist_append.argtypes = c_void_p, [c_void_p, ctypes.c_char_p]
        self.slist_free_all = held.curl_slist_free_all
        self.slist_free_all.restype, self.slist_free_all.argtypes = None, [c_void_p]
        self.fmemopen = libc.fmemopen
        self.fmemopen.restype, self.fmemopen.argtypes = c_void_p, [c_void_p, c_size_t, ctypes.c_char_p]
        self.setvbuf = libc.setvbuf
        self.setvbuf.restype, self.setvbuf.argtypes = c_int, [c_void_p, c_void_p, c_int, c_size_t]
        self.ftell = libc.ftell
        self.ftell.restype, self.ftell.argtypes = ctypes.c_long, [c_void_p]
        self.fclose = libc.fclose
        self.fclose.restype, self.fclose.argtypes = c_int, [c_void_p]

    def stream(self, address: int, size: int) -> int:
        """An unbuffered ``FILE *`` writing to the ``size`` bytes at ``address``."""
        stream = self.fmemopen(address, size, b"w")
        if not stream:
            raise MemoryError(f"fmemopen of {size} bytes failed")
        self.setvbuf(stream, None, _IONBF, 0)
        return int(stream)


def _loaded_libcurl() -> str:
    """The libcurl that pycurl loaded (the process's own copy: its wheel bundles one), else the
    system's."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            path = "/" + line.rstrip("\n").partition("/")[2]
            if "/libcurl" in path and os.path.exists(path):  # (not a file replaced since: "... (deleted)")
                return path
    found = ctypes.util.find_library("curl")
    if found is None:
        raise ImportError("libcurl: pycurl is loaded but its library was not found")
    return found


_library: _Library | None = None
_library_lock = threading.Lock()


def _lib() -> _Library:
    global _library
    if _library is None:
        with _library_lock:
            if _library is None:
                _library = _Library()
    return _library


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class Failed(Exception):
    """A transfer that did not complete: ``code`` is libcurl's (``CURLcode``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message


class Easy:
    """One thread's libcurl handle (and so its kept-alive connections)."""

    def __init__(self) -> None:
        lib = _lib()
        handle = lib.init()
        if not handle:
            raise MemoryError("curl_easy_init failed")
        self._lib = lib
        self._handle = ctypes.c_void_p(handle)
        self._errors = ctypes.create_string_buffer(_ERROR_SIZE)
        self._head = ctypes.create_string_buffer(HEAD_MAX + 1)
        self._lists: dict[int, int] = {}  # option -> the curl_slist it was given (libcurl does not copy one)
        self._set(_ERRORBUFFER, self._errors)
        self.setopt(pycurl.NOSIGNAL, 1)
        self.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
        self.setopt(pycurl.BUFFERSIZE, 512 << 10)

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            self._lib.cleanup(handle)
        for pointer in getattr(self, "_lists", {}).values():
            self._lib.slist_free_all(pointer)

    def setopt(self, option: int, value: int | str | bytes | Iterable[str] | None) -> None:
        """Set a libcurl option (pycurl's numbers): an int, a string, a list of strings (HTTPHEADER,
        ...), or None to clear a string or list."""
        if option >= _OFF_T:
            self._set(option, ctypes.c_int64(int(value)))  # type: ignore[arg-type]
        elif option >= _FUNCTIONPOINT:
            raise ValueError(f"option {option}: callbacks are not taken here")
        elif option < _OBJECTPOINT:
            self._set(option, ctypes.c_long(int(value)))  # type: ignore[arg-type]
        elif value is None:
            self._set(option, ctypes.c_void_p(None))
            self._free_list(option)
        elif isinstance(value, (str, bytes)):
            self._set(option, ctypes.c_char_p(value.encode() if isinstance(value, str) else value))
        else:
            lib, pointer = self._lib, None
            try:
                for item in value:
                    appended = lib.slist_append(pointer, item.encode())
                    if not appended:
                        raise MemoryError("curl_slist_append failed")
                    pointer = appended
                self._set(option, ctypes.c_void_p(pointer))
            except BaseException:
                if pointer:
                    lib.slist_free_all(pointer)
                raise
            self._free_list(option)
            if pointer:
                self._lists[option] = pointer

    def _free_list(self, option: int) -> None:
        old = self._lists.pop(option, None)
        if old:
            self._lib.slist_free_all(old)

    def _set(self, option: int, value: Any) -> None:
        code = self._lib.setopt(self._handle, ctypes.c_int(option), value)
        if code:
            raise ValueError(f"libcurl option {option}: {self._lib.strerror(code).decode('utf-8', 'replace')}")

    def getinfo(self, info: int) -> int | float:
        """A number about the last transfer (pycurl's ``RESPONSE_CODE``, ``TOTAL_TIME``, ...)."""
        kind = info & _INFO_TYPEMASK
        value: Any = ctypes.c_long() if kind == _INFO_LONG else ctypes.c_double() if kind == _INFO_DOUBLE else None
        if value is None:
            raise ValueError(f"info {info:#x}: only numbers are read here")
        code = self._lib.getinfo(self._handle, ctypes.c_int(info), ctypes.byref(value))
        if code:
            raise ValueError(f"libcurl info {info:#x}: {self._lib.strerror(code).decode('utf-8', 'replace')}")
        return value.value  # type: ignore[no-any-return]

    def perform(self, limit: int) -> tuple[dict[str, str], memoryview]:
        """Run the transfer set up with :meth:`setopt`: the last answer's header fields (lower-case
        names) and its body, at most ``limit`` bytes (received into :func:`aligned_buffer` memory).
        Raises :class:`Failed` (``CURLE_FILESIZE_EXCEEDED`` or ``CURLE_WRITE_ERROR`` for a body over
        ``limit``: :func:`overflowed`)."""
        lib = self._lib
        # One byte more than the limit: the memory stream ends a full buffer with a null byte, which
        # must never land on a byte of the body; a body that reaches it is over the limit.
        buffer = aligned_buffer(limit + 1)
        body = lib.stream(_address(buffer), limit + 1)
        try:
            head = lib.stream(ctypes.addressof(self._head), HEAD_MAX + 1)
        except BaseException:
            lib.fclose(body)
            raise
        self._errors.value = b""
        try:
            self._set(pycurl.WRITEDATA, ctypes.c_void_p(body))
            self._set(pycurl.WRITEHEADER, ctypes.c_void_p(head))
            self._set(pycurl.MAXFILESIZE_LARGE, ctypes.c_int64(limit))
            code = lib.perform(self._handle)
            size, head_size = lib.ftell(body), lib.ftell(head)
        finally:
            self._set(pycurl.WRITEDATA, ctypes.c_void_p(None))
            self._set(pycurl.WRITEHEADER, ctypes.c_void_p(None))
            lib.fclose(body)
            lib.fclose(head)
        if code:
            message = self._errors.value or lib.strerror(code)
            raise Failed(code, message.decode("utf-8", "replace"))
        if size < 0 or head_size < 0:
            raise Failed(pycurl.E_WRITE_ERROR, "the answer's memory stream failed")
        if size > limit:
            raise Failed(pycurl.E_FILESIZE_EXCEEDED, f"an answer longer than the {limit} bytes allowed")
        if head_size > HEAD_MAX:
            raise Failed(pycurl.E_WRITE_ERROR, f"header lines longer than {HEAD_MAX} bytes")
        return parse_head(ctypes.string_at(self._head, head_size)), buffer[:size]


def overflowed(exc: Failed) -> bool:
    """Whether a failed transfer was stopped for being longer than its limit."""
    return exc.code in (pycurl.E_FILESIZE_EXCEEDED, pycurl.E_WRITE_ERROR)


def parse_head(raw: bytes) -> dict[str, str]:
    """The fields of the last answer in ``raw``, the header lines of all answers of a transfer (a
    ``100 Continue`` before the answer, say): lower-case names, the last of a repeated name."""
    fields: dict[str, str] = {}
    for line in raw.split(b"\n"):
        if line.startswith(b"HTTP/"):
            fields = {}
            continue
        name, sep, value = line.partition(b":")
        if sep:
            fields[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return fields

