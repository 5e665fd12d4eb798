"""The node's content index: where the node's caches hold the bytes an ETag names, for its other mounts.

Two mounts of one node that read objects of the same content (a dataset's ``v1/`` and ``v2/`` sharing
most files, the same shard under two keys) each have a store of their own. A store offers each object it
holds whole whose ETag names its bytes (:func:`content_md5`: a single-part S3 ETag is the MD5 of the
object); the index under the node's share directory (``<share dir>/index``, LMDB, written by every
daemon of the node's user) keeps, per content, where one store holds it. Another mount that misses an
object of that content takes it from there instead of fetching it: an object file by a hard link
(:func:`link_checked`: on disk once, for both stores, which then never write or punch it, :func:`alone`),
a pack's range by a copy (:func:`copy_checked`, :func:`read_checked`); the backend is asked for each
content once per node.

Nothing in the index is trusted. An entry says only where to look: the copy is hashed (MD5) and served
only if it is the content its ETag names, then checksummed per chunk like any fill. An entry that names
a file that moved, a pack range reused, a file outside the share directory's tree, another user's file,
or bytes that are not that content costs the reader a fetch, never a wrong byte. Keys are scoped
(:func:`epochfs.core.blocks.scope_id`: endpoint, bucket and credentials), so a mount is never given bytes of a bucket its
credentials did not list.

Layout: key ``scope (16) | MD5 (16) | size (8)``; value ``inode (8) | offset (8) | path`` (the file
and offset where the bytes were, the path absolute, under the share directory's parent).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
import struct
from pathlib import Path
from typing import NamedTuple

import lmdb

from epochfs.blockstore.format import checksums, digest
from epochfs.core.private import private_dir, private_subdir

log = logging.getLogger(__name__)

_KEY = struct.Struct("<16s16sQ")
_HEAD = struct.Struct("<QQ")
MAX_PATH = 1024  # an entry's path is never longer (a store's files are a few dozen bytes under its root)
MAX_COPY = 64 << 30  # objects larger than this are fetched, not copied (the copy is hashed before use)
_HEX = frozenset("0123456789abcdef")


def content_md5(etag: str) -> bytes | None:
    """The MD5 an S3 ETag names, or None where it names none (a multipart ETag ``...-N``, another
    backend's version tag). Under SSE-KMS and SSE-C a single-part ETag is not an MD5 either: the copy's
    hash then refuses it (:func:`copy_checked`)."""
    tag = etag.strip('"').lower()
    if len(tag) != 32 or not _HEX.issuperset(tag):
        return None
    return bytes.fromhex(tag)


class Entry(NamedTuple):
    """Where one store held an object's bytes when it offered them."""

    ino: int
    offset: int
    path: str

    def encode(self) -> bytes:
        return _HEAD.pack(self.ino, self.offset) + os.fsencode(self.path)

    @classmethod
    def decode(cls, raw: bytes) -> Entry | None:
        """The entry, or None for anything this version could not have written."""
        if not _HEAD.size < len(raw) <= _HEAD.size + MAX_PATH:
            return None
        ino, offset = _HEAD.unpack_from(raw)
        path = os.fsdecode(raw[_HEAD.size:])
        if not path.startswith("/") or "\0" in path or "/../" in path + "/" or offset > 1 << 50:
            return None
        return cls(ino, offset, path)


def key_of(scope: bytes, md5: bytes, size: int) -> bytes:
    return _KEY.pack(scope, md5, size)


class ContentIndex:
    """The node's content index (one per share directory; every daemon of the node's user opens it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.root = os.path.realpath(directory.parent)  # (entries must name files under it)
        self.env: lmdb.Environment | None = None

    def open(self) -> None:
        """Create or open it (a private directory; raises ConfigError where it is not one, lmdb.Error)."""
        private_dir(self.directory)
        where = private_subdir(self.directory, "index")
        self.env = lmdb.open(str(where), map_size=1 << 34, subdir=True, max_dbs=0, sync=False, metasync=False,
                             readahead=False, lock=True, mode=0o600)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    def find(self, key: bytes) -> Entry | None:
        """Where the content ``key`` names is, or None (also where the index cannot be read: a fetch)."""
        assert self.env is not None
        try:
            with self.env.begin(buffers=True) as txn:
                raw = txn.get(key)
                return Entry.decode(bytes(raw)) if raw is not None else None
        except lmdb.Error as exc:
            log.warning("the node's content index cannot be read (%s): fetching", exc)
            return None

    def offer(self, entries: list[tuple[bytes, Entry]]) -> None:
        """Say where these contents are now (one write; the newest offer of a content wins)."""
        assert self.env is not None
        with self.env.begin(write=True) as txn:
            for key, entry in entries:
                txn.put(key, entry.encode())

    def forget(self, key: bytes, entry: Entry) -> None:
        """Drop ``key`` if it still says ``entry`` (found stale, or not the content it names)."""
        assert self.env is not None
        with self.env.begin(write=True) as txn:
            raw = txn.get(key)
            if raw is not None and Entry.decode(bytes(raw)) == entry:
                txn.delete(key)

    def __len__(self) -> int:
        assert self.env is not None
        return int(self.env.stat()["entries"])


class Refused(Exception):
    """An entry that does not lead to the content it names (stale, foreign, or other bytes)."""


_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def open_source(root: str, entry: Entry, size: int) -> int:
    """A descriptor of the file ``entry`` names, if it may be read for ``size`` bytes at its offset: a
    regular file of this user, reached by no symbolic link, under ``root``, the inode offered, long
    enough. Raises :class:`Refused`."""
    if not entry.path.startswith(root + "/"):
        raise Refused(f"{entry.path} is not a file of the node's caches")
    try:
        fd = os.open(entry.path, _READ)
    except OSError as exc:
        raise Refused(f"{entry.path}: {exc.strerror}") from None
    try:  # (the kernel's name for what was opened: another where any part of the path is a link)
        st, reached = os.fstat(fd), os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        os.close(fd)
        raise Refused(f"{entry.path}: {exc.strerror}") from None
    if (reached != entry.path or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_ino != entry.ino or st.st_size < entry.offset + size):
        os.close(fd)
        raise Refused(f"{entry.path} is no longer the file offered")
    return fd


def read_checked(root: str, entry: Entry, size: int, md5: bytes) -> bytes:
    """(a worker thread) The ``size`` bytes ``entry`` names, if their MD5 is ``md5``. Raises :class:`Refused`."""
    src = open_source(root, entry, size)
    try:
        data = os.pread(src, size, entry.offset)
    finally:
        os.close(src)
    if len(data) != size or hashlib.md5(data, usedforsecurity=False).digest() != md5:
        raise Refused(f"{entry.path}: not the bytes the ETag names")
    return data


Sums = tuple[bytes, bytes]  # a block's chunk checksums, and its BLAKE3 hash (b"" unless asked for)


def alone(fd: int) -> bool:
    """Whether the object file open at ``fd`` is its store's alone: no other store of the node holds a
    link to it, nor is taking one now (:func:`link_checked` holds a shared lock on it until it has).
    True takes the exclusive lock that says so (released when ``fd`` is closed): only then may the store
    punch a hole in it; a file that is not its alone is never punched nor written (its blocks leave the
    store whole, its other names keep the bytes)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return os.fstat(fd).st_nlink == 1


def link_checked(root: str, entry: Entry, size: int, md5: bytes, dst: str,
                 blocks: list[tuple[bytes, int, int]], digests: bool) -> list[Sums] | None:
    """(a worker thread) Link the object file ``entry`` names at ``dst`` (the bytes on disk once, for both
    stores) and read it once: its MD5 must be ``md5``; each of ``blocks`` is checksummed as a fill is. The
    blocks' sums; None where it cannot be linked (a range of a pack, another file system, a file of
    another length): then :func:`copy_checked`. Raises :class:`Refused` (``dst`` is removed then)."""
    src = open_source(root, entry, size)
    try:
        st = os.fstat(src)
        if entry.offset or st.st_size != size:
            return None
        fcntl.flock(src, fcntl.LOCK_SH)  # (its store does not punch it while the link is made: alone())
        try:
            os.link(entry.path, dst, follow_symlinks=False)  # (the inode there now: checked to be src's below)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                return None
            raise Refused(f"{entry.path}: {exc.strerror}") from None  # (ENOENT: its last name went meanwhile)
        finally:
            fcntl.flock(src, fcntl.LOCK_UN)
    finally:
        os.close(src)
    try:
        try:
            fd = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:  # (ELOOP: a link was put at the path meanwhile, and linked)
            raise Refused(f"{entry.path} changed while it was linked: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_ino != st.st_ino:
                raise Refused(f"{entry.path} was replaced while it was linked")
            return _hashed(fd, entry, size, md5, blocks, digests)
        finally:
            os.close(fd)
    except BaseException:
        _unlink(dst)
        raise


def copy_checked(root: str, entry: Entry, size: int, md5: bytes, dst: str,
                 blocks: list[tuple[bytes, int, int]], digests: bool) -> list[Sums]:
    """(a worker thread) Copy the ``size`` bytes ``entry`` names into a new file ``dst`` (``copy_file_range``:
    a reflink where the file system has them, an in-kernel copy elsewhere) and read the copy once: its
    MD5 must be ``md5``; each of ``blocks`` (id, offset, length) is checksummed as a fill is. The blocks'
    sums. Raises :class:`Refused` (``dst`` is removed then) or OSError (the copy failed: the disk, not
    the entry)."""
    src = open_source(root, entry, size)
    try:
        out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _copy(src, out, entry.offset, size)
            return _hashed(out, entry, size, md5, blocks, digests)
        except BaseException:
            _unlink(dst)
            raise
        finally:
            os.close(out)
    finally:
        os.close(src)


def _hashed(fd: int, entry: Entry, size: int, md5: bytes, blocks: list[tuple[bytes, int, int]],
            digests: bool) -> list[Sums]:
    """One read of the file at ``fd``: the blocks' sums if its MD5 is ``md5``, else :class:`Refused`."""
    h, sums, at = hashlib.md5(usedforsecurity=False), [], 0
    for bid, start, length in blocks:
        data = os.pread(fd, length, start) if start == at else b""
        if len(data) != length:
            raise Refused(f"{entry.path}: the copy is not the object's length")
        h.update(data)
        sums.append((checksums(bid, data), digest(data) if digests else b""))
        at += length
    if at != size or os.fstat(fd).st_size != size or h.digest() != md5:
        raise Refused(f"{entry.path}: not the bytes the ETag names")
    return sums


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _copy(src: int, dst: int, offset: int, size: int) -> None:
    """``size`` bytes of ``src`` at ``offset`` to ``dst`` at 0: in the kernel where it can, else read and
    written here."""
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src, dst, size - done, offset + done, done)
            if n == 0:
                raise Refused("the file offered is shorter than its object")
            done += n
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
            raise
    while done < size:
        chunk = os.pread(src, min(8 << 20, size - done), offset + done)
        if not chunk:
            raise Refused("the file offered is shorter than its object")
        view = memoryview(chunk)
        while view:
            n = os.pwrite(dst, view, done)
            view, done = view[n:], done + n
