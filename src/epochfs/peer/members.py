"""Cluster membership through the shared Redis store: no other coordination service.

Each member renews itself in a sorted set every ``HEARTBEAT`` seconds, with an expiry ``TTL`` seconds
ahead by the store's clock; a member that stops renewing (killed, partitioned) drops out of every node's
view within ``TTL`` plus one heartbeat. Concurrency contract: :meth:`Membership.run` is a trio task; the
Redis calls run in a worker thread; :attr:`Membership.ring` is replaced whole (readers in worker threads
see the old ring or the new one).

What the store returns is validated here: a member that is not ``HOST:PORT`` is ignored (and logged
once), at most ``MAX_MEMBERS`` are taken.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from epochfs.errors import BackendUnavailable
from epochfs.peer.ring import Ring
from epochfs.peer.wire import split_addr

log = logging.getLogger(__name__)

MAX_MEMBERS = 10_000
class MemberStore(Protocol):
    def heartbeat(self, source: str, member: str, ttl: float, limit: int) -> list[bytes]: ...

    def leave(self, source: str, member: str) -> None: ...


class Membership:
    HEARTBEAT = 2.0
    TTL = 6.0

    def __init__(self, store: MemberStore, source: str, me: str) -> None:
        self.store = store
        self.source = source
        self.me = me
        self.ring = Ring([me])
        self.reachable = True
        self._ignored: set[bytes] = set()

    def rename(self, me: str) -> None:
        """This member's address, once it is known (a port the system picked); before :meth:`run`."""
        self.me = me
        self.ring = Ring([me])

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.beat()
        task_status.started()
        try:
            while True:
                await trio.sleep(self.HEARTBEAT)
                await self.beat()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await trio.to_thread.run_sync(self._leave, abandon_on_cancel=True)

    async def beat(self) -> None:
        try:
            raw = await trio.to_thread.run_sync(self.store.heartbeat, self.source, self.me, self.TTL, MAX_MEMBERS)
        except BackendUnavailable as exc:
            if self.reachable:
                log.warning("peer membership: %s; keeping the last member list", exc)
            self.reachable = False
            return
        if not self.reachable:
            log.info("peer membership: the store answers again")
        self.reachable = True
        members = {self.me}
        for item in raw:
            member = self._checked(item)
            if member is not None:
                members.add(member)
        ring = Ring(members)
        if ring != self.ring:
            joined, left = set(ring.members) - set(self.ring.members), set(self.ring.members) - set(ring.members)
            log.info("peer members: %d (%s)", len(ring), ", ".join(
                [f"+{m}" for m in sorted(joined)] + [f"-{m}" for m in sorted(left)]))
            self.ring = ring

    def _checked(self, item: object) -> str | None:
        text = None
        if isinstance(item, bytes) and len(item) <= 300:
            try:
                text = item.decode("ascii")
            except UnicodeDecodeError:
                pass
        if text is None or split_addr(text) is None:
            if isinstance(item, bytes) and item not in self._ignored and len(self._ignored) < 1000:
                self._ignored.add(item)
                log.warning("peer membership: ignoring %r in the member list (not HOST:PORT)", item[:80])
            return None
        return text

    def _leave(self) -> None:
        try:
            self.store.leave(self.source, self.me)
        except BackendUnavailable as exc:
            log.info("could not leave the member list (%s); it expires in %.0fs", exc, self.TTL)
