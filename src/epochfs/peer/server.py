"""The peer port: answers other members' block requests (HTTP/1.1 over TCP, parsed by h11).

Concurrency contract: one trio task per connection, at most ``MAX_CONNECTIONS`` at once. A connection
earns its slot with its first request: until a request of it has been authenticated it has
``REQUEST_TIMEOUT`` seconds to send one, and when the slots are full a new connection closes the oldest
of those that have not (so connections without the token cannot hold the port shut); a request that
fails authentication is answered and its connection closed. An authenticated connection that sends
nothing for ``IDLE`` seconds is closed; an answer that cannot be sent within ``SEND_TIMEOUT`` closes
the connection. Nothing a client sends can end the server: every request is checked by
:mod:`epochfs.peer.wire` (signature and freshness first), anything else is answered with an error
status or a close. Every answer to an authenticated request carries its answer MAC.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import h11
import trio

from epochfs.core.errors import ConfigError
from epochfs.links.meter import TransferMeter
from epochfs.peer import wire
from epochfs.transport.slots import Slot, Slots

log = logging.getLogger(__name__)

Serve = Callable[[wire.BlockRequest], Awaitable[bytes | None]]


@dataclass
class ServerStats:
    served: int = 0
    served_bytes: int = 0
    rejected: int = 0
    connections: int = 0


class PeerServer:
    MAX_CONNECTIONS = 128
    IDLE = 60.0
    REQUEST_TIMEOUT = 5.0
    SEND_TIMEOUT = 30.0
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
        self._slots = Slots(self.MAX_CONNECTIONS)  # earned by an authenticated request
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
                slot = self._slots.take()
                if slot is None:
                    await stream.aclose()  # every slot holds an authenticated connection
                    continue
                nursery.start_soon(self._connection, stream, slot)

    async def _connection(self, stream: trio.SocketStream, slot: Slot) -> None:
        self.stats.connections += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=wire.MAX_TARGET + 8192)
        try:
            with slot.scope:
                while True:
                    with trio.move_on_after(self.IDLE if slot.earned else self.REQUEST_TIMEOUT) as idle:
                        request = await self._next(conn, stream)
                    if idle.cancelled_caught or not isinstance(request, h11.Request):
                        return  # idle, or closed
                    with trio.move_on_after(self.REQUEST_TIMEOUT) as late:
                        end = await self._next(conn, stream)
                    if late.cancelled_caught:
                        return
                    if not isinstance(end, h11.EndOfMessage):
                        raise h11.RemoteProtocolError("a block request has no body", 400)
                    with trio.move_on_after(self.SEND_TIMEOUT) as slow:
                        trusted = await self._answer(conn, stream, request)
                    if (not trusted or slow.cancelled_caught
                            or h11.MUST_CLOSE in (conn.our_state, conn.their_state)):
                        return
                    slot.earned = True
                    conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            self.stats.rejected += 1
            await self._try_error(conn, stream, exc.error_status_hint, str(exc))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.LocalProtocolError):
            pass
        finally:
            self.stats.connections -= 1
            self._slots.release(slot)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    @staticmethod
    async def _next(conn: h11.Connection, stream: trio.SocketStream) -> object:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await stream.receive_some(65536))

    async def _answer(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request) -> bool:
        """Answer one request; whether it was authenticated (a connection that sent one that was not
        is closed after the answer)."""
        target = request.target.decode("latin-1")
        try:
            fields = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
            now = time.time()
            mac, nonce, sent = self.keys.verify(self.me(), target, fields.get(wire.TIME_HEADER),
                                                fields.get(wire.NONCE_HEADER), fields.get(wire.AUTH_HEADER), now)
            self.replays.admit(nonce, sent, now, hello=target in (wire.HELLO, wire.HELLO_SIZED))
        except wire.Rejected as exc:
            self.stats.rejected += 1
            await self._send(conn, stream, exc.status, str(exc).encode(), None)
            return False
        hello = target in (wire.HELLO, wire.HELLO_SIZED)
        status, body = (204, b"")
        if hello:  # (the plain hello's answer is the start second alone: what members of older versions take)
            since = self.replays.since
            body = wire.hello_body(since, self.capacity) if target == wire.HELLO_SIZED else str(since).encode()
            status = 200
        try:
            if request.method != b"GET":
                raise wire.Rejected(405, "only GET")
            if not hello:
                data = await self.serve(wire.parse_target(request.target))
                status, body = (204, b"") if data is None else (200, data)
        except wire.Rejected as exc:
            self.stats.rejected += 1
            status, body = exc.status, str(exc).encode()
        except Exception:  # a bug must not end the port: answer 500, keep serving
            log.exception("peer port: serving %r failed", request.target[:200])
            self.stats.rejected += 1
            status, body = 500, b"internal error"
        else:
            if not hello:
                self.stats.served += 1
                self.stats.served_bytes += len(body)
        if len(body) >= self.MAC_IN_THREAD:
            answer = await trio.to_thread.run_sync(self.keys.answer_mac, mac, status, body)
        else:
            answer = self.keys.answer_mac(mac, status, body)
        await self._send(conn, stream, status, body, answer)
        return True

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, status: int, body: bytes,
                    answer_mac: str | None) -> None:
        headers = [("content-length", str(len(body))), ("content-type", "application/octet-stream")]
        if answer_mac is not None:
            headers.append((wire.ANSWER_HEADER, answer_mac))
        await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
        if body:
            started = time.monotonic()
            for chunk in conn.send_with_data_passthrough(h11.Data(data=body)):
                await stream.send_all(chunk)
            self.sends.record(started, time.monotonic(), len(body))
        await stream.send_all(conn.send(h11.EndOfMessage()))

    async def _try_error(self, conn: h11.Connection, stream: trio.SocketStream, status: int, reason: str) -> None:
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        with trio.move_on_after(2):
            try:
                await self._send(conn, stream, status, reason.encode()[:200], None)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.LocalProtocolError):
                pass

    async def aclose(self) -> None:
        for listener in self._listeners:
            await listener.aclose()
