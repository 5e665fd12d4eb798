"""The tree a write-back mount shows: the snapshot's namespace with the node's own changes on top. Pure.

The snapshot (:class:`~epochfs.meta.namespace.Namespace`) is immutable; the :class:`Overlay` holds what
this node changed since: directories made here (:class:`LocalDir`), files written here and not yet
uploaded (:class:`LocalFile`), files uploaded but not yet in a snapshot (:class:`Stored`), and the
snapshot paths hidden by an unlink or a rename. :class:`Tree` answers lookups, listings and paths over
both. An entry that replaces a snapshot file keeps its inode number (the kernel opens a file it has
just truncated by that number); new entries have numbers of their own (from ``1 << 48``), so they
never meet the snapshot's.

Paths are relative to the source root, ``/``-separated, as in the namespace.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from epochfs.core.records import ObjectInfo
from epochfs.meta.entries import name_cookie
from epochfs.meta.namespace import Namespace
from epochfs.meta.nodes import KINDS

OVERLAY_INODES = 1 << 48


@dataclass(slots=True)
class LocalDir:
    """A directory made on this node: its creator's mode and owner, or None for one made implicitly
    (the parent of a file whose directory the snapshot does not have yet), presented as the mount's
    default."""

    inode: int
    path: str
    mtime_ns: int
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None

    is_dir, in_backend, written_here, made_here, in_snapshot = KINDS["local dir"]

    def record(self) -> ObjectInfo | None:
        return ObjectInfo(self.path, 0, self.mtime_ns, "", self.mode, self.uid, self.gid)


@dataclass(slots=True)
class LocalFile:
    """A file written on this node: its bytes are in the data file ``id`` until uploaded."""

    inode: int
    path: str
    id: str
    size: int
    mtime_ns: int
    mode: int
    uid: int
    gid: int
    writers: int = 0  # open handles that may write
    generation: int = 0  # bumped by every change: an upload of an older generation is stale
    since: float = 0.0  # when it was last closed (its bytes pending since then)
    uploading: bool = False
    closed: bool = False  # as the journal has it: its last writable handle released since its last change
    failed: str = ""  # why a write of it failed: never uploaded as it is

    is_dir, in_backend, written_here, made_here, in_snapshot = KINDS["local file"]

    def record(self) -> ObjectInfo | None:
        return ObjectInfo(self.path, self.size, self.mtime_ns, "", self.mode, self.uid, self.gid)


@dataclass(slots=True)
class Stored:
    """Uploaded from this node, not yet in the snapshot being served."""

    inode: int
    path: str
    obj: ObjectInfo

    is_dir, in_backend, written_here, made_here, in_snapshot = KINDS["stored"]

    def record(self) -> ObjectInfo | None:
        return self.obj


Entry = LocalDir | LocalFile | Stored


class Node(Protocol):
    """What every entry of the tree can say of itself, so the write path and the FUSE adapter ask it
    instead of testing its class: the snapshot's :class:`~epochfs.meta.nodes.Dir` and
    :class:`~epochfs.meta.nodes.File`, and the overlay's :class:`LocalDir`, :class:`LocalFile`
    and :class:`Stored`."""

    inode: int
    path: str
    # (what each means, and each kind's: :class:`epochfs.meta.nodes.Flags` and ``KINDS``)
    is_dir: ClassVar[bool]
    in_backend: ClassVar[bool]
    written_here: ClassVar[bool]
    made_here: ClassVar[bool]
    in_snapshot: ClassVar[bool]

    def record(self) -> ObjectInfo | None:
        """What the mount presents of it: size, mtime, mode and owner (None where the source gives
        none: the mount's defaults)."""
        ...


def parent_of(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent, name


@dataclass
class Overlay:
    entries: dict[str, Entry] = field(default_factory=dict)
    hidden: set[str] = field(default_factory=set)  # snapshot paths unlinked or renamed away
    by_inode: dict[int, Entry] = field(default_factory=dict)
    children: dict[str, set[str]] = field(default_factory=dict)  # dir path -> names of entries here
    _inodes: Iterator[int] = field(default_factory=lambda: itertools.count(OVERLAY_INODES))

    def new_inode(self) -> int:
        return next(self._inodes)

    def put(self, entry: Entry) -> None:
        old = self.entries.get(entry.path)
        if old is not None:
            self.by_inode.pop(old.inode, None)
        self.entries[entry.path] = entry
        self.by_inode[entry.inode] = entry
        parent, name = parent_of(entry.path)
        self.children.setdefault(parent, set()).add(name)

    def remove(self, path: str) -> Entry | None:
        entry = self.entries.pop(path, None)
        if entry is not None:
            self.by_inode.pop(entry.inode, None)
            parent, name = parent_of(path)
            names = self.children.get(parent)
            if names is not None:
                names.discard(name)
                if not names:
                    del self.children[parent]
        return entry

    def __bool__(self) -> bool:
        return bool(self.entries or self.hidden)


class Tree:
    """Lookups over the snapshot with the overlay on top."""

    def __init__(self, namespace: Namespace, overlay: Overlay | None = None) -> None:
        self.namespace = namespace
        self.overlay = overlay

    def node(self, inode: int) -> Node:
        o = self.overlay
        if o is not None:
            entry = o.by_inode.get(inode)
            if entry is not None:
                return entry
            if inode >= OVERLAY_INODES:
                raise KeyError(inode)
        node = self.namespace.node(inode)
        if o is not None and (node.path in o.hidden or node.path in o.entries):
            raise KeyError(inode)  # replaced or removed here
        return node

    def resolve(self, path: str) -> Node | None:
        path = path.strip("/")
        o = self.overlay
        if o is not None:
            entry = o.entries.get(path)
            if entry is not None:
                return entry
            if path in o.hidden:
                return None
        return self.namespace.resolve(path)

    def lookup(self, parent: Node, name: bytes) -> Node | None:
        if not parent.is_dir:
            return None
        o = self.overlay
        if o is None or parent.in_snapshot and parent.path not in o.children and not o.hidden:
            return self.namespace.lookup(parent.inode, name) if parent.in_snapshot else None
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return self.resolve(f"{parent.path}/{text}" if parent.path else text)

    def entries(self, parent: Node, after: int = 0) -> Iterator[tuple[int, bytes, Node]]:
        """The entries of a directory whose cookie is above ``after``, in cookie order
        (:func:`~epochfs.meta.namespace.name_cookie`), with their cookies: the snapshot's directory at
        that path (a directory made here may have been published since) with the overlay's entries
        merged in. Each step costs the entries it yields (and the snapshot's entries this node hid)."""
        o = self.overlay
        snap = parent if parent.in_snapshot else self.namespace.resolve(parent.path)
        base: Iterator[tuple[int, bytes, Node]] = iter(())
        if snap is not None and snap.is_dir:
            base = self.namespace.entries_after(snap.inode, after)
        if o is None or (parent.in_snapshot and parent.path not in o.children and not o.hidden):
            yield from base
            return
        prefix = parent.path + "/" if parent.path else ""
        local = []
        for text in o.children.get(parent.path, ()):
            name = text.encode("utf-8")
            cookie = name_cookie(name)
            if cookie > after:
                local.append((cookie, name, o.entries[prefix + text]))
        local.sort(key=lambda e: e[:2])
        kept = ((c, n, node) for c, n, node in base if node.path not in o.hidden and node.path not in o.entries)
        yield from heapq.merge(kept, local, key=lambda e: e[:2])

    def is_empty_dir(self, node: Node) -> bool:
        return next(self.entries(node), None) is None
