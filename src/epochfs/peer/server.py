"""The peer port: answers other members' block requests (HTTP/1.1 over TCP, parsed by h11).

Concurrency contract: one trio task per connection. A connection earns a slot (``MAX_CONNECTIONS`` at
once) with its first request, as soon as that request is authenticated; until then it waits among at
most ``UNAUTHENTICATED`` connections, has ``REQUEST_TIMEOUT`` seconds to send its request, and gives way
to a newer one when they are full (:mod:`epochfs.transport.slots`): connections without the token push
only each other out, never a member's request that was authenticated, and never close one unanswered.
When every slot holds a connection being answered, an authenticated request gets an authenticated
**busy** answer (503 with ``Retry-After``), which a member takes as "ask again shortly", never as a
fault. A request that fails authentication is answered and its connection closed. An authenticated
connection that sends nothing for ``IDLE`` seconds is closed (its slot goes first to a new one that
earned its own). An answer is sent as long as it makes progress: a connection whose answer moves no byte
for ``STALL`` seconds is closed (a link that is full still moves bytes; a client that stopped reading
does not); the block itself must be had within ``SERVE_TIMEOUT``. Every close but a client's own is counted by its reason (``stats.closed``),
and logged (the first of each reason, then every ``LOG_EVERY``-th). Nothing a client sends can end the
server: every request is checked by :mod:`epochfs.peer.wire` (signature and freshness first),
anything else is answered with an error status or a close. Every answer to an authenticated request
carries its answer MAC.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h11
import trio

from epochfs.core.errors import ConfigError
from epochfs.links.meter import TransferMeter
from epochfs.peer import wire
from epochfs.transport.slots import Slot, Slots

log = logging.getLogger(__name__)



@dataclass
class Bound:
    """A block's answer bound by its BLAKE3 ``digest`` (:mod:`epochfs.peer.wire`) rather than by a MAC
    over its bytes: the bytes (``data``), or ``length`` bytes at ``offset`` of ``fd`` that the kernel
    sends from the file (``sendfile``), never read here; ``done`` is called once, when it was sent or
    given up."""

    digest: bytes
    length: int
    data: bytes | None = None
    fd: int = -1
    offset: int = 0
    done: Callable[[], None] | None = None


#: Answers a request; the flag: whether the asker takes an answer bound by digest (a :class:`Bound`).
Serve = Callable[[wire.BlockRequest, bool], Awaitable[bytes | Bound | None]]


#: Why the server closed a connection (``stats.closed``, the ``epochfs_peer_closed_total`` series).
CLOSE_REASONS = ("idle", "unauthenticated", "protocol", "stalled", "evicted", "reclaimed", "busy", "refused")


@dataclass
class ServerStats:
    served: int = 0
    served_bytes: int = 0
    rejected: int = 0
    connections: int = 0
    busy: int = 0  # requests answered busy (every slot held by a connection being answered)
    served_from_files: int = 0  # of served_bytes, those the kernel sent from the cache's files (sendfile)
    closed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLOSE_REASONS, 0))


class PeerServer:
    MAX_CONNECTIONS = 128  # connections that sent an authenticated request
    UNAUTHENTICATED = 512  # connections at once that have not (yet): the oldest gives way to a new one
    IDLE = 60.0
    REQUEST_TIMEOUT = 5.0
    SERVE_TIMEOUT = 30.0  # seconds to have the block asked for (from the cache, or the backend)
    STALL = 15.0  # seconds an answer may move no byte
    SLICE = 64 << 10  # bytes of an answer's body sent under one progress deadline
    RETRY_AFTER = 1  # seconds a busy answer asks the member to wait
    LOG_EVERY = 100
    MAC_IN_THREAD = 256 << 10  # bodies from this size have their MAC computed in a worker thread

    def __init__(self, host: str, port: int, keys: wire.Keys, me: Callable[[], str], serve: Serve, *,
                 capacity: int = 0) -> None:
        self.host, self.port = host, port
        self.capacity = capacity  # this member's cache in bytes, stated in its hello (its weight in the ring)
        self.keys = keys
        self.me = me  # this member's address as the member list has it: requests must be made for it
        self.serve = serve
        self.stats = ServerStats()
        self.sends = TransferMeter()  # when the bodies of answers went out: this node's link's rate
        self.replays = wire.Replays()
        self._slots = Slots(self.MAX_CONNECTIONS, self.UNAUTHENTICATED)  # earned by an authenticated request
        self._listeners: list[trio.SocketListener] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            self._listeners = await trio.open_tcp_listeners(self.port, host=self.host.strip("[]"))
        except OSError as exc:
            raise ConfigError(f"--peer-listen {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.port = self._listeners[0].socket.getsockname()[1]
        log.info("peer port listening on %s:%d", self.host, self.port)
        async with trio.open_nursery() as nursery:
            task_status.started()
            for listener in self._listeners:
                nursery.start_soon(self._accept, listener, nursery)

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:  # out of descriptors: wait, do not spin
                    log.warning("peer port: accept failed: %s", exc)
                    await trio.sleep(0.5)
                    continue
                nursery.start_soon(self._connection, stream, self._slots.take())

    def _closed(self, reason: str, detail: str) -> None:
        """Count (and log, the first and every ``LOG_EVERY``-th of each reason) a close by this server."""
        n = self.stats.closed.get(reason, 0) + 1
        self.stats.closed[reason] = n
        if n == 1 or n % self.LOG_EVERY == 0:
            log.info("peer port: closed a connection (%s: %s; %d so far)", reason, detail, n)

    async def _connection(self, stream: trio.SocketStream, slot: Slot) -> None:
        self.stats.connections += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=wire.MAX_TARGET + 8192)
        try:
            with slot.scope:
                while True:
                    slot.idle = slot.earned
                    with trio.move_on_after(self.IDLE if slot.earned else self.REQUEST_TIMEOUT) as idle:
                        request = await self._next(conn, stream)
                    slot.idle = False
                    if idle.cancelled_caught:
                        self._closed("idle", f"no request within {self.IDLE if slot.earned else self.REQUEST_TIMEOUT:g}s")
                        return
                    if not isinstance(request, h11.Request):
                        return  # closed by the client
                    with trio.move_on_after(self.REQUEST_TIMEOUT) as late:
                        end = await self._next(conn, stream)
                    if late.cancelled_caught:
                        self._closed("idle", "a request's end did not come")
                        return
                    if not isinstance(end, h11.EndOfMessage):
                        raise h11.RemoteProtocolError("a block request has no body", 400)
                    if not await self._answer(conn, stream, request, slot):
                        return  # (not authenticated, or told busy: closed, with the reason counted)
                    if h11.MUST_CLOSE in (conn.our_state, conn.their_state):
                        return
                    conn.start_next_cycle()
            if slot.scope.cancelled_caught and slot.idle:
                self._closed("reclaimed", "a kept-alive connection between requests gave its slot to a new one")
            elif slot.scope.cancelled_caught and not slot.earned:
                self._closed("evicted", f"{self.UNAUTHENTICATED} newer connections came before it sent an "
                                        "authenticated request")
            elif slot.scope.cancelled_caught:
                self._closed("reclaimed", "its answer was sent as far as its socket takes; its slot went to a new one")
        except _Stalled as exc:
            self._closed("stalled", str(exc))
        except h11.RemoteProtocolError as exc:
            self.stats.rejected += 1
            self._closed("protocol", str(exc)[:100])
            await self._try_error(conn, stream, exc.error_status_hint, str(exc))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.LocalProtocolError):
            pass
        finally:
            self.stats.connections -= 1
            self._slots.release(slot)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    def _verify(self, request: h11.Request) -> str:
        """The request's MAC if it is authenticated and fresh (a replay is not); :class:`wire.Rejected`."""
        target = request.target.decode("latin-1")
        fields = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
        now = time.time()
        mac, nonce, sent = self.keys.verify(self.me(), target, fields.get(wire.TIME_HEADER),
                                            fields.get(wire.NONCE_HEADER), fields.get(wire.AUTH_HEADER), now)
        self.replays.admit(nonce, sent, now, hello=target in (wire.HELLO, wire.HELLO_SIZED))
        return mac

    def _verified(self, request: h11.Request) -> str | None:
        try:
            return self._verify(request)
        except wire.Rejected:
            return None

    @staticmethod
    async def _next(conn: h11.Connection, stream: trio.SocketStream) -> object:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await stream.receive_some(65536))

    async def _answer(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request,
                      slot: Slot | None = None) -> bool:
        """Answer one request; whether the connection may go on (one that sent a request that was not
        authenticated is closed after the answer, as is one told busy). An authenticated request earns
        ``slot`` at once: an answer being sent is never cut off for a new connection."""
        target = request.target.decode("latin-1")
        if slot is not None and slot.scope.cancel_called:
            # Its slot went to a newer connection while the request came in: not taken (its nonce not
            # used up), so the client's retry of the same request elsewhere is answered.
            await trio.lowlevel.checkpoint()
        try:
            mac = self._verify(request)
        except wire.Rejected as exc:
            self.stats.rejected += 1
            await self._send(conn, stream, exc.status, str(exc).encode(), None)
            self._closed("unauthenticated", "a request without the cluster's token")
            return False
        hello = target in (wire.HELLO, wire.HELLO_SIZED)
        if slot is not None and not self._slots.earn(slot) and not hello:  # (a proof costs nothing: never busy)
            self.stats.busy += 1
            body = b"busy: every connection is being answered; ask again shortly"
            await self._send(conn, stream, 503, body, self.keys.answer_mac(mac, 503, body), retry_after=self.RETRY_AFTER)
            self._closed("busy", "every slot holds a connection being answered")
            return False
        status, body, bound = (204, b"", None)
        if hello:  # (the plain hello's answer is the start second alone: what members of older versions take)
            since = self.replays.since
            body = wire.hello_body(since, self.capacity) if target == wire.HELLO_SIZED else str(since).encode()
            status = 200
        try:
            if request.method != b"GET":
                raise wire.Rejected(405, "only GET")
            if not hello:
                by_digest = any(k == wire.BIND_HEADER.encode() and v == b"digest" for k, v in request.headers)
                with trio.fail_after(self.SERVE_TIMEOUT):
                    data = await self.serve(wire.parse_target(request.target), by_digest)
                if isinstance(data, Bound):
                    status, bound = 200, data
                else:
                    status, body = (204, b"") if data is None else (200, data)
        except wire.Rejected as exc:
            self.stats.rejected += 1
            status, body = exc.status, str(exc).encode()
        except trio.TooSlowError:
            self.stats.rejected += 1
            status, body = 503, f"the block was not had within {self.SERVE_TIMEOUT:g}s".encode()
        except Exception:  # a bug must not end the port: answer 500, keep serving
            log.exception("peer port: serving %r failed", request.target[:200])
            self.stats.rejected += 1
            status, body = 500, b"internal error"
        else:
            if not hello:
                self.stats.served += 1
                self.stats.served_bytes += len(body) if bound is None else bound.length
        if bound is not None:
            try:
                await self._send_bound(conn, stream, bound, self.keys.digest_mac(mac, 200, bound.digest, bound.length))
            finally:
                if bound.done is not None:
                    bound.done()
            return True
        if len(body) >= self.MAC_IN_THREAD:
            answer = await trio.to_thread.run_sync(self.keys.answer_mac, mac, status, body)
        else:
            answer = self.keys.answer_mac(mac, status, body)
        await self._send(conn, stream, status, body, answer)
        return True

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, status: int, body: bytes,
                    answer_mac: str | None, *, retry_after: int | None = None, digest: bytes = b"") -> None:
        """Send an answer as long as it moves: :class:`_Stalled` if no byte of it goes for ``STALL`` s."""
        headers = [("content-length", str(len(body))), ("content-type", "application/octet-stream")]
        if answer_mac is not None:
            headers.append((wire.ANSWER_HEADER, answer_mac))
        if digest:
            headers.append((wire.DIGEST_HEADER, digest.hex()))
        if retry_after is not None:
            headers.append(("retry-after", str(retry_after)))
        await self._moving(stream, conn.send(h11.Response(status_code=status, headers=headers)))
        if body:
            started = time.monotonic()
            view = memoryview(body)
            for at in range(0, len(view), self.SLICE):
                for chunk in conn.send_with_data_passthrough(h11.Data(data=view[at:at + self.SLICE])):
                    await self._moving(stream, chunk)
            self.sends.record(started, time.monotonic(), len(body))
        await self._moving(stream, conn.send(h11.EndOfMessage()))

    async def _send_bound(self, conn: h11.Connection, stream: trio.SocketStream, bound: Bound, answer_mac: str) -> None:
        """Send an answer bound by digest: its bytes, or its range of a file by ``sendfile`` (the kernel
        moves them from the page cache or the disk to the socket); :class:`_Stalled` as :meth:`_send`."""
        if bound.data is not None:
            await self._send(conn, stream, 200, bound.data, answer_mac, digest=bound.digest)
            return
        headers = [("content-length", str(bound.length)), ("content-type", "application/octet-stream"),
                   (wire.ANSWER_HEADER, answer_mac), (wire.DIGEST_HEADER, bound.digest.hex())]
        await self._moving(stream, conn.send(h11.Response(status_code=200, headers=headers)))
        # (h11 counts the body's bytes against its length; they go by the kernel, not through it)
        conn.send_with_data_passthrough(h11.Data(data=_Sent(bound.length)))
        started = time.monotonic()
        sock = stream.socket
        at, left = bound.offset, bound.length
        while left:
            try:
                n = os.sendfile(sock.fileno(), bound.fd, at, min(left, 1 << 30))
            except BlockingIOError:
                with trio.move_on_after(self.STALL) as stalled:
                    await trio.lowlevel.wait_writable(sock)
                if stalled.cancelled_caught:
                    raise _Stalled(f"an answer moved no byte for {self.STALL:g}s") from None
                continue
            if n == 0:  # (the file is shorter than its block: the member sees a short answer and asks another)
                raise OSError("a cached block's file ended before the block")
            at, left = at + n, left - n
            await trio.lowlevel.checkpoint()
        self.sends.record(started, time.monotonic(), bound.length)
        self.stats.served_from_files += bound.length
        await self._moving(stream, conn.send(h11.EndOfMessage()))

    async def _moving(self, stream: trio.SocketStream, data: bytes | memoryview | None) -> None:
        if not data:
            return
        with trio.move_on_after(self.STALL) as stalled:
            await stream.send_all(data)
        if stalled.cancelled_caught:
            raise _Stalled(f"an answer moved no byte for {self.STALL:g}s")

    async def _try_error(self, conn: h11.Connection, stream: trio.SocketStream, status: int, reason: str) -> None:
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        with trio.move_on_after(2):
            try:
                await self._send(conn, stream, status, reason.encode()[:200], None)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.LocalProtocolError, _Stalled):
                pass

    async def aclose(self) -> None:
        for listener in self._listeners:
            await listener.aclose()


class _Stalled(Exception):
    """An answer that moved no byte for ``PeerServer.STALL`` seconds."""


class _Sent:
    """What h11 is told of a body the kernel sends itself: its length."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n
