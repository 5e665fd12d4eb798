"""A member's share of the dataset: how large it is (:func:`ownership`: ``epochfs cluster status`` for
every member, :class:`ShareWatch` for this node, kept current), and, when the membership changes on
purpose, what a node that leaves hands over and what a node that joins with ``--rebalance`` fills at
once (instead of as it is asked).

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
from typing import TYPE_CHECKING

import trio

from epochfs.core.blocks import block_bounds, block_count, block_id
from epochfs.core.records import ObjectInfo, stored_extent
from epochfs.doctor import share_fix
from epochfs.meta.namespace import Namespace
from epochfs.peer import wire
from epochfs.peer.ring import Ring

if TYPE_CHECKING:
    from epochfs.peer.tier import PeerTier

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


#: At most this many blocks are ranked to size the shares; the rest of a larger dataset is estimated.
SHARE_SAMPLE = 100_000
GiB = 1 << 30


@dataclass(frozen=True)
class Ownership:
    """The bytes of a snapshot's blocks each member of a ring holds, replicas included."""

    owned: dict[str, int]  # member -> bytes (estimated where ``sampled``)
    total: int  # the bytes of the snapshot's stored objects (each shard once; estimated where ``sampled``)
    ranked: int  # blocks ranked
    sampled: bool  # only the first ``SHARE_SAMPLE`` blocks were ranked; their shares scaled to ``total``


def ownership(objects: Iterable[ObjectInfo], source_id: str, ring: Ring, block_size: int, replicas: int,
              sample: int = SHARE_SAMPLE, total: int | None = None) -> Ownership:
    """Who owns how much of the stored objects behind ``objects`` (a packed member's shard whole, each
    once), each block ranked as the members rank it. Pure.

    Every block is ranked, up to ``sample`` blocks or the blocks of ``2 * sample`` objects (a packed
    member costs a parse and adds no block of its own). Past that, the shares of the blocks ranked are
    scaled to the whole: a block's owner is a hash of its id, so any blocks taken without regard to it
    are a fair sample. The whole is ``total`` where the caller knows it (the listing is then not walked
    further), else the bytes ranked and the listed sizes of the objects after them (a packed member's
    own size, which leaves out its shard's archive headers)."""
    owned: Counter[str] = Counter()
    seen: set[tuple[str, str]] = set()
    ranked = blocks = rest = walked = 0  # (bytes ranked, blocks ranked, bytes listed after the sample)
    for obj in objects:
        walked += 1
        if blocks >= sample or walked > 2 * sample:
            if total is not None:
                break
            rest += obj.size
            continue
        o = stored_extent(obj)[0]
        if (o.key, o.etag) in seen:
            continue
        seen.add((o.key, o.etag))
        for index in range(block_count(o.size, block_size)):
            length = block_bounds(index, o.size, block_size)[1]
            if blocks >= sample:
                rest += length
                continue
            ranked, blocks = ranked + length, blocks + 1
            for member in ring.owners(block_id(source_id, o.key, o.etag, index, block_size=block_size), replicas):
                owned[member] += length
    sampled = (blocks >= sample or walked > 2 * sample) and (rest > 0 or total is not None)
    whole = total if sampled and total is not None else ranked + rest
    scale = whole / ranked if ranked else 0.0
    return Ownership({m: round(owned[m] * scale) for m in ring.members}, whole, blocks, sampled)


class ShareWatch:
    """This node's share of the snapshot it serves (``owned``, bytes with replicas; ``total``), ranked
    again in a worker thread when the ring or the snapshot has changed, at most every ``INTERVAL``
    seconds (a ranking walks the files that hold the snapshot's first ``SHARE_SAMPLE`` blocks); the
    first node of a tier, which first ranks itself alone, ranks again as soon as the others join. A node
    that keeps only the blocks it owns (a cache node, ``--peer-cache owned``) and owns more than its
    cache holds is named in the log: it evicts blocks it owns, and each member that asks for one costs
    a backend read again (``epochfs_peer_share_bytes`` against ``epochfs_cache_capacity_bytes``: an
    alert rule compares them). Kept only on such a node. Trio thread, but for the ranking."""

    INTERVAL = 30.0  # seconds between two rankings, at the least
    CHECK = 2.0  # seconds between two looks at the ring and the snapshot

    def __init__(self, tier: PeerTier, namespace: Callable[[], Namespace], version: Callable[[], object],
                 source_id: str, block_size: int, capacity: Callable[[], int]) -> None:
        self.tier = tier
        self.namespace, self.version, self.capacity = namespace, version, capacity
        self.source_id, self.block_size = source_id, block_size
        self.owned: int | None = None  # None: not ranked yet, or this node owns nothing (not in the ring)
        self.total: int | None = None
        self._seen: tuple[object, ...] | None = None

    def due(self) -> bool:
        """Whether the ring or the snapshot changed since the last ranking, and this node is in a ring
        whose members have all been tried (not a node alone while the others are still proving)."""
        members = self.tier.members
        return ((members.ring, self.version()) != self._seen and members.me in members.ring
                and members.settled())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        first = True
        while True:
            if self.due():
                alone = len(self.tier.members.ring) == 1
                await self.rank()
                if not (first and alone):  # (the first node of a tier ranks again as soon as others join)
                    await trio.sleep(self.INTERVAL - self.CHECK)
                first = False
            await trio.sleep(self.CHECK)

    async def rank(self) -> None:
        tier = self.tier
        ring, version, namespace = tier.members.ring, self.version(), self.namespace()
        self._seen = (ring, version)
        try:
            shares = await trio.to_thread.run_sync(
                lambda: ownership((f.obj for f in namespace.files()), self.source_id, ring, self.block_size,
                                  tier.replicas, total=namespace.total_bytes), abandon_on_cancel=True)
        except Exception as exc:  # noqa: BLE001 - a figure for the operator: never worth the daemon
            log.warning("could not rank this node's share of the dataset (%s); trying again later", exc)
            self._seen = None
            return
        self.owned, self.total = shares.owned.get(tier.members.me, 0), shares.total
        capacity = self.capacity()
        if self.owned <= capacity:
            log.info("this node owns %.2f GiB of the dataset's %.2f GiB (one of %d members); its cache holds %.2f GiB",
                     self.owned / GiB, self.total / GiB, len(ring), capacity / GiB)
        else:
            fix = share_fix(self.owned, capacity, ring.cache_of(tier.members.me), ring.cache_bytes(),
                            self.total * tier.replicas)
            log.warning("this node owns %.2f GiB of the dataset (one of %d members) and its cache holds %.2f GiB: "
                        "it evicts blocks it owns, and each member that asks for one costs a backend read again (%s)",
                        self.owned / GiB, len(ring), capacity / GiB, fix)


def hand_over(tier: PeerTier, namespace: Namespace, block_id: Callable[[ObjectInfo, int], bytes], block_size: int,
              held: Callable[[bytes], bool], deadline: float) -> tuple[int, int]:
    """Ask the new owner of every block this node holds to warm it, before this node leaves; (blocks
    handed over, blocks that were not). Blocking (a worker thread)."""
    members, replicas = tier.members, tier.replicas
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
        futures = [pool.submit(tier.ask, new, req) for new, req in work]
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
