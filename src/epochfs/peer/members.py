"""Cluster membership through the shared Redis store: no other coordination service.

Each member renews itself in its role's sorted set every ``HEARTBEAT`` seconds, with an expiry ``TTL``
seconds ahead by the store's clock; a member that stops renewing (killed, partitioned) drops out of every
node's view within ``TTL`` plus one heartbeat.

**Roles.** A ``peer`` is a GPU node's mount that serves (the tier among GPU nodes); a ``server`` is a
dedicated cache node (``epochfs serve``); a ``client`` is a mount that asks and never serves: it is
listed nowhere, so it never owns a block and its coming and going moves nothing. Where any server is
proven, the servers own every block (a GPU node's cache is volatile, a cache node's is not); else the
peers do. A server looks at servers only.

Anyone who can write to the store can add an entry, so an entry is only a candidate. It must be a
literal IP address and port of this node's address family (nothing is resolved by name), and it must
prove that it holds the cluster's token (a hello whose answer is authenticated, bound to a fresh
request for that address) before it is asked for a block. A candidate that fails its proof is tried
again after a backoff (``RETRY_MIN`` doubling to ``RETRY_MAX``); a member whose answers fail later (no
answer, an unauthenticated one, errors) is distrusted at once (:meth:`Membership.distrust`) and must
prove itself again. The ring holds this node and the proven members only.

**Weights.** A member's share of the blocks follows the size of its cache (:mod:`epochfs.peer.ring`),
which it states in its proof: authenticated like the proof itself, so only a holder of the token can
state it, never a writer of the store. This node's own is its ``capacity``. Where a member stated none
(a member of an older version) every member is ranked with the same weight, as before weights existed:
the nodes of a fleet rank alike as long as they see the same members and the same sizes. A member that
restarts with another cache size states it at its next proof (every member is asked again every
``REPROVE`` seconds; one that fails to answer that is kept as it was and asked again after ``RETRY_MIN``:
its answers to readers decide whether it is trusted).

Concurrency contract: :meth:`Membership.run` is a trio task (heartbeats and proofs); the Redis calls and
the proofs run in worker threads; :meth:`distrust` may be called from any thread; :attr:`ring` is
replaced whole under a lock (readers in worker threads see the old ring or the new one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import trio

from epochfs.core.errors import BackendUnavailable
from epochfs.core.text import printable
from epochfs.peer.ring import Ring, ring_weights
from epochfs.peer.wire import CLOCK_SKEW, member_addr, same_family

log = logging.getLogger(__name__)

#: What to do when members refuse this node's token (said in its log, status and doctor).
REFUSED_FIX = ("its answers are not authenticated with this node's token (HTTP 401): the nodes hold different "
               "peer tokens (make the cluster's token once and copy the same file to every node: "
               f"peer_token_file), or their clocks are more than {CLOCK_SKEW // 60} minutes apart")


def refusal(exc: BaseException) -> bool:
    """Whether a failed exchange was a member refusing this node's token (an answer 401, not authenticated)."""
    return getattr(exc, "status", 0) == 401 and getattr(exc, "kind", "") == "bad"


MAX_MEMBERS = 10_000
MAX_SESSION = 200  # characters of a client's session name


ROLES = ("peer", "server", "client")


class MemberStore(Protocol):
    def heartbeat(self, source: str, member: str | None, ttl: float, limit: int,
                  role: str = "peer") -> dict[str, list[bytes]]: ...

    def publish_stats(self, source: str, member: str, stats: bytes) -> None: ...

    def leave(self, source: str, member: str, role: str = "peer") -> None: ...


# Raises (with the reason) unless the member proved it holds the token; returns the size of its cache that
# its proof stated (None where it stated none).
Prove = Callable[[str], "int | None"]
Stats = Callable[[], bytes]  # what this member publishes of itself at each heartbeat (epochfs cluster status)


