"""The namespace index: a snapshot's tree in an LMDB environment in the cache directory, built once per
snapshot version and read through its memory map by :class:`~epochfs.meta.namespace.Namespace` views.

Tables (each in two generations, ``0`` and ``1``; ``info`` names the one being served):

- ``n<g>``: inode (8 bytes, big-endian) -> the node's record (:data:`~epochfs.meta.namespace.RECORD`);
- ``k<g>``: parent inode + the name's cookie + name -> child inode + its record (a directory's names come
  out in cookie order, each with what a listing shows, and a listing resumes at any cookie:
  :func:`~epochfs.meta.namespace.name_cookie`);
- ``p<g>``: the path's hash (:func:`~epochfs.meta.namespace.path_key`) -> inode + record (checked to
  hold the path);
- ``h<g>``: the path's hash -> the record of a file hidden by a directory of the same name (it shows
  again if the directory goes);
- ``s``: scratch for a build: the parent's path hash + name -> record, so each directory's entries
  come out together and sorted; inodes are then given out breadth-first from the root, which makes
  them independent of the listing's order;
- ``info`` (main table): JSON — the snapshot it was built from (source, version, created, objects), the
  generation, counts, and the highest inode number ever given (``max_inode``).

A full build (:meth:`NamespaceIndex.build`) writes the other generation in batches and then switches
``info`` in one transaction, so a view sees the old tree or the new one, never a part. Paths that stay
the same kind keep their inode number; new paths get numbers never used before, so the kernel's cached
inodes never come to mean another file. A change set (:meth:`NamespaceIndex.apply`: a node's own
uploads and deletions) is written into the served generation in one transaction, in time proportional
to the change; views opened before it keep seeing their version (LMDB's readers see the transaction
they began with).

The index is derived data: when it is missing, damaged, of another format or of another snapshot, it is
built again from the snapshot. It is written without fsync per transaction (``env.sync()`` follows each
switch): a crash can only lose a version, and a lost version is rebuilt.
"""

from __future__ import annotations

import array
import itertools
import json
import logging
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb
import xxhash

from epochfs.core.private import private_dir
from epochfs.core.records import MEMBER_TAG, ObjectInfo, reserved_key, stored_extent, unsafe_reason
from epochfs.kernel.abi import ROOT_INODE
from epochfs.meta.base import Change
from epochfs.meta.entries import (
    KIND_DIR,
    KIND_FILE,
    RECORD,
    checked_entry,
    encode_dir,
    encode_file,
    inode_key,
    kid_key,
    path_key,
    record_path,
)
from epochfs.meta.namespace import Namespace

log = logging.getLogger(__name__)

FORMAT = 2  # 2: directory entries in cookie order
_BATCH = 20_000  # objects per write transaction of a build
_KNOWN = 1 << 16  # directories remembered while staging
_ROOT = b"root"  # the root's record in the scratch table (other keys are 16 bytes + a name)
Changes = tuple[list[tuple[int, bytes]], list[int]]  # what the kernel must forget: entries, inodes


def _kind(record: bytes) -> int:
    return record[0]


def _entry_key(path: str) -> bytes:
    """A path's key in the scratch table: its directory's path hash, then its name."""
    parent, _, name = path.rpartition("/")
    return xxhash.xxh3_128_digest(parent.encode("utf-8")) + name.encode("utf-8")


def _warn_skipped(key: str, reason: str) -> None:
    log.warning("skipping object %r: %s", key, reason)


def _path_of(obj: ObjectInfo) -> str | None:
    """The path an object makes (``""``: the root's marker), or None when it is skipped (logged)."""
    if obj.key == "" and not obj.size:
        return ""
    reason = unsafe_reason(obj.key)
    if reason is None and obj.key.endswith("/") and obj.size:
        reason = "a directory marker with data"
    if reason is None and reserved_key(obj.key):
        reason = "a '.epochfs' component is reserved for epochfs's own records"
    if reason:
        _warn_skipped(obj.key, reason)
        return None
    return obj.key.rstrip("/")


