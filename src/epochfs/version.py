"""The version of epochfs (what ``epochfs --version`` and ``status`` say)."""

__version__ = "0.1.0"
