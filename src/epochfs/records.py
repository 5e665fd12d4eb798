"""Records that cross component boundaries, and the limits every boundary checks them against.

An :class:`ObjectInfo` is one object of the dataset as listed: the backends produce it, the metadata
stores keep it, the namespace, the cache and the prefetcher read it. It lives here, not in any of those
packages, so none of them imports another for it.
"""

from __future__ import annotations

from typing import NamedTuple

#: Largest object accepted from a listing or a stored snapshot (64 TiB, above any object store's limit).
#: Anything larger is malformed input: block arithmetic over it would not finish.
MAX_OBJECT_SIZE = 1 << 46
#: Longest key (bytes) and ETag accepted from a stored snapshot.
MAX_KEY_BYTES = 4096
MAX_ETAG_BYTES = 1024


class ObjectInfo(NamedTuple):
    """One object of the dataset: key relative to the source root, size, mtime and version tag.

    ``mode``, ``uid`` and ``gid`` are the source's permission bits (``0o7777`` at most) and owner, where
    the source has them (a ``file://`` directory); None where it has not (S3), and the mount then
    presents its uniform defaults. Immutable; a tuple, because a snapshot holds millions of them and a
    tuple is built in a fraction of a frozen dataclass's time.
    """

    key: str
    size: int
    mtime_ns: int
    etag: str
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
