"""Domain errors and the one mapping from them to errno values.

Components raise these; ``vfs/fs.py`` turns them into ``FUSEError`` through
:func:`errno_for` and nowhere else.
"""

from __future__ import annotations

import errno
from typing import Any


class EpochfsError(Exception):
    """Base class of every error epochfs raises on purpose."""


class ConfigError(EpochfsError):
    """A setting is missing, malformed or contradictory (reported to the user, exit code 2)."""


class BackendError(EpochfsError):
    """The backend failed permanently for this request (after its own retries)."""


class BackendUnavailable(BackendError):
    """Retries were exhausted or the overall deadline passed: the backend cannot be reached."""


class ObjectChanged(BackendError):
    """The object no longer matches the snapshot (ETag mismatch, deleted or resized).

    Serving it would mix versions; the reader gets ESTALE.
    """


class KeyRefused(BackendError):
    """The backend will not store an object under the key asked for (too long, a name it changes):
    retrying cannot help."""


class AccessDenied(BackendError):
    """The backend refused the credentials for this object. ``policy``: the credentials are valid and a
    policy refuses this request (another request may be allowed); otherwise they are not valid at all."""

    def __init__(self, message: str, *, policy: bool = False) -> None:
        super().__init__(message)
        self.policy = policy


class NotFound(EpochfsError):
    """A name or inode that the snapshot does not contain."""


class UploadCancelled(BackendError):
    """An upload stopped because its file changed meanwhile (write-back); nothing was left behind."""


class NoSpace(EpochfsError):
    """Written data not yet uploaded would not fit in the cache (ENOSPC): it is never evicted."""


class NotDurable(EpochfsError):
    """What was written through a --writeback mount is not all in the backend (``Client.sync``). ``reply``:
    the daemon's answer (``pending``: key, bytes and state of each file still owed, the first thousand;
    ``pending_total``); ``message``: why, without the list."""

    def __init__(self, message: str, reply: dict[str, Any]) -> None:
        pending = reply.get("pending") or []
        super().__init__(message + ": " + ", ".join(f"{x.get('key')} ({x.get('state')})" for x in pending[:5])
                         + (", ..." if int(reply.get("pending_total") or 0) > 5 else ""))
        self.message = message
        self.reply = reply


class NotPermitted(EpochfsError):
    """A control request its caller may not make: another user's order, warmup, job or files, a share
    over its bound, or what needs an operator. Refused with nothing changed (the CLI exits 1)."""


class Refused(EpochfsError):
    """An operation the mount does not do on this entry; ``errno`` says which (EROFS, EEXIST, ENOTEMPTY,
    EXDEV, EISDIR, ENOTDIR, EOPNOTSUPP, EPERM)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Answered(EpochfsError):
    """An answer the kernel expects, not a failure: no such attribute, not a directory, an opcode this
    mount does not take (ENOSYS: "do not send it again"). Answered with ``code`` and counted nowhere."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or errno.errorcode.get(code, str(code)))
        self.code = code


class CacheUnreadable(EpochfsError):
    """A cached block could not be read (out of descriptors or memory, a disk error). Not evidence of
    damage: the block is kept, the reader gets EIO."""


_ERRNO: tuple[tuple[type[BaseException], int], ...] = (
    (NotFound, errno.ENOENT),
    (NoSpace, errno.ENOSPC),
    (ObjectChanged, errno.ESTALE),
    (AccessDenied, errno.EACCES),
    (NotPermitted, errno.EACCES),
    (BackendError, errno.EIO),
    (EpochfsError, errno.EIO),
)


def errno_for(exc: BaseException) -> int:
    """The errno a reader sees for ``exc``; anything unexpected is EIO."""
    if isinstance(exc, (Refused, Answered)):
        return exc.code
    for cls, code in _ERRNO:
        if isinstance(exc, cls):
            return code
    return errno.EIO


def error_inside(exc: BaseException) -> EpochfsError | None:
    """The EpochfsError inside ``exc`` (trio wraps errors of nursery children in exception groups)."""
    if isinstance(exc, EpochfsError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = error_inside(inner)
            if found is not None:
                return found
    return None
