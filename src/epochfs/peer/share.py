"""A member's share of the dataset: how large it is (:func:`ownership`, for ``epochfs cluster status``),
and, when the membership changes on purpose, what a node that leaves hands over and what a node that
joins with ``--rebalance`` fills at once (instead of as it is asked).

Both walk the blocks of the snapshot being served (every file's blocks; a packed member's are its
shard's, each once) in a worker thread and hand the work to the cluster tier: a leaving node asks each
block's new owner to warm it (the new owner takes it from the leaving node, which still serves, with a
stored-only request: nothing crosses the backend link again), a joining node warms the blocks it now
owns (from the other cache nodes first, then the backend). Each is bounded in time; what does not get
done is done later, on demand.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from epochfs.cache.keys import block_bounds, block_count, block_id
from epochfs.meta.namespace import Namespace
from epochfs.peer import wire
from epochfs.peer.ring import Ring
from epochfs.records import ObjectInfo, stored_extent

log = logging.getLogger(__name__)


def blocks(namespace: Namespace, block_id: Callable[[ObjectInfo, int], bytes],
           block_size: int) -> Iterator[tuple[ObjectInfo, int, int, bytes]]:
    """(object, index, length, block id) of every block the snapshot stores, each once (worker thread)."""
    seen: set[tuple[str, str]] = set()
    for f in namespace.files():
        stored, _ = stored_extent(f.obj)
        if (stored.key, stored.etag) in seen:
            continue
        seen.add((stored.key, stored.etag))
        for index in range(block_count(stored.size, block_size)):
            yield stored, index, block_bounds(index, stored.size, block_size)[1], block_id(stored, index)


#: At most this many blocks are ranked to size the shares; a larger dataset is sampled evenly.
SHARE_SAMPLE = 100_000


@dataclass(frozen=True)
class Ownership:
    """The bytes of a snapshot's blocks each member of a ring holds, replicas included."""

    owned: dict[str, int]  # member -> bytes (estimated where ``sampled``)
    total: int  # the bytes of the snapshot's stored objects (each shard once)
    blocks: int
    sampled: bool  # ranked one block in ``blocks / SHARE_SAMPLE``, scaled by bytes


def ownership(objects: Iterable[ObjectInfo], source_id: str, ring: Ring, block_size: int, replicas: int,
              sample: int = SHARE_SAMPLE) -> Ownership:
    """Who owns how much of the stored objects behind ``objects`` (a packed member's shard whole, each
    once): every block ranked as the members rank it, or an even sample of ``sample`` blocks (every
    k-th, in the listing's order) where there are more. Pure."""
    stored = {(o.key, o.etag): o for o in (stored_extent(obj)[0] for obj in objects)}
    counts = [block_count(o.size, block_size) for o in stored.values()]
    blocks, total = sum(counts), sum(o.size for o in stored.values())
    stride = max(1, -(-blocks // max(1, sample)))
    owned: Counter[str] = Counter()
    seen = ranked = 0  # (blocks passed, bytes of the blocks ranked)
    for o, count in zip(stored.values(), counts, strict=True):
        for index in range((-seen) % stride, count, stride):
            length = block_bounds(index, o.size, block_size)[1]
            ranked += length
            for member in ring.owners(block_id(source_id, o.key, o.etag, index, block_size=block_size), replicas):
                owned[member] += length
        seen += count
    scale = total / ranked if ranked else 0.0
    return Ownership({m: round(owned[m] * scale) for m in ring.members}, total, blocks, stride > 1)


def hand_over(tier: object, namespace: Namespace, block_id: Callable[[ObjectInfo, int], bytes], block_size: int,
              held: Callable[[bytes], bool], deadline: float) -> tuple[int, int]:
    """Ask the new owner of every block this node holds to warm it, before this node leaves; (blocks
    handed over, blocks that were not). Blocking (a worker thread)."""
    members, replicas = tier.members, tier.replicas  # type: ignore[attr-defined]
    ring, me = members.ring, members.me
    if ring.members == (me,) or not len(ring):
        return 0, 0
    work = []
    for obj, index, length, bid in blocks(namespace, block_id, block_size):
        if time.monotonic() > deadline:
            break
        if not held(bid):
            continue
        before = ring.owners(bid, replicas)
        for new in ring.owners(bid, replicas, exclude={me}):
            if new not in before:
                work.append((new, wire.BlockRequest(bid, obj.key, obj.etag, index, length, warm=True)))
    done = failed = 0
    with concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="handover") as pool:
        futures = [pool.submit(tier.ask, new, req) for new, req in work]  # type: ignore[attr-defined]
        for future in futures:
            left = deadline - time.monotonic()
            try:
                ok = future.result(timeout=max(0.0, left)) is not None
            except concurrent.futures.TimeoutError:
                ok = False
            done, failed = done + ok, failed + (not ok)
        if failed:
            for future in futures:
                future.cancel()
    return done, failed