def _shard_of(obj: ObjectInfo) -> tuple[str, int, str]:
    shard = stored_extent(obj)[0]
    return shard.key, shard.size, shard.etag


def _discard(env: lmdb.Environment, path: Path) -> None:
    env.close()
    shutil.rmtree(path, ignore_errors=True)


def build(objects: Iterable[ObjectInfo], mtime_ns: int = 0, previous: Namespace | None = None) -> Namespace:
    """The tree of a listing in an index of its own (or, with ``previous``, the next version in the
    index ``previous`` reads, keeping its inode numbers)."""
    index = previous.owner if previous is not None and isinstance(previous.owner, NamespaceIndex) else None
    if index is None:
        index = NamespaceIndex.temporary()
    version = previous.version + 1 if previous is not None else 1
    return index.build(objects, source="", version=version, created=0.0, mtime_ns=mtime_ns, previous=previous)


class NamespaceIndex:
    """The index of one mount (its cache directory is locked by the daemon); builds and change sets run
    one at a time, views are read from any thread."""

    def __init__(self, path: Path, *, renumber_changed: bool = False) -> None:
        self.path = Path(path)
        # A file whose record changed gets a new inode number (each number then names one version of
        # an object, for ever): what a mount whose files are opened with no request needs, so that a
        # file held open across a change keeps reading its version.
        self.renumber_changed = renumber_changed
        self._env = lmdb.open(str(private_dir(self.path)), map_size=1 << 38, subdir=True, max_dbs=12,
                              max_readers=1024, lock=True, mode=0o600, sync=False, metasync=False,
                              readahead=False)
        self._gens = [tuple(self._env.open_db(f"{t}{g}".encode()) for t in "nkph") for g in (0, 1)]
        self._scratch = self._env.open_db(b"s")
        self._writing = threading.Lock()

    @classmethod
    def temporary(cls) -> NamespaceIndex:
        """An index in a directory of its own, removed when the index and its views are gone."""
        path = Path(tempfile.mkdtemp(prefix="epochfs-namespace-"))
        index = cls(path / "index")
        weakref.finalize(index, _discard, index._env, path)
        return index

    def close(self) -> None:
        self._env.close()

    # -- reading ---------------------------------------------------------------------------------------

    def info(self) -> dict[str, Any] | None:
        with self._env.begin() as txn:
            return self._read_info(txn)

    @staticmethod
    def _read_info(txn: lmdb.Transaction) -> dict[str, Any] | None:
        raw = txn.get(b"info")
        if raw is None:
            return None
        try:
            info = json.loads(raw)
        except ValueError:
            return None
        keys = ("gen", "version", "bytes", "mtime_ns", "files", "dirs", "max_inode", "objects")
        if (not isinstance(info, dict) or info.get("format") != FORMAT or info.get("gen") not in (0, 1)
                or not all(isinstance(info.get(k), int) for k in keys)):
            return None
        return info

    def view(self, source: str | None = None, version: int | None = None, created: float | None = None
             ) -> Namespace | None:
        """The served version, or None if there is none (or it is not of this snapshot)."""
        txn = self._env.begin()
        info = self._read_info(txn)
        if info is None or (source is not None and info.get("source") != source) or (
                version is not None and info.get("version") != version) or (
                created is not None and info.get("created") != created):
            txn.abort()
            return None
        if txn.get(inode_key(ROOT_INODE), db=self._gens[info["gen"]][0]) is None:
            txn.abort()
            return None
        return Namespace(txn, self._gens[info["gen"]], info, owner=self)

    # -- a full build ----------------------------------------------------------------------------------

    def build(self, objects: Iterable[ObjectInfo], *, source: str, version: int, created: float,
              mtime_ns: int = 0, previous: Namespace | None = None) -> Namespace:
        """The tree of a listing, written as the next generation and then served. With ``previous`` (a
        view of this index), paths that stay the same kind keep their inode numbers."""
        with self._writing:
            current = self.info()
            gen = 0 if current is None else 1 - current["gen"]
            if previous is not None and (previous.owner is not self or current is None
                                         or previous.generation != current["gen"]):
                previous = None  # another index's view: numbers start afresh (a new mount)
            with self._env.begin(write=True) as txn:
                for db in (*self._gens[gen], self._scratch):
                    txn.drop(db, delete=False)
                txn.put(_ROOT, encode_dir("", None), db=self._scratch)
            stored: set[tuple[str, int, str]] = set()
            count = self._stage(objects, self._gens[gen][3], stored)
            totals = self._number(gen, previous, current)
            newest = totals.pop("newest")
            info = {"format": FORMAT, "gen": gen, "source": source, "version": version, "created": created,
                    "objects": count, "mtime_ns": mtime_ns or newest, **totals}
            if stored:
                info["stored"] = sorted(stored)
            with self._env.begin(write=True) as txn:
                txn.drop(self._scratch, delete=False)
                txn.put(b"info", json.dumps(info).encode())
            self._env.sync(True)
        view = self.view()
        assert view is not None
        return view

    def _stage(self, objects: Iterable[ObjectInfo], hidden: Any, stored: set[tuple[str, int, str]]) -> int:
        """Group the listing's paths by directory in the scratch table (directories implied by keys made,
        unsafe keys skipped, files that are also directories set aside in ``hidden``), and note in
        ``stored`` the shards packed members are stored in. The number of objects read."""
        count, it, s = 0, iter(objects), self._scratch
        known = {"": xxhash.xxh3_128_digest(b"")}  # directories staged (some), and their paths' hashes
        while True:
            batch = list(itertools.islice(it, _BATCH))
            if not batch:
                return count
            count += len(batch)
            with self._env.begin(write=True, db=s) as txn:
                get, put = txn.get, txn.put
                for obj in batch:
                    if obj.etag.startswith(MEMBER_TAG):
                        stored.add(_shard_of(obj))
                    path = _path_of(obj)
                    if not path:
                        if path is not None:
                            put(_ROOT, encode_dir("", obj))  # the root's marker
                        continue
                    parent, _, name = path.rpartition("/")
                    prefix = known.get(parent)
                    if prefix is not None:  # a directory staged already (most objects' case)
                        parent = ""
                    else:
                        if len(known) >= _KNOWN:
                            known.clear()
                        prefix = known[parent] = xxhash.xxh3_128_digest(parent.encode("utf-8"))
                    while parent:  # its ancestors, up to the first one already known
                        pk = _entry_key(parent)
                        had = get(pk)
                        if had is not None and _kind(had) == KIND_DIR:
                            break
                        if had is not None:
                            _warn_skipped(parent, "it is also a directory prefix")
                            put(path_key(parent), had, db=hidden)
                        put(pk, encode_dir(parent, None))
                        parent = parent.rpartition("/")[0]
                    key = prefix + name.encode("utf-8")
                    if not obj.key.endswith("/") and put(key, encode_file(obj), overwrite=False):
                        continue  # (the common case: a new file)
                    had = get(key)
                    if obj.key.endswith("/"):
                        if had is not None and _kind(had) == KIND_FILE:
                            _warn_skipped(path, "it is also a directory prefix")
                            put(path_key(path), had, db=hidden)
                        put(key, encode_dir(path, obj))
                    elif had is not None and _kind(had) == KIND_DIR:
                        _warn_skipped(obj.key, "it is also a directory prefix")
                        put(path_key(path), encode_file(obj), db=hidden)
                    else:
                        put(key, encode_file(obj))

    def _number(self, gen: int, previous: Namespace | None, current: dict[str, Any] | None) -> dict[str, int]:
        """Give the staged paths their inodes, breadth-first from the root (each directory's names in
        byte order), and write the generation's tables. The counts of the new tree."""
        nodes, kids, paths, _ = self._gens[gen]
        fresh = max(previous.max_inode if previous is not None else 1,
                    current["max_inode"] if current is not None else 1) + 1
        files = dirs = total = newest = 0
        queue = array.array("Q", [ROOT_INODE])  # directories whose entries are still to be numbered
        done = ops = 0
        txn = self._env.begin(write=True)
        try:
            root = txn.get(_ROOT, db=self._scratch)
            assert root is not None
            txn.put(inode_key(ROOT_INODE), root, db=nodes)
            txn.put(path_key(""), inode_key(ROOT_INODE) + root, db=paths)
            dirs = 1
            cursor = txn.cursor(db=self._scratch)
            while done < len(queue):
                parent = queue[done]
                done += 1
                parent_path = record_path(txn.get(inode_key(parent), db=nodes))
                prefix, parent_key = xxhash.xxh3_128_digest(parent_path), inode_key(parent)
                node_items, kid_items, path_items = [], [], []
                at = cursor.set_range(prefix)
                while at:
                    key, record = cursor.item()
                    if not key.startswith(prefix) or key == _ROOT:
                        break
                    kind, _, size, mtime, _, _, _, klen, _ = RECORD.unpack_from(record)
                    path = record[RECORD.size:RECORD.size + klen]
                    inode = 0
                    if previous is not None:
                        if kind == KIND_FILE and self.renumber_changed:  # kept only as the same version
                            version = previous.path_version(path.decode())
                            if version is not None and version[1] == record:
                                inode = version[0]
                        else:
                            was = previous.path_entry(path.decode())
                            if was is not None and was[1] == kind:
                                inode = was[0]
                    if not inode:
                        inode, fresh = fresh, fresh + 1
                    number = inode.to_bytes(8, "big")
                    kid_items.append((kid_key(parent_key, key[16:]), number + record))
                    node_items.append((number, record))
                    path_items.append((xxhash.xxh3_128_digest(path), number + record))
                    if kind == KIND_FILE:
                        files, total, newest = files + 1, total + size, max(newest, mtime)
                    else:
                        dirs += 1
                        queue.append(inode)
                    at = cursor.next()
                # Inodes and (parent, cookie, name) keys grow as they are given out: appended, unless
                # numbers of the previous version are reused.
                ordered = previous is None
                kid_items.sort()
                txn.cursor(db=kids).putmulti(kid_items, append=ordered)
                txn.cursor(db=nodes).putmulti(node_items, append=ordered)
                txn.cursor(db=paths).putmulti(path_items)
                ops += len(node_items)
                if ops >= _BATCH:  # bound a transaction's dirty pages
                    cursor.close()
                    txn.commit()
                    txn, ops = self._env.begin(write=True), 0
                    cursor = txn.cursor(db=self._scratch)
            cursor.close()
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        return {"files": files, "dirs": dirs, "bytes": total, "newest": newest, "max_inode": fresh - 1}

    # -- a change set ----------------------------------------------------------------------------------

    def apply(self, added: dict[str, ObjectInfo], removed: Iterable[str], *, version: int, created: float,
              mtime_ns: int = 0) -> tuple[Namespace, Changes]:
        """Serve the current version with objects put (``added``, by key) and deleted (``removed``) as
        ``version``: the tree a build of the merged listing would give, written in one transaction in
        time proportional to the change. Returns the new view and what the kernel must forget."""
        with self._writing:
            current = self.info()
            if current is None:
                raise ValueError("no namespace to apply changes to")
            with self._env.begin(write=True) as txn:
                edit = _Edit(txn, self._gens[current["gen"]], current, renumber=self.renumber_changed)
                for key in sorted(added):  # first: a directory that keeps a name keeps its inode
                    edit.add(added[key])
                for key in sorted(set(removed) - added.keys(), reverse=True):  # children first
                    edit.remove(key)
                info = {**current, **edit.totals(), "version": version, "created": created,
                        "objects": max(0, current["objects"] + edit.objects), "mtime_ns": mtime_ns or current["mtime_ns"]}
                stored = {_shard_of(o) for o in added.values() if o.etag.startswith(MEMBER_TAG)}
                if stored:  # (kept while the version holds no member of them: harmless, dataset bytes)
                    info["stored"] = sorted(stored.union(map(tuple, current.get("stored", ()))))
                txn.put(b"info", json.dumps(info).encode())
            self._env.sync(True)
        view = self.view()
        assert view is not None
        return view, (edit.entries, sorted(edit.inodes))

    def apply_all(self, changes: Iterable[Change]) -> tuple[Namespace | None, Changes]:
        """:meth:`apply` of published change sets in turn; the last view and all the kernel must forget."""
        view, entries, inodes = None, dict[tuple[int, bytes], None](), set[int]()
        for c in changes:
            view, (changed, forget) = self.apply(c.added, c.removed, version=c.version, created=c.created,
                                                 mtime_ns=int(c.created * 1e9))
            entries.update(dict.fromkeys(changed))
            inodes.update(forget)
        return view, (list(entries), sorted(inodes))


