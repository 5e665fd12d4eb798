"""The dataset's namespace as an immutable tree with inode numbers. Pure: no I/O.

A :class:`Namespace` is built from a listing. Keys that cannot be safe path names are skipped with one
log line each and never become entries:

- an empty component (a leading ``/``, ``//``) or a ``.`` / ``..`` component;
- a NUL or another control character, or text that is not valid UTF-8;
- a component over 255 bytes, or a whole path over 4000 bytes;
- a key that is a file and also the prefix of other keys (the directory wins, as in mountpoint-s3).

A key ending in ``/`` with no data is a directory marker: it makes the directory, not a file, and
carries the directory's attributes where the source has them (mode, owner, mtime). The empty key is the
marker of the root.
Inode numbers are assigned in sorted path order, so the same snapshot always gets the same numbers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from epochfs.records import ObjectInfo

log = logging.getLogger(__name__)

ROOT_INODE = 1
NAME_MAX = 255
PATH_MAX = 4000
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def unsafe_reason(key: str) -> str | None:
    """Why ``key`` cannot be a path of the mount, or None if it can."""
    if key.isascii() and key.isprintable() and len(key) <= NAME_MAX:  # the common case, checked at once
        inner = "/" + (key[:-1] if key.endswith("/") else key) + "/"
        if "//" not in inner and "/./" not in inner and "/../" not in inner:
            return None
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8"
    if len(raw) > PATH_MAX:
        return f"path longer than {PATH_MAX} bytes"
    if _CONTROL.search(key):
        return "contains a NUL or control character"
    parts = key[:-1].split("/") if key.endswith("/") else key.split("/")
    for part in parts:
        if part == "":
            return "empty path component (leading '/' or '//')"
        if part in (".", ".."):
            return f"'{part}' path component"
        if len(part.encode("utf-8")) > NAME_MAX:
            return f"component longer than {NAME_MAX} bytes"
    return None


@dataclass(slots=True)
class Dir:
    """A directory of the snapshot (what a node can do: :class:`epochfs.writeback.tree.Node`)."""

    inode: int
    path: str
    children: dict[bytes, int]
    names: list[bytes]  # sorted, for readdir offsets
    info: ObjectInfo | None = None  # its marker, if the listing had one

    is_dir = True
    in_backend = False
    written_here = False
    made_here = False
    in_snapshot = True

    def record(self) -> ObjectInfo | None:
        return self.info


class File(NamedTuple):  # immutable; a tuple builds in a fraction of a frozen dataclass's time
    """An object of the snapshot."""

    inode: int
    path: str
    obj: ObjectInfo

    is_dir = False
    in_backend = True
    written_here = False
    made_here = False
    in_snapshot = True

    def record(self) -> ObjectInfo | None:
        return self.obj


class Namespace:
    """Immutable after :meth:`build`. Lookups by inode and by (parent inode, name)."""

    def __init__(self, nodes: list[Dir | File | None], total_bytes: int, mtime_ns: int, file_count: int,
                 dir_count: int):
        self._nodes = nodes
        self.total_bytes = total_bytes
        self.mtime_ns = mtime_ns
        self.file_count = file_count
        self.dir_count = dir_count
        self._by_path: dict[str, int] | None = None

    @classmethod
    def build(cls, objects: Iterable[ObjectInfo], mtime_ns: int = 0, previous: Namespace | None = None) -> Namespace:
        """The tree of a listing. With ``previous`` (the snapshot being replaced), a path that stays the
        same kind keeps its inode number and new paths get numbers never used before, so the kernel's
        cached inodes never come to mean another file."""
        files: dict[str, ObjectInfo] = {}
        dirs: set[str] = {""}
        markers: dict[str, ObjectInfo] = {}
        for obj in objects:
            if obj.key == "" and not obj.size:
                markers[""] = obj  # the root's marker
                continue
            reason = unsafe_reason(obj.key)
            if reason is None and obj.key.endswith("/") and obj.size:
                reason = "a directory marker with data"
            if reason:
                log.warning("skipping object %r: %s", obj.key, reason)
                continue
            path = obj.key.rstrip("/")
            parent = path.rpartition("/")[0]
            while parent not in dirs:  # its ancestors, up to the first one already known
                dirs.add(parent)
                parent = parent.rpartition("/")[0]
            if obj.key.endswith("/"):
                dirs.add(path)
                markers[path] = obj
            else:
                files[path] = obj
        for path in sorted(dirs.intersection(files)):
            log.warning("skipping object %r: it is also a directory prefix", files.pop(path).key)

        nodes: list[Dir | File | None] = [None]  # inode 0 is unused; the root is inode 1
        old = previous.by_path() if previous is not None else {}
        fresh = previous.max_inode + 1 if previous is not None else 2
        if not old:  # inodes 1.. in order
            nodes.extend([None] * (len(dirs) + len(files)))
        dir_of: dict[str, Dir] = {}
        for path in sorted(dirs | files.keys()):  # a parent sorts before its children
            obj = files.get(path)
            was = old.get(path)
            if path == "":
                inode = ROOT_INODE
            elif was is not None and isinstance(was, File if obj is not None else Dir):
                inode = was.inode
            else:
                inode, fresh = fresh, fresh + 1
            if inode >= len(nodes):
                nodes.extend([None] * (inode + 1 - len(nodes)))
            if obj is not None:
                nodes[inode] = File(inode, path, obj)
            else:
                nodes[inode] = dir_of[path] = Dir(inode, path, {}, [], markers.get(path))
            if path:
                parent_path, _, name = path.rpartition("/")
                dir_of[parent_path].children[name.encode("utf-8")] = inode
        for d in dir_of.values():
            d.names = sorted(d.children)
        total = sum(f.size for f in files.values())
        newest = max((f.mtime_ns for f in files.values()), default=mtime_ns)
        return cls(nodes, total, mtime_ns or newest, len(files), len(dir_of))

    @property
    def max_inode(self) -> int:
        return len(self._nodes) - 1

    def by_path(self) -> dict[str, Dir | File]:
        return {n.path: n for n in self._nodes if n is not None}

    def node(self, inode: int) -> Dir | File:
        if 0 < inode < len(self._nodes):
            node = self._nodes[inode]
            if node is not None:
                return node
        raise KeyError(inode)

    def lookup(self, parent: int, name: bytes) -> Dir | File | None:
        node = self.node(parent)
        if not isinstance(node, Dir):
            return None
        inode = node.children.get(name)
        return None if inode is None else self.node(inode)

    def resolve(self, path: str) -> Dir | File | None:
        """The node at ``path`` (relative to the root, '/'-separated), or None."""
        if self._by_path is None:
            self._by_path = {n.path: n.inode for n in self._nodes if n is not None}
        inode = self._by_path.get(path.strip("/"))
        return None if inode is None else self.node(inode)

    def files(self) -> Iterable[File]:
        return (n for n in self._nodes if isinstance(n, File))

    def __len__(self) -> int:
        return self.file_count + self.dir_count


def diff(old: Namespace, new: Namespace) -> tuple[list[tuple[int, bytes]], list[int]]:
    """What the kernel must forget when ``new`` replaces ``old``: directory entries (parent inode,
    name) that were added, removed or now name something else, and inodes whose attributes or data
    changed (their cached pages must go) or whose listing changed."""
    before, after = old.by_path(), new.by_path()
    entries: list[tuple[int, bytes]] = []
    inodes: set[int] = set()
    if before[""].info != after[""].info:  # type: ignore[union-attr]
        inodes.add(ROOT_INODE)
    for path in before.keys() | after.keys():
        if not path:
            continue
        o, n = before.get(path), after.get(path)
        if o is not None and n is not None and type(o) is type(n) and o.inode == n.inode and (
                o.info == n.info if isinstance(o, Dir) else o.obj == n.obj):  # type: ignore[union-attr]
            continue
        parent_path, _, name = path.rpartition("/")
        parent = after.get(parent_path) or before[parent_path]
        entries.append((parent.inode, name.encode("utf-8")))
        inodes.add(parent.inode)
        if o is not None:
            inodes.add(o.inode)
    return entries, sorted(inodes)
