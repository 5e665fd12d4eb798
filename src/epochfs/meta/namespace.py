"""The dataset's namespace: the rules for which keys become paths, the nodes, and a read-only view of one
version of the tree with inode numbers. The tree itself lives in an LMDB index (:mod:`.index`), read
through its memory map: a node is decoded when it is asked for, so the daemon's memory follows what
readers touch, not the size of the dataset.

Keys that cannot be safe path names are skipped with one log line each and never become entries:

- an empty component (a leading ``/``, ``//``) or a ``.`` / ``..`` component;
- a NUL or another control character, or text that is not valid UTF-8;
- a component over 255 bytes, or a whole path over 4000 bytes;
- a key that is a file and also the prefix of other keys (the directory wins, as in mountpoint-s3).

A key ending in ``/`` with no data is a directory marker: it makes the directory, not a file, and
carries the directory's attributes where the source has them (mode, owner, mtime). The empty key is the
marker of the root.

A :class:`Namespace` is one version, unchanging while anyone holds it (an LMDB read transaction): the
files opened through it keep what they saw while newer versions are written beside it. A directory's
entries are in the order of their names' cookies (:func:`epochfs.meta.entries.name_cookie`), so a listing is continued from
any offset on whichever version is current, and nothing a reader holds keeps a version alive. Its
lookups may be called from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

import xxhash

from epochfs.core.records import ObjectInfo
from epochfs.kernel.abi import ROOT_INODE
from epochfs.meta.entries import (
    COOKIE_MAX,
    KIND_FILE,
    checked_entry,
    decode,
    inode_key,
    kid_key,
    path_key,
    record_path,
)
from epochfs.meta.nodes import Dir, File

_CHUNK = 1024  # entries read per turn of the lock when iterating
_BULK = 16384  # paths resolved per turn of the lock
_MEMO = 1 << 16  # decoded nodes kept per view (the hot set of readers)


class Reader(Protocol):
    """What a view reads through: one read transaction of the index (:mod:`.index`), which holds its
    version for as long as it is open."""

    def get(self, key: bytes, default: Any = None, db: Any = None) -> Any: ...

    def cursor(self, db: Any = None) -> Any: ...

    def abort(self) -> None: ...


class Namespace:
    """One version of the tree: lookups by inode, by (parent inode, name) and by path."""

    def __init__(self, txn: Reader, dbs: tuple[Any, ...], info: dict[str, Any],
                 owner: object = None) -> None:
        self._txn = txn
        self._nodes, self._kids, self._paths = dbs[:3]
        self._lock = threading.Lock()
        self._memo: dict[int, Dir | File] = {}  # decoded nodes by inode, and how they were asked for:
        self._by_name: dict[tuple[int, bytes], Dir | File] = {}
        self._by_path: dict[str, Dir | File] = {}
        self.owner = owner  # the index this view reads (kept open while the view lives)
        self.info = info
        self.version: int = info["version"]
        self.generation: int = info["gen"]
        self.total_bytes: int = info["bytes"]
        self.mtime_ns: int = info["mtime_ns"]
        self.file_count: int = info["files"]
        self.dir_count: int = info["dirs"]
        self.max_inode: int = info["max_inode"]
        self._stored: dict[tuple[str, str], int] | None = None

    def stored(self, key: str, etag: str) -> ObjectInfo | None:
        """The shard ``key`` at version ``etag`` if packed members of this version are stored in it (what
        a peer may ask this node for besides the files themselves), else None."""
        if self._stored is None:
            rows = self.info.get("stored", ())
            self._stored = {(k, e): n for k, n, e in rows} if isinstance(rows, list) and all(
                isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and type(r[1]) is int
                and isinstance(r[2], str) for r in rows) else {}
        size = self._stored.get((key, etag))
        return None if size is None else ObjectInfo(key, size, 0, etag)

    def close(self) -> None:
        """Let the index reuse what only this version held (also when the view is dropped)."""
        with self._lock:
            self._txn.abort()

    def node(self, inode: int) -> Dir | File:
        node = self._memo.get(inode)
        if node is not None:
            return node
        if not 0 < inode < 1 << 63:
            raise KeyError(inode)
        with self._lock:
            raw = self._txn.get(inode_key(inode), db=self._nodes)
        if raw is None:
            raise KeyError(inode)
        return self._remember(decode(inode, raw))

    def lookup(self, parent: int, name: bytes) -> Dir | File | None:
        node = self._by_name.get((parent, name))
        if node is not None:
            return node
        if not name or not 0 < parent < 1 << 63:
            return None
        with self._lock:
            raw = self._txn.get(kid_key(inode_key(parent), name), db=self._kids)
        if raw is None:
            return None
        node = self._found(raw)
        self._by_name[(parent, name)] = node
        return node

    def _found(self, raw: bytes) -> Dir | File:
        """The node of an entry (inode + record)."""
        inode = int.from_bytes(raw[:8], "big")
        node = self._memo.get(inode)
        return node if node is not None else self._remember(decode(inode, raw[8:]))

    def resolve(self, path: str) -> Dir | File | None:
        """The node at ``path`` (relative to the root, '/'-separated), or None."""
        node = self._by_path.get(path)
        if node is not None:
            return node
        key = path.strip("/")
        try:
            want = key.encode("utf-8")
        except UnicodeEncodeError:
            return None
        with self._lock:
            raw = checked_entry(self._txn.get(xxhash.xxh3_128_digest(want), db=self._paths), want)
        if raw is None:
            return None
        node = self._found(raw)
        if len(self._by_path) >= _MEMO:  # (many spellings of few paths)
            self._by_path.clear()
        self._by_path[path] = node
        return node

    def resolve_all(self, paths: list[str]) -> list[Dir | File | None]:
        """:meth:`resolve` of many paths (a manifest's), a chunk per turn of the lock; not remembered."""
        out: list[Dir | File | None] = []
        digest, memo, get, db = xxhash.xxh3_128_digest, self._memo, self._txn.get, self._paths
        for start in range(0, len(paths), _BULK):
            wanted = []
            for path in paths[start:start + _BULK]:
                try:
                    wanted.append(path.strip("/").encode("utf-8"))
                except UnicodeEncodeError:
                    wanted.append(b"\xff")  # never a path (not UTF-8)
            keys = [digest(w) for w in wanted]
            order = sorted(range(len(keys)), key=keys.__getitem__)  # in key order: the pages come in turn
            found: list[bytes | None] = [None] * len(keys)
            with self._lock:
                for i in order:
                    found[i] = get(keys[i], db=db)
            for want, raw in zip(wanted, found, strict=True):
                raw = checked_entry(raw, want)
                if raw is None:
                    out.append(None)
                    continue
                inode = int.from_bytes(raw[:8], "big")
                node = memo.get(inode)
                out.append(node if node is not None else decode(inode, raw[8:]))
        return out

    def _remember(self, node: Dir | File) -> Dir | File:
        """Keep a decoded node for the next asks (the hot set of readers; all of them are forgotten at
        once when ``_MEMO`` are kept, so memory stays bounded by the readers, not the dataset)."""
        if len(self._memo) >= _MEMO:
            self._memo.clear()
            self._by_name.clear()
            self._by_path.clear()
        self._memo[node.inode] = node
        return node

    def _scan(self, db: Any, start: bytes, stop: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Items of ``db`` from ``start`` (inclusive) while keys begin with ``stop``, a chunk per turn
        of the lock (the caller may take its time between items)."""
        key, first = start, True
        while True:
            chunk = []
            with self._lock:
                cursor = self._txn.cursor(db=db)
                at = cursor.set_range(key)
                if at and not first and cursor.key() == key:
                    at = cursor.next()
                while at:
                    item = cursor.item()
                    if stop is not None and not item[0].startswith(stop):
                        break
                    chunk.append(item)
                    if len(chunk) >= _CHUNK:
                        break
                    at = cursor.next()
                cursor.close()
            yield from chunk
            if len(chunk) < _CHUNK:
                return
            key, first = chunk[-1][0], False

    def entries(self, inode: int) -> Iterator[tuple[bytes, Dir | File]]:
        """The names in directory ``inode`` in cookie order (:func:`epochfs.meta.entries.name_cookie`), with their nodes."""
        for _, name, node in self.entries_after(inode, 0):
            yield name, node

    def entries_after(self, inode: int, cookie: int) -> Iterator[tuple[int, bytes, Dir | File]]:
        """The entries of directory ``inode`` whose cookie is above ``cookie``, in cookie order (then
        name order), with their cookies: found with one lookup, wherever the listing stands."""
        if not 0 <= cookie <= COOKIE_MAX:
            return
        prefix = inode_key(inode)
        for key, value in self._scan(self._kids, prefix + (cookie + 1).to_bytes(8, "big"), prefix):
            if len(key) > 16:
                yield int.from_bytes(key[8:16], "big"), key[16:], self._found(value)

    def path_entry(self, path: str) -> tuple[int, int] | None:
        """The inode and kind at ``path``, without decoding its node."""
        with self._lock:
            raw = checked_entry(self._txn.get(path_key(path), db=self._paths), path.encode("utf-8"))
        return None if raw is None else (int.from_bytes(raw[:8], "big"), raw[8])

    def path_version(self, path: str) -> tuple[int, bytes] | None:
        """The inode and record at ``path`` as stored (compared, not decoded)."""
        with self._lock:
            raw = checked_entry(self._txn.get(path_key(path), db=self._paths), path.encode("utf-8"))
        return None if raw is None else (int.from_bytes(raw[:8], "big"), bytes(raw[8:]))

    def records(self) -> Iterator[tuple[int, bytes]]:
        """Every node's inode and record, in inode order."""
        for key, value in self._scan(self._nodes, inode_key(1), None):
            yield int.from_bytes(key, "big"), value

    def files(self) -> Iterator[File]:
        for key, value in self._scan(self._nodes, inode_key(1), None):
            if value[0] == KIND_FILE:
                node = decode(int.from_bytes(key, "big"), value)
                assert isinstance(node, File)
                yield node

    def walk(self, inode: int) -> Iterator[File]:
        """The files under directory ``inode``, depth first, each directory's names in cookie order."""
        stack = [self.entries(inode)]
        while stack:
            for _, node in stack[-1]:
                if isinstance(node, File):
                    yield node
                else:
                    stack.append(self.entries(node.inode))
                    break
            else:
                stack.pop()

    def __len__(self) -> int:
        return self.file_count + self.dir_count


def diff(old: Namespace, new: Namespace) -> tuple[list[tuple[int, bytes]], list[int]]:
    """What the kernel must forget when ``new`` replaces ``old``: directory entries (parent inode,
    name) that were added, removed or now name something else, and inodes whose attributes or data
    changed (their cached pages must go) or whose listing changed. One pass over both in inode order
    (a path that stays keeps its number, so an unchanged node is the same record under the same inode)."""
    entries: dict[tuple[int, bytes], None] = {}
    inodes: set[int] = set()

    def changed(record: bytes, was: int | None) -> None:
        path = record_path(record).decode()
        if not path:
            inodes.add(ROOT_INODE)
            return
        parent_path, _, name = path.rpartition("/")
        parent = new.resolve(parent_path) or old.resolve(parent_path)
        assert parent is not None
        entries[(parent.inode, name.encode("utf-8"))] = None
        inodes.add(parent.inode)
        if was is not None:
            inodes.add(was)

    before, after = old.records(), new.records()
    o, n = next(before, None), next(after, None)
    while o is not None or n is not None:
        if n is None or (o is not None and o[0] < n[0]):  # gone (or now under another number)
            changed(o[1], o[0])  # type: ignore[index]
            o = next(before, None)
        elif o is None or n[0] < o[0]:  # new
            changed(n[1], None)
            n = next(after, None)
        else:
            if o[1] != n[1]:
                if record_path(o[1]) != record_path(n[1]):
                    changed(o[1], o[0])
                changed(n[1], o[0])
            o, n = next(before, None), next(after, None)
    return list(entries), sorted(inodes)
