"""Where the cache's fetches get their bytes (:class:`BlockSource`): the backend itself
(:class:`BackendSource`), or the cluster tier (:class:`epochfs.peer.tier.PeerTier`: the block's owner,
falling back to the backend). A source may say a block is not kept here (another member owns it): such
a block is read through, never cached.

Each fetch says where its bytes came from (:data:`ORIGINS`): the backend, the block's first owner in the
cluster tier (a cache node, or a serving peer), or another replica of it (asked once the first failed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from epochfs.backend.base import Backend
from epochfs.core.records import ObjectInfo

#: Where a fetched block's bytes came from (``local``: a file this node wrote and uploaded, not yet
#: adopted as cached blocks: see :class:`epochfs.cache.own.OwnUploads`).
ORIGINS = ("backend", "owner", "replica", "local")


class BlockSource(Protocol):
    """Where fetches get their bytes (blocking; called from worker threads)."""

    def keeps(self, bid: bytes) -> bool:
        """Whether this node caches the block."""

    def read_block(self, obj: ObjectInfo, index: int, start: int, length: int, bid: bytes, *, direct: bool,
                   warm: bool, urgent: Callable[[], bool] | None = None) -> tuple[bytes | None, str]:
        """The block's bytes and where they came from (one of :data:`ORIGINS`). ``direct``: from the
        backend only (a cache node answering a member: from another cache node that holds it, too).
        ``warm``: a prefetch of a block not kept here: only make sure its owner has it (may return None).
        ``urgent``: whether a reader waits for the block now (a source that queues its requests serves
        those first)."""


class BackendSource:
    """Every block from the backend, every block kept."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def keeps(self, bid: bytes) -> bool:
        return True

    def read_block(self, obj: ObjectInfo, index: int, start: int, length: int, bid: bytes, *, direct: bool,
                   warm: bool, urgent: Callable[[], bool] | None = None) -> tuple[bytes | None, str]:
        return self.backend.read_range(obj.key, obj.etag, start, length), "backend"
