"""Directory backend: a dataset on a slow shared filesystem (NFS, Lustre, a network mount).

Every path is resolved beneath the source root one component at a time, each opened with
``O_NOFOLLOW`` relative to its parent's descriptor: no symbolic link is ever followed, anywhere in a
path, so neither a link inside the source nor a snapshot entry naming one (a shared store may hold
any name) can reach a file outside the source. Listing skips symbolic links, special files and names
that are not UTF-8.

The source root itself is opened once, when the backend is made, and every listing and read starts
from that descriptor: the path is never resolved again, so a directory swapped for a link (or another
directory) under the path later changes nothing this daemon reads. A process that checked the root
before starting the daemon (``epochfs-fluid-mount``: a Dataset's source, walked without following any
link, :func:`open_root`) hands its descriptor down (:data:`ROOT_FD_ENV`), so what was checked is what
is read. (A file system mounted over the root later is not seen until the daemon restarts.)

The version tag ("ETag") of a file is its device, inode, size, mtime and ctime: a file replaced,
rewritten or rewritten in place with its mtime restored gets a new tag (the ctime moves on any
change). A read checks the tag before and after reading, so a file changed underneath is reported as
changed, never mixed. Directories are listed as markers carrying their mode and owner, so the mount
presents the source's permissions (see :class:`epochfs.vfs.presentation.Presentation`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from epochfs.backend.base import Backend, BackendSettings, BackendStats, StatsRecorder, servable
from epochfs.core.errors import AccessDenied, BackendUnavailable, ConfigError, ObjectChanged
from epochfs.core.records import ObjectInfo
from epochfs.links.meter import TransferMeter

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted under a file's name must not block; it is refused below.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def file_etag(st: os.stat_result) -> str:
    return f"{st.st_dev:x}-{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ctime_ns:x}"


def _info(key: str, st: os.stat_result, etag: str) -> ObjectInfo:
    size = st.st_size if stat.S_ISREG(st.st_mode) else 0  # a directory's marker holds no data
    return ObjectInfo(key=key, size=size, mtime_ns=st.st_mtime_ns, etag=etag,
                      mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid)


#: The environment variable that hands a checked source root's descriptor to the daemon (its value:
#: ``FD:PATH``, the descriptor and the path it was opened at).
ROOT_FD_ENV = "EPOCHFS_SOURCE_ROOT_FD"


def open_root(path: str) -> int:
    """Open the directory ``path`` (absolute) walking from ``/`` one component at a time, following no
    symbolic link anywhere (as ``openat2``'s RESOLVE_NO_SYMLINKS does): what it opens is exactly the
    directory its literal path names. OSError: ELOOP or ENOTDIR where a component is a link, ..."""
    if not os.path.isabs(path):
        raise OSError(errno.EINVAL, f"not an absolute path: {path!r}")
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise OSError(errno.EINVAL, f"a path with . or .. components: {path!r}")
    return _walk(os.open("/", _DIR_FLAGS), parts, _DIR_FLAGS)


def inherited_root(path: str) -> int | None:
    """The descriptor a checking process handed down for the source root at ``path`` (:data:`ROOT_FD_ENV`),
    taken over (close-on-exec from now on, the variable cleared); None where there is none for it."""
    value = os.environ.pop(ROOT_FD_ENV, None)
    if not value:
        return None
    fd_text, _, handed = value.partition(":")
    try:
        fd = int(fd_text)
        info = os.fstat(fd)
    except (ValueError, OSError):
        log.warning("%s=%r names no open descriptor: ignored", ROOT_FD_ENV, value[:100])
        return None
    if os.path.normpath(handed) != os.path.normpath(path) or not stat.S_ISDIR(info.st_mode):
        log.warning("%s hands down %r, not the source %s: ignored", ROOT_FD_ENV, handed[:200], path)
        return None
    os.set_inheritable(fd, False)
    return fd


def open_beneath(root: int, key: str, *, directory: bool = False) -> int:
    """Open ``key`` (``/``-separated, relative) beneath the directory open at ``root`` without following
    any symbolic link. Raises OSError: ELOOP or ENOTDIR where a component is a link, ENOENT, EACCES, ..."""
    parts = key.split("/") if key else []
    if any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EINVAL, f"not a relative path: {key!r}")
    # (the root opened anew: a description of its own, so each listing reads from its start)
    return _walk(os.open(".", _DIR_FLAGS, dir_fd=root), parts, _DIR_FLAGS if directory else _FILE_FLAGS)


def _walk(fd: int, parts: list[str], last: int) -> int:
    """Open ``parts`` one below the other from the directory open at ``fd`` (taken over: closed as the
    walk moves on, or on an error), following no link: each with ``O_NOFOLLOW``, the last with ``last``."""
    try:
        for i, part in enumerate(parts):
            child = os.open(part, last if i == len(parts) - 1 else _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


class LocalBackend(Backend):
    def __init__(self, settings: BackendSettings) -> None:
        self.root = settings.source.prefix
        self.source_id = settings.source.url
        self._stats = StatsRecorder()
        self._root_fd = inherited_root(self.root)
        if self._root_fd is None:
            try:
                self._root_fd = os.open(self.root, _DIR_FLAGS & ~os.O_NOFOLLOW)  # (the operator's path: links in it are theirs)
            except OSError:
                self._root_fd = None  # (said at the first listing, as before)

    def _root(self) -> int:
        if self._root_fd is None:
            raise ConfigError(f"source directory {self.root} does not exist or is not a directory")
        return self._root_fd

    def close(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def statistics(self) -> BackendStats:
        return self._stats.snapshot()

    def transfers(self) -> TransferMeter:
        return self._stats.transfers

    def link_peer(self) -> tuple[str, int] | None:
        return network_server(f"/proc/self/fd/{self._root_fd}" if self._root_fd is not None else self.root)

    def list_objects(self) -> Iterator[ObjectInfo]:
        return servable(self._listing())

    def _listing(self) -> Iterator[ObjectInfo]:
        root = self._root()
        stack = [""]
        while stack:
            rel = stack.pop()
            try:
                fd = open_beneath(root, rel, directory=True)
            except OSError as exc:
                self._stats.record("list", "error")
                raise BackendUnavailable(f"listing {os.path.join(self.root, rel)}: {exc.strerror}") from None
            try:
                yield from self._list_dir(fd, rel, stack)
            finally:
                os.close(fd)

    def _list_dir(self, fd: int, rel: str, stack: list[str]) -> Iterator[ObjectInfo]:
        """The marker of the directory open at ``fd`` and its files; its subdirectories go on ``stack``."""
        try:
            st = os.fstat(fd)
            entries = list(os.scandir(fd))
        except OSError as exc:
            self._stats.record("list", "error")
            raise BackendUnavailable(f"listing {os.path.join(self.root, rel)}: {exc.strerror}") from None
        self._stats.record("list", "ok")
        yield _info(f"{rel}/" if rel else "", st, "")  # the directory's marker: its mode and owner
        for entry in entries:
            key = f"{rel}/{entry.name}" if rel else entry.name
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                log.warning("skipping %r: not valid UTF-8", key)
                continue
            try:
                if entry.is_symlink():
                    log.warning("skipping symbolic link %r", key)
                elif entry.is_dir(follow_symlinks=False):
                    stack.append(key)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    yield _info(key, st, file_etag(st))
            except OSError as exc:  # gone meanwhile
                log.info("skipping %r: %s", key, exc.strerror)

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            fd = open_beneath(self._root(), key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except PermissionError:
            raise AccessDenied(f"{key}: permission denied") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EINVAL):
                return None
            raise BackendUnavailable(f"{key}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return _info(key, st, file_etag(st)) if stat.S_ISREG(st.st_mode) else None

    def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        started = time.monotonic()
        root = self._root()
        try:
            fd = open_beneath(root, key)
        except FileNotFoundError:
            self._stats.record("get", "changed")
            raise ObjectChanged(f"{key}: deleted") from None
        except PermissionError:
            self._stats.record("get", "denied")
            raise AccessDenied(f"{key}: permission denied") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EINVAL):
                self._stats.record("get", "changed")
                raise ObjectChanged(f"{key}: not a file beneath the source root (a symbolic link?)") from None
            self._stats.record("get", "error")
            raise BackendUnavailable(f"{key}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or file_etag(st) != etag:
                self._stats.record("get", "changed")
                raise ObjectChanged(f"{key}: changed since the snapshot")
            chunks = []
            pos, remaining = start, length
            while remaining:
                chunk = os.pread(fd, remaining, pos)
                if not chunk:
                    break
                chunks.append(chunk)
                pos += len(chunk)
                remaining -= len(chunk)
            data = b"".join(chunks)
            if len(data) != length or file_etag(os.fstat(fd)) != etag:
                self._stats.record("get", "changed")
                raise ObjectChanged(f"{key}: changed while reading")
        except OSError as exc:
            self._stats.record("get", "error")
            raise BackendUnavailable(f"{key}: {exc.strerror}") from None
        finally:
            os.close(fd)
        end = time.monotonic()
        self._stats.record("get", "ok", len(data), end - started, moving=(started, end))
        return data


#: Network file systems whose server a directory source is read from, and the port each serves on.
NETWORK_FS = {"nfs": 2049, "nfs4": 2049, "cifs": 445, "smb3": 445, "lustre": 988, "ceph": 6789, "glusterfs": 24007}


def mount_server(mountinfo: str, path: str) -> tuple[str, int] | None:
    """The server of the network file system holding ``path``, from ``/proc/self/mountinfo``'s text:
    ``(host, port)``, or None where ``path`` is on a local file system."""
    best: tuple[int, str, str] | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > best[0]):
            best = (len(point), tail[0], tail[1])
    if best is None or best[1] not in NETWORK_FS:
        return None
    fstype, spec = best[1], best[2]
    if spec.startswith("//"):  # cifs: //host/share
        host = spec[2:].split("/", 1)[0]
    else:  # nfs host:/export (an IPv6 host in brackets), lustre addr@tcp:/fs, ceph mon1,mon2:/
        host = spec.rsplit(":/", 1)[0] if ":/" in spec else spec.split(":", 1)[0]
        host = host.split(",", 1)[0].split("@", 1)[0].strip("[]")
    return (host, NETWORK_FS[fstype]) if host else None


def network_server(path: str) -> tuple[str, int] | None:
    """:func:`mount_server` of this process's mounts."""
    try:
        return mount_server(Path("/proc/self/mountinfo").read_text(), os.path.realpath(path))
    except OSError:
        return None
