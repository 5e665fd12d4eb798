"""The daemon's view of its links, kept current: every :data:`~epochfs.links.meter.WINDOW` seconds each
meter looks at the window just ended, and every :data:`LinkWatch.PROBE` seconds the interfaces are read
again (in a worker thread: ``tc`` runs there), since a route or a shaping can change under a running
daemon. A capacity that changes where it comes from is logged once.

Concurrency contract: runs on the trio thread; :meth:`LinkWatch.view` is read there too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from epochfs.links.capacity import LinkView, choose
from epochfs.links.interface import InterfaceCapacity, rate_text
from epochfs.links.meter import WINDOW, TransferMeter

log = logging.getLogger(__name__)


@dataclass
class Link:
    """One link the daemon measures against a capacity: the backend's, or a cache node's own."""

    name: str  # in the log: "backend link", "peer link"
    flag: str  # the option that declares its capacity
    declared: float | None
    meter: TransferMeter | None
    probe: Callable[[], InterfaceCapacity | None] | None  # blocking: run in a worker thread
    interface: InterfaceCapacity | None = None
    said: str | None = None  # the source last logged


class LinkWatch:
    PROBE = 60.0

    def __init__(self, links: dict[str, Link]) -> None:
        self.links = links

    def view(self, key: str) -> LinkView | None:
        link = self.links.get(key)
        if link is None:
            return None
        meter = link.meter
        return choose(link.declared, link.interface, meter.measured() if meter else None, link.flag,
                      meter.busy_seconds if meter else 0.0)

    async def _probe(self) -> None:
        for link in self.links.values():
            if link.probe is not None and not link.declared:
                link.interface = await trio.to_thread.run_sync(link.probe)

    def _sample(self) -> None:
        for key, link in self.links.items():
            if link.meter is not None:
                link.meter.sample()
            view = self.view(key)
            source = view.capacity.source if view and view.capacity else None
            if source != link.said and view is not None:
                if view.capacity is not None:
                    log.info("%s: %s (%s)", link.name, rate_text(view.capacity.bytes_per_second), view.capacity.detail)
                elif link.said is not None:
                    log.info("%s: capacity no longer known", link.name)
                link.said = source

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._probe()
        self._sample()
        task_status.started()
        since_probe = 0.0
        while True:
            await trio.sleep(WINDOW)
            since_probe += WINDOW
            if since_probe >= self.PROBE:
                since_probe = 0.0
                await self._probe()
            self._sample()