class Membership:
    HEARTBEAT = 2.0
    TTL = 6.0
    RETRY_MIN, RETRY_MAX = 5.0, 300.0  # backoff of a candidate that failed its proof
    PROOFS_AT_ONCE = 16
    PROOF_INTERVAL = 0.5  # how often the prover looks for candidates due
    REPROVE = 300.0  # a proven member is asked again after this long (a cache size it changed is learnt)

    def __init__(self, store: MemberStore, source: str, me: str, prove: Prove, *, role: str = "peer",
                 stats: Stats | None = None, capacity: int | None = None, session: str | None = None) -> None:
        if role not in ROLES:
            raise ValueError(role)
        self.store = store
        self.source = source
        self.me = me
        # A client's name in the list of sessions (``cluster status`` shows who reads; never a member).
        self.session = session[:MAX_SESSION] if session and role == "client" else None
        self.prove = prove
        self.role = role
        self.stats = stats
        self.capacity = capacity  # this node's cache in bytes: its weight, as its proof states it
        self.ring = Ring([] if role == "client" else [me])
        self.reachable = True
        self.unreachable: str | None = None  # why the store did not answer the last heartbeat
        self._lock = threading.Lock()
        self._listed: dict[str, str] = {}  # valid candidates in the store's lists (not this node) -> role
        self._proven: set[str] = set()
        self._capacity: dict[str, int | None] = {}  # proven member -> the cache size its proof stated
        self._proved_at: dict[str, float] = {}  # proven member -> when (monotonic)
        self._retry: dict[str, tuple[float, float]] = {}  # member -> (not before (monotonic), backoff)
        self._proving: set[str] = set()
        self._refusing: set[str] = set()  # members whose last word was a refusal of this node's token (401)
        self._ignored: set[bytes] = set()
        self._wake = trio.Event()

    def rename(self, me: str) -> None:
        """This member's address, once it is known (a port the system picked); before :meth:`run`."""
        self.me = me
        self.ring = Ring([] if self.role == "client" else [me])

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.beat()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._prover)
                task_status.started()
                while True:
                    await trio.sleep(self.HEARTBEAT)
                    await self.beat()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await trio.to_thread.run_sync(self._leave, abandon_on_cancel=True)

    async def beat(self) -> None:
        """Renew this node's entry and take the store's list of candidates."""
        me = self.session if self.role == "client" else self.me
        try:
            raw = await trio.to_thread.run_sync(self.store.heartbeat, self.source, me, self.TTL, MAX_MEMBERS,
                                                self._role_listed)
        except BackendUnavailable as exc:  # (a password refused under a running node too: said why)
            if self.reachable:
                log.warning("peer membership: %s; keeping the last member list", exc)
            self.reachable = False
            self.unreachable = str(exc)[:300]
            return
        if not self.reachable:
            log.info("peer membership: the store answers again")
        self.reachable = True
        self.unreachable = None
        if self.stats is not None and me is not None:
            try:
                await trio.to_thread.run_sync(self.store.publish_stats, self.source, me, self.stats())
            except BackendUnavailable:
                pass  # (the next heartbeat publishes them again)
        listed: dict[str, str] = {}
        for role, entries in raw.items():
            if role == "client" or (self.role == "server" and role != "server"):
                continue  # (a cache node serves from the backend and the other cache nodes only)
            for m in map(self._checked, entries):
                if m is not None and m != self.me:
                    listed.setdefault(m, role)
        with self._lock:
            self._listed = listed
            self._proven &= listed.keys()
            for member in [m for m in self._retry if m not in listed]:
                del self._retry[member]
            self._refusing &= listed.keys()
            self._rebuild()
        self._wake.set()

    async def _prover(self) -> None:
        while True:
            self._wake = trio.Event()
            await self.prove_due()
            with trio.move_on_after(self.PROOF_INTERVAL):
                await self._wake.wait()

    async def prove_due(self) -> None:
        """Ask every candidate that is due for its proof (at most ``PROOFS_AT_ONCE`` at a time); returns
        when they have answered or timed out."""
        now = time.monotonic()
        with self._lock:
            due = [m for m in self._listed if m not in self._proving
                   and (m not in self._proven and self._retry.get(m, (0.0, 0.0))[0] <= now
                        or m in self._proven and now - self._proved_at.get(m, now) > self.REPROVE)]
            self._proving.update(due)
        if not due:
            return
        limiter = trio.CapacityLimiter(self.PROOFS_AT_ONCE)
        async with trio.open_nursery() as nursery:
            for member in due:
                nursery.start_soon(self._prove, member, limiter)

    async def _prove(self, member: str, limiter: trio.CapacityLimiter) -> None:
        try:
            capacity = await trio.to_thread.run_sync(self.prove, member, limiter=limiter, abandon_on_cancel=True)
        except Exception as exc:  # noqa: BLE001 - any failure is a failed proof
            self._failed(member, str(exc), refused=refusal(exc))
        else:
            with self._lock:
                self._refusing.discard(member)
                if member in self._listed:
                    self._proven.add(member)
                    self._capacity[member] = capacity if isinstance(capacity, int) else None
                    self._proved_at[member] = time.monotonic()
                    self._retry.pop(member, None)
                    self._rebuild()
        finally:
            self._proving.discard(member)

    def _failed(self, member: str, why: str, refused: bool = False) -> None:
        with self._lock:
            if refused and member in self._listed:
                if member not in self._refusing:
                    log.error("peer %s refuses this node's token: %s", member, REFUSED_FIX)
                self._refusing.add(member)
            if member in self._proven:
                # A re-proof (asked for its cache size) that failed: the member stays with the weight it
                # stated, and is asked again after a backoff. What it answers readers decides whether
                # it is trusted (distrust); a hello slow under load must not move its blocks.
                self._proved_at[member] = time.monotonic() - self.REPROVE + self.RETRY_MIN
                log.info("peer %s: asked for its proof again, no answer (%s); kept", member, printable(why))
                return
            _, backoff = self._retry.get(member, (0.0, 0.0))
            backoff = min(self.RETRY_MAX, max(self.RETRY_MIN, 2 * backoff))
            self._retry[member] = (time.monotonic() + backoff, backoff)
            first = backoff == self.RETRY_MIN
        if first:
            log.warning("peer %s not trusted, asked again in %.0fs: %s", member, backoff, printable(why))

    def distrust(self, member: str, why: str, refused: bool = False) -> None:
        """``member`` answered wrongly or not at all (``refused``: it refused this node's token): out of the
        ring until it proves itself again."""
        with self._lock:
            if refused and member in self._listed:
                self._refusing.add(member)
            if member not in self._proven:
                return
            self._proven.discard(member)
            self._retry[member] = (time.monotonic() + self.RETRY_MIN, self.RETRY_MIN)
            self._rebuild()
        log.warning("peer %s bypassed, asked to prove itself again in %.0fs: %s", member, self.RETRY_MIN,
                    printable(why))

    def settled(self) -> bool:
        """Whether every listed candidate has been tried at least once (proven, or failed its proof)."""
        with self._lock:
            return not self._proving and all(m in self._proven or m in self._retry for m in self._listed)

    def refusing(self) -> tuple[str, ...]:
        """Listed members whose last answer refused this node's token: it reads from elsewhere (the
        backend) what they own, until the tokens agree."""
        with self._lock:
            return tuple(sorted(self._refusing))

    def down(self) -> tuple[str, ...]:
        """Listed members that are not (or no longer) trusted: bypassed."""
        with self._lock:
            return tuple(sorted(self._listed.keys() - self._proven))

    @property
    def _role_listed(self) -> str:
        return self.role

    def _rebuild(self) -> None:  # (under the lock)
        for gone in self._capacity.keys() - self._proven:
            del self._capacity[gone]
            self._proved_at.pop(gone, None)
        servers = {m for m in self._proven if self._listed.get(m) == "server"}
        if self.role == "server":
            servers.add(self.me)
        if servers:
            members = servers
        else:
            members = {*self._proven, *([self.me] if self.role == "peer" else [])}
        ring = Ring(members, ring_weights(members, {**self._capacity, self.me: self.capacity}))
        if ring != self.ring:
            joined, left = set(ring.members) - set(self.ring.members), set(self.ring.members) - set(ring.members)
            if joined or left:
                log.info("peer members: %d (%s)", len(ring), ", ".join(
                    [f"+{m}" for m in sorted(joined)] + [f"-{m}" for m in sorted(left)]))
            else:
                log.info("peer members: weighed by their caches %s", ", ".join(
                    f"{m} {w} MiB" for m, w in zip(ring.members, ring.weights, strict=True)) if ring.sized
                    else "alike (a member states no cache size)")
            self.ring = ring

    def _checked(self, item: object) -> str | None:
        text = None
        if isinstance(item, bytes) and len(item) <= 64:
            try:
                text = member_addr(item.decode("ascii"))
            except UnicodeDecodeError:
                pass
        if text is None or not same_family(text, self.me):
            if isinstance(item, bytes) and item not in self._ignored and len(self._ignored) < 1000:
                self._ignored.add(item)
                log.warning("peer membership: ignoring %r in the member list (not a literal IP:PORT of this "
                            "node's address family)", item[:80])
            return None
        return text

    def _leave(self) -> None:
        name = self.session if self.role == "client" else self.me
        if name is None:
            return
        try:
            self.store.leave(self.source, name, self._role_listed)
        except BackendUnavailable as exc:
            log.info("could not leave the member list (%s); it expires in %.0fs", exc, self.TTL)

