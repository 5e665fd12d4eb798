"""What the libcurl (pycurl) clients share: collecting one answer, headers and a bounded body."""

from __future__ import annotations

import pycurl

from epochfs.transport.buffers import aligned_buffer


def new_handle() -> pycurl.Curl:
    """A handle for one thread: no signals (threads), HTTP/1.1 kept alive, large receive buffers (fewer
    write callbacks per block)."""
    curl = pycurl.Curl()
    curl.setopt(pycurl.NOSIGNAL, 1)
    curl.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
    curl.setopt(pycurl.BUFFERSIZE, 512 << 10)
    return curl


class Answer:
    """Collects one answer: headers (lower-case names) and a body of at most ``limit`` bytes.

    The body is received into memory allocated once for ``limit`` bytes
    (:func:`epochfs.transport.buffers.aligned_buffer`): no copy as it grows, and a block of it is written to the
    cache disk from where it is. libcurl itself stops a transfer that would exceed ``limit``
    (``CURLOPT_MAXFILESIZE_LARGE``, which also applies to answers of unknown length); the write
    callback refuses what would not fit all the same."""

    __slots__ = ("headers", "limit", "_buffer", "_size")

    def __init__(self, limit: int) -> None:
        self.headers: dict[str, str] = {}
        self.limit = limit
        self._buffer = aligned_buffer(limit)
        self._size = 0

    @property
    def body(self) -> memoryview:
        """The bytes received (a view of the buffer: nothing writes to it once the transfer ended)."""
        return self._buffer[:self._size]

    def attach(self, curl: pycurl.Curl) -> None:
        """Have ``curl``'s next transfer fill this answer."""
        curl.setopt(pycurl.HEADERFUNCTION, self.header)
        curl.setopt(pycurl.WRITEFUNCTION, self._write)
        curl.setopt(pycurl.MAXFILESIZE_LARGE, self.limit)

    @staticmethod
    def overflowed(exc: pycurl.error) -> bool:
        """Whether a failed transfer was stopped for being longer than the limit."""
        return bool(exc.args) and exc.args[0] in (pycurl.E_FILESIZE_EXCEEDED, pycurl.E_WRITE_ERROR)

    def _write(self, chunk: bytes) -> int | None:
        start = self._size
        end = start + len(chunk)
        if end > self.limit:
            return 0  # libcurl stops the transfer (CURLE_WRITE_ERROR)
        self._buffer[start:end] = chunk
        self._size = end
        return None

    def header(self, line: bytes) -> None:
        if line.startswith(b"HTTP/"):
            self.headers = {}  # a new answer (after a 100 Continue, say)
            self._size = 0
            return
        name, sep, value = line.partition(b":")
        if sep:
            self.headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
