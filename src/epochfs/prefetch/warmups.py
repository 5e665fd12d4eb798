"""A warmup's job (:meth:`epochfs.prefetch.scheduler.Prefetcher.warmup`): its progress, and what it left
cached when it ends: a warmup that reports everything done left everything cached."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import trio

from epochfs.cache.service import BlockCache
from epochfs.core.blocks import extent_blocks
from epochfs.core.records import ObjectInfo, stored_extent


@dataclass
class WarmupJob:
    id: int
    total_bytes: int
    files: int
    done_bytes: int = 0
    done_files: int = 0
    skipped_bytes: int = 0  # not cached: the cache is full
    failed_bytes: int = 0  # not cached: their fetch failed (``errors`` says why)
    evicted_bytes: int = 0  # warmed, then evicted again before the job ended (counted in done_bytes no more)
    errors: list[str] = field(default_factory=list)
    finished: bool = False
    cancelled: bool = False
    owner: int | None = None  # the uid that started it (None: the daemon's own)
    started: float = field(default_factory=time.monotonic)
    done: trio.Event = field(default_factory=trio.Event, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "total_bytes": self.total_bytes, "files": self.files, "done_bytes": self.done_bytes,
            "done_files": self.done_files, "skipped_bytes": self.skipped_bytes, "failed_bytes": self.failed_bytes,
            "evicted_bytes": self.evicted_bytes, "errors": self.errors[:20],
            "finished": self.finished, "cancelled": self.cancelled, "elapsed": time.monotonic() - self.started,
        }


async def left_cached(cache: BlockCache, job: WarmupJob, objs: list[ObjectInfo]) -> None:
    """What a finished warmup left cached: blocks it warmed that a later fetch evicted meanwhile (a
    handed-over order's prefetch, readers, another warmup, when the cache cannot hold them all) are
    no longer counted done but evicted, so a job that reports everything done left everything cached."""
    bs = cache.block_size
    missing = seen = 0
    for obj in objs:
        stored, base = stored_extent(obj)
        for index, _, size in extent_blocks(base, obj.size, stored.size, bs):
            seen += 1
            if seen % 256 == 0:
                await trio.lowlevel.checkpoint()
            bid = cache.block_id(stored, index)
            if cache.keeps(bid) and not cache.is_resident(bid):
                missing += size
    job.evicted_bytes = min(job.done_bytes, max(0, missing - job.skipped_bytes - job.failed_bytes))
    job.done_bytes -= job.evicted_bytes

