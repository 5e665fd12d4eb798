"""Connection slots a client must earn, for the servers that any local user (or the network) can reach.

Two pools. A new connection always gets a place among the connections that have not earned a slot yet
(at most ``waiting`` of them): when that pool is full, the oldest of them is let go (its handler is
cancelled), however young it is. An honest client asks as it connects, so it earns its slot (a complete
request, an authenticated one) long before ``waiting`` newer connections arrive; connections that open
and send nothing, or drip, only push each other out. Earning moves a connection into the pool of
``capacity`` earned slots; when that is full, it takes the slot of the oldest one whose answer is being
sent (:attr:`Slot.sending`: a client that asks and never reads holds nothing once it has been answered
as far as its socket takes), failing that of the oldest one that waits between requests
(:attr:`Slot.idle`: a kept-alive connection that asks nothing now; its client opens another when it
asks again); if every earned slot is working, :meth:`Slots.earn` says no (the server then answers busy).
So no number of connections without a request (or without the token) can keep an earned request from
being answered, nor close one: only a connection that earned its slot holds one. Not thread-safe (the
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
    def __init__(self, capacity: int, waiting: int | None = None) -> None:
        self.capacity = capacity
        self.waiting = capacity if waiting is None else waiting
        self._earned: dict[Slot, None] = {}  # insertion order: the oldest first
        self._unearned: dict[Slot, None] = {}
        self.evicted = 0  # connections let go before they earned a slot (newer ones came)

    def take(self) -> Slot:
        """A place for a new connection among those that have not earned a slot (the oldest of them
        gives way when they are ``waiting``)."""
        if len(self._unearned) >= self.waiting:
            oldest = next(iter(self._unearned))
            del self._unearned[oldest]
            oldest.scope.cancel()
            self.evicted += 1
        slot = Slot()
        self._unearned[slot] = None
        return slot

    def earn(self, slot: Slot) -> bool:
        """``slot``'s connection sent a complete (authenticated) request: give it an earned slot; False
        when every earned slot holds a connection being answered (then answer it busy, and close it: it
        is in neither pool from now on, so no newer connection cuts that answer off either)."""
        if slot.earned:
            return True
        if len(self._earned) >= self.capacity:
            victim = next((s for s in self._earned if s.sending), None) or next(
                (s for s in self._earned if s.idle), None)
            if victim is None:
                self._unearned.pop(slot, None)
                return False
            del self._earned[victim]
            victim.scope.cancel()
        self._unearned.pop(slot, None)
        self._earned[slot] = None
        slot.earned = True
        return True

    def release(self, slot: Slot) -> None:
        self._earned.pop(slot, None)
        self._unearned.pop(slot, None)

    def __len__(self) -> int:
        return len(self._earned) + len(self._unearned)
