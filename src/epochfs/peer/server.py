"""The peer port: answers other members' block requests (HTTP/1.1 over TCP, parsed by h11).

Concurrency contract: one trio task per connection, at most ``MAX_CONNECTIONS`` at once (more are closed
at once); a connection that sends nothing for ``IDLE`` seconds, or takes longer than ``REQUEST_TIMEOUT``
to send its request, is closed; an answer that cannot be sent within ``SEND_TIMEOUT`` closes the
connection. Nothing a client sends can end the server: every request is checked by
:mod:`epochfs.peer.wire` (signature first), anything else is answered with an error status or a close.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import h11
import trio

from epochfs.errors import ConfigError
from epochfs.peer import wire

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
    REQUEST_TIMEOUT = 10.0
    SEND_TIMEOUT = 30.0

    def __init__(self, host: str, port: int, token: bytes, serve: Serve) -> None:
        self.host, self.port = host, port
        self.token = token
        self.serve = serve
        self.stats = ServerStats()
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
                if self.stats.connections >= self.MAX_CONNECTIONS:
                    await stream.aclose()
                    continue
                nursery.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.stats.connections += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=wire.MAX_TARGET + 8192)
        try:
            while True:
                with trio.move_on_after(self.IDLE) as idle:
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
                    await self._answer(conn, stream, request)
                if slow.cancelled_caught or h11.MUST_CLOSE in (conn.our_state, conn.their_state):
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            self.stats.rejected += 1
            await self._try_error(conn, stream, exc.error_status_hint, str(exc))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.LocalProtocolError):
            pass
        finally:
            self.stats.connections -= 1
            with trio.CancelScope(shield=True):
                await stream.aclose()

    @staticmethod
    async def _next(conn: h11.Connection, stream: trio.SocketStream) -> object:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await stream.receive_some(65536))

    async def _answer(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request) -> None:
        try:
            if request.method != b"GET":
                raise wire.Rejected(405, "only GET")
            fields = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
            wire.verify(self.token, request.target.decode("latin-1"), fields.get(wire.TIME_HEADER),
                        fields.get(wire.AUTH_HEADER), time.time())
            data = await self.serve(wire.parse_target(request.target))
        except wire.Rejected as exc:
            self.stats.rejected += 1
            await self._send(conn, stream, exc.status, str(exc).encode(), [])
            return
        except Exception:  # a bug must not end the port: answer 500, keep serving
            log.exception("peer port: serving %r failed", request.target[:200])
            self.stats.rejected += 1
            await self._send(conn, stream, 500, b"internal error", [])
            return
        self.stats.served += 1
        if data is None:  # a warm request: the block is here now
            await self._send(conn, stream, 204, b"", [])
            return
        self.stats.served_bytes += len(data)
        await self._send(conn, stream, 200, data, [(wire.SUM_HEADER, wire.checksum(data))])

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, status: int, body: bytes,
                    extra: list[tuple[str, str]]) -> None:
        headers = [("content-length", str(len(body))), ("content-type", "application/octet-stream"), *extra]
        await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
        if body:
            for chunk in conn.send_with_data_passthrough(h11.Data(data=body)):
                await stream.send_all(chunk)
        await stream.send_all(conn.send(h11.EndOfMessage()))

    async def _try_error(self, conn: h11.Connection, stream: trio.SocketStream, status: int, reason: str) -> None:
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        with trio.move_on_after(2):
            try:
                await self._send(conn, stream, status, reason.encode()[:200], [])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.LocalProtocolError):
                pass

    async def aclose(self) -> None:
        for listener in self._listeners:
            await listener.aclose()
