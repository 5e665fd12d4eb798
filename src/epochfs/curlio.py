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
    """Collects one answer: headers (lower-case names) and a body of at most ``limit`` bytes."""

    __slots__ = ("headers", "body", "limit", "overflow")

    def __init__(self, limit: int) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.limit = limit
        self.overflow = False

    def header(self, line: bytes) -> None:
        if line.startswith(b"HTTP/"):
            self.headers = {}  # a new answer (after a 100 Continue, say)
            return
        name, sep, value = line.partition(b":")
        if sep:
            self.headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")

    def write(self, chunk: bytes) -> int | None:
        if len(self.body) + len(chunk) > self.limit:
            self.overflow = True
            return 0  # stops the transfer
        self.body += chunk
        return None
