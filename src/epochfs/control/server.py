"""The daemon's end of the control channel: one request and one reply per connection of its Unix socket,
or per session of the channel through the mount (:mod:`.inmount`), answered alike.

The socket is for the node's operators (root, the user the daemon runs as, the control group): it is
mode 0600 in a private directory (the cache directory, or a checked private runtime directory when that
path is too long for AF_UNIX), and the peer's credentials (SO_PEERCRED) are checked on every connection.
Everybody else, and anyone who sees only the mount (a pod, a container), comes through the mount, where
the kernel names the caller. Every request is authorised by its caller's credentials
(:data:`epochfs.control.caller.RIGHTS`): what changes the mount for everybody needs an operator, the rest
is checked by the handler against what the caller may read and own. Every line is bounded
(``MAX_LINE``) before it is parsed, and parsed and validated by :mod:`.protocol` in a worker thread; a
long manifest arrives as a stream of chunk lines, parsed and handed to the handler one at a time (a
handler that refuses the request stops the reading). A request that does not parse, or a handler that
fails, gets an error reply: nothing a client sends can stop the daemon. Connections are bounded in
number and in time (``RECEIVE_TIMEOUT`` for each line).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from epochfs.control.caller import ADMIN, RIGHTS, Caller, caller_of_socket
from epochfs.control.paths import runtime_dir, socket_path  # noqa: F401 - (the daemon's)
from epochfs.control.protocol import MAX_LINE, BadRequest, Request, encode, op_of, parse, parse_chunk
from epochfs.core.errors import ConfigError, EpochfsError, NotPermitted

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[dict[str, Any]]]  # (request, caller=) or, streamed, (request, chunks, caller=)
Chunks = AsyncIterator[tuple[tuple[int, str], ...]]
MAX_CONNECTIONS = 32
RECEIVE_TIMEOUT = 60.0  # seconds to deliver a whole request


class ControlServer:
    """Serves requests on ``path``; ``handlers`` maps a request type to the coroutine answering it."""

    def __init__(self, path: Path, handlers: dict[type, Handler], *, control_group: int | None = None) -> None:
        self.path = Path(path)
        self.handlers = handlers
        self.control_group = control_group
        self._slots = trio.Semaphore(MAX_CONNECTIONS)
        self.refused: dict[str, int] = {}  # requests refused for their caller's rights, by operation

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        # The directory is private (checked), so nobody can reach the socket before its mode is set.
        await sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                await trio.serve_listeners(self._serve, [listener], handler_nursery=nursery)
        finally:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    async def _serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                await _try_send(stream, {"ok": False, "error": "the daemon is busy with other requests; retry"})
                return
            try:
                await self._answer(stream)
            except Exception:  # the last line of defence: a connection never takes the daemon down
                log.exception("control: unexpected error serving a connection")
            finally:
                self._slots.release()

    async def _answer(self, stream: trio.SocketStream) -> None:
        caller = caller_of_socket(stream.socket, self.control_group)
        if not caller.operator:
            log.warning("control: refused a request from uid %d on the socket (other users come through the mount)",
                        caller.uid)
            # Take (a bounded part of) the request first, so the client reads the refusal rather than a
            # broken pipe.
            with trio.move_on_after(5):
                try:
                    await _Lines(stream).next(limit=1 << 16)
                except BadRequest:
                    pass
            await _try_send(stream, {"ok": False, "error": "permission denied: the socket is for root, the mount's "
                                     "owner and --control-group; other users reach the daemon through the mount",
                                     "kind": "permission"})
            return
        await self.serve_stream(stream, caller)

    async def serve_stream(self, stream: Any, caller: Caller) -> None:
        """Read one request from ``stream`` (``receive_some``/``send_all``: a socket connection, or a
        session through the mount), answer it for ``caller``, and send the reply."""
        lines = _Lines(stream)
        streamed = False
        try:
            with trio.fail_after(RECEIVE_TIMEOUT):
                line = await lines.next()
            request = await trio.to_thread.run_sync(parse, line)
            streamed = getattr(request, "follow", False)
            reply = await self.dispatch(request, _chunks(lines) if streamed else None, caller=caller)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        except trio.TooSlowError:
            reply = {"ok": False, "error": f"no complete request within {RECEIVE_TIMEOUT:.0f}s"}
        except BadRequest as exc:
            reply = {"ok": False, "error": f"malformed request: {exc}", "kind": "config"}
        await _try_send(stream, reply)
        if streamed and not lines.ended:
            await _discard_rest(stream)

    async def dispatch(self, request: Request, chunks: Chunks | None = None, *, caller: Caller | None = None
                       ) -> dict[str, Any]:
        """The reply to a parsed request (whose further entries come from ``chunks``, if streamed) from
        ``caller`` (None: the daemon's own user). Never raises for a failure of the handler."""
        handler = self.handlers.get(type(request))
        op = op_of(request)
        if handler is None:
            return {"ok": False, "error": f"{op} is not supported by this daemon"}
        caller = caller if caller is not None else OWNER
        if RIGHTS.get(op) == ADMIN and not caller.operator:
            self.refused[op] = self.refused.get(op, 0) + 1
            log.warning("control: refused %s from %s: not an operator", op, caller.describe())
            return {"ok": False, "kind": "permission",
                    "error": f"permission denied: {op} changes the mount for everybody; it needs root, the mount's "
                             "owner or a member of the daemon's --control-group"}
        try:
            reply = await (handler(request, caller=caller) if chunks is None else handler(request, chunks, caller=caller))
            return {"ok": True, **reply}
        except NotPermitted as exc:  # (what the caller may not do to what is not theirs)
            self.refused[op] = self.refused.get(op, 0) + 1
            log.info("control: refused %s from %s: %s", op, caller.describe(), exc)
            return {"ok": False, "error": f"permission denied: {exc}", "kind": "permission"}
        except EpochfsError as exc:  # "config": the request's input is wrong (the CLI exits with 2)
            return {"ok": False, "error": str(exc), "kind": "config" if isinstance(exc, ConfigError) else "error"}
        except Exception as exc:  # a bug must fail the request, never the daemon
            log.exception("control: %s failed", type(request).__name__)
            return {"ok": False, "error": f"internal error: {type(exc).__name__}; see the daemon's log"}


#: The daemon's own user: what a request made inside the daemon acts as.
OWNER = Caller(os.geteuid(), os.getegid(), operator=True)


class _Lines:
    """Newline-ended lines from a stream, each at most ``limit`` bytes (refused once it is longer,
    before anything of it is parsed)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._buf = bytearray()
        self.ended = False  # the closing line of a streamed request was read

    async def next(self, limit: int = MAX_LINE) -> bytes:
        start = 0
        while True:
            end = self._buf.find(b"\n", start)
            if end >= 0:
                line = bytes(self._buf[:end + 1])
                del self._buf[:end + 1]
                return line
            if len(self._buf) > limit:
                raise BadRequest(f"line longer than {limit} bytes (stream long manifests in chunks)")
            start = len(self._buf)
            chunk = await self.stream.receive_some(1 << 16)
            if not chunk:
                line = bytes(self._buf)
                self._buf.clear()
                return line
            self._buf += chunk


async def _chunks(lines: _Lines) -> Chunks:
    """The chunks of a streamed request, parsed one at a time in a worker thread, until the empty one."""
    while True:
        try:
            with trio.fail_after(RECEIVE_TIMEOUT):
                line = await lines.next()
        except trio.TooSlowError:
            raise BadRequest(f"no complete chunk within {RECEIVE_TIMEOUT:.0f}s") from None
        if not line:
            raise BadRequest("the stream of entries ended without its closing []")
        chunk = await trio.to_thread.run_sync(parse_chunk, line)
        if not chunk:
            lines.ended = True
            return
        yield chunk


async def _discard_rest(stream: Any) -> None:
    """Read and drop what a refused streamed request still sends (for a few seconds at most): a Unix
    socket closed with unread data resets the connection, and the client would lose the reply."""
    with trio.move_on_after(5):
        try:
            while await stream.receive_some(1 << 20):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def _try_send(stream: Any, obj: dict[str, Any]) -> None:
    """Send a reply, giving up on a client that does not read it."""
    with trio.move_on_after(RECEIVE_TIMEOUT):
        try:
            await stream.send_all(encode(obj))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
