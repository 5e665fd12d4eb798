"""Mounting a FUSE file system: ``/dev/fuse`` opened and mounted with mount(2) as root, through
``fusermount3`` (which passes the descriptor back) otherwise; mount(8)-style options; the lazy unmount.
The session (:mod:`epochfs.kernel.session`) then serves the descriptor."""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import os
import socket
import stat
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

_MS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "sync": 16, "dirsync": 128, "noatime": 1024,
       "nodiratime": 2048}
_NO_FLAG = {"rw", "suid", "dev", "exec", "atime", "diratime", "async"}
_KERNEL = {"default_permissions", "allow_other"}
_MNT_DETACH = 2


class MountError(RuntimeError):
    """The file system could not be mounted."""


@dataclass(frozen=True)
class MountOptions:
    flags: int  # MS_* flags for mount(2)
    data: tuple[str, ...]  # what the kernel's FUSE takes in mount(2)'s data (allow_other, max_read=...)
    source: str  # what findmnt and df show (fsname)
    fstype: str  # fuse.SUBTYPE
    debug: bool


def parse_options(options: Iterable[str]) -> MountOptions:
    """mount(8)-style options: flags for mount(2), what goes in its data, fsname, subtype, debug."""
    flags, data, source, subtype, debug = 0, [], "epochfs", "", False
    for opt in sorted(set(options)):
        key, _, value = opt.partition("=")
        if key in _MS and not value:
            flags |= _MS[key]
        elif key in _NO_FLAG and not value:
            pass
        elif key in _KERNEL and not value:
            data.append(key)
        elif key in ("max_read", "blksize") and value.isdigit():
            data.append(opt)
        elif key == "fsname" and value:
            source = value.replace("\\,", ",").replace("\\\\", "\\")
        elif key == "subtype" and value:
            subtype = value
        elif key == "debug" and not value:
            debug = True
        else:
            raise MountError(f"unknown mount option {opt!r}")
    return MountOptions(flags, tuple(data), source, f"fuse.{subtype}" if subtype else "fuse", debug)


def mount(mountpoint: str, opts: MountOptions) -> tuple[int, bool]:
    """Open ``/dev/fuse`` and mount it at ``mountpoint``: (the device's descriptor, whether mounted with
    mount(2) directly, as root; else through ``fusermount3``)."""
    try:
        st = os.stat(mountpoint)
    except OSError as exc:
        raise MountError(f"{mountpoint}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"{mountpoint} is not a directory")
    if os.geteuid() == 0:
        return _mount_direct(mountpoint, opts, st.st_mode), True
    return _mount_fusermount(mountpoint, opts), False


def unmount(mountpoint: str, direct: bool) -> None:
    """Unmount lazily (open files keep the mount until closed)."""
    if direct:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.umount2(mountpoint.encode(), _MNT_DETACH)
    else:
        subprocess.run(["fusermount3", "-u", "-q", "-z", "--", mountpoint], capture_output=True, timeout=60,
                       check=False)


def _mount_direct(mountpoint: str, opts: MountOptions, mode: int) -> int:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise MountError(f"cannot open /dev/fuse: {exc.strerror}") from None
    data = ",".join([f"fd={fd}", f"rootmode={stat.S_IFMT(mode):o}", f"user_id={os.getuid()}",
                     f"group_id={os.getgid()}", *opts.data])
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    rc = libc.mount(opts.source.encode(), mountpoint.encode(), opts.fstype.encode(),
                    ctypes.c_ulong(opts.flags), data.encode())
    if rc != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise MountError(f"mount {mountpoint}: {os.strerror(err)}")
    return fd


def _mount_fusermount(mountpoint: str, opts: MountOptions) -> int:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    given = [o for o, bit in _MS.items() if opts.flags & bit] + list(opts.data)
    fsname = opts.source.replace("\\", "\\\\").replace(",", "\\,")  # (its option parser splits at commas)
    given += [f"fsname={fsname}", f"subtype={opts.fstype.removeprefix('fuse.')}"]
    try:
        proc = subprocess.run(["fusermount3", "-o", ",".join(given), "--", mountpoint],
                              env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())},
                              pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MountError(f"fusermount3: {exc}") from None
    finally:
        theirs.close()
    try:
        if proc.returncode != 0:
            raise MountError(proc.stderr.strip() or f"fusermount3 exited {proc.returncode}")
        fds = array.array("i")
        _, anc, _, _ = ours.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:fds.itemsize])
        if not fds:
            raise MountError("fusermount3 passed no /dev/fuse descriptor")
        os.set_inheritable(fds[0], False)
        return fds[0]
    finally:
        ours.close()
