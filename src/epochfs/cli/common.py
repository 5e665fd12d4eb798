"""What the command modules share: the epilog, byte formatting, paths relative to a mount."""

from __future__ import annotations

import os

from epochfs.errors import ConfigError

EPILOG = """\
Credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE,
~/.aws/credentials, instance roles); they are never taken on the command line.
"""


def human(n: float) -> str:
    """Bytes with a binary unit: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def mount_relative(mountpoint: str, path: str) -> str:
    """``path`` (absolute, or relative to the mount root) as a path relative to the mount root."""
    full = os.path.abspath(path if os.path.isabs(path) else os.path.join(mountpoint, path))
    rel = os.path.relpath(full, os.path.abspath(mountpoint))
    if rel.startswith(".."):
        raise ConfigError(f"{path} is not under {mountpoint}")
    return "" if rel == "." else rel
