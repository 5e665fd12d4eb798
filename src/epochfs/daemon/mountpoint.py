"""The mount point itself: whether it can take a mount, a dead FUSE mount (its daemon gone), and
detaching one. Light (no event loop): ``epochfs umount`` and the daemon both use it."""

from __future__ import annotations

import errno
import logging
import os
import subprocess

from epochfs.core.errors import ConfigError

log = logging.getLogger("epochfs.daemon.mount")


def is_dead_mount(path: str) -> bool:
    try:
        os.listdir(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def lazy_unmount(path: str) -> None:
    subprocess.run(["fusermount3", "-uz", path], check=False, capture_output=True)


def check_mountpoint(path: str, allow_non_empty: bool = False) -> None:
    if is_dead_mount(path):
        log.warning("%s holds a dead FUSE mount (a daemon died); clearing it", path)
        lazy_unmount(path)
    if not os.path.isdir(path):
        raise ConfigError(f"mount point {path} does not exist or is not a directory")
    if os.path.ismount(path):
        raise ConfigError(f"{path} is already a mount point")
    if not allow_non_empty:
        try:
            entries = len(os.listdir(path))
        except OSError as exc:
            raise ConfigError(f"mount point {path}: {exc.strerror}") from None
        if entries:
            raise ConfigError(f"mount point {path} is not empty ({entries} entries): the mount would hide them; "
                              "use an empty directory, or --allow-non-empty")
