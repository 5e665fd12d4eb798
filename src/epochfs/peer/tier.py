"""The cluster cache tier: the block source the cache fetches through, and the answers to other members.

**Fetching** (worker threads, one per block fetch). The owner of a block is its rendezvous choice among
the members that proved they hold the cluster's token (:mod:`.members`). If that is this node (or it is
alone), the block comes from the backend. Otherwise the owner is asked; it serves the block from its
cache or fetches it from the backend once (its own single flight serves every member asking at the
same time). Only an authenticated answer (:mod:`.wire`) of exactly the block's length is used. If the
owner cannot be reached, times out, answers something unauthenticated or fails (a 5xx, a refusal),
it is distrusted: out of the ring until it proves itself again (its blocks go to their next choice
meanwhile), and this block comes from the backend at once. An owner that says it does not have this
object version (404, 409, 412) keeps its place unless it says so ``DECLINES_IN_A_ROW`` times in a row;
the block comes from the backend.

**Keeping.** With ``mode="all"`` a node caches every block it reads, so later epochs are local. With
``mode="owned"`` it caches only the blocks it owns, and the members' caches add up to one cache; blocks
of other owners are read from them each time (at network speed), and prefetching one only warms its
owner (``warm`` requests carry no bytes back).

**Serving** (trio thread, :class:`PeerAnswers`, built after the cache it answers from). A request is answered only for an object of this node's snapshot whose
block id, derived here, is the one asked for; the block comes from this node's cache or its backend,
never from another member (no request is forwarded, so differing member views cannot loop).

Concurrency contract: :meth:`read_block` and :meth:`keeps` run in worker threads; they read the ring (an
immutable object replaced whole) and the down-list (under a lock). Everything else runs on the trio
thread.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from epochfs.backend.base import Backend
from epochfs.errors import EpochfsError, ObjectChanged
from epochfs.meta.namespace import File, Namespace
from epochfs.peer import wire
from epochfs.peer.client import PeerClient, PeerFailure
from epochfs.peer.members import Membership
from epochfs.peer.server import ServerStats
from epochfs.records import ObjectInfo

log = logging.getLogger(__name__)

MODES = ("all", "owned")
OUTCOMES = ("ok", "unavailable", "bad", "declined", "served", "rejected")


@dataclass(frozen=True)
class PeerStats:
    me: str
    mode: str
    members: tuple[str, ...]
    down: tuple[str, ...]
    store_reachable: bool
    requests: dict[str, int]  # outcome -> count (asked: ok, unavailable, bad, declined; answered: served, rejected)
    bytes_in: int
    bytes_out: int


class PeerCache(Protocol):
    """What the tier needs of the block cache to answer other members."""

    def block_id(self, obj: ObjectInfo, index: int) -> bytes: ...

    def block_length(self, obj: ObjectInfo, index: int) -> int: ...

    async def read_for_peer(self, obj: ObjectInfo, index: int, warm: bool) -> bytes | None: ...


class PeerTier:
    DECLINES_IN_A_ROW = 8
    OBJECT_STATUSES = (404, 409, 412)  # "not this object version here": no fault of the member

    def __init__(self, backend: Backend, members: Membership, client: PeerClient, *, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(mode)
        self.backend = backend
        self.members = members
        self.client = client
        self.mode = mode
        self._lock = threading.Lock()
        self._declines: Counter[str] = Counter()
        self._outcomes: Counter[str] = Counter()
        self._bytes_in = 0

    # -- the block source (worker threads) ---------------------------------------------------------------

    def owner(self, bid: bytes) -> str | None:
        ring = self.members.ring
        return ring.owner(bid) if len(ring) > 1 else None

    def keeps(self, bid: bytes) -> bool:
        """Whether this node caches ``bid`` (always, unless ``owned`` and another member owns it)."""
        if self.mode == "all":
            return True
        owner = self.owner(bid)
        return owner is None or owner == self.members.me

    def read_block(self, obj: ObjectInfo, index: int, start: int, length: int, bid: bytes, *, direct: bool,
                   warm: bool) -> tuple[bytes | None, bool]:
        """The block's bytes and whether they came from a peer; ``direct``: from the backend, never a
        peer; ``warm``: only make sure its owner has it (None when it does)."""
        owner = None if direct else self.owner(bid)
        if owner is not None and owner != self.members.me:
            try:
                data = self.client.get(owner, wire.BlockRequest(bid, obj.key, obj.etag, index, length, warm))
            except PeerFailure as exc:
                self._failed(owner, exc)
            else:
                with self._lock:
                    self._outcomes["ok"] += 1
                    self._declines.pop(owner, None)
                    self._bytes_in += len(data) if data else 0
                return data, True
        return self.backend.read_range(obj.key, obj.etag, start, length), False

    def _failed(self, owner: str, exc: PeerFailure) -> None:
        with self._lock:
            self._outcomes[exc.kind] += 1
            if exc.kind == "declined" and exc.status in self.OBJECT_STATUSES:
                self._declines[owner] += 1
                distrust = self._declines[owner] >= self.DECLINES_IN_A_ROW
            else:
                distrust = True
            if distrust:
                self._declines.pop(owner, None)
        if distrust:
            self.members.distrust(owner, str(exc))
        else:
            log.debug("peer %s: %s; reading from the backend", owner, exc)

    def statistics(self, served: ServerStats | None = None) -> PeerStats:
        """The tier's counts, with what this node's peer server answered (``served``)."""
        with self._lock:
            outcomes = {**dict.fromkeys(OUTCOMES, 0), **self._outcomes}
            bytes_in = self._bytes_in
        if served is not None:
            outcomes["served"] = served.served
            outcomes["rejected"] = served.rejected
        return PeerStats(me=self.members.me, mode=self.mode, members=self.members.ring.members, down=self.members.down(),
                         store_reachable=self.members.reachable, requests=outcomes, bytes_in=bytes_in,
                         bytes_out=served.served_bytes if served else 0)


class PeerAnswers:
    """Answers to other members' block requests, from this node's cache (trio thread)."""

    def __init__(self, cache: PeerCache, namespace: Callable[[], Namespace]) -> None:
        self.cache = cache
        self.namespace = namespace

    async def serve(self, req: wire.BlockRequest) -> bytes | None:
        namespace = self.namespace()
        node = namespace.resolve(req.key)
        if isinstance(node, File) and node.obj.key == req.key and node.obj.etag == req.etag:
            obj = node.obj
        else:  # a shard of a packed dataset, whose members this node serves
            stored = namespace.stored(req.key, req.etag)
            if stored is None:
                raise wire.Rejected(404, "no such object version in this node's snapshot")
            obj = stored
        cache = self.cache
        try:
            length = cache.block_length(obj, req.index)
        except ValueError:
            raise wire.Rejected(404, "no such block") from None
        if length != req.length or cache.block_id(obj, req.index) != req.bid:
            raise wire.Rejected(409, "another block geometry (is --block-size the same on every node?)")
        try:
            return await cache.read_for_peer(obj, req.index, req.warm)
        except ObjectChanged as exc:
            raise wire.Rejected(412, str(exc)) from None
        except EpochfsError as exc:
            raise wire.Rejected(503, str(exc)) from None
