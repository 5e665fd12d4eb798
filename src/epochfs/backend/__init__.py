"""Backends: where the bytes come from. See :mod:`epochfs.backend.base` for the contract."""

from epochfs.backend.base import Backend, BackendStats
from epochfs.config import Config


def open_backend(config: Config) -> Backend:
    """The backend for ``config.source`` (the only place that chooses one)."""
    if config.source.scheme == "s3":
        from epochfs.backend.s3 import S3Backend

        return S3Backend(config)
    from epochfs.backend.local import LocalBackend

    return LocalBackend(config)


__all__ = ["Backend", "BackendStats", "open_backend"]
