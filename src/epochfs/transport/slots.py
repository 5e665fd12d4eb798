"""Connection slots a client must earn, for the servers that any local user (or the network) can reach.

A server holds at most ``capacity`` connections. A new connection gets a slot at once; it *earns* it by
what it sends (a complete request, an authenticated one). When the slots are full, a new connection
takes the slot of the oldest one that has not earned its own, and has had ``grace`` seconds to (an
honest client asks as it connects; one just opened may have its request on the way), whose handler is
cancelled; failing that,
of the oldest one whose answer is being sent (:attr:`Slot.sending`: a client that asks and never reads
holds nothing once it has been answered as far as its socket takes); failing that, of the oldest one
that waits between requests (:attr:`Slot.idle`: a kept-alive connection that asks nothing now; its
client opens another when it asks again); if every slot is earned and working, the new connection is
refused. So connections that open and send nothing, or ask and never
read, cannot hold a server shut: an honest client is served as soon as it asks. Not thread-safe (the
trio thread owns it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio


@dataclass(eq=False)
class Slot:
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)  # the connection's handler runs in it
    earned: bool = False
    sending: bool = False  # its answer is being written: the client has been served all it reads
    idle: bool = False  # earned, and waiting for the connection's next request
    opened: float = field(default_factory=trio.current_time)


class Slots:
    def __init__(self, capacity: int, grace: float = 0.0) -> None:
        self.capacity = capacity
        self.grace = grace
        self._held: dict[Slot, None] = {}  # insertion order: the oldest first

    def take(self) -> Slot | None:
        """A slot for a new connection, or None when every slot is earned."""
        if len(self._held) >= self.capacity:
            now = trio.current_time()
            oldest = next((s for s in self._held if not s.earned and now - s.opened >= self.grace), None) or next(
                (s for s in self._held if s.sending), None) or next((s for s in self._held if s.idle), None)
            if oldest is None:
                return None
            del self._held[oldest]
            oldest.scope.cancel()
        slot = Slot()
        self._held[slot] = None
        return slot

    def release(self, slot: Slot) -> None:
        self._held.pop(slot, None)

    def __len__(self) -> int:
        return len(self._held)
