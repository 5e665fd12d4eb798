"""The local control channel: a Unix socket speaking one JSON request and one JSON reply per line.

Only root and the user the daemon runs as may use it: the socket file is mode 0600 in a private
directory, and the peer's credentials (SO_PEERCRED) are checked on every connection. Clients find the
socket through the ``user.epochfs.control`` extended attribute of the mount root.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from epochfs.errors import EpochfsError

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
CONTROL_XATTR = "user.epochfs.control"
PID_XATTR = "user.epochfs.pid"
_MAX_REQUEST = 64 << 20
_SUN_PATH_MAX = 107


def socket_path(cache_dir: Path) -> Path:
    """``<cache-dir>/control.sock``, or a short private path when that is too long for AF_UNIX."""
    path = Path(cache_dir).resolve() / "control.sock"
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        return path
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"epochfs-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    return base / f"{digest}.sock"


class ControlServer:
    def __init__(self, path: Path, handlers: dict[str, Handler]) -> None:
        self.path = Path(path)
        self.handlers = handlers
        self._allowed = {0, os.getuid()}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        old = os.umask(0o177)
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old)
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
            creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if uid not in self._allowed:
                log.warning("control: refused a request from uid %d", uid)
                await _send(stream, {"ok": False, "error": "permission denied: only root or the mount's owner"})
                return
            try:
                request = json.loads(await _receive_line(stream))
                handler = self.handlers.get(request.get("op"))
                if handler is None:
                    reply = {"ok": False, "error": f"unknown operation {request.get('op')!r}"}
                else:
                    reply = {"ok": True, **await handler(request)}
            except EpochfsError as exc:
                reply = {"ok": False, "error": str(exc)}
            except (ValueError, AttributeError) as exc:
                reply = {"ok": False, "error": f"malformed request: {exc}"}
            except trio.BrokenResourceError:
                return
            try:
                await _send(stream, reply)
            except trio.BrokenResourceError:
                pass


async def _receive_line(stream: trio.SocketStream) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = await stream.receive_some(1 << 16)
        if not chunk:
            break
        buf += chunk
        if len(buf) > _MAX_REQUEST:
            raise ValueError("request too large")
    return bytes(buf)


async def _send(stream: trio.SocketStream, obj: dict[str, Any]) -> None:
    await stream.send_all(json.dumps(obj).encode() + b"\n")


def request(mountpoint: str | os.PathLike[str], op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
    """Blocking client: send ``op`` to the daemon serving ``mountpoint`` and return its reply."""
    try:
        path = os.getxattr(mountpoint, CONTROL_XATTR).decode()
    except OSError as exc:
        raise EpochfsError(f"{mountpoint} is not an epochfs mount (or its daemon is not answering): {exc}") from None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            buf = bytearray()
            while not buf.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
        except OSError as exc:
            raise EpochfsError(f"control channel {path}: {exc}") from None
    reply = json.loads(buf)
    if not reply.pop("ok", False):
        raise EpochfsError(reply.get("error", "request failed"))
    return reply
