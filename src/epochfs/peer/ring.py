"""Who owns a block: rendezvous (highest random weight) hashing over the live members. Pure.

Every member ranks every block by a hash of (member, block id); the highest wins. A member joining
takes over exactly the blocks it now ranks first for, a member leaving hands each of its blocks to that
block's second choice, and nothing else moves. The ranking also gives each block a fallback order when
its owner is down.

**Weights.** Members whose caches differ in size are ranked in proportion to them: a member's weight
is its cache in MiB (each member states its own in its authenticated hello), and a block's score for a
member is ``weight / -ln(u)`` with ``u`` its hash mapped into (0, 1) (weighted rendezvous hashing: a
member's expected share is its weight over the sum of the weights, and joining or leaving still moves
only the blocks that member wins or held). Where every member has the same weight (or none is known)
the ranking is the plain one above, exactly: a fleet of equal nodes places each block where it did
before weights existed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import xxhash

#: The unit of a weight: a member's weight is its cache's size in these, at least one.
WEIGHT_UNIT = 1 << 20
MAX_WEIGHT = 1 << 40  # (a cache of a zebibyte: anything stated beyond is taken as this)


def _seed(member: str) -> int:
    return xxhash.xxh3_64_intdigest(member.encode("utf-8"), seed=0x65706F6368)


def weight_of(capacity: int) -> int:
    """A member's weight for a cache of ``capacity`` bytes."""
    return max(1, min(MAX_WEIGHT, capacity // WEIGHT_UNIT))


def ring_weights(members: Iterable[str], capacity: Mapping[str, int | None]) -> dict[str, int] | None:
    """The ring's weights for ``members`` from the cache sizes they stated (:func:`weight_of`); None (every
    member alike) where any of them stated none."""
    sizes = {m: capacity.get(m) for m in members}
    if any(size is None for size in sizes.values()):
        return None
    return {m: weight_of(size) for m, size in sizes.items() if size is not None}


def _cost(h: int, weight: int) -> float:
    """The weighted rank of a hash: lower is better (``-ln(u) / weight``, ``u`` in (0, 1) from the hash's
    top 52 bits, so it is never 0 or 1)."""
    return -math.log(((h >> 12) + 0.5) / 4503599627370496.0) / weight


class Ring:
    """An immutable set of members (``HOST:PORT`` strings), each with its weight (default 1)."""

    __slots__ = ("members", "weights", "sized", "_seeds", "_weighted")

    def __init__(self, members: Iterable[str], weights: Mapping[str, int] | None = None) -> None:
        self.members: tuple[str, ...] = tuple(sorted(set(members)))
        self.sized = weights is not None  # weighted by the members' caches (else every member alike)
        given = weights or {}
        self.weights: tuple[int, ...] = tuple(max(1, min(MAX_WEIGHT, int(given.get(m, 1)))) for m in self.members)
        self._seeds = [(_seed(m), m, w) for m, w in zip(self.members, self.weights, strict=True)]
        self._weighted = len(set(self.weights)) > 1

    def owner(self, bid: bytes, exclude: frozenset[str] | set[str] = frozenset()) -> str | None:
        """The member that owns ``bid`` among those not in ``exclude``; None if there is none."""
        if self._weighted:
            best, best_cost = None, math.inf
            for seed, member, w in self._seeds:
                if member in exclude:
                    continue
                cost = _cost(xxhash.xxh3_64_intdigest(bid, seed=seed), w)
                if cost < best_cost or (cost == best_cost and best is not None and member < best):
                    best, best_cost = member, cost
            return best
        best, best_weight = None, -1
        for seed, member, _ in self._seeds:
            if member in exclude:
                continue
            weight = xxhash.xxh3_64_intdigest(bid, seed=seed)
            if weight > best_weight or (weight == best_weight and best is not None and member < best):
                best, best_weight = member, weight
        return best

    def owners(self, bid: bytes, count: int, exclude: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """The ``count`` members that hold ``bid`` (its replicas), first choice first, among those not in
        ``exclude``: the rendezvous ranking's head, so a member joining or leaving changes a block's
        holders only where it ranks among them."""
        if self._weighted:
            scored = sorted((_cost(xxhash.xxh3_64_intdigest(bid, seed=seed), w), member)
                            for seed, member, w in self._seeds if member not in exclude)
        else:
            scored = sorted((-xxhash.xxh3_64_intdigest(bid, seed=seed), member) for seed, member, _ in self._seeds
                            if member not in exclude)
        return [member for _, member in scored[:count]]

    def weight(self, member: str) -> int:
        """``member``'s weight (1 for one not in the ring)."""
        try:
            return self.weights[self.members.index(member)]
        except ValueError:
            return 1

    def cache_of(self, member: str) -> int | None:
        """``member``'s cache as it is weighed (None where the ring is not weighted by the caches, or for one
        not in the ring)."""
        return self.weight(member) * WEIGHT_UNIT if self.sized and member in self.members else None

    def cache_bytes(self) -> int | None:
        """The members' caches together, as they are weighed (None where the ring is not weighted by them)."""
        return sum(self.weights) * WEIGHT_UNIT if self.sized else None

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, member: object) -> bool:
        return member in self.members

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ring) and (self.members, self.weights) == (other.members, other.weights)

    def __hash__(self) -> int:
        return hash((self.members, self.weights))
