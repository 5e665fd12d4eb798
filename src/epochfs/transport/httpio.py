"""Large answers through the standard library's HTTP client, received straight into an aligned buffer.

libcurl, through pycurl, hands a body over in Python ``bytes`` objects: each segment is copied into a
new object and again into the body, both while holding the GIL. Here the kernel copies each segment
from the socket into the answer's buffer (``recv_into``) with the GIL released, and the cache writes
the block to disk from that buffer (it is aligned for ``O_DIRECT``). Measured on a cold 256 MiB stream
(``benchmarks/profiles/results/*-engines.md``): 1.1 daemon CPU seconds per GiB against 1.5 through pycurl, and
against ``awscrt``'s S3 client and a curl multi handle, which both cost more CPU per byte and read
slower on this machine's two cores.

A request has one deadline, enforced on every send and receive (connect, TLS handshake, headers and
body included): a server that drips its answer cannot hold a thread past it. A connection is kept per
thread and closed after any failure or any answer not read to its end.
"""

from __future__ import annotations

import http.client
import math
import socket
import ssl
import time
from typing import Any

from epochfs.transport.buffers import aligned_buffer

#: Connection setup waits at most this long (within the request's deadline).
CONNECT_TIMEOUT = 5.0
#: What is read of an answer that is not a success (an error document).
ERROR_BODY = 64 << 10


#: What a kept connection the server has closed meanwhile fails with.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class Overflow(Exception):
    """The answer is longer than the caller allows."""


class _Deadline:
    """Every receive and send of the socket waits at most until :attr:`deadline` (monotonic)."""

    deadline = math.inf

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        self.settimeout(left)  # type: ignore[attr-defined]

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return super().recv_into(*args)  # type: ignore[misc, no-any-return]

    def recv(self, *args: Any) -> bytes:
        self._arm()
        return super().recv(*args)  # type: ignore[misc, no-any-return]

    def sendall(self, *args: Any) -> None:
        self._arm()
        super().sendall(*args)  # type: ignore[misc]


class _Socket(_Deadline, socket.socket):
    pass


class _TLSSocket(_Deadline, ssl.SSLSocket):
    pass


class _Connection(http.client.HTTPConnection):
    """An HTTP/1.1 connection whose socket keeps the current request's deadline."""

    def __init__(self, host: str, port: int | None, context: ssl.SSLContext | None) -> None:
        if context is not None:
            self.default_port = http.client.HTTPS_PORT  # (before the base class picks the port)
        super().__init__(host, port)
        self.context = context
        self.deadline = math.inf

    def connect(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        plain = socket.create_connection((self.host, self.port), min(left, CONNECT_TIMEOUT))
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: Any
        if self.context is None:
            sock = _Socket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        else:
            plain.settimeout(max(0.001, self.deadline - time.monotonic()))
            sock = self.context.wrap_socket(plain, server_hostname=self.host)
        sock.deadline = self.deadline
        self.sock = sock


def tls_context(cafile: str | bool | None) -> ssl.SSLContext:
    """The client context for ``https``: the CA bundle ``cafile`` (None: the system's), or no
    verification at all where ``cafile`` is False (as the AWS client was told)."""
    context = ssl.create_default_context(cafile=cafile if isinstance(cafile, str) else None)
    if cafile is False:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.sslsocket_class = _TLSSocket
    return context


class Client:
    """One thread's connection to one endpoint (not thread-safe: one per thread)."""

    def __init__(self, host: str, port: int | None, context: ssl.SSLContext | None) -> None:
        self._host, self._port, self._context = host, port, context
        self._conn: _Connection | None = None
        self.answered = 0.0  # monotonic seconds: when the last answer's head arrived (its body moved after)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def get(self, target: str, headers: dict[str, str], limit: int,
            deadline: float) -> tuple[int, dict[str, str], memoryview]:
        """GET ``target`` (path and query): the status, the headers (lower-case names) and the body,
        which for a success is at most ``limit`` bytes (:class:`Overflow` if it is longer) and for any
        other answer at most :data:`ERROR_BODY` (the rest unread). Raises OSError (TimeoutError once
        ``deadline`` passed; ssl.SSLError) or http.client.HTTPException on a transport failure; the
        connection is then closed. A kept connection the server closed meanwhile is replaced at once
        (the request is sent again on a new one), as any client of keep-alive connections does."""
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                return self._get(conn, target, headers, limit, deadline)
            except _STALE:
                pass  # (closed by _get)
        conn = self._conn = _Connection(self._host, self._port, self._context)
        return self._get(conn, target, headers, limit, deadline)

    def _get(self, conn: _Connection, target: str, headers: dict[str, str], limit: int,
             deadline: float) -> tuple[int, dict[str, str], memoryview]:
        conn.deadline = deadline
        if conn.sock is not None:
            conn.sock.deadline = deadline
        try:
            conn.request("GET", target, headers=headers)
            answer = conn.getresponse()
            self.answered = time.monotonic()
            status = answer.status
            fields = {name.lower(): value for name, value in answer.getheaders()}
            body = self._body(answer, limit if 200 <= status < 300 else ERROR_BODY, strict=200 <= status < 300)
            if not answer.isclosed():  # an error document longer than we read: drop the connection
                self.close()
            return status, fields, body
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _body(answer: http.client.HTTPResponse, limit: int, *, strict: bool) -> memoryview:
        if answer.length is not None and answer.length > limit and strict:
            raise Overflow(f"an answer of {answer.length} bytes, more than the {limit} asked for")
        size = limit if answer.length is None else min(limit, answer.length)
        buffer = aligned_buffer(size)
        got = 0
        while got < size:
            n = answer.readinto(buffer[got:])
            if not n:
                break
            got += n
        if strict and not answer.isclosed() and answer.read(1):
            raise Overflow(f"an answer longer than the {limit} bytes asked for")
        return buffer[:got]
