"""Who asks: a control request's caller as the kernel reports it (``SO_PEERCRED`` and ``SO_PEERGROUPS``
for the socket; the uid, gid and pid of an ioctl's request header for the channel through the mount),
never as the request says, and what that caller may do (:func:`right_of`, :data:`RIGHTS`).

Which operation needs what (the table ``docs/security.md`` shows):

==================  ==================  ===========================================================
right               operations          who has it
==================  ==================  ===========================================================
``read``            status, job,        anyone who can reach the mount (the kernel lets only the
                    get_manifest        mount's owner and root in unless it is mounted ``allow_other``)
``files``           prefetch, warmup,   the same, for files the caller may read (its uid and groups
                    resident, locate    against the modes the mount presents, as the kernel checks
                                        them); bounded per uid (``--user-share``)
``own``             report, cancel,     the same; each acts on the caller's own: a job name is held
                    sync                by the uid that first reported it, a warmup by its starter,
                                        and ``sync`` without paths waits for the caller's files
``admin``           refresh,            root, the daemon's own user, and members of
                    publish_manifest    ``--control-group``
==================  ==================  ===========================================================

Root, the daemon's user and the control group (operators) also act on anybody's orders, warmups and
jobs, and are not bounded per uid.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from epochfs.core.access import Caller, allowed  # noqa: F401 - (who asks, and the rights rule: with the rest)

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # (Linux 4.13)
MAX_GROUPS = 65536

READ, FILES, OWN, ADMIN = "read", "files", "own", "admin"

#: The right each operation needs (by the protocol's operation name).
RIGHTS: dict[str, str] = {
    "status": READ, "job": READ, "get_manifest": READ,
    "prefetch": FILES, "warmup": FILES, "resident": FILES, "locate": FILES,
    "report": OWN, "cancel": OWN, "sync": OWN,
    "refresh": ADMIN, "publish_manifest": ADMIN,
}


def operator_of(uid: int, gid: int, groups: frozenset[int], control_group: int | None) -> bool:
    """Root, the daemon's own user, or a member of the control group."""
    if uid in (0, os.geteuid()):
        return True
    return control_group is not None and (gid == control_group or control_group in groups)


def caller_of(uid: int, gid: int, pid: int, control_group: int | None = None) -> Caller:
    """The caller of a request through the mount: the uid, gid and pid of its header (the kernel's), and
    the supplementary groups of that task (``/proc/<pid>/status``: the task waits in its ioctl while the
    request is answered, so the pid is its own)."""
    groups = groups_of_task(pid, uid) if pid > 0 else frozenset()
    return Caller(uid, gid, groups, pid, operator_of(uid, gid, groups, control_group))


def groups_of_task(pid: int, uid: int) -> frozenset[int]:
    """The supplementary groups of task ``pid``, if its file-system uid is ``uid``; else none (a task
    that is gone, or a pid reused by another user's process, grants no group)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read(1 << 20)
    except OSError:
        return frozenset()
    fields: dict[bytes, list[bytes]] = {}
    for line in text.splitlines():
        name, _, value = line.partition(b":")
        fields[name] = value.split()
    try:
        uids = [int(x) for x in fields.get(b"Uid", [])]
        groups = [int(x) for x in fields.get(b"Groups", [])[:MAX_GROUPS]]
    except ValueError:
        return frozenset()
    if len(uids) != 4 or uids[3] != uid:
        return frozenset()
    return frozenset(groups)


def caller_of_socket(sock: socket.socket | Any, control_group: int | None = None) -> Caller:
    """The caller at the other end of a connected Unix socket (``SO_PEERCRED``, ``SO_PEERGROUPS``)."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    groups: frozenset[int] = frozenset()
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4]))
    except OSError:  # (more than 1024 groups, or an old kernel: the primary group only)
        pass
    return Caller(uid, gid, groups, pid, operator_of(uid, gid, groups, control_group))
