"""Asking an owner for a block (blocking; called from the cache's fetch worker threads and the
membership's proofs).

libcurl (:mod:`epochfs.transport.curlio`). Requests to one member go through that member's **gate**: a
pool of handles (each with its kept-alive connection), so a node has at most the gate's size of
requests in flight to a member and as many connections to it, whatever its fetch concurrency. The gate
is sized by what the member's link carries: the bytes per second its answers arrived at over the last
seconds, times ``HIDE`` (the latency an answer in flight should hide), in blocks of the size asked
(``MIN_INFLIGHT`` to ``MAX_INFLIGHT``; ``START_INFLIGHT`` until it is measured). Few: one download
already carries 0.94-0.96 of a full link (``benchmarks/cluster/goodput.py``), so on a member whose link
binds every request past a couple is queue, shared by every node asking it, and the block a reader
waits for crosses the link at its share of all of them; with the cluster box's busy step at 0.89 of
two cache nodes' links, 2 to start and at least (a quarter second of the rate) instead of 8 and 4
(half a second) took the links from 0.76 to 0.85 busy and the epoch's AU from 0.90 to 0.93, the
warm tier's from 0.96 to 0.99 (``benchmarks/cluster/results/``, quick boxes 11 and 12). A fetch waits for a
handle (a node's own queue: no fault of the member) at most ``WAIT`` times the tier's timeout, then the
member counts as busy. A handle that comes free goes to a fetch a reader waits for (``urgent``) before
the prefetches queued ahead of it, else to the fetch waiting longest. Proofs (hellos) bypass the gate.
Warm requests (answered once the member holds the block, which it may fetch from this node) go through a
gate of their own, ``WARM_INFLIGHT`` wide: sharing the block gate, two members each warming the other
held every handle to each other while their fetches waited for one, until the requests timed out.

A request is bounded by progress: an answer that moves fewer than ``LOW_SPEED`` bytes a second for the
tier's timeout is given up (a member that died or stopped sending costs at most that), and by
``TOTAL`` times the timeout in all (a full link still moves bytes). The connection by
``CONNECT_TIMEOUT`` (a refused connection fails at once). A kept-alive connection the member closed
just as it was reused (an empty reply, a reset) is asked again once on a new connection before it
counts. An answer is used only if it is complete and authenticated: its MAC (made with the cluster's
token, bound to this request) fits the status and the body (or the digest the body's BLAKE3 hash must
be, where the owner sent it from its file: :mod:`epochfs.peer.wire`), and a block is exactly the block's length.
Anything else is a :class:`PeerFailure` and nothing of it is kept.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable

import pycurl

from epochfs.core.text import printable
from epochfs.peer import wire
from epochfs.transport import curlio


class PeerFailure(Exception):
    """The owner could not give the block. ``kind``: ``unavailable`` (no connection, no answer in
    time), ``bad`` (an answer that does not check out), ``declined`` (the owner answered an error:
    ``status`` says which), ``busy`` (the owner is answering as many as it can: ask again after
    ``retry_after`` seconds; no fault of it)."""

    def __init__(self, kind: str, message: str, status: int = 0, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.retry_after = retry_after


class _Waiter:
    """A fetch waiting for one of a gate's handles; ``urgent`` says, when a handle comes free, whether a
    reader waits for its block now (it goes first)."""

    __slots__ = ("cond", "urgent", "granted")

    def __init__(self, lock: threading.Lock, urgent: Callable[[], bool] | None) -> None:
        self.cond = threading.Condition(lock)
        self.urgent = urgent
        self.granted = False


class _Gate:
    """A member's handles: at most ``limit`` requests in flight to it (its limit follows its rate). A
    handle that comes free goes to the first waiter a reader waits for, else to the one waiting
    longest: prefetches queued at a busy member never hold a reader's block back, and none is overtaken
    by a newcomer."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lent = 0
        self.free: list[curlio.Easy] = []
        self.lock = threading.Lock()
        self.waiting: collections.deque[_Waiter] = collections.deque()
        self.done: collections.deque[tuple[float, int]] = collections.deque(maxlen=512)  # (when, bytes) answered

    def grant(self) -> None:
        """Hand free handles to waiters (``lock`` held): the urgent first, then in the order they came."""
        while self.waiting and self.lent < self.limit:
            chosen = next((w for w in self.waiting if w.urgent is not None and w.urgent()), self.waiting[0])
            self.waiting.remove(chosen)
            self.lent += 1
            chosen.granted = True
            chosen.cond.notify()


