"""Least recently used: evicts the block used longest ago, admits everything."""

from __future__ import annotations

from collections import OrderedDict

from epochfs.eviction import EvictionPolicy, register


@register("lru", "evict the least recently used block")
class LruPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def inserted(self, bid: bytes, size: int) -> None:
        self._order[bid] = None
        self._order.move_to_end(bid)

    def accessed(self, bid: bytes) -> None:
        if bid in self._order:
            self._order.move_to_end(bid)

    def removed(self, bid: bytes) -> None:
        self._order.pop(bid, None)

    def victim(self) -> bytes | None:
        return next(iter(self._order), None)

    def prefer(self, candidate: bytes, victim: bytes, in_use: bool = False) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._order)
