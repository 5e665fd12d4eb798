"""The FUSE kernel protocol spoken on ``/dev/fuse`` directly: :mod:`~epochfs.kernel.abi` (the
protocol's bytes, pure), :mod:`~epochfs.kernel.session` (a mount and its request loop),
:mod:`~epochfs.kernel.types` (what handlers take and return)."""

from epochfs.kernel.abi import NO_OPEN_SUPPORT, PASSTHROUGH
from epochfs.kernel.mounting import MountError
from epochfs.kernel.session import Session
from epochfs.kernel.types import (
    ENOATTR,
    ROOT_INODE,
    EntryAttributes,
    FileInfo,
    FUSEError,
    ReaddirToken,
    RequestContext,
    SetattrFields,
    StatvfsData,
    readdir_reply,
)

__all__ = ["ENOATTR", "NO_OPEN_SUPPORT", "PASSTHROUGH", "ROOT_INODE", "EntryAttributes", "FUSEError", "FileInfo", "MountError",
           "ReaddirToken",
           "RequestContext", "Session", "SetattrFields", "StatvfsData", "readdir_reply"]
