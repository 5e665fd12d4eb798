"""Private directories and files: the cache directory and everything the daemon creates in it, the log,
the control socket's directory.

The daemon runs as root on a shared node, so a directory it writes into must not be one another local
user prepared: a planted symlink would make root write where that user chose, a pre-created directory
would let that user read cached data. Every such path is checked where it is opened:

- a private directory is owned by the daemon's user, is not a symlink, and is writable by nobody else
  (directories we create are 0700; group/other read bits on one we own are removed);
- every ancestor of it is owned by root or the daemon's user and is writable by nobody else, unless it
  is sticky (``/tmp``), where others cannot rename or remove what we own;
- files are opened with ``O_NOFOLLOW`` and created 0600; an existing file must be a regular file owned
  by the daemon's user with no other link to it.

Violations raise :class:`~epochfs.core.errors.ConfigError` naming the path and what is wrong; nothing is
changed then. See docs/security.md.
"""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import stat
from pathlib import Path

from epochfs.core.errors import ConfigError

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


def _owner_ok(st: os.stat_result, allow_root: bool) -> bool:
    return st.st_uid == os.geteuid() or (allow_root and st.st_uid == 0)


def _check_ancestors(path: Path) -> None:
    """Every directory above ``path`` must be owned by root or us and not writable by others
    (unless sticky)."""
    for parent in reversed(path.parents):
        st = os.stat(parent)
        if not _owner_ok(st, allow_root=True):
            raise ConfigError(f"{path}: its parent {parent} belongs to uid {st.st_uid}, who could replace it; "
                              "use a directory whose parents belong to root or to this user")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(f"{path}: its parent {parent} is writable by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}), who could replace it")


def _checked_dir(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"{path} is a symbolic link; a private directory must be a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} exists and is not a directory")
    if not _owner_ok(st, allow_root=False):
        raise ConfigError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
                          "refusing to keep private data in it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        if st.st_mode & 0o022:
            raise ConfigError(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"make it private: chmod 700 {path}")
        os.chmod(path, DIR_MODE, follow_symlinks=False)
        log.info("made %s private (mode 0700)", path)


def private_dir(path: Path | str, *, check_parents: bool = True) -> Path:
    """Create ``path`` (and missing parents) mode 0700, or check an existing one; return it absolute."""
    path = Path(os.path.abspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    try:
        if st is None:
            if not path.parent.exists():
                private_dir(path.parent, check_parents=check_parents)
            os.mkdir(path, DIR_MODE)
            st = os.lstat(path)
        real = Path(os.path.realpath(path.parent)) / path.name
        if check_parents:
            _check_ancestors(real)
    except ConfigError:
        raise
    except FileExistsError:
        return private_dir(path, check_parents=check_parents)  # created meanwhile: check it
    except OSError as exc:
        raise ConfigError(f"cannot create directory {path}: {exc.strerror}") from None
    _checked_dir(path, st)
    return path


def private_subdir(parent: Path, name: str) -> Path:
    """``parent/name`` as a private directory; ``parent`` has been checked already."""
    return private_dir(parent / name, check_parents=False)


def open_private(path: Path | str, flags: int = os.O_RDONLY) -> int:
    """Open a file in a private directory without following a symlink; create it 0600 if ``flags`` say
    so. The file must be a regular file owned by this user with one link. Returns the descriptor."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symbolic link; refusing to open it") from None
        raise ConfigError(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path} is not a regular file")
        if not _owner_ok(st, allow_root=False) or st.st_nlink > 1:
            raise ConfigError(f"{path} belongs to uid {st.st_uid} or has other links; refusing to use it")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, FILE_MODE)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def touch_private(path: Path) -> None:
    os.close(open_private(path, os.O_WRONLY | os.O_CREAT))


class PrivateLogFile(logging.handlers.RotatingFileHandler):
    """A rotating log file opened through :func:`open_private` (no symlink, mode 0600)."""

    def _open(self):  # type: ignore[no-untyped-def]
        fd = open_private(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


def read_secret(path: Path | str, option: str, *, low: int = 1, high: int = 4096) -> bytes:
    """The secret in ``path`` (stripped of surrounding white space, ``low`` to ``high`` bytes): a regular
    file of this user that nobody else can read, opened without following a symlink and without
    blocking (a FIFO there is refused, not waited on). ``option`` names it in errors."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{option} {path} is not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"{option} {path} must belong to this user and be readable by nobody else "
                              f"(chmod 600): it is mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}")
        raw = os.read(fd, high + 4097)
    finally:
        os.close(fd)
    secret = raw.strip()
    if not low <= len(secret) <= high:
        raise ConfigError(f"{option} {path}: the secret must be {low} to {high} bytes")
    return secret
