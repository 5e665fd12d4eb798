"""Eviction policies: pure bookkeeping over block ids, no I/O.

The store tells a policy what it holds (``inserted``/``removed``) and what the reader used
(``accessed``). When it needs room it asks for a ``victim`` and whether a new block should replace it
(``prefer``); a policy that prefers the victim makes the store read through instead of caching.

- :class:`LruPolicy` evicts the least recently used block and admits everything.
- :class:`NoEvictionPolicy` ("fill once") never evicts: once full, new blocks are read through.
- :class:`ManifestPolicy` knows the future block sequence of the epoch (from the manifest) and the
  reader's position in it. It evicts the block whose next use is farthest (Belady's MIN) and does not
  admit a block whose next use is farther than that of every resident block (it would be evicted before
  it is used). Blocks with no future use are evicted first, least recently used first; with no
  manifest loaded every block is in that class, so the policy is plain LRU.

The reader's position is the block it is reading: that block's use counts as future until the reader
moves on, so it is never the victim while it is being read; whether a demand miss is worth caching is
judged by its use after the current one.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

NEVER = 1 << 62  # "no future use"


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

    def prefer(self, candidate: bytes, victim: bytes, in_use: bool = False) -> bool:
        """Whether caching ``candidate`` is worth evicting ``victim``. ``in_use``: the reader is using
        ``candidate`` right now (a demand miss), so what counts is its use after this one."""


class LruPolicy:
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

    def prefer(self, candidate: bytes, victim: bytes, in_use: bool = False) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._order)


class NoEvictionPolicy(LruPolicy):
    name = "none"

    def victim(self) -> bytes | None:
        return None

    def prefer(self, candidate: bytes, victim: bytes, in_use: bool = False) -> bool:
        return False


class ManifestPolicy:
    name = "manifest"

    def __init__(self) -> None:
        self._sequence: Sequence[bytes] = ()
        self._uses: dict[bytes, list[int]] = {}
        self._pos = 0
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # resident, no future use; LRU order
        self._future: dict[bytes, int] = {}  # resident block -> its next use
        self._heap: list[tuple[int, int, bytes]] = []  # (-next use, tiebreak, block); lazily invalidated
        self._tiebreak = itertools.count()

    # -- the future --------------------------------------------------------------------------------

    def set_sequence(self, sequence: Sequence[bytes], uses: dict[bytes, list[int]] | None = None) -> None:
        """The blocks the reader will use, in order; the reader is at position 0 of it. ``uses`` (block
        -> its positions in order) may be given precomputed, so that this costs only the resident blocks."""
        if uses is None:
            uses = {}
            for i, bid in enumerate(sequence):
                uses.setdefault(bid, []).append(i)
        self._sequence, self._uses, self._pos = sequence, uses, 0
        resident = list(self._idle) + list(self._future)
        self._idle.clear()
        self._future.clear()
        self._heap.clear()
        for bid in resident:
            self._place(bid)

    @property
    def position(self) -> int:
        return self._pos

    def advance(self, position: int) -> None:
        """The reader has reached ``position``: uses before it are in the past."""
        if position <= self._pos:
            return
        passed = self._sequence[self._pos:position]
        self._pos = position
        for bid in passed:
            if bid in self._future:
                del self._future[bid]
                self._place(bid)

    def next_use(self, bid: bytes, after_current: bool = False) -> int:
        """Position of the next use of ``bid`` at or after the reader's (strictly after, if
        ``after_current``), or NEVER."""
        uses = self._uses.get(bid)
        if not uses:
            return NEVER
        i = bisect_left(uses, self._pos + 1 if after_current else self._pos)
        return uses[i] if i < len(uses) else NEVER

    def _place(self, bid: bytes) -> None:
        nxt = self.next_use(bid)
        if nxt == NEVER:
            self._idle[bid] = None
        else:
            self._future[bid] = nxt
            heapq.heappush(self._heap, (-nxt, next(self._tiebreak), bid))

    # -- policy interface ---------------------------------------------------------------------------

    def inserted(self, bid: bytes, size: int) -> None:
        self.removed(bid)
        self._place(bid)

    def accessed(self, bid: bytes) -> None:
        if bid in self._idle:
            self._idle.move_to_end(bid)

    def removed(self, bid: bytes) -> None:
        self._idle.pop(bid, None)
        self._future.pop(bid, None)  # its heap entries become stale

    def victim(self) -> bytes | None:
        if self._idle:
            return next(iter(self._idle))
        heap = self._heap
        while heap:
            neg, _, bid = heap[0]
            if self._future.get(bid) == -neg:
                return bid
            heapq.heappop(heap)
        return None

    def prefer(self, candidate: bytes, victim: bytes, in_use: bool = False) -> bool:
        cand = self.next_use(candidate, after_current=in_use)
        if cand == NEVER:
            return victim in self._idle  # an unplanned read may only replace another unplanned block
        return cand < self.next_use(victim)

    def __len__(self) -> int:
        return len(self._idle) + len(self._future)


POLICIES = {"lru": LruPolicy, "manifest": ManifestPolicy, "none": NoEvictionPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (choose from {', '.join(POLICIES)})") from None
