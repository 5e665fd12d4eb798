"""Who owns a block: rendezvous (highest random weight) hashing over the live members. Pure.

Every member ranks every block by a hash of (member, block id); the highest wins. A member joining
takes over exactly the blocks it now ranks first for, a member leaving hands each of its blocks to that
block's second choice, and nothing else moves. The ranking also gives each block a fallback order when
its owner is down.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def _seed(member: str) -> int:
    return xxhash.xxh3_64_intdigest(member.encode("utf-8"), seed=0x65706F6368)


class Ring:
    """An immutable set of members (``HOST:PORT`` strings)."""

    __slots__ = ("members", "_seeds")

    def __init__(self, members: Iterable[str]) -> None:
        self.members: tuple[str, ...] = tuple(sorted(set(members)))
        self._seeds = [(_seed(m), m) for m in self.members]

    def owner(self, bid: bytes, exclude: frozenset[str] | set[str] = frozenset()) -> str | None:
        """The member that owns ``bid`` among those not in ``exclude``; None if there is none."""
        best, best_weight = None, -1
        for seed, member in self._seeds:
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
        ranked = sorted(((-xxhash.xxh3_64_intdigest(bid, seed=seed), member) for seed, member in self._seeds
                         if member not in exclude))
        return [member for _, member in ranked[:count]]

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, member: object) -> bool:
        return member in self.members

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ring) and self.members == other.members

    def __hash__(self) -> int:
        return hash(self.members)
