"""Directory backend: a dataset on a slow shared filesystem (NFS, Lustre, a network mount).

The "ETag" of a file is derived from its inode, size and mtime; a read checks it before and after
reading, so a file replaced or rewritten underneath is reported as changed, never mixed.
Only regular files are listed; symbolic links are skipped (they could point outside the dataset).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Iterator

from epochfs.backend.base import Backend, BackendStats, ObjectInfo, StatsRecorder
from epochfs.config import Config
from epochfs.errors import AccessDenied, BackendUnavailable, ConfigError, ObjectChanged

log = logging.getLogger(__name__)


def file_etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


class LocalBackend(Backend):
    def __init__(self, config: Config) -> None:
        self.root = config.source.prefix
        self.source_id = config.source.url
        self._stats = StatsRecorder()

    def statistics(self) -> BackendStats:
        return self._stats.snapshot()

    def list_objects(self) -> Iterator[ObjectInfo]:
        if not os.path.isdir(self.root):
            raise ConfigError(f"source directory {self.root} does not exist or is not a directory")
        stack = [""]
        while stack:
            rel = stack.pop()
            try:
                entries = list(os.scandir(os.path.join(self.root, rel)))
            except OSError as exc:
                self._stats.record("list", "error")
                raise BackendUnavailable(f"listing {os.path.join(self.root, rel)}: {exc}") from None
            self._stats.record("list", "ok")
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_symlink():
                    log.warning("skipping symbolic link %r", key)
                elif entry.is_dir(follow_symlinks=False):
                    stack.append(key)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    yield ObjectInfo(key=key, size=st.st_size, mtime_ns=st.st_mtime_ns, etag=file_etag(st))

    def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        started = time.monotonic()
        path = os.path.join(self.root, key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            self._stats.record("get", "changed")
            raise ObjectChanged(f"{key}: deleted") from None
        except PermissionError:
            self._stats.record("get", "denied")
            raise AccessDenied(f"{key}: permission denied") from None
        except OSError as exc:
            self._stats.record("get", "error")
            if exc.errno == errno.ELOOP:
                raise ObjectChanged(f"{key}: replaced by a symbolic link") from None
            raise BackendUnavailable(f"{key}: {exc}") from None
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
            raise BackendUnavailable(f"{key}: {exc}") from None
        finally:
            os.close(fd)
        self._stats.record("get", "ok", len(data), time.monotonic() - started)
        return data
