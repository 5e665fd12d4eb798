"""The control channel through the mount itself: the frames a client and the daemon exchange as ioctls
of the mount's control file (``<mount>/.epochfs``). Pure; the client (:mod:`.client`) and the daemon
(:mod:`.inmount`) share it.

A process that sees only the mount (a pod with the dataset mounted, a Slurm job, a container: its own
mount and network namespaces, no path into the node's cache directory or ``/run``) still reaches the
daemon through it, and the kernel tells the daemon who asks: every ioctl request carries the caller's
uid, gid and pid in its header, as the kernel knows them, never as the caller says.

One ioctl command, ``_IOWR('e', 1, FRAME)``: the kernel copies ``FRAME`` bytes in and at most
``FRAME`` back. A request of the line protocol (:mod:`.protocol`) crosses in ``SEND`` frames, its
reply comes back in ``RECV`` frames; a session (16 random bytes the client chose, bound to the uid of
the ioctl that opened it) carries one request and its reply, like one connection of the socket.

In: ``session (16) | kind (1) | pad (3) | length (4) | data``. Out: ``state (1) | pad (3) | length (4) |
data``.
"""

from __future__ import annotations

import struct

FRAME = 16376  # bytes each way per ioctl (an ioctl's size field holds at most 16383)
_IN = struct.Struct("<16sB3xI")
_OUT = struct.Struct("<B3xI")
PAYLOAD = FRAME - _IN.size  # request bytes one SEND carries, at most
REPLY_PAYLOAD = FRAME - _OUT.size

_IOC_READ, _IOC_WRITE = 2, 1
COMMAND = ((_IOC_READ | _IOC_WRITE) << 30) | (FRAME << 16) | (ord("e") << 8) | 1

# kinds (in)
SEND = 1  # request bytes (the first SEND opens the session)
RECV = 2  # the next bytes of the reply (the first RECV ends what the client sends)
CLOSE = 3  # the client gives up on the session

# states (out)
TAKEN = 1  # the request bytes were taken
STOP = 2  # the daemon has answered before reading all of the request: RECV its reply now
MORE = 3  # reply bytes, and more follow
END = 4  # the reply's last bytes: the session is over
WAIT = 5  # no reply bytes yet: RECV again
FAILED = 6  # the channel refused the frame: ``data`` says why (UTF-8)
BUSY = 7  # no session was opened: as many are open as the daemon takes (of this uid, or in all); retry

NAME = ".epochfs"  # the control file, at the mount's root (a reserved name: no object is listed as it)


class BadFrame(ValueError):
    """A frame that is not one."""


def frame_in(session: bytes, kind: int, data: bytes = b"") -> bytearray:
    """A frame the client sends (padded to :data:`FRAME`, the buffer the reply comes back in)."""
    if len(session) != 16 or len(data) > PAYLOAD:
        raise ValueError("a session is 16 bytes and a frame carries at most PAYLOAD bytes")
    buf = bytearray(FRAME)
    _IN.pack_into(buf, 0, session, kind, len(data))
    buf[_IN.size:_IN.size + len(data)] = data
    return buf


def parse_in(buf: bytes) -> tuple[bytes, int, bytes]:
    """(session, kind, data) of a frame the daemon received; :class:`BadFrame`."""
    if len(buf) < _IN.size:
        raise BadFrame(f"a frame of {len(buf)} bytes")
    session, kind, length = _IN.unpack_from(buf)
    if kind not in (SEND, RECV, CLOSE):
        raise BadFrame(f"unknown kind {kind}")
    if length > len(buf) - _IN.size:
        raise BadFrame(f"a frame says {length} bytes and carries {len(buf) - _IN.size}")
    return session, kind, bytes(buf[_IN.size:_IN.size + length])


def frame_out(state: int, data: bytes = b"") -> bytes:
    if len(data) > REPLY_PAYLOAD:
        raise ValueError("a frame carries at most REPLY_PAYLOAD bytes")
    return _OUT.pack(state, len(data)) + data


def parse_out(buf: bytes) -> tuple[int, bytes]:
    """(state, data) of a frame the client received; :class:`BadFrame`."""
    if len(buf) < _OUT.size:
        raise BadFrame("a reply frame shorter than its header")
    state, length = _OUT.unpack_from(buf)
    if state not in (TAKEN, STOP, MORE, END, WAIT, FAILED, BUSY) or length > len(buf) - _OUT.size:
        raise BadFrame(f"a reply frame of state {state} and {length} bytes")
    return state, bytes(buf[_OUT.size:_OUT.size + length])
