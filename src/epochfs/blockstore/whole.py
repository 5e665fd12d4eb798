"""Objects held whole, one file each, for the kernel to read itself (``--passthrough``).

A passthrough open hands the kernel one backing file whose offset 0 is the object's offset 0; the
block store keeps an object as blocks, so an object read whole is assembled once into
``whole/<id>.<xxh3-128>`` from its verified blocks (``id``: the object's version, see
:func:`epochfs.blockstore.keys.whole_id`; the digest: of the whole file, taken as it was written, seeded with
the id, so a copy moved under another object's name fails its check: :func:`hasher`). The
kernel's reads of such a file never reach the daemon, so they are not checked: the bytes are checked
when the file is assembled (every block against its chunk checksums), at every open (the file is the
one written: a regular file of this user, of the object's size, with the inode and modification time
recorded when it was verified) and by a scrub that hashes every file again (:meth:`WholeFiles.verify`,
at most once per ``scrub`` seconds each, at a bounded rate). A file a run before left is served only
once this daemon has hashed it (what happened to it while no daemon watched is not known): until then
its object is read through the daemon, and the scrub takes such files first. A file that fails any of
these is removed and never served again; its object is read through the daemon, verified on every
read, as before.

Whole files are a second copy of their blocks, and count against the cache's bound: their bytes are
pinned in the block store (blocks are evicted for them, as the policy orders), and they are kept within
``limit`` bytes, the least recently opened let go first (never one an open file is reading).

Everything here runs on the trio thread except :meth:`WholeFiles.write` and :meth:`WholeFiles.verify`,
which only touch the file they are given.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from epochfs.blockstore.packs import discard
from epochfs.blockstore.store import BlockStore
from epochfs.core.errors import ConfigError
from epochfs.core.private import open_private, private_subdir

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


@dataclass
class Whole:
    """A whole file: the object's version, its size, what it was verified as, and when."""

    wid: str  # hex id of the object's version
    digest: str  # xxh3-128 of its bytes (hex), as written
    size: int
    ino: int = 0
    mtime_ns: int = 0
    verified: float = 0.0  # when it was last hashed (0: not since this daemon started)
    users: int = 0  # backing files open on it

    @property
    def name(self) -> str:
        return f"{self.wid}.{self.digest}"


@dataclass(frozen=True)
class WholeStats:
    files: int
    bytes: int
    limit: int
    assembled: int
    damaged: int
    evicted: int
    unchecked: int = 0  # left by a run before, not hashed by this daemon yet (not served until then)


