"""Text from outside (object keys, a peer's or a store's words) made safe for a log line or a terminal;
byte counts written for people (:func:`human`).

A key may hold any character S3 allows; printed raw, a newline forges a log record, and C1 controls
(U+0080..U+009F: ``U+009B`` is a terminal's CSI), line and paragraph separators and bidirectional
overrides rewrite what an operator sees. :func:`printable` writes each of them as an escape
(``\\x1b``, ``\\u2028``) and leaves everything else as it is.
"""

from __future__ import annotations

import logging
import re

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    """``text`` with every control, separator and direction-changing character escaped."""
    return _UNSAFE.sub(_escape, text) if _UNSAFE.search(text) else text


class SafeFormatter(logging.Formatter):
    """A log formatter whose records are one line each, whatever their message holds (a traceback
    keeps its own lines: it is ours, not input)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return printable(super().formatMessage(record))


def human(n: float) -> str:
    """Bytes with a binary unit: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 block``, ``2 blocks``: a count with its noun."""
    return f"{n} {one if n == 1 else many or one + 's'}"
