"""Asking an owner for a block (blocking; called from the cache's fetch worker threads and the
membership's proofs).

libcurl (:mod:`epochfs.transport.curlio`), one handle per thread, connections kept alive per peer. The
whole request is bounded by the tier's timeout, the connection by ``CONNECT_TIMEOUT`` (a refused
connection fails at once). An answer is used only if it is complete and authenticated: its MAC (made
with the cluster's token, bound to this request) fits the status and the body, and a block is exactly
the block's length. Anything else is a :class:`PeerFailure` and nothing of it is kept.
"""

from __future__ import annotations

import threading
import time

import pycurl

from epochfs.core.text import printable
from epochfs.peer import wire
from epochfs.transport import curlio


class PeerFailure(Exception):
    """The owner could not give the block. ``kind``: ``unavailable`` (no connection, no answer in
    time), ``bad`` (an answer that does not check out), ``declined`` (the owner answered an error:
    ``status`` says which)."""

    def __init__(self, kind: str, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


class PeerClient:
    CONNECT_TIMEOUT = 0.5

    def __init__(self, keys: wire.Keys, timeout: float) -> None:
        self.keys = keys
        self.timeout = timeout
        self._local = threading.local()
        self._since: dict[str, int] = {}  # member -> the second it started (from its hello)

    def _curl(self) -> curlio.Easy:
        curl = getattr(self._local, "curl", None)
        if curl is None:
            curl = self._local.curl = curlio.Easy()
            curl.setopt(pycurl.PROXY, "")  # peers are on the cluster network, never behind a proxy
            curl.setopt(pycurl.CONNECTTIMEOUT_MS, int(self.CONNECT_TIMEOUT * 1000))
        return curl

    def get(self, member: str, req: wire.BlockRequest) -> bytes | None:
        """The block's bytes (None for a warm request, once the owner has it); :class:`PeerFailure`."""
        status, data = self._ask(member, req.target(), max(req.length, 4096), self.timeout)
        if req.warm and status == 204:
            return None
        if status != 200:
            reason = bytes(data[:200]).decode("utf-8", "replace")
            raise PeerFailure("declined", f"{member}: HTTP {status} {printable(reason)}".strip(), status)
        if len(data) != req.length:
            raise PeerFailure("bad", f"{member}: {len(data)} bytes for a block of {req.length}")
        return bytes(data)

    def hello(self, member: str, timeout: float) -> int | None:
        """Have ``member`` prove that it holds the cluster's token; :class:`PeerFailure` if it does not.
        Its answer says when it started (requests to it are signed no earlier: it refuses older ones) and
        the size of its cache, returned (None from a member that does not say it)."""
        status, body = self._ask(member, wire.HELLO_SIZED, 4096, timeout)
        if status in (400, 404):  # (authenticated: a member of an older version, which knows the plain hello)
            status, body = self._ask(member, wire.HELLO, 4096, timeout)
        answer = wire.parse_hello(bytes(body)) if status == 200 else None
        if answer is None:
            raise PeerFailure("declined", f"{member}: HTTP {status} to a hello", status)
        self._since[member], capacity = answer
        return capacity

    def _ask(self, member: str, target: str, limit: int, timeout: float) -> tuple[int, memoryview]:
        try:
            return self._exchange(member, target, limit, timeout)
        except PeerFailure:
            self._local.curl = None  # its connection may hold the rest of a bad answer: start afresh
            raise

    def _exchange(self, member: str, target: str, limit: int, timeout: float) -> tuple[int, memoryview]:
        headers, mac = self.keys.headers(member, target, max(time.time(), self._since.get(member, 0)))
        curl = self._curl()
        curl.setopt(pycurl.URL, f"http://{member}{target}")
        curl.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in headers.items()])
        curl.setopt(pycurl.TIMEOUT_MS, max(1, int(timeout * 1000)))
        try:
            fields, body = curl.perform(limit)
        except curlio.Failed as exc:
            if curlio.overflowed(exc):
                raise PeerFailure("bad", f"{member}: answer longer than the block") from None
            raise PeerFailure("unavailable", f"{member}: {exc.message}") from None
        status = int(curl.getinfo(pycurl.RESPONSE_CODE))
        if not self.keys.answer_ok(mac, status, body, fields.get(wire.ANSWER_HEADER)):
            hint = " (does it have another --peer-token-file?)" if status == 401 else ""
            raise PeerFailure("bad", f"{member}: an answer (HTTP {status}) not authenticated with the "
                                     f"cluster's token{hint}", status)
        return status, body
