"""Fill once: never evicts; once the cache is full, new blocks are read through."""

from __future__ import annotations

from epochfs.eviction import register
from epochfs.eviction.lru import LruPolicy


@register("none", "fill once, then read through")
class NoEvictionPolicy(LruPolicy):
    def victim(self) -> bytes | None:
        return None

    def prefer(self, candidate: bytes, victim: bytes, in_use: bool = False) -> bool:
        return False
