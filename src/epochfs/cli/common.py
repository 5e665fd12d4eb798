"""What the command modules share: the epilog and byte formatting."""

from __future__ import annotations

from epochfs.core.text import human

__all__ = ["EPILOG", "human"]

EPILOG = """\
Credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE,
~/.aws/credentials, instance roles); they are never taken on the command line.
"""
