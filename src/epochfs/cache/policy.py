"""Eviction policies: pure bookkeeping over block ids, no I/O.

The store tells a policy what it holds (``inserted``/``removed``) and what the reader touched
(``accessed``); it asks ``admit`` before caching a new block and ``victim`` for the next block to
evict. A manifest-aware policy (farthest next use) implements the same interface.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def inserted(self, bid: bytes, size: int) -> None:
        """A block is now resident."""

    def accessed(self, bid: bytes) -> None:
        """The reader used a resident block."""

    def removed(self, bid: bytes) -> None:
        """A block is no longer resident (evicted, corrupt or dropped)."""

    def victim(self) -> bytes | None:
        """The block to evict next, or None if nothing may be evicted. Does not remove it."""

    def admit(self, bid: bytes) -> bool:
        """Whether a block that is not resident should be cached at all."""


class LruPolicy:
    """Least recently used first. Admits everything."""

    name = "lru"

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

    def admit(self, bid: bytes) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._order)


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LruPolicy()
    raise ValueError(f"unknown eviction policy {name!r}")
