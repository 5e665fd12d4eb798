"""The peer port and its clients under load, without a mount: more members asking than the port has
slots. An answer being sent is never cut off, a full port answers busy (authenticated) and the members
ask again instead of bypassing it, idle kept-alive connections give up their slots first, an answer
that moves no byte is closed with its reason counted, and a client keeps to its gate of requests in
flight to a member."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio

from epochfs.peer import wire
from epochfs.peer.client import PeerClient, PeerFailure
from epochfs.peer.server import PeerServer
from epochfs.transport.slots import Slots

KEYS = wire.Keys(b"a-token-of-enough-length-for-tests")
BLOCK = bytes(range(256)) * 4096  # 1 MiB


class Port:
    """A peer port on 127.0.0.1 in a thread of its own: its answers ``answer(request, by_digest)``, after
    ``delay`` seconds (default: the first bytes of :data:`BLOCK`); ``asked`` says, per request, whether
    the asker took an answer bound by digest."""

    def __init__(self, *, slots: int = 128, waiting: int = 64, delay: float = 0.0, stall: float | None = None,
                 answer: Callable[[wire.BlockRequest, bool], Any] | None = None) -> None:
        self.delay = delay
        self.answer = answer or (lambda req, by_digest: BLOCK[:req.length])
        self.asked: list[bool] = []
        self.inflight = self.most = 0
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        server_cls = type("Small", (PeerServer,), {"MAX_CONNECTIONS": slots, "UNAUTHENTICATED": waiting,
                                                   **({"STALL": stall} if stall is not None else {})})
        self.server = server_cls("127.0.0.1", 0, KEYS, lambda: self.addr, self.serve)
        self.addr = ""
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def serve(self, req: wire.BlockRequest, by_digest: bool = False) -> Any:
        self.asked.append(by_digest)
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        try:
            await trio.sleep(self.delay)
            return self.answer(req, by_digest)
        finally:
            self.inflight -= 1

    async def _main(self) -> None:
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as n:
            await n.start(self.server.run)
            self.addr = f"127.0.0.1:{self.server.port}"
            self._ready.set()
            await self._stop.wait()
            n.cancel_scope.cancel()

    def close(self) -> None:
        assert self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(10)


def request(i: int = 0, length: int = len(BLOCK)) -> wire.BlockRequest:
    return wire.BlockRequest(bytes([i % 256]) * 16, f"d/{i}.bin", '"e"', 0, length)


def ask_all(clients: list[PeerClient], addr: str, n: int) -> tuple[list[bytes | None], list[str]]:
    got: list[bytes | None] = [None] * n
    failed: list[str] = []
    for client in clients:  # (the proof the membership asks first: it says when the member started)
        client.hello(addr, 5.0)

    def one(i: int) -> None:
        client = clients[i % len(clients)]
        deadline = time.monotonic() + 20
        while True:  # (what the tier does with a busy member: ask again after the pause it names)
            try:
                got[i] = client.get(addr, request(i))
                return
            except PeerFailure as exc:
                if exc.kind != "busy" or time.monotonic() > deadline:
                    failed.append(f"{exc.kind}: {exc}")
                    return
                time.sleep(exc.retry_after * 0.2)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got, failed


def test_a_full_port_answers_busy_and_no_answer_being_sent_is_cut_off():
    port = Port(slots=4, delay=0.3)
    try:
        clients = [PeerClient(KEYS, timeout=5.0) for _ in range(12)]  # twelve members, one request each
        got, failed = ask_all(clients, port.addr, 12)
        stats = port.server.stats
    finally:
        port.close()
    assert not failed and all(g == BLOCK for g in got)
    assert stats.busy > 0 and stats.closed["busy"] == stats.busy  # told busy, authenticated, and asked again
    assert stats.closed["evicted"] == 0 and stats.closed["stalled"] == 0  # nothing cut off mid-answer
    assert port.most <= 4


def test_a_client_keeps_to_its_gate_of_requests_in_flight_to_a_member():
    port = Port(slots=64, delay=0.2)
    try:
        client = PeerClient(KEYS, timeout=5.0)
        client.START_INFLIGHT = client.MIN_INFLIGHT = client.MAX_INFLIGHT = 3
        got, failed = ask_all([client], port.addr, 24)
        connections = port.server.stats.connections
    finally:
        port.close()
    assert not failed and all(g == BLOCK for g in got)
    assert port.most <= 3  # 24 fetches at once, never more than the gate in flight
    assert connections <= 3 + 1  # and as many connections (the gate's handles keep theirs), and the proof's


def test_status_shows_each_members_requests_in_flight_its_limit_and_the_fetches_waiting():
    from epochfs.cli.status import format_peer

    client = PeerClient(KEYS, timeout=5.0)
    client.START_INFLIGHT = 1
    gate = client._gate("10.0.0.7:9570")
    held = client._borrow("10.0.0.7:9570", gate, None)
    waiter = threading.Thread(target=lambda: client._give_back(gate, client._borrow("10.0.0.7:9570", gate, None),
                                                              4096, 0))
    waiter.start()
    deadline = time.monotonic() + 5
    while not gate.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    gates = client.gates()
    client._give_back(gate, held, 4096, 0)
    waiter.join(5)
    assert gates == {"10.0.0.7:9570": {"in_flight": 1, "limit": 1, "waiting": 1}}
    assert client.gates()["10.0.0.7:9570"] == {"in_flight": 0, "limit": 1, "waiting": 0}
    peer = {"requests": {"ok": 1, "unavailable": 0, "bad": 0, "declined": 0, "served": 0, "rejected": 0},
            "role": "client", "me": "client", "mode": "owned", "members": ["10.0.0.7:9570"], "down": [],
            "store_reachable": True, "bytes_in": 1, "bytes_out": 0, "gates": gates}
    assert "member 10.0.0.7:9570: 1 of 1 requests in flight, 1 waiting" in "\n".join(format_peer(peer))


def test_warm_requests_hold_no_handle_a_block_fetch_needs():
    """A warm request waits while the member fetches the block, possibly from this node: with every
    handle of the block gate held, a warm request to the same member still goes (its own gate), and
    warm requests held never starve a block fetch (two members warming each other would otherwise each
    hold every handle to the other, their fetches waiting for one)."""
    client = PeerClient(KEYS, timeout=5.0)
    client.START_INFLIGHT = 1
    blocks = client._gate("m")
    held = client._borrow("m", blocks, None)
    warm = client._gate("m", warm=True)
    assert warm is not blocks and warm.limit == client.WARM_INFLIGHT
    handles = [client._borrow("m", warm, None) for _ in range(client.WARM_INFLIGHT)]  # (none waits)
    assert blocks.lent == 1 and warm.lent == client.WARM_INFLIGHT
    client._give_back(blocks, held, 4096, 0)
    again = client._borrow("m", blocks, None)  # every warm handle held: a block fetch still goes
    client._give_back(blocks, again, 4096, 0)
    for h in handles:
        client._give_back(warm, h, 4096, 0)
    assert list(client.gates()) == ["m"]  # (status lists the block gates)


def test_the_gate_follows_the_members_rate():
    client = PeerClient(KEYS, timeout=5.0)
    gate = client._gate("m")
    now = time.monotonic()
    with gate.lock:
        for k in range(20):  # 20 MiB in the last 2 s: 10 MiB/s
            gate.done.append((now - 2 + k * 0.1, 1 << 20))
        client._sized(gate, 1 << 20)
        assert gate.limit == 3  # 10 MiB/s x 0.25 s in 1 MiB blocks, rounded up
        gate.done.clear()
        for k in range(20):
            gate.done.append((now - 1 + k * 0.05, 64 << 20))
        client._sized(gate, 1 << 20)
        assert gate.limit == client.MAX_INFLIGHT


def test_a_free_handle_goes_to_the_block_a_reader_waits_for_then_to_the_longest_waiting():
    # One handle, held; four fetches queue for it in order: two prefetches, a demand read, and a
    # prefetch a reader catches up with once it is queued. Handles come free one at a time: the demand
    # and the caught-up prefetch go first (in the order they came), then the others in theirs; a
    # newcomer never overtakes a waiter.
    client = PeerClient(KEYS, timeout=5.0)
    client.START_INFLIGHT = 1
    gate = client._gate("m")
    first = client._borrow("m", gate, None)
    caught_up = threading.Event()
    order: list[str] = []
    lock = threading.Lock()

    def fetch(name: str, urgent) -> None:
        curl = client._borrow("m", gate, urgent)
        with lock:
            order.append(name)
        client._give_back(gate, curl, 4096, 0)

    wanted = {"prefetch-1": None, "prefetch-2": caught_up.is_set, "demand": lambda: True, "prefetch-3": None}
    threads = []
    for name, urgent in wanted.items():
        threads.append(threading.Thread(target=fetch, args=(name, urgent)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while len(gate.waiting) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.005)
    assert len(gate.waiting) == 4
    caught_up.set()  # a reader now waits for prefetch-2's block
    with gate.lock:  # (a newcomer while handles are taken waits behind the queue, not before it)
        assert gate.lent == 1 and gate.limit == 1
    client._give_back(gate, first, 4096, 0)
    for t in threads:
        t.join(5)
    assert order == ["prefetch-2", "demand", "prefetch-1", "prefetch-3"]
    assert gate.lent == 0 and not gate.waiting


def test_a_fetch_that_waits_too_long_for_a_handle_leaves_the_queue_and_says_busy():
    client = PeerClient(KEYS, timeout=0.05)
    client.START_INFLIGHT = 1
    gate = client._gate("m")
    held = client._borrow("m", gate, None)
    with pytest.raises(PeerFailure) as exc:
        client._borrow("m", gate, lambda: True)
    assert exc.value.kind == "busy" and not gate.waiting and gate.lent == 1
    client._give_back(gate, held, 4096, 0)
    assert gate.lent == 0


def test_idle_kept_alive_connections_give_up_their_slots_first_and_busy_ones_are_kept():
    async def main():
        slots = Slots(3)
        a, b, c = slots.take(), slots.take(), slots.take()
        assert all(slots.earn(s) for s in (a, b, c))
        b.idle = True
        d = slots.take()
        assert slots.earn(d)  # the idle one gives way
        assert b.scope.cancel_called and not a.scope.cancel_called
        e = slots.take()
        assert not slots.earn(e)  # every slot earned and working: refused (the port then says busy)
        assert not any(s.scope.cancel_called for s in (a, c, d, e))
    trio.run(main)


def test_connections_that_never_ask_push_out_only_each_other():
    async def main():
        slots = Slots(2, waiting=3)
        member = slots.take()
        assert slots.earn(member)
        silent = [slots.take() for _ in range(3)]
        newest = [slots.take() for _ in range(3)]  # each a new one: the oldest unearned one gives way
        assert all(s.scope.cancel_called for s in silent) and slots.evicted == 3
        assert not member.scope.cancel_called and not any(s.scope.cancel_called for s in newest)
        assert slots.earn(newest[0]) and len(slots) == 4  # (two earned, two still waiting)
    trio.run(main)


def test_a_flood_of_connections_without_the_token_never_closes_a_members_request():
    """A client without the token opening connections as fast as it can and sending nothing (each new one
    young, so no grace protects anything): the members' signed requests are all answered, none closed
    unanswered or failed, and the member is never told anything but the blocks (round 5's guard)."""
    port = Port(slots=8, waiting=64, delay=0.01)
    stop = threading.Event()
    opened = [0]

    def flood() -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            try:
                held.append(socket.create_connection(("127.0.0.1", port.server.port), timeout=2))
                opened[0] += 1
            except OSError:
                time.sleep(0.001)
            if len(held) > 400:
                held.pop(0).close()
        for s in held:
            s.close()

    flooders = [threading.Thread(target=flood) for _ in range(4)]
    try:
        for t in flooders:
            t.start()
        time.sleep(0.5)
        clients = [PeerClient(KEYS, timeout=5.0) for _ in range(4)]
        got, failed = ask_all(clients, port.addr, 80)
        stats = port.server.stats
    finally:
        stop.set()
        for t in flooders:
            t.join(10)
        port.close()
    assert opened[0] > 400, opened  # (the flood happened: past every pool)
    assert not failed and all(g == BLOCK for g in got), failed[:5]
    assert stats.closed["evicted"] > 0  # the flood's connections pushed each other out


def test_an_answer_that_moves_no_byte_is_closed_and_counted():
    port = Port(slots=8, stall=1.0)
    try:
        prover = PeerClient(KEYS, timeout=5.0)
        prover.hello(port.addr, 5.0)
        headers, _ = KEYS.headers(port.addr, request(1, 8 << 20).target(), max(time.time(), prover._since[port.addr]))
        global BLOCK
        saved, BLOCK = BLOCK, bytes(8 << 20)
        try:
            s = socket.create_connection(("127.0.0.1", port.server.port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(f"GET {request(1, 8 << 20).target()} HTTP/1.1\r\nHost: x\r\n".encode()
                      + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() + b"\r\n")
            deadline = time.monotonic() + 15  # never read: the answer stops moving
            while not port.server.stats.closed["stalled"] and time.monotonic() < deadline:
                time.sleep(0.2)
            s.close()
        finally:
            BLOCK = saved
        assert port.server.stats.closed["stalled"] == 1
    finally:
        port.close()


@pytest.mark.parametrize("kind", ["busy", "unavailable"])
def test_the_tier_asks_a_busy_member_again_and_never_distrusts_it(kind):
    from epochfs.peer.tier import PeerTier

    class Members:
        role, me, down_calls = "client", "me:1", []
        ring = None

        def distrust(self, member, why, refused=False):
            self.down_calls.append(member)

    class Client:
        timeout = 1.0
        calls = 0

        def get(self, member, req, urgent=None):
            self.calls += 1
            if self.calls < 3:
                raise PeerFailure(kind, "x", 503, 0.05)
            return b"ok"

    members = Members()
    tier = PeerTier.__new__(PeerTier)
    tier.__init__(None, members, Client(), mode="all")
    got = tier.ask("m:1", request())
    if kind == "busy":
        assert got == (b"ok",) and not members.down_calls and tier._outcomes["busy"] == 2
    else:
        assert got is None and members.down_calls == ["m:1"]
