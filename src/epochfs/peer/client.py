"""Asking an owner for a block (blocking; called from the cache's fetch worker threads).

libcurl (pycurl), one handle per thread, connections kept alive per peer. The whole request is bounded
by the tier's timeout, the connection by ``CONNECT_TIMEOUT`` (a refused connection fails at once). An
answer is used only if it is complete and checks out: status 200, exactly the block's length, and the
XXH3-128 checksum the owner computed over the bytes it sent.
"""

from __future__ import annotations

import threading
import time

import pycurl

from epochfs.curlio import Answer, new_handle
from epochfs.peer import wire


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

    def __init__(self, token: bytes, timeout: float) -> None:
        self.token = token
        self.timeout = timeout
        self._local = threading.local()

    def _curl(self) -> pycurl.Curl:
        curl = getattr(self._local, "curl", None)
        if curl is None:
            curl = self._local.curl = new_handle()
            curl.setopt(pycurl.PROXY, "")  # peers are on the cluster network, never behind a proxy
            curl.setopt(pycurl.CONNECTTIMEOUT_MS, int(self.CONNECT_TIMEOUT * 1000))
        return curl

    def get(self, member: str, req: wire.BlockRequest) -> bytes | None:
        """The block's bytes (None for a warm request, once the owner has it); :class:`PeerFailure`."""
        target = req.target()
        answer = Answer(max(req.length, 4096))
        curl = self._curl()
        curl.setopt(pycurl.URL, f"http://{member}{target}")
        curl.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in wire.headers(self.token, target, time.time()).items()])
        curl.setopt(pycurl.TIMEOUT_MS, max(1, int(self.timeout * 1000)))
        answer.attach(curl)
        try:
            curl.perform()
        except pycurl.error as exc:
            if answer.overflowed(exc):
                raise PeerFailure("bad", f"{member}: answer longer than the block") from None
            message = exc.args[1] if len(exc.args) > 1 else str(exc)
            raise PeerFailure("unavailable", f"{member}: {message}") from None
        status = curl.getinfo(pycurl.RESPONSE_CODE)
        if req.warm and status == 204:
            return None
        if status != 200:
            reason = bytes(answer.body[:200]).decode("utf-8", "replace")
            raise PeerFailure("declined", f"{member}: HTTP {status} {reason}".strip(), status)
        data = bytes(answer.body)
        if len(data) != req.length:
            raise PeerFailure("bad", f"{member}: {len(data)} bytes for a block of {req.length}")
        if answer.headers.get(wire.SUM_HEADER) != wire.checksum(data):
            raise PeerFailure("bad", f"{member}: the block's checksum does not match")
        return data
