"""What the members a node reads from say of themselves: how much of the dataset they hold and how busy
their links are, read from their published statistics (:mod:`.published`) every :data:`TierLoad.INTERVAL`
seconds, for the members of this node's ring only (a few; never the whole published list). A reader
of the cache nodes uses it to tell a cold tier from a busy one (``epochfs doctor``); the figures are
what the members claim, advice and nothing more.

Concurrency contract: a trio task; the store is read in a worker thread; :meth:`TierLoad.statistics`
on the trio thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from epochfs.peer.published import published_stats

log = logging.getLogger(__name__)


class StatsStore(Protocol):
    def member_stats_of(self, source: str, members: list[str]) -> dict[str, bytes]: ...


@dataclass(frozen=True)
class MemberLoad:
    member: str
    held_bytes: int | None
    capacity_bytes: int | None
    utilization: float | None  # of its link, over its last heartbeat
    link_capacity: float | None
    link_source: str | None
    out_bytes_per_second: float | None
    age_seconds: float | None  # since it published them


class TierLoad:
    INTERVAL = 10.0
    MAX_MEMBERS = 64  # members read at most (a ring of more is read in part)

    def __init__(self, store: StatsStore, source: str, members: Callable[[], tuple[str, ...]]) -> None:
        self.store = store
        self.source = source
        self.members = members  # the members this node reads from (its ring, without itself)
        self._loads: tuple[MemberLoad, ...] = ()

    def statistics(self) -> tuple[MemberLoad, ...]:
        return self._loads

    async def refresh(self) -> None:
        wanted = list(self.members())[:self.MAX_MEMBERS]
        if not wanted:
            self._loads = ()
            return
        try:
            raw = await trio.to_thread.run_sync(self.store.member_stats_of, self.source, wanted)
        except Exception as exc:  # noqa: BLE001 - the store down: the last figures stay, marked by their age
            log.debug("reading the members' statistics failed: %s", exc)
            return
        now = time.time()
        self._loads = tuple(load_of(m, published_stats(raw.get(m)), now) for m in wanted)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.refresh()
            await trio.sleep(self.INTERVAL)


def load_of(member: str, published: dict[str, Any] | None, now: float) -> MemberLoad:
    p = published or {}
    updated = p.get("updated")
    return MemberLoad(member, p.get("held_bytes"), p.get("capacity_bytes"), p.get("utilization"),
                      p.get("link_capacity"), p.get("link_source"), p.get("out_bytes_per_second"),
                      max(0.0, now - updated) if isinstance(updated, float) else None)
