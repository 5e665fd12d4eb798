"""What the block cache service (:mod:`epochfs.cache.service`) is given and gives: its settings, the
observer it tells where readers are, and one block fetch in flight (its statistics: :mod:`.accounting`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import trio

from epochfs.core.errors import EpochfsError
from epochfs.core.memory import MemorySplit
from epochfs.core.records import ObjectInfo


@dataclass(frozen=True)
class CacheSettings:
    """What the block cache service needs of the mount's options."""

    block_size: int
    concurrency: int  # backend fetches at once, demand and readahead each
    readahead_blocks: int  # blocks fetched ahead of a sequential reader
    plan_concurrency: int = 0  # fetches of the prefetch plan and warmups at once (0: ``concurrency``)
    fetch_timeout: float = 60.0  # a fill gives up after this long, whatever its thread is doing
    memory: MemorySplit | None = None  # the shares of --memory-limit (None: unbounded)


class Kept:
    """A block kept in memory for its readers' next requests (:attr:`BlockCache._recent`): its bytes,
    whether reading them counts as a hit, whether the store has it too (then it leaves memory once its
    readers were given all of it: later reads go to the verified block file), and how many bytes of it
    they were given. Counting bytes, not watching for the last one: the kernel sends a sequential
    reader's readahead requests concurrently, and the one that ends the block may be answered before
    one in its middle, which would otherwise find the block gone from memory."""

    __slots__ = ("data", "hit", "stored", "served")

    def __init__(self, data: bytes | memoryview, hit: bool, stored: bool, served: int = 0) -> None:
        self.data = data
        self.hit = hit
        self.stored = stored
        self.served = served


class ReadObserver(Protocol):
    """Told where the reader is (the prefetcher follows it)."""

    def opened(self, obj: ObjectInfo, reader: tuple[int, int] | None = None) -> None: ...

    def touched(self, obj: ObjectInfo, index: int, reader: tuple[int, int] | None = None) -> None: ...


class Fetch:
    """One block being fetched (single flight: every reader of the block waits on the same one)."""

    __slots__ = ("event", "data", "error", "demand", "direct", "warm", "near", "from_peer", "served", "waited",
                 "budget")

    def __init__(self, demand: bool, direct: bool = False, warm: bool = False, near: bool = True) -> None:
        self.event = trio.Event()
        self.data: bytes | None = None
        self.error: EpochfsError | None = None
        self.demand = demand
        self.direct = direct  # for a peer: from the backend, never another peer
        self.warm = warm  # a prefetch that only warms the block's owner: no bytes for readers
        self.near = near  # a reader is at or right behind this block: keep it in memory, write it around
        self.from_peer = False
        self.served = 0  # bytes of it the readers were given (once all were, the readers have moved on)
        self.waited = demand  # a reader waits for it (a prefetch a reader caught up with): its request goes first
        self.budget: float | None = None  # its deadline, where shorter than the service's (a failed read's retry)

    def urgent(self) -> bool:
        """Whether a reader waits for this block now (read from the fetch's worker thread)."""
        return self.waited

    async def wait(self) -> EpochfsError | None:
        """Wait for the fetch; its error, or None when the bytes arrived."""
        await self.event.wait()
        return self.error