class PeerClient:
    CONNECT_TIMEOUT = 0.5
    START_INFLIGHT = 2
    MIN_INFLIGHT = 2
    MAX_INFLIGHT = 32
    HIDE = 0.25  # seconds of a member's rate kept in flight
    WARM_INFLIGHT = 8  # warm requests in flight to a member (their answers carry no bytes to size it by)
    WINDOW = 3.0  # seconds of answers the rate is measured over
    WAIT = 4.0  # a fetch waits for a handle at most this many timeouts
    TOTAL = 4.0  # a request takes at most this many timeouts in all
    LOW_SPEED = 1024  # bytes/s under which, for a timeout, an answer counts as stopped

    def __init__(self, keys: wire.Keys, timeout: float) -> None:
        self.keys = keys
        self.timeout = timeout
        self._local = threading.local()
        self._since: dict[str, int] = {}  # member -> the second it started (from its hello)
        self._gates: dict[tuple[str, bool], _Gate] = {}  # (member, warm requests) -> its gate
        self._gates_lock = threading.Lock()

    def gates(self) -> dict[str, dict[str, int]]:
        """Each member's gate now: requests in flight to it, its limit, fetches waiting for a handle."""
        with self._gates_lock:
            gates = dict(self._gates)
        out = {}
        for (member, warm), gate in gates.items():
            if not warm:
                with gate.lock:
                    out[member] = {"in_flight": gate.lent, "limit": gate.limit, "waiting": len(gate.waiting)}
        return out

    def _new_curl(self) -> curlio.Easy:
        curl = curlio.Easy()
        curl.setopt(pycurl.PROXY, "")  # peers are on the cluster network, never behind a proxy
        curl.setopt(pycurl.CONNECTTIMEOUT_MS, int(self.CONNECT_TIMEOUT * 1000))
        return curl

    def _curl(self) -> curlio.Easy:
        curl = getattr(self._local, "curl", None)
        if curl is None:
            curl = self._local.curl = self._new_curl()
        return curl

    def _gate(self, member: str, warm: bool = False) -> _Gate:
        """``member``'s gate for block requests, or (``warm``) its gate for warm requests: these wait
        while the member fetches the block, possibly from this node, so sharing the handles that fetch
        needs could leave two members each holding every handle to the other, all waiting."""
        with self._gates_lock:
            gate = self._gates.get((member, warm))
            if gate is None:
                gate = self._gates[member, warm] = _Gate(self.WARM_INFLIGHT if warm else self.START_INFLIGHT)
            return gate

    def _sized(self, gate: _Gate, size: int) -> None:
        """The gate's limit from the rate its answers arrived at (``gate.lock`` held)."""
        now = time.monotonic()
        recent = [(t, n) for t, n in gate.done if now - t <= self.WINDOW]
        if len(recent) < 4:
            return
        span = max(now - recent[0][0], 0.1)
        rate = sum(n for _, n in recent) / span
        gate.limit = max(self.MIN_INFLIGHT, min(self.MAX_INFLIGHT, math.ceil(rate * self.HIDE / max(size, 4096))))

    def _borrow(self, member: str, gate: _Gate, urgent: Callable[[], bool] | None) -> curlio.Easy:
        with gate.lock:
            if gate.lent < gate.limit and not gate.waiting:
                gate.lent += 1
            else:
                waiter = _Waiter(gate.lock, urgent)
                gate.waiting.append(waiter)
                deadline = time.monotonic() + self.WAIT * self.timeout
                while not waiter.granted:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        gate.waiting.remove(waiter)
                        raise PeerFailure("busy", f"{member}: {gate.lent} requests in flight to it already", 0, 0.0)
                    waiter.cond.wait(left)
            return gate.free.pop() if gate.free else self._new_curl()

    def _give_back(self, gate: _Gate, curl: curlio.Easy | None, size: int, got: int) -> None:
        with gate.lock:
            gate.lent -= 1
            if curl is not None:
                gate.free.append(curl)
            if got:
                gate.done.append((time.monotonic(), got))
                self._sized(gate, size)
            gate.grant()

    def get(self, member: str, req: wire.BlockRequest, urgent: Callable[[], bool] | None = None) -> bytes | None:
        """The block's bytes (None for a warm request, once the owner has it); :class:`PeerFailure`.
        ``urgent``: whether a reader waits for the block now (asked when it waits for a handle)."""
        gate = self._gate(member, req.warm)
        curl: curlio.Easy | None = self._borrow(member, gate, urgent)
        got = 0
        try:
            status, data, fields = self._ask(member, req.target(), max(req.length, 4096), self.timeout, curl)
            got = len(data) if status == 200 else 0
        except PeerFailure:
            curl = None  # its connection may hold the rest of a bad answer: a new one next time
            raise
        finally:
            self._give_back(gate, curl, req.length, got)
        if req.warm and status == 204:
            return None
        if status == 503 and "retry-after" in fields:  # (authenticated: the owner itself says it is busy)
            try:
                wait = min(max(float(fields["retry-after"]), 0.0), 10.0)
            except ValueError:
                wait = 1.0
            raise PeerFailure("busy", f"{member}: busy", status, wait)
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
        status, body, _ = self._ask(member, wire.HELLO_SIZED, 4096, timeout)
        if status in (400, 404):  # (authenticated: a member of an older version, which knows the plain hello)
            status, body, _ = self._ask(member, wire.HELLO, 4096, timeout)
        answer = wire.parse_hello(bytes(body)) if status == 200 else None
        if answer is None:
            raise PeerFailure("declined", f"{member}: HTTP {status} to a hello", status)
        self._since[member], capacity = answer
        return capacity

    def _ask(self, member: str, target: str, limit: int, timeout: float, curl: curlio.Easy | None = None
             ) -> tuple[int, memoryview, dict[str, str]]:
        """One exchange (on ``curl``, a handle of the member's gate, else this thread's own), asked again
        once on a new connection if a kept-alive one was closed as it was reused."""
        for attempt in (0, 1):
            handle = curl if curl is not None else self._curl()
            try:
                return self._exchange(member, target, limit, timeout, handle)
            except _Dropped as exc:
                if curl is None:
                    self._local.curl = None
                else:
                    curl = self._new_curl()
                if attempt:
                    raise PeerFailure("unavailable", str(exc)) from None
            except PeerFailure:
                if curl is None:
                    self._local.curl = None  # its connection may hold the rest of a bad answer: start afresh
                raise
        raise AssertionError("unreachable")

    def _exchange(self, member: str, target: str, limit: int, timeout: float, curl: curlio.Easy
                  ) -> tuple[int, memoryview, dict[str, str]]:
        headers, mac = self.keys.headers(member, target, max(time.time(), self._since.get(member, 0)))
        curl.setopt(pycurl.URL, f"http://{member}{target}")
        headers[wire.BIND_HEADER] = "digest"  # (an owner may send a cached block from its file)
        curl.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in headers.items()])
        curl.setopt(pycurl.TIMEOUT_MS, max(1, int(self.TOTAL * timeout * 1000)))
        curl.setopt(pycurl.LOW_SPEED_LIMIT, self.LOW_SPEED)
        curl.setopt(pycurl.LOW_SPEED_TIME, max(1, math.ceil(timeout)))
        try:
            fields, body = curl.perform(limit)
        except curlio.Failed as exc:
            if curlio.overflowed(exc):
                raise PeerFailure("bad", f"{member}: answer longer than the block") from None
            if exc.code in _DROPPED:
                raise _Dropped(f"{member}: {exc.message}") from None
            raise PeerFailure("unavailable", f"{member}: {exc.message}") from None
        status = int(curl.getinfo(pycurl.RESPONSE_CODE))
        if not self.keys.answer_ok(mac, status, body, fields.get(wire.ANSWER_HEADER), fields.get(wire.DIGEST_HEADER)):
            hint = " (does it have another --peer-token-file?)" if status == 401 else ""
            raise PeerFailure("bad", f"{member}: an answer (HTTP {status}) not authenticated with the "
                                     f"cluster's token{hint}", status)
        return status, body, fields


#: A connection closed under the request (an empty reply, a reset, a send that failed): on a kept-alive
#: connection, the member closing it as it was reused.
_DROPPED = (pycurl.E_GOT_NOTHING, pycurl.E_RECV_ERROR, pycurl.E_SEND_ERROR)


class _Dropped(Exception):
    pass
