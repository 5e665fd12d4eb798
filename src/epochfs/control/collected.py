"""Every component's statistics at one moment (:class:`Collected`): the composition root gathers them on
the trio thread; the metrics (:mod:`epochfs.daemon.metrics`) and ``epochfs status`` (:mod:`epochfs.control`)
render them. It stands above the components and below both renderers, so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epochfs.backend.base import BackendStats
    from epochfs.blockstore.store import StoreStats
    from epochfs.cache.accounting import CacheStats
    from epochfs.cache.nodeshare import NodeStats
    from epochfs.cache.passthrough import PassthroughStats
    from epochfs.cache.shared import SharedStats
    from epochfs.control.jobs import JobStats
    from epochfs.core.memory import MemorySplit
    from epochfs.links.capacity import LinkView
    from epochfs.meta.snapshots import SnapshotStats
    from epochfs.peer.tier import PeerStats
    from epochfs.prefetch.learned import LearnedStats
    from epochfs.prefetch.scheduler import PrefetchStats
    from epochfs.vfs.fs import FsStats
    from epochfs.writeback.owed import WritebackStats


@dataclass(frozen=True)
class Collected:
    """Every component's statistics, read at one moment on the trio thread (the composition root
    gathers them; the metrics and ``epochfs status`` render them)."""

    cache: CacheStats
    store: StoreStats
    backend: BackendStats
    fs: FsStats
    prefetch: PrefetchStats
    snapshot: SnapshotStats
    backend_link: LinkView | None = None  # the link to the backend: its capacity and where it is known from
    writeback: WritebackStats | None = None
    peer: PeerStats | None = None
    jobs: tuple[JobStats, ...] = ()
    passthrough: PassthroughStats | None = None
    peer_link: LinkView | None = None  # a serving member's own link (what it sends to the others)
    learned: LearnedStats | None = None  # the order learned on a plain mount (``prefetch/learned.py``)
    memory: MemorySplit | None = None  # the shares of --memory-limit
    resident_bytes: int = 0  # the daemon's resident set
    pool_bytes: int = 0  # idle receive buffers kept for reuse
    shared: SharedStats | None = None  # objects shared with the node's other mounts by content
    node_cache: NodeStats | None = None  # the node's capacity, split between its mounts
