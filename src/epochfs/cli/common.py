"""What the command modules share: the epilog and byte formatting."""

from __future__ import annotations

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
