"""Backends: where the bytes come from. See :mod:`epochfs.backend.base` for the contract."""

from epochfs.backend.base import Backend, BackendSettings, BackendStats


def open_backend(settings: BackendSettings) -> Backend:
    """The backend for ``settings.source`` (the only place that chooses one)."""
    if settings.source.scheme == "s3":
        from epochfs.backend.s3 import S3Backend

        return S3Backend(settings)
    from epochfs.backend.local import LocalBackend

    return LocalBackend(settings)


__all__ = ["Backend", "BackendSettings", "BackendStats", "open_backend"]
