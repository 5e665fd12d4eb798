"""The adapter's seams to what the daemon gives it: the cached files the kernel reads itself and the
control file through the mount (each provided elsewhere, named here so the adapter imports neither);
and what it gives the pusher (:class:`KernelPages`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from epochfs.core.records import ObjectInfo

if TYPE_CHECKING:
    from epochfs.kernel import Session
    from epochfs.writeback.tree import Tree


class BackingFiles(Protocol):
    """What the adapter asks of the cached files the kernel reads itself (passthrough; the cache
    provides it: :class:`epochfs.cache.passthrough.Passthrough`)."""

    active: bool  # False once the kernel refused a backing file

    def open(self, inode: int, obj: ObjectInfo, fh: int) -> int:
        """The backing id to answer this open with, or 0: read it through the daemon. Raises
        :class:`~epochfs.cache.passthrough.BackingChanged` for an open that can be served neither way (EIO)."""
        ...

    def off(self, why: str) -> None: ...

    def release(self, fh: int) -> None: ...


class ControlFile(Protocol):
    """The control channel through the mount (:mod:`epochfs.control.inmount`): a file at the root named
    ``name`` whose ioctls of ``command`` it answers for the caller the kernel names."""

    name: bytes
    command: int

    async def call(self, uid: int, gid: int, pid: int, data: bytes) -> bytes: ...


class Mounted(Protocol):
    """What :class:`KernelPages` needs of the adapter (:class:`epochfs.vfs.fs.Operations`)."""

    session: Session | None
    tree: Tree


class KernelPages:
    """The page cache of the mount's files, for :class:`epochfs.cache.push.Pusher`."""

    def __init__(self, ops: Mounted) -> None:
        self.ops = ops

    def store(self, inode: int, offset: int, data: memoryview) -> None:
        assert self.ops.session is not None
        self.ops.session.notify_store(inode, offset, data)

    def current(self, inode: int, obj: ObjectInfo) -> bool:
        try:
            node = self.ops.tree.node(inode)
        except KeyError:
            return False
        return node.in_backend and node.obj == obj

    def forget(self, inode: int) -> None:
        assert self.ops.session is not None
        self.ops.session.invalidate_inode(inode)
