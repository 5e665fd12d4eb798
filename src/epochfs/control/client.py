"""The client's end of the control channel (the command-line tools and the Python API use it).

The daemon's socket is found through the ``user.epochfs.control`` extended attribute of the mount root.
A client talks only to a socket owned by root or by itself, and checks the daemon's credentials once
connected: another local user cannot stand in for the daemon.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from epochfs.control.creds import peer_uid
from epochfs.control.paths import socket_path
from epochfs.control.protocol import CHUNK_ENTRIES, encode
from epochfs.core.errors import ConfigError, EpochfsError

CONTROL_XATTR = "user.epochfs.control"
PID_XATTR = "user.epochfs.pid"
_MAX_REPLY = 256 << 20


def _mount_root(path: str) -> str:
    """The mount point of the file system ``path`` is on (``path`` itself for a mount root)."""
    here = os.path.abspath(path)
    while not os.path.ismount(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def _socket_of(mountpoint: str | os.PathLike[str]) -> str:
    """The control socket of the mount at ``mountpoint`` (or of the mount a path inside it is on), or of
    the cache node (``epochfs serve``) whose cache directory it is."""
    if os.path.isdir(mountpoint) and not os.path.ismount(mountpoint):
        root = _mount_root(os.fspath(mountpoint))
        try:
            os.getxattr(root, CONTROL_XATTR)
            mountpoint = root  # (a directory inside a mount: its mount's daemon)
        except OSError:
            pass
    try:
        path = os.getxattr(mountpoint, CONTROL_XATTR).decode("utf-8", "replace")
    except OSError as exc:
        where = os.fspath(mountpoint)
        if exc.errno == errno.ENOTCONN:
            raise EpochfsError(f"the daemon of {where} is gone (the mount is dead): clear it with "
                               f"'epochfs umount {where}' and mount again") from None
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            node = socket_path(Path(where), create=False) if os.path.isdir(where) else None
            if node is None or not os.path.exists(node):
                raise EpochfsError(f"{where} is not an epochfs mount (nor a cache node's cache directory)") from None
            path = str(node)
        else:
            raise EpochfsError(f"{where}: {exc.strerror}") from None
    trusted = {0, os.geteuid()}
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise EpochfsError(f"control socket {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in trusted:
        raise EpochfsError(f"control socket {path} is not a socket owned by root or by you; refusing to use it")
    return path


def _lines(op: str, args: dict[str, Any]) -> Iterator[bytes]:
    """The request's lines: one, or a streamed request's header, its chunks and the closing ``[]``."""
    entries = args.get("entries")
    if not (isinstance(entries, list) and len(entries) > CHUNK_ENTRIES):
        yield encode({"op": op, **args})
        return
    yield encode({"op": op, **args, "entries": [], "follow": True})
    for i in range(0, len(entries), CHUNK_ENTRIES):
        yield json.dumps(entries[i:i + CHUNK_ENTRIES]).encode() + b"\n"
    yield b"[]\n"


def request(mountpoint: str | os.PathLike[str], op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
    """Send ``op`` to the daemon serving ``mountpoint`` and return its reply (without ``ok``).
    Raises :class:`EpochfsError` with the daemon's message, or with what went wrong on the way.
    ``entries`` longer than one chunk are streamed (the daemon takes them one chunk at a time)."""
    path = _socket_of(mountpoint)
    lines = _lines(op, args)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            if peer_uid(sock) not in {0, os.geteuid()}:
                raise EpochfsError(f"control socket {path} is served by another user; refusing to use it")
            try:
                for line in lines:
                    sock.sendall(line)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon refused the request before reading it all: its reply says why
            buf = bytearray()
            while not buf.endswith(b"\n") and len(buf) <= _MAX_REPLY:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
        except TimeoutError:
            raise EpochfsError(f"the daemon did not answer {op!r} within {timeout:g}s") from None
        except OSError as exc:
            raise EpochfsError(f"control channel {path}: {exc.strerror or exc}") from None
    if not buf.strip():
        raise EpochfsError(f"the daemon closed the connection without answering {op!r}; see its log")
    try:
        reply = json.loads(buf)
    except ValueError:
        raise EpochfsError(f"the daemon's answer to {op!r} is not readable ({len(buf)} bytes)") from None
    if not isinstance(reply, dict):
        raise EpochfsError(f"the daemon's answer to {op!r} is not readable")
    if not reply.pop("ok", False):
        error = ConfigError if reply.get("kind") == "config" else EpochfsError
        raise error(str(reply.get("error", "request failed")))
    return reply
