"""Belady's MIN with the future the epoch manifest gives.

The policy knows the future block sequence of the epochs handed over (:meth:`plan`) and the reader's
position in it (:meth:`advance`). It evicts the block whose next use is farthest and does not admit a
block whose next use is farther than that of every resident block (it would be evicted before it is
used). Blocks with no future use are evicted first, least recently used first; with no manifest loaded
every block is in that class, so the policy is plain LRU.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence

from epochfs.eviction import EvictionPolicy, register

NEVER = 1 << 62  # "no future use"


@register("manifest", "evict the block needed farthest in the future once 'epochfs prefetch' has handed "
          "over a manifest (LRU until then)")
class ManifestPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._sequence: Sequence[bytes] = ()
        self._uses: dict[bytes, list[int]] = {}
        self._pos = 0
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # resident, no future use; LRU order
        self._future: dict[bytes, int] = {}  # resident block -> its next use
        self._heap: list[tuple[int, int, bytes]] = []  # (-next use, tiebreak, block); lazily invalidated
        self._tiebreak = itertools.count()

    # -- the future --------------------------------------------------------------------------------

    def plan(self, sequence: Sequence[bytes], uses: dict[bytes, list[int]] | None = None) -> None:
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
