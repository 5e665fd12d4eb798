"""What a node of the mount's tree is: the flags every kind of node answers (declared once, in
:data:`KINDS`), and the snapshot's own nodes, :class:`Dir` and :class:`File` (the write-back overlay's are
in :mod:`epochfs.writeback.tree`)."""

from __future__ import annotations

from typing import NamedTuple

from epochfs.core.records import ObjectInfo


class Flags(NamedTuple):
    is_dir: bool  # a directory: listed, never read
    in_backend: bool  # an object of the backend (``obj``): read through the cache, replaced, not changed
    written_here: bool  # a file whose bytes are on this node's disk, not yet uploaded
    made_here: bool  # made on this node and known only here (a LocalDir or a LocalFile)
    in_snapshot: bool  # a node of the snapshot being served, not of this node's overlay


#: Every kind of node, and what it is.
KINDS = {
    "snapshot dir": Flags(is_dir=True, in_backend=False, written_here=False, made_here=False, in_snapshot=True),
    "snapshot file": Flags(is_dir=False, in_backend=True, written_here=False, made_here=False, in_snapshot=True),
    "local dir": Flags(is_dir=True, in_backend=False, written_here=False, made_here=True, in_snapshot=False),
    "local file": Flags(is_dir=False, in_backend=False, written_here=True, made_here=True, in_snapshot=False),
    "stored": Flags(is_dir=False, in_backend=True, written_here=False, made_here=False, in_snapshot=False),
}


class Dir(NamedTuple):
    """A directory of the snapshot (what a node can do: :class:`epochfs.writeback.tree.Node`)."""

    inode: int
    path: str
    info: ObjectInfo | None = None  # its marker, if the listing had one

    is_dir, in_backend, written_here, made_here, in_snapshot = KINDS["snapshot dir"]

    def record(self) -> ObjectInfo | None:
        return self.info


class File(NamedTuple):  # immutable; a tuple builds in a fraction of a frozen dataclass's time
    """An object of the snapshot."""

    inode: int
    path: str
    obj: ObjectInfo

    is_dir, in_backend, written_here, made_here, in_snapshot = KINDS["snapshot file"]

    def record(self) -> ObjectInfo | None:
        return self.obj
