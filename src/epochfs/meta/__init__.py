"""Namespace snapshots: the rules and views of the tree (:mod:`.namespace`), the node's index of it
(:mod:`.index`), and the stores that keep them (:mod:`.base` for the contract; :mod:`.lmdb` embedded,
:mod:`.redis` shared). Schema: ``docs/metadata-store.md``."""

from __future__ import annotations

from pathlib import Path

from epochfs.core.errors import ConfigError
from epochfs.meta.base import SHARED_FORMS, MetaStore, Snapshot, StoreAccess, is_shared


def open_meta(url: str | None, cache_dir: Path, name: str | None = None,
              access: StoreAccess | None = None) -> MetaStore:
    """The store for ``url``: ``lmdb://PATH``, ``redis[s]://[USER@]HOST:PORT/DB`` or
    ``redis[s]+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``; None = LMDB in the cache dir.
    ``access``: a shared store's password and certificates."""
    if url is None:
        from epochfs.meta.lmdb import LmdbMetaStore

        return LmdbMetaStore(cache_dir / "meta")
    if url.startswith("lmdb://"):
        from epochfs.meta.lmdb import LmdbMetaStore

        return LmdbMetaStore(Path(url[len("lmdb://"):]))
    if is_shared(url):
        from epochfs.meta.redis import RedisMetaStore

        return RedisMetaStore(url, name, access or StoreAccess())
    raise ConfigError(f"--meta {url!r}: expected lmdb://PATH, {SHARED_FORMS}")


__all__ = ["MetaStore", "Snapshot", "StoreAccess", "open_meta"]
