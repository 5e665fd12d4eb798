"""How a mount presents its entries' modes and owners to the kernel (which checks permissions against
them: ``default_permissions``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from epochfs.core.records import ObjectInfo


@dataclass(frozen=True)
class Presentation:
    """How entries are presented: the source's permission bits and owners where it has them (a
    ``file://`` source), the kernel then enforcing them (``default_permissions``); uniform
    ``file_mode``/``dir_mode``/``uid``/``gid`` where it has none (S3) or where they are given.
    Set-id bits are never presented; the sticky bit only on directories. A write-back mount presents
    objects without modes as 0644 and directories as 0755 (writable by their owner), otherwise 0444
    and 0555; there an entry's own mode and owner (what its writer made, or set with chmod and chown)
    win over the uniform ones, so a file written private stays private. ``root_mode``: the mount root's
    mode where it has none of its own and ``dir_mode`` is not given (a write-back mount several users
    share presents it 1777: each may make a directory of their own in it, none may remove another's)."""

    writable: bool = False
    file_mode: int | None = None
    dir_mode: int | None = None
    root_mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    default_uid: int = field(default_factory=os.getuid)
    default_gid: int = field(default_factory=os.getgid)

    def mode(self, info: ObjectInfo | None, forced: int | None, default: int, *, directory: bool = False) -> int:
        bits = 0o1777 if directory else 0o777
        if info is not None and info.mode is not None and (forced is None or self.writable):
            return info.mode & bits
        return forced & bits if forced is not None else default

    def owner(self, own: int | None, forced: int | None, default: int) -> int:
        if own is not None and (forced is None or self.writable):
            return own
        return forced if forced is not None else default
