"""The client's end of the control channel (the command-line tools and the Python API use it).

The daemon is found from the mount: the ``user.epochfs.control`` extended attribute of the mount root
names its socket. Root and the daemon's own user talk to that socket, owned by root or by themselves,
and check the daemon's credentials once connected: another local user cannot stand in for the daemon.
Everybody else, and any process that cannot see the socket (a pod or a container that sees only the
mount, a job of another user), talks through the mount itself (:mod:`.frames`): the ioctls of the
control file at the mount's root, which the kernel hands to the daemon of that mount with the caller's
credentials; the mount is used only if it is an epochfs mount made by root or by the caller.

A channel that cannot be had raises :class:`Unreachable`, whose message says why and what fixes it;
:func:`tell_once` prints such a reason once per process on stderr, for the parts of a training job that
carry on without the daemon (the sampler wrapper, ``epochfs.watch``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from epochfs.control import frames
from epochfs.control.creds import peer_uid
from epochfs.control.paths import socket_path
from epochfs.control.protocol import CHUNK_ENTRIES, encode
from epochfs.core.errors import ConfigError, EpochfsError, NotPermitted

CONTROL_XATTR = "user.epochfs.control"
PID_XATTR = "user.epochfs.pid"
_MAX_REPLY = 256 << 20


class Unreachable(EpochfsError):
    """The daemon of a mount cannot be reached from here; the message says why and what fixes it."""


def _mount_root(path: str) -> str:
    """The mount point of the file system ``path`` is on (``path`` itself for a mount root)."""
    here = os.path.abspath(path)
    while not os.path.ismount(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def _channel_of(mountpoint: str | os.PathLike[str]) -> tuple[str, str]:
    """How to reach the daemon of the mount at ``mountpoint`` (or of the mount a path inside it is on), or
    of the cache node (``epochfs serve``) whose cache directory it is: ``("socket", path)`` or
    ``("mount", control file)``."""
    if os.path.isdir(mountpoint) and not os.path.ismount(mountpoint):
        root = _mount_root(os.fspath(mountpoint))
        try:
            os.getxattr(root, CONTROL_XATTR)
            mountpoint = root  # (a directory inside a mount: its mount's daemon)
        except OSError:
            pass
    where = os.fspath(mountpoint)
    try:
        path = os.getxattr(mountpoint, CONTROL_XATTR).decode("utf-8", "replace")
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise Unreachable(f"the daemon of {where} is gone (the mount is dead): clear it with "
                              f"'epochfs umount {where}' and mount again") from None
        if exc.errno == errno.ENOENT and not os.path.lexists(where):
            inside = _mount_root(os.path.dirname(os.path.abspath(where)) or "/")
            if os.path.ismount(inside) and inside != "/":
                raise EpochfsError(f"{where}: no such file or directory (in the mount at {inside})") from None
            raise EpochfsError(f"{where}: no such file or directory") from None
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            node = socket_path(Path(where), create=False) if os.path.isdir(where) else None
            if node is None or not os.path.exists(node):
                raise EpochfsError(f"{where} is not an epochfs mount (nor a cache node's cache directory)") from None
            return "socket", _checked_socket(str(node))
        if exc.errno == errno.EACCES:
            raise Unreachable(_denied(where)) from None
        raise Unreachable(f"{where}: {exc.strerror}") from None
    try:
        st = os.lstat(path)
    except OSError:
        st = None  # (a private directory, or a namespace that does not see it: through the mount)
    if st is not None and os.geteuid() in (0, st.st_uid):
        return "socket", _checked_socket(path, st)
    return "mount", _checked_mount(where)


def _checked_socket(path: str, st: os.stat_result | None = None) -> str:
    trusted = {0, os.geteuid()}
    if st is None:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise Unreachable(f"control socket {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in trusted:
        raise EpochfsError(f"control socket {path} is not a socket owned by root or by you; refusing to use it")
    return path


def _unescape(field: str) -> str:
    """A path as /proc/self/mountinfo writes it (space, tab, newline and backslash as octal escapes)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_owner(root: str) -> tuple[str, int | None] | None:
    """The file system type and the mounting user (``user_id=``, FUSE's) of the mount at ``root`` as this
    process sees it (``/proc/self/mountinfo``; the last mount there wins), or None if none is there."""
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 10 or "-" not in fields[6:]:
                continue
            sep = fields.index("-", 6)
            if _unescape(fields[4]) != root or len(fields) < sep + 4:
                continue
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            owner = next((int(o[8:]) for o in options if o.startswith("user_id=") and o[8:].isdigit()), None)
            found = (fstype, owner)
    return found


def _checked_mount(where: str) -> str:
    """The control file of the mount at ``where``, if it is an epochfs mount made by root or by us."""
    root = os.path.realpath(where)
    try:
        seen = mount_owner(root)
    except OSError as exc:
        raise Unreachable(f"cannot tell who mounted {where} (/proc/self/mountinfo: {exc.strerror}); "
                          "refusing to talk to it") from None
    if seen is None or seen[0] != "fuse.epochfs":
        raise EpochfsError(f"{where} is not an epochfs mount")
    if seen[1] not in (0, os.geteuid()):
        raise EpochfsError(f"{where} was mounted by another user (uid {seen[1]}); refusing to talk to it")
    return os.path.join(root, frames.NAME)


_told: set[tuple[str, str]] = set()
_told_lock = threading.Lock()


