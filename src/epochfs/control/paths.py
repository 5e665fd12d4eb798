"""Where a daemon's control socket is: in its cache directory, or, when that path is too long for a Unix
socket, in a private runtime directory under a name derived from it. The daemon makes the directory; a
tool only looks (:func:`socket_path` with ``create=False``)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from epochfs.core.private import private_dir

_SUN_PATH_MAX = 107


def _runtime_base() -> Path:
    if os.geteuid() == 0:
        return Path("/run/epochfs")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "epochfs" if xdg else Path.home() / ".cache" / "epochfs" / "run"


def runtime_dir() -> Path:
    """A private directory for sockets whose natural path is too long: ``/run/epochfs`` for root,
    ``$XDG_RUNTIME_DIR/epochfs`` (or ``~/.cache/epochfs/run``) otherwise; never a shared ``/tmp`` path."""
    return private_dir(_runtime_base())


def socket_path(cache_dir: Path, *, create: bool = True) -> Path:
    """``<cache-dir>/control.sock``, or a short path in :func:`runtime_dir` when that is too long
    (``create``: make that directory, checked private, if it is missing)."""
    path = Path(cache_dir).resolve() / "control.sock"
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        return path
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    return (runtime_dir() if create else _runtime_base()) / f"{digest}.sock"
