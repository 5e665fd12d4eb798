"""The cluster cache tier: the block source the cache fetches through, and the answers to other members.

**Fetching** (worker threads, one per block fetch). The owners of a block are its ``replicas`` first
rendezvous choices among the members that proved they hold the cluster's token (:mod:`.members`: the
cache nodes where there are any, else the serving GPU nodes). They are asked in turn; if one of them
is this node (or it is alone), the block comes from the backend. An owner asked serves the block from its
cache or fetches it from the backend once (its own single flight serves every member asking at the
same time). Only an authenticated answer (:mod:`.wire`) of exactly the block's length is used. If the
owner cannot be reached, times out, answers something unauthenticated or fails (a 5xx, a refusal),
it is distrusted: out of the ring until it proves itself again (its blocks go to their next choice
meanwhile), and the next owner is asked, then the backend. An owner that answers **busy** (every
connection it has is being answered: its link is full) is no fault: it is asked again after the pause
it names (jittered), for as long as the tier's timeout allows, and only then is the next owner (or the
backend) asked; it keeps its place in the ring. An owner that says it does not have this
object version (404, 409, 412) keeps its place unless it says so ``DECLINES_IN_A_ROW`` times in a row;
the block comes from the backend.

**Cache nodes** (``role="server"``, ``epochfs serve``) keep only the blocks they own. One asked for a
block it does not hold asks the other owners and the next cache nodes for it first (stored-only
requests: never fetched there), then the backend: a cache node that joins fills its share from the
others, and one that leaves hands its share to the next. With ``replicas`` above one, a cache node that
fetched a block from the backend has its other owners warm it (in the background; they take it from
this node), so each block crosses the backend link once and is held ``replicas`` times.

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

import concurrent.futures
import functools
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from epochfs.backend.base import Backend
from epochfs.core.errors import EpochfsError, ObjectChanged
from epochfs.core.records import ObjectInfo
from epochfs.meta.namespace import Namespace
from epochfs.meta.nodes import File
from epochfs.peer import wire
from epochfs.peer.client import PeerClient, PeerFailure
from epochfs.peer.load import MemberLoad
from epochfs.peer.members import Membership, refusal
from epochfs.peer.server import Bound, ServerStats

log = logging.getLogger(__name__)

MODES = ("all", "owned")
OUTCOMES = ("ok", "unavailable", "bad", "declined", "busy", "served", "rejected")


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
    role: str = "peer"  # peer, server (a cache node) or client
    replicas: int = 1
    link_capacity: float | None = None  # bytes/s of this node's link (--link-capacity, its interface, measured)
    share_bytes: int | None = None  # of the dataset, the bytes this node owns (replicas included; None: not known)
    dataset_bytes: int | None = None  # the bytes of the dataset the share is of
    cache_size_bytes: int | None = None  # this node's cache as the ring weighs it (None: not weighted)
    tier_cache_bytes: int | None = None  # the ring's members' caches together, as weighed (None: not weighted)
    fallbacks: dict[str, int] | None = None  # asks that failed and went on: to another replica, to the backend
    refusing: tuple[str, ...] = ()  # listed members that refuse this node's token (the tokens differ)
    store_error: str | None = None  # why the shared store did not answer the last heartbeat (a refused password...)
    load: tuple[MemberLoad, ...] = ()  # what the members this node reads from publish of their load
    closed: dict[str, int] | None = None  # connections this node's peer port closed, by why (None: no port)
    gates: dict[str, dict[str, int]] | None = None  # member -> requests in flight to it, its limit, fetches waiting
    bytes_out_from_files: int = 0  # of bytes_out, those the kernel sent from the cache's files (sendfile)


class PeerCache(Protocol):
    """What the tier needs of the block cache to answer other members."""

    def block_id(self, obj: ObjectInfo, index: int) -> bytes: ...

    def block_length(self, obj: ObjectInfo, index: int) -> int: ...

    async def read_for_peer(self, obj: ObjectInfo, index: int, warm: bool) -> bytes | None: ...

    async def read_stored(self, obj: ObjectInfo, index: int) -> bytes | None: ...

    def extent_for_peer(self, obj: ObjectInfo, index: int) -> FileRange | None: ...

    def sent(self, extent: Any) -> None: ...

    async def digest_for_peer(self, obj: ObjectInfo, index: int, data: bytes) -> bytes: ...


class FileRange(Protocol):
    """A cached block's range of an open file, with its digest (the store's extent)."""

    @property
    def fd(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def digest(self) -> bytes: ...


class PeerTier:
    DECLINES_IN_A_ROW = 8
    OBJECT_STATUSES = (404, 409, 412)  # "not this object version here": no fault of the member

    def __init__(self, backend: Backend, members: Membership, client: PeerClient, *, mode: str,
                 replicas: int = 1) -> None:
        if mode not in MODES or replicas < 1:
            raise ValueError(mode)
        self.backend = backend
        self.members = members
        self.client = client
        self.mode = "owned" if members.role == "server" else mode
        self.replicas = replicas
        self._replicating: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._declines: Counter[str] = Counter()
        self._outcomes: Counter[str] = Counter()
        self._fallbacks: Counter[str] = Counter()  # failed asks that went on: to another replica, the backend
        self._bytes_in = 0

    # -- the block source (worker threads) ---------------------------------------------------------------

    def owners(self, bid: bytes) -> list[str]:
        """The members that hold ``bid``, first choice first (none: this node is alone)."""
        ring = self.members.ring
        if not len(ring) or ring.members == (self.members.me,):
            return []
        return ring.owners(bid, self.replicas)

    def keeps(self, bid: bytes) -> bool:
        """Whether this node caches ``bid`` (always, unless ``owned`` and other members own it)."""
        if self.mode == "all":
            return True
        owners = self.owners(bid)
        return not owners or self.members.me in owners

    def read_block(self, obj: ObjectInfo, index: int, start: int, length: int, bid: bytes, *, direct: bool,
                   warm: bool, urgent: Callable[[], bool] | None = None) -> tuple[bytes | None, str]:
        """The block's bytes and where they came from (``owner``: its first owner; ``replica``: another,
        asked once an owner before it failed; ``backend``); ``direct``: not from its owners (this node
        answers a member: a cache node still asks the others for what they hold); ``warm``: only make
        sure an owner has it (None when it does); ``urgent``: whether a reader waits for it now (its request
        goes before the prefetches queued for the member)."""
        if not direct:
            failed = False
            for owner in self.owners(bid):
                if owner == self.members.me:
                    break
                if failed:
                    self._count_fallback("replica")
                got = self.ask(owner, wire.BlockRequest(bid, obj.key, obj.etag, index, length, warm), urgent)
                if got is not None:
                    return got[0], "replica" if failed else "owner"
                failed = True
            if failed:
                self._count_fallback("backend")
        elif self.members.role == "server":
            ring, me = self.members.ring, self.members.me
            for other in ring.owners(bid, self.replicas, exclude={me}):
                got = self.ask(other, wire.BlockRequest(bid, obj.key, obj.etag, index, length, stored=True))
                if got is not None:
                    return got[0], "replica"
            data = self.backend.read_range(obj.key, obj.etag, start, length)
            owners = self.owners(bid)
            if self.replicas > 1 and me in owners:  # the other replicas take it from here
                for other in owners:
                    if other != me:
                        self._replicas().submit(self.ask, other, wire.BlockRequest(
                            bid, obj.key, obj.etag, index, length, warm=True))
            return data, "backend"
        return self.backend.read_range(obj.key, obj.etag, start, length), "backend"

    def _count_fallback(self, to: str) -> None:
        with self._lock:
            self._fallbacks[to] += 1

    def _replicas(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._replicating is None:
                self._replicating = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="replicate")
            return self._replicating

    def ask(self, member: str, req: wire.BlockRequest,
            urgent: Callable[[], bool] | None = None) -> tuple[bytes | None] | None:
        """(the answer,) of ``member``, or None if it failed (distrusted where it must be). A busy
        member is asked again, after the pause it names, until the tier's timeout has passed."""
        deadline = time.monotonic() + self.client.timeout
        while True:
            try:
                data = self.client.get(member, req, urgent)
                break
            except PeerFailure as exc:
                if exc.kind == "busy":
                    with self._lock:
                        self._outcomes["busy"] += 1
                    pause = exc.retry_after * random.uniform(0.2, 1.0)
                    if time.monotonic() + pause < deadline:
                        time.sleep(pause)
                        continue
                    log.debug("peer %s: busy for %.1fs; asking elsewhere", member, self.client.timeout)
                    return None
                if not (req.stored and exc.kind == "declined" and exc.status == 404):  # (not held there: fine)
                    self._failed(member, exc)
                return None
        with self._lock:
            self._outcomes["ok"] += 1
            self._declines.pop(member, None)
            self._bytes_in += len(data) if data else 0
        return (data,)

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
            self.members.distrust(owner, str(exc), refused=refusal(exc))
        else:
            log.debug("peer %s: %s; reading from the backend", owner, exc)

    def statistics(self, served: ServerStats | None = None,
                   share: tuple[int | None, int | None] = (None, None), link_capacity: float | None = None) -> PeerStats:
        """The tier's counts, with what this node's peer server answered (``served``), its ``share``
        of the dataset (bytes owned, of bytes in all: :class:`~epochfs.peer.share.ShareWatch`) and the
        capacity of the link it serves over (:mod:`epochfs.links`)."""
        with self._lock:
            outcomes = {**dict.fromkeys(OUTCOMES, 0), **self._outcomes}
            fallbacks = {"replica": self._fallbacks["replica"], "backend": self._fallbacks["backend"]}
            bytes_in = self._bytes_in
        if served is not None:
            outcomes["served"] = served.served
            outcomes["rejected"] = served.rejected
        ring, me = self.members.ring, self.members.me
        own = ring.cache_of(me)
        return PeerStats(me=me, mode=self.mode, members=ring.members, down=self.members.down(),
                         store_reachable=self.members.reachable, requests=outcomes, bytes_in=bytes_in,
                         bytes_out=served.served_bytes if served else 0, role=self.members.role,
                         replicas=self.replicas, link_capacity=link_capacity, share_bytes=share[0],
                         dataset_bytes=share[1], cache_size_bytes=own,
                         tier_cache_bytes=ring.cache_bytes() if own is not None else None, fallbacks=fallbacks,
                         refusing=self.members.refusing(), store_error=self.members.unreachable,
                         closed=dict(served.closed) if served is not None else None, gates=self.client.gates(),
                         bytes_out_from_files=served.served_from_files if served else 0)


