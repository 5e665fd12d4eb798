"""Offline simulation of the cache over a block sequence: what ``epochfs plan`` reports before an epoch
runs, and what the benchmarks compare against. Pure. It drives the same policy classes as the daemon's
store, with the same admission rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epochfs.core.blocks import extent_blocks, file_blocks
from epochfs.eviction import make_policy, make_room

Block = tuple[bytes, int]  # (block id, size)


def block_sequence(files: Sequence[tuple[str, int]], block_size: int,
                   stored: Sequence[tuple[str, int, int] | None] | None = None) -> list[Block]:
    """The blocks an epoch reads, in order, for (path, size) pairs read whole. ``stored[i]``: where file
    ``i``'s bytes are, if not in an object of its own (a packed member: its shard's key, the offset there
    and the shard's size): it reads the blocks of the shard its range touches."""
    seq = []
    for n, (path, size) in enumerate(files):
        where = stored[n] if stored is not None else None
        if where is None:
            seq.extend((f"{path}\0{i}".encode(), length) for i, length in file_blocks(size, block_size))
        else:
            key, offset, whole = where
            seq.extend((f"{key}\0{i}".encode(), length) for i, length, _ in extent_blocks(offset, size, whole, block_size))
    return seq


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity: int
    reads: int
    hits: int
    hit_bytes: int
    miss_bytes: int  # = bytes fetched from the backend

    @property
    def hit_ratio(self) -> float:
        total = self.hit_bytes + self.miss_bytes
        return self.hit_bytes / total if total else 1.0


def simulate(sequence: Sequence[Block], capacity: int, policy_name: str,
             warmup: Sequence[Block] = ()) -> SimResult:
    """Replay ``warmup`` then ``sequence`` (counted) through a cache of ``capacity`` bytes.

    A policy that plans is told the whole future (``warmup`` followed by ``sequence``), as the daemon is
    when the next epoch's manifest is handed over before the current one ends.
    """
    policy = make_policy(policy_name)
    full = list(warmup) + list(sequence)
    policy.plan([bid for bid, _ in full])
    resident: dict[bytes, int] = {}
    used = hits = hit_bytes = miss_bytes = 0

    def evict(victim: bytes) -> None:
        nonlocal used
        used -= resident.pop(victim)
        policy.removed(victim)

    for pos, (bid, size) in enumerate(full):
        counted = pos >= len(warmup)
        policy.advance(pos)
        if bid in resident:
            policy.accessed(bid)
            if counted:
                hits += 1
                hit_bytes += size
            continue
        if counted:
            miss_bytes += size
        fits = lambda size=size: used + size <= capacity  # noqa: E731, B023 - called at once: the live count
        if size <= capacity and make_room(policy, bid, fits, evict, in_use=True):
            resident[bid] = size
            used += size
            policy.inserted(bid, size)
    return SimResult(policy_name, capacity, len(sequence), hits, hit_bytes, miss_bytes)


def offline_optimum(sequence: Sequence[bytes], capacity: int) -> int:
    """Misses of Belady's MIN with bypass over unit-size blocks, computed directly (the reference the
    policies are checked against): on a miss with a full cache, drop whichever of the resident blocks
    and the new one is next used farthest in the future."""
    nxt: list[int] = [0] * len(sequence)
    last: dict[bytes, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        nxt[i] = last.get(sequence[i], len(sequence) + i)
        last[sequence[i]] = i
    cache: dict[bytes, int] = {}  # block -> its next use
    misses = 0
    for i, b in enumerate(sequence):
        if b in cache:
            cache[b] = nxt[i]
            continue
        misses += 1
        if len(cache) < capacity:
            cache[b] = nxt[i]
            continue
        far = max(cache, key=cache.__getitem__)
        if cache[far] > nxt[i]:
            del cache[far]
            cache[b] = nxt[i]
    return misses