class _Edit:
    """One change set's edits of a generation's tables, and what they change for the kernel."""

    def __init__(self, txn: lmdb.Transaction, dbs: tuple[Any, ...], info: dict[str, Any], *,
                 renumber: bool = False) -> None:
        self.txn = txn
        self.renumber = renumber
        self.nodes, self.kids, self.paths, self.hidden = dbs
        self.fresh = info["max_inode"] + 1
        self.files, self.dirs, self.bytes = info["files"], info["dirs"], info["bytes"]
        self.objects = 0  # objects of the snapshot added less those removed
        self.entries: list[tuple[int, bytes]] = []
        self.inodes: set[int] = set()

    def totals(self) -> dict[str, int]:
        return {"files": self.files, "dirs": self.dirs, "bytes": self.bytes, "max_inode": self.fresh - 1}

    def _at(self, path: str) -> tuple[bytes, int] | None:
        raw = checked_entry(self.txn.get(path_key(path), db=self.paths), path.encode("utf-8"))
        return None if raw is None else (raw[:8], raw[8])

    def _record(self, inode: bytes) -> bytes:
        record = self.txn.get(inode, db=self.nodes)
        assert record is not None
        return record

    def _write(self, path: str, inode: bytes, record: bytes) -> None:
        """A node's record, in each table that holds it."""
        self.txn.put(inode, record, db=self.nodes)
        self.txn.put(path_key(path), inode + record, db=self.paths)
        if path:
            parent_path, _, name = path.rpartition("/")
            at = self._at(parent_path)
            assert at is not None
            self.txn.put(kid_key(at[0], name.encode("utf-8")), inode + record, db=self.kids)

    def _changed(self, path: str, inode: bytes | None) -> None:
        parent_path, _, name = path.rpartition("/")
        at = self._at(parent_path)
        assert at is not None
        parent = int.from_bytes(at[0], "big")
        self.entries.append((parent, name.encode("utf-8")))
        self.inodes.add(parent)
        if inode is not None:
            self.inodes.add(int.from_bytes(inode, "big"))

    def _has_children(self, inode: bytes) -> bool:
        cursor = self.txn.cursor(db=self.kids)
        try:
            return cursor.set_range(inode) and cursor.key().startswith(inode)
        finally:
            cursor.close()

    def _put(self, path: str, record: bytes, inode: bytes | None) -> bytes:
        """Write ``path``'s node (a new one when ``inode`` is None)."""
        if inode is None:
            inode, self.fresh = inode_key(self.fresh), self.fresh + 1
        self._write(path, inode, record)
        return inode

    def _drop(self, path: str, inode: bytes, kind: int, *, prune: bool = True) -> None:
        """Remove ``path``'s node; a file it hid shows again; then (``prune``) its directory goes if that
        was implied by it alone."""
        record = self._record(inode)
        if kind == KIND_FILE:
            self.files -= 1
            self.bytes -= RECORD.unpack_from(record)[2]
        else:
            self.dirs -= 1
        self._changed(path, inode)
        self.txn.delete(inode, db=self.nodes)
        self.txn.delete(path_key(path), db=self.paths)
        parent_path, _, name = path.rpartition("/")
        at = self._at(parent_path)
        assert at is not None
        self.txn.delete(kid_key(at[0], name.encode("utf-8")), db=self.kids)
        shown = self.txn.pop(path_key(path), db=self.hidden) if kind == KIND_DIR else None
        if shown is not None:
            self._put(path, shown, None)
            self.files += 1
            self.bytes += RECORD.unpack_from(shown)[2]
        elif prune and parent_path and not self._has_children(at[0]):
            if not self._record(at[0])[1]:  # no marker of its own
                self._drop(parent_path, at[0], KIND_DIR)

    def _hide(self, path: str, at: tuple[bytes, int]) -> None:
        """Set the file at ``path`` aside: a directory of its name wins."""
        _warn_skipped(path, "it is also a directory prefix")
        record = self._record(at[0])
        self._drop(path, *at, prune=False)
        self.txn.put(path_key(path), record, db=self.hidden)

    def _present(self, key: str) -> bool:
        """Whether the snapshot holds ``key`` (as a file, a file set aside, or a directory's marker)."""
        path = key.rstrip("/")
        at = self._at(path)
        if key.endswith("/") or not key:
            return at is not None and at[1] == KIND_DIR and bool(self._record(at[0])[1])
        if at is not None and at[1] == KIND_FILE:
            return True
        return self.txn.get(path_key(path), db=self.hidden) is not None

    def remove(self, key: str) -> None:
        self.objects -= self._present(key)
        path = key.rstrip("/")
        if not path:
            return
        at = self._at(path)
        if not key.endswith("/"):
            if at is not None and at[1] == KIND_FILE:
                self._drop(path, *at)
            else:
                self.txn.delete(path_key(path), db=self.hidden)
        elif at is not None and at[1] == KIND_DIR:
            if self._has_children(at[0]):  # still implied by what it holds
                self._write(path, at[0], encode_dir(path, None))
                self._changed(path, at[0])
            else:
                self._drop(path, *at)

    def _ancestors(self, path: str) -> None:
        """Make the directories ``path`` implies (a file in the way is set aside)."""
        missing = []
        parent = path.rpartition("/")[0]
        while True:
            at = self._at(parent)
            if at is not None and at[1] == KIND_DIR:
                break
            if at is not None:
                self._hide(parent, at)
            missing.append(parent)
            parent = parent.rpartition("/")[0]
        for d in reversed(missing):
            self._changed(d, None)
            self._put(d, encode_dir(d, None), None)
            self.dirs += 1

    def add(self, obj: ObjectInfo) -> None:
        if (unsafe_reason(obj.key) is None and not reserved_key(obj.key)) or obj.key == "":
            self.objects += not self._present(obj.key)
        path = _path_of(obj)
        if not path:
            if path is not None:  # the root's marker
                self._write("", inode_key(ROOT_INODE), encode_dir("", obj))
                self.inodes.add(ROOT_INODE)
            return
        self._ancestors(path)
        at = self._at(path)
        if obj.key.endswith("/"):
            if at is not None and at[1] == KIND_FILE:
                self._hide(path, at)
                at = None
            record = encode_dir(path, obj)
            if at is None:
                self.dirs += 1
        else:
            if at is not None and at[1] == KIND_DIR:
                _warn_skipped(obj.key, "it is also a directory prefix")
                self.txn.put(path_key(path), encode_file(obj), db=self.hidden)
                return
            record = encode_file(obj)
            if at is None:
                self.files += 1
            else:
                self.bytes -= RECORD.unpack_from(self._record(at[0]))[2]
            self.bytes += obj.size
        if at is not None and self._record(at[0]) == record:
            return
        self._changed(path, at[0] if at else None)
        if at is not None and at[1] == KIND_FILE and self.renumber:  # a new version: a new number
            self.txn.delete(at[0], db=self.nodes)
            at = None
        self._put(path, record, at[0] if at else None)
