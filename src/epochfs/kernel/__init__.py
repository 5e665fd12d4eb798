"""The FUSE kernel protocol spoken on ``/dev/fuse`` directly: :mod:`~epochfs.kernel.abi` (the
protocol's bytes, pure), :mod:`~epochfs.kernel.mounting` (mount(2), fusermount3),
:mod:`~epochfs.kernel.session` (INIT and the request loop), :mod:`~epochfs.kernel.translate` (a row
per request: its call and reply), :mod:`~epochfs.kernel.operations` (the typed handlers' interface),
:mod:`~epochfs.kernel.types` (what handlers take and return).

:class:`Session` is loaded when first asked for (it brings the event loop): the protocol's constants
(the root's inode number, say) cost a tool nothing to import."""

from typing import Any

from epochfs.kernel.abi import NO_OPEN_SUPPORT, PASSTHROUGH, ROOT_INODE
from epochfs.kernel.mounting import MountError
from epochfs.kernel.operations import Operations
from epochfs.kernel.types import (
    ENOATTR,
    EntryAttributes,
    FileInfo,
    FUSEError,
    ReaddirToken,
    RequestContext,
    SetattrFields,
    StatvfsData,
    readdir_reply,
)

__all__ = ["ENOATTR", "NO_OPEN_SUPPORT", "PASSTHROUGH", "ROOT_INODE", "EntryAttributes", "FUSEError", "FileInfo",
           "MountError", "Operations", "ReaddirToken", "RequestContext", "Session", "SetattrFields", "StatvfsData",
           "readdir_reply"]


def __getattr__(name: str) -> Any:
    if name == "Session":
        from epochfs.kernel.session import Session

        return Session
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
