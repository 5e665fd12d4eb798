"""What the libcurl (pycurl) clients share: collecting one answer, headers and a bounded body."""

from __future__ import annotations

import pycurl


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

    The body goes straight into a bytearray (libcurl calls ``bytearray.extend``, no Python frame per
    16 KiB chunk) and libcurl itself stops a transfer that would exceed ``limit``
    (``CURLOPT_MAXFILESIZE_LARGE``, which also applies to answers of unknown length)."""

    __slots__ = ("headers", "body", "limit")

    def __init__(self, limit: int) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.limit = limit

    def attach(self, curl: pycurl.Curl) -> None:
        """Have ``curl``'s next transfer fill this answer."""
        curl.setopt(pycurl.HEADERFUNCTION, self.header)
        curl.setopt(pycurl.WRITEFUNCTION, self.body.extend)
        curl.setopt(pycurl.MAXFILESIZE_LARGE, self.limit)

    @staticmethod
    def overflowed(exc: pycurl.error) -> bool:
        """Whether a failed transfer was stopped for being longer than the limit."""
        return bool(exc.args) and exc.args[0] == pycurl.E_FILESIZE_EXCEEDED

    def header(self, line: bytes) -> None:
        if line.startswith(b"HTTP/"):
            self.headers = {}  # a new answer (after a 100 Continue, say)
            return
        name, sep, value = line.partition(b":")
        if sep:
            self.headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