class PeerAnswers:
    """Answers to other members' block requests, from this node's cache (trio thread)."""

    def __init__(self, cache: PeerCache, namespace: Callable[[], Namespace]) -> None:
        self.cache = cache
        self.namespace = namespace

    async def serve(self, req: wire.BlockRequest, by_digest: bool = False) -> bytes | Bound | None:
        """The answer to a block request: its bytes, read and checked (None to a warm request); or, to
        an asker that takes an answer bound by digest (``by_digest``), a :class:`Bound`: the cached
        block's range of its file for the kernel to send, or the bytes read with their digest."""
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
        if by_digest and not req.warm and (extent := cache.extent_for_peer(obj, req.index)) is not None:
            return Bound(extent.digest, extent.length, fd=extent.fd, offset=extent.offset,
                         done=functools.partial(cache.sent, extent))
        if req.stored:
            data = await cache.read_stored(obj, req.index)
            if data is None:
                raise wire.Rejected(404, "not held here")
        else:
            try:
                data = await cache.read_for_peer(obj, req.index, req.warm)
            except ObjectChanged as exc:
                raise wire.Rejected(412, str(exc)) from None
            except EpochfsError as exc:
                raise wire.Rejected(503, str(exc)) from None
        if data is None or not by_digest:
            return data
        return Bound(await cache.digest_for_peer(obj, req.index, data), len(data), data=data)
