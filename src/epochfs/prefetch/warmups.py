"""A warmup's job (:meth:`epochfs.prefetch.scheduler.Prefetcher.warmup`): its progress, and what it left
cached when it ends (a warmup that reports everything done left everything cached), how much of a set of
files is cached, and what each user's warmups that ended filled (its --user-share counts them a while)."""

from __future__ import annotations

import time
from collections.abc import Sequence
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


async def resident(cache: BlockCache, objs: Sequence[ObjectInfo]) -> dict[str, int]:
    """How much of ``objs`` is cached (yielding to the loop as it goes)."""
    bs = cache.block_size
    total = held = files = seen = 0
    for obj in objs:
        whole = True
        stored, base = stored_extent(obj)
        for index, _, size in extent_blocks(base, obj.size, stored.size, bs):
            seen += 1
            if seen % 256 == 0:
                await trio.lowlevel.checkpoint()
            total += size
            if cache.is_resident(cache.block_id(stored, index)):
                held += size
            else:
                whole = False
        files += whole
    return {"total_bytes": total, "resident_bytes": held, "files": len(objs), "resident_files": files}


class WarmupShare:
    """What each user's warmups that ended filled, kept ``window`` seconds: ``--user-share`` bounds
    those too, so warmups one after the other cannot cycle the cache (trio thread)."""

    def __init__(self, window: float = 600.0) -> None:
        self.window = window
        self._ended: dict[int | None, list[tuple[float, int]]] = {}  # uid -> (when it ended, bytes filled)

    def ended(self, uid: int | None, nbytes: int) -> None:
        if uid is not None and nbytes:
            self._ended.setdefault(uid, []).append((time.monotonic(), nbytes))

    def _live(self, uid: int | None) -> list[tuple[float, int]]:
        now = time.monotonic()
        live = [(t, n) for t, n in self._ended.get(uid, []) if now - t < self.window]
        if live:
            self._ended[uid] = live
        else:
            self._ended.pop(uid, None)
        return live

    def held(self, uid: int | None) -> int:
        return sum(n for _, n in self._live(uid))

    def frees_in(self, uid: int | None, need: int) -> float | None:
        """Seconds until ``need`` bytes of ``uid``'s ended warmups leave the window (None: they cannot)."""
        freed, now = 0, time.monotonic()
        for t, n in self._live(uid):
            freed += n
            if freed >= need:
                return max(0.0, self.window - (now - t))
        return None
