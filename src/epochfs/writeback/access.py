"""Who may write a name where, on a write-back mount several users share (beyond the modes the kernel
checks, ``default_permissions``). Pure.

The owner of a directory can remove or rename any name in it, whatever its sticky bit (which keeps
other users from each other's files, not from the directory's owner). So what one user writes in a
directory another user owns (a checkpoint's files, DCP's ``.metadata``, a pickle ``dcp.load`` runs)
could be replaced under them with what that user chose, and the swapped file is what uploads. A
user therefore writes (makes a file, opens one for writing, makes a directory, renames into) only in
a directory of their own, root's or the mount's (its daemon's user): in another user's it is EACCES,
and a path squatted by another user fails the write loudly instead of holding it.
"""

from __future__ import annotations

import errno

from epochfs.core.errors import Refused


def writes_in(owner: int, uid: int, mount_uid: int, where: str) -> None:
    """Let ``uid`` write a name in the directory ``where`` owned by ``owner`` (the mount's own user is
    ``mount_uid``), or :class:`Refused` (EACCES) saying why not."""
    if uid in (0, mount_uid) or owner in (uid, 0, mount_uid):
        return
    raise Refused(f"{where or 'the mount root'} is uid {owner}'s directory: uid {uid} does not write in another "
                  "user's directory (its owner could replace what is written there); write in a directory of "
                  "your own", errno.EACCES)