def tell_once(who: str, mountpoint: str | os.PathLike[str], exc: BaseException) -> bool:
    """Say on stderr, once per process for ``who`` and ``mountpoint``, that ``who`` could not reach the
    daemon and why (the message carries the fix). Whether it was said now."""
    key = (who, os.fspath(mountpoint))
    with _told_lock:
        if key in _told:
            return False
        _told.add(key)
    try:
        print(f"epochfs: {who} cannot reach the daemon of {os.fspath(mountpoint)}: {exc}; training goes on "
              "without it", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # (a closed stderr)
        pass
    return True


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
    Raises :class:`EpochfsError` with the daemon's message (:class:`NotPermitted` where the caller may
    not), :class:`Unreachable` with why the daemon cannot be reached and the fix. ``entries`` longer
    than one chunk are streamed (the daemon takes them one chunk at a time)."""
    how, path = _channel_of(mountpoint)
    lines = _lines(op, args)
    buf = _by_socket(path, op, lines, timeout) if how == "socket" else _by_mount(path, op, lines, timeout)
    if not buf.strip():
        raise EpochfsError(f"the daemon closed the connection without answering {op!r}; see its log")
    try:
        reply = json.loads(buf)
    except ValueError:
        raise EpochfsError(f"the daemon's answer to {op!r} is not readable ({len(buf)} bytes)") from None
    if not isinstance(reply, dict):
        raise EpochfsError(f"the daemon's answer to {op!r} is not readable")
    if not reply.pop("ok", False):
        kind = reply.get("kind")
        error = ConfigError if kind == "config" else NotPermitted if kind == "permission" else EpochfsError
        raise error(str(reply.get("error", "request failed")))
    return reply


def _by_socket(path: str, op: str, lines: Iterator[bytes], timeout: float) -> bytearray:
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
        except ConnectionRefusedError:
            raise Unreachable(f"nothing serves the control socket {path}: the daemon is gone; mount again") from None
        except OSError as exc:
            raise Unreachable(f"control channel {path}: {exc.strerror or exc}") from None
    return buf


def _by_mount(path: str, op: str, lines: Iterator[bytes], timeout: float) -> bytearray:
    """The reply to the request of ``lines`` through the mount's control file ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise Unreachable(_mount_failure(path, exc)) from None
    session = os.urandom(16)
    deadline = time.monotonic() + timeout
    done = False
    try:
        sending = True
        opened = False
        for line in lines:
            for at in range(0, len(line), frames.PAYLOAD):
                piece = line[at:at + frames.PAYLOAD]
                pause = 0.02
                while True:  # (the frame is the reply's buffer: a fresh one for each ioctl)
                    state, data = _frame(fd, path, frames.frame_in(session, frames.SEND, piece))
                    if state != frames.BUSY or opened:
                        break
                    if time.monotonic() + pause >= deadline:  # (as many requests open as it takes: wait a turn)
                        raise EpochfsError(f"the daemon was busy with other requests for {timeout:g}s; {op!r} not sent")
                    time.sleep(pause * random.uniform(0.5, 1.5))
                    pause = min(0.5, pause * 2)
                opened = True
                if state == frames.STOP:  # the daemon has answered before taking it all: its reply says why
                    sending = False
                    break
                if state != frames.TAKEN:
                    raise EpochfsError(f"the daemon refused {op!r}: {data.decode('utf-8', 'replace')}")
            if not sending:
                break
        buf = bytearray()
        while True:
            state, data = _frame(fd, path, frames.frame_in(session, frames.RECV))
            if state == frames.FAILED:
                raise EpochfsError(f"the daemon refused {op!r}: {data.decode('utf-8', 'replace')}")
            buf += data
            if len(buf) > _MAX_REPLY:
                raise EpochfsError(f"the daemon's answer to {op!r} is longer than {_MAX_REPLY} bytes")
            if state == frames.END:
                done = True
                return buf
            if state == frames.WAIT and time.monotonic() >= deadline:
                raise EpochfsError(f"the daemon did not answer {op!r} within {timeout:g}s")
    finally:
        if not done:
            try:
                _frame(fd, path, frames.frame_in(session, frames.CLOSE))
            except EpochfsError:
                pass
        os.close(fd)


def _frame(fd: int, path: str, frame: bytearray) -> tuple[int, bytes]:
    try:
        fcntl.ioctl(fd, frames.COMMAND, frame, True)
    except OSError as exc:
        raise Unreachable(_mount_failure(path, exc)) from None
    try:
        return frames.parse_out(frame)
    except frames.BadFrame as exc:
        raise EpochfsError(f"the daemon's answer through {path} is not readable: {exc}") from None


def _denied(where: str) -> str:
    """Why ``where`` refused this user: a directory above it it may not pass, or the mount itself."""
    here = os.path.dirname(os.path.abspath(where))
    while here != "/" and os.access(here, os.X_OK):
        here = os.path.dirname(here)
    if here != "/":
        return (f"{where}: permission denied: this user (uid {os.getuid()}) may not pass {here} on the way to it; "
                "mount it where the node's users can reach it (and with --allow-other)")
    return (f"{where}: permission denied: the mount lets only its owner and root in; mount it with --allow-other "
            "for the node's other users (and their pods)")


def _mount_failure(path: str, exc: OSError) -> str:
    where = os.path.dirname(path)
    if exc.errno == errno.ENOTCONN:
        return f"the daemon of {where} is gone (the mount is dead): clear it with 'epochfs umount {where}' and mount again"
    if exc.errno in (errno.ENOENT, errno.ENOTTY):
        return (f"the daemon of {where} takes no requests through the mount (it predates the channel through the "
                "mount): remount it with this version of epochfs, or ask as root")
    if exc.errno == errno.EACCES:
        return _denied(where)
    return f"the control channel through {where}: {exc.strerror or exc}"