class WholeFiles:
    def __init__(self, cache_dir: Path, store: BlockStore, limit: int) -> None:
        self.dir = private_subdir(Path(cache_dir), "whole")
        self.store = store
        self.limit = limit
        self.files: OrderedDict[str, Whole] = OrderedDict()  # least recently opened first
        self.held = 0
        self.assembled = self.damaged = self.evicted = 0

    def open(self) -> None:
        """Take up the whole files a run before left (pinned again in the store); remove what is not one."""
        with os.scandir(self.dir) as entries:
            found = sorted(entries, key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
        for entry in found:
            wid, _, digest = entry.name.partition(".")
            st = entry.stat(follow_symlinks=False)
            if (not stat.S_ISREG(st.st_mode) or len(wid) != 32 or len(digest) != 32
                    or not _hex(wid) or not _hex(digest) or wid in self.files):
                discard(entry.path)  # (an interrupted write, or not ours: a link, a directory)
                continue
            self.files[wid] = Whole(wid, digest, st.st_size, st.st_ino, st.st_mtime_ns)
            self.held += st.st_size
            self.store.hold(st.st_size)

    # -- serving -----------------------------------------------------------------------------------------

    def get(self, wid: str, size: int) -> Whole | None:
        """The whole file of ``wid`` to serve, if there is one checked by this daemon."""
        w = self.files.get(wid)
        if w is None:
            return None
        if w.size != size:
            self.drop(w, f"it holds {w.size} bytes, the object {size}")
            return None
        if not w.verified:  # (a run before's, not hashed yet: read through the daemon)
            return None
        self.files.move_to_end(wid)
        return w

    def open_file(self, w: Whole) -> int | None:
        """A descriptor of ``w`` for the kernel, if it is still the file that was written and verified;
        else it is removed and None."""
        try:
            fd = open_private(self.dir / w.name)
        except (OSError, ConfigError) as exc:  # (gone, a link, another user's or linked twice)
            self.drop(w, f"it cannot be opened ({exc})")
            return None
        st = os.fstat(fd)
        if st.st_size != w.size or (st.st_ino, st.st_mtime_ns) != (w.ino, w.mtime_ns):
            os.close(fd)
            self.drop(w, "it was changed after it was verified")
            return None
        return fd

    def drop(self, w: Whole, why: str) -> None:
        """Remove a whole file that failed a check: never served again."""
        log.warning("whole cached file %s is damaged (%s); removed, its object is read through the daemon", w.name,
                    why)
        self.damaged += 1
        self.remove(w)

    def remove(self, w: Whole) -> None:
        if self.files.get(w.wid) is w:
            del self.files[w.wid]
            self.held -= w.size
            self.store.unpin(w.size)
        discard(str(self.dir / w.name))

    # -- filling -----------------------------------------------------------------------------------------

    def admit(self, size: int) -> bool:
        """Room for a whole file of ``size`` bytes: whole files not in use are let go (least recently
        opened first) to keep within the limit, then blocks are evicted for it. False: it does not fit."""
        if size > self.limit:
            return False
        for w in list(self.files.values()):
            if self.held + size <= self.limit:
                break
            if not w.users:
                self.evicted += 1
                self.remove(w)
        return self.held + size <= self.limit and self.store.pin(size)

    def abandon(self, wid: str, size: int) -> None:
        """Give back an admission whose file was not made, and what was written of it."""
        discard(str(self.temp_path(wid)))
        self.store.unpin(size)

    def temp_path(self, wid: str) -> Path:
        return self.dir / f"{wid}.tmp"

    @staticmethod
    def write(path: Path, data: bytes, last: bool) -> None:
        """(a worker thread) Append ``data`` to ``path`` (created by the first call); ``last``: then make
        it durable, before :meth:`install` names it."""
        fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if last:
                os.fsync(fd)
        finally:
            os.close(fd)

    def install(self, wid: str, digest: str, size: int) -> Whole | None:
        """(the trio thread) Put an assembled file in place, under its digest. Its admission becomes its
        hold. None if it is not there as written."""
        tmp = self.temp_path(wid)
        w = Whole(wid, digest, size)
        try:
            fd = open_private(tmp)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if st.st_size != size:
                raise OSError(errno.EIO, f"{st.st_size} bytes written of {size}")
            os.rename(tmp, self.dir / w.name)
        except (OSError, ConfigError) as exc:
            log.warning("whole cached file for %s not installed: %s", wid, exc)
            self.abandon(wid, size)
            return None
        w.ino, w.mtime_ns, w.verified = st.st_ino, st.st_mtime_ns, time.monotonic()
        old = self.files.pop(wid, None)
        if old is not None:
            self.held -= old.size
            self.store.unpin(old.size)
        self.files[wid] = w
        self.held += size
        self.assembled += 1
        return w

    # -- the scrub ---------------------------------------------------------------------------------------

    def due(self, every: float) -> Whole | None:
        """The whole file to hash next: one never hashed by this daemon, else the one hashed longest ago
        if that is more than ``every`` seconds (``every`` 0: only those never hashed)."""
        now = time.monotonic()
        oldest = min(self.files.values(), key=lambda w: w.verified, default=None)
        if oldest is None or (oldest.verified and (every <= 0 or now - oldest.verified < every)):
            return None
        return oldest

    def verify(self, w: Whole, rate: float) -> tuple[bool, int, int] | OSError:
        """(a worker thread) Hash ``w`` again, at most ``rate`` bytes a second: (matches its digest,
        inode, modification time), or the error that kept it from being read."""
        try:
            fd = open_private(self.dir / w.name)
        except OSError as exc:
            return exc
        except ConfigError as exc:  # (gone, a link, another user's or linked twice)
            return OSError(errno.EIO, str(exc))
        try:
            st = os.fstat(fd)
            h = hasher(w.wid)
            started, done = time.monotonic(), 0
            while True:
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    break
                h.update(chunk)
                done += len(chunk)
                ahead = done / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
            return h.hexdigest() == w.digest and done == w.size, st.st_ino, st.st_mtime_ns
        except OSError as exc:
            return exc
        finally:
            os.close(fd)

    def verified(self, w: Whole, answer: tuple[bool, int, int] | OSError) -> None:
        """(the trio thread) What :meth:`verify` found: a file that does not match is removed."""
        if self.files.get(w.wid) is not w:
            return
        if isinstance(answer, OSError):
            self.drop(w, f"it cannot be read ({answer})")
        elif not answer[0]:
            self.drop(w, "its bytes are not those written")
        elif (answer[1], answer[2]) != (w.ino, w.mtime_ns):
            self.drop(w, "it was replaced")
        else:
            w.ino, w.mtime_ns, w.verified = answer[1], answer[2], time.monotonic()

    def statistics(self) -> WholeStats:
        return WholeStats(len(self.files), self.held, self.limit, self.assembled, self.damaged, self.evicted,
                          sum(1 for w in self.files.values() if not w.verified))


def hasher(wid: str) -> Any:
    """The digest of the copy of ``wid``: xxh3-128 seeded with the id, so the digest in a copy's name
    holds for that object's copy alone."""
    return xxhash.xxh3_128(seed=int(wid[:16], 16))


def _hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)

