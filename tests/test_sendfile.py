"""Answers to other members sent from the cache's files by the kernel (``sendfile``), bound by the block's
digest taken at fill, without a mount: the store keeps a block's range on disk while it is sent (an
eviction meanwhile lets go of it after), the peer port sends it with no byte through Python, the receiver
checks every byte against the digest (a block that rotted on disk is refused, never used), and an asker
of an older version, which knows only answers MAC'ed over their bodies, still gets those."""

from __future__ import annotations

import os
import random
import time

import pytest

from epochfs.blockstore.format import digest
from epochfs.blockstore.objects import Place
from epochfs.blockstore.store import BlockStore
from epochfs.eviction.lru import LruPolicy
from epochfs.peer import wire
from epochfs.peer.client import PeerClient, PeerFailure
from epochfs.peer.server import Bound

from .test_peer_load import KEYS, Port

MiB = 1 << 20


def bid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def store_at(tmp_path, packing: bool = False) -> BlockStore:
    s = BlockStore(tmp_path / "cache", 1 << 30, 0.0, LruPolicy())
    s.open()
    s.packing = packing
    s.digests = True
    return s


def fill(s: BlockStore, b: bytes, data: bytes, place: Place | None = None) -> None:
    assert s.reserve(b, len(data))
    s.install(b, *s.write_temp(b, data, place=place))


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_block_is_hashed_at_fill_where_the_node_serves_members_and_only_there(tmp_path):
    s = store_at(tmp_path)
    data = os.urandom(3 * MiB + 5)
    fill(s, bid(1), data)
    assert s.lookup(bid(1)).digest == digest(data)
    s.close()
    s = BlockStore(tmp_path / "cache", 1 << 30, 0.0, LruPolicy())
    s.open()  # (kept in the index across a restart; a node that serves no member takes none)
    assert s.lookup(bid(1)).digest == digest(data)
    fill(s, bid(2), b"x" * 70_000)
    assert s.lookup(bid(2)).digest == b""
    assert s.extent(bid(2), s.lookup(bid(2))) is None  # (no digest: read, checked and hashed instead)
    s.close()


@pytest.mark.parametrize("packing", [False, True])
def test_an_extent_is_the_blocks_bytes_and_stays_on_disk_while_it_is_sent(tmp_path, packing):
    s = store_at(tmp_path, packing)
    oid = bid(100)
    blocks = {i: os.urandom(MiB) for i in range(3)} if not packing else {0: os.urandom(50_000)}
    size = sum(len(d) for d in blocks.values())
    for i, data in blocks.items():
        fill(s, bid(i), data, Place(oid, i * MiB, size))
    meta = s.lookup(bid(0))
    extent = s.extent(bid(0), meta)
    assert extent is not None and extent.digest == digest(blocks[0]) and s.sending == 1
    assert os.pread(extent.fd, extent.length, extent.offset) == blocks[0]
    path, _, _ = s.block_location(bid(0))
    before = _allocated(path)
    s.remove(bid(0), meta.length)  # (evicted while the kernel sends it)
    assert s.lookup(bid(0)) is None
    assert _allocated(path) == before and os.pread(extent.fd, extent.length, extent.offset) == blocks[0]
    if packing:  # (its pack range is not given to another block meanwhile)
        fill(s, bid(7), os.urandom(50_000))
        assert s.lookup(bid(7)).offset != meta.offset
    s.sent(extent)  # let go of at the last send: its range punched
    assert s.sending == 0
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, meta.length, meta.offset) == bytes(meta.length)
    finally:
        os.close(fd)
    assert _allocated(path) <= before - (0 if packing else MiB)
    s.close()


def _evicted_while_sent(tmp_path):
    """A store with an object of two blocks whose first is being sent and was evicted meanwhile: (store,
    the extent, the block's bytes, its place)."""
    s = store_at(tmp_path)
    oid, data = bid(100), os.urandom(MiB)
    place = Place(oid, 0, 2 * MiB)
    fill(s, bid(0), data, place)
    fill(s, bid(1), os.urandom(MiB), Place(oid, MiB, 2 * MiB))
    extent = s.extent(bid(0), s.lookup(bid(0)))
    s.remove(bid(0), MiB)
    return s, extent, data, place


def test_a_block_refilled_while_it_was_sent_is_not_punched_after(tmp_path):
    s, extent, data, place = _evicted_while_sent(tmp_path)
    fill(s, bid(0), data, place)  # (asked again meanwhile: in place, the same bytes)
    s.sent(extent)
    meta = s.lookup(bid(0))
    assert meta is not None and s.read(bid(0), meta, 0, MiB) == data
    s.close()


def test_a_write_begun_before_a_deferred_punch_is_not_indexed_over_the_hole(tmp_path):
    s, extent, data, place = _evicted_while_sent(tmp_path)
    assert s.reserve(bid(0), MiB)
    written = s.write_temp(bid(0), data, place=place)  # (a fill that began before the send ends)
    s.sent(extent)  # (punches the range: the fill's bytes are gone)
    with pytest.raises(OSError):
        s.install(bid(0), *written)
    s.release(MiB)
    assert s.lookup(bid(0)) is None
    s.close()


def request(length: int, i: int = 0) -> wire.BlockRequest:
    return wire.BlockRequest(bytes([i % 256]) * 16, f"d/{i}.bin", '"e"', 0, length)


@pytest.fixture
def block_file(tmp_path):
    data = os.urandom(5 * MiB + 3)
    path = tmp_path / "object"
    path.write_bytes(os.urandom(4096) + data)  # (the block at an offset of its file)
    return path, 4096, data


def _bound_of(path, offset: int, data: bytes, done: list[int]):
    def answer(req, by_digest):
        if not by_digest:
            return data
        fd = os.open(path, os.O_RDONLY)
        return Bound(digest(data), len(data), fd=fd, offset=offset, done=lambda: (os.close(fd), done.append(1)))
    return answer


def test_a_block_sent_from_its_file_reaches_the_member_byte_exact(block_file):
    path, offset, data = block_file
    done: list[int] = []
    port = Port(answer=_bound_of(path, offset, data, done), stall=1.0)
    try:
        client = PeerClient(KEYS, timeout=5.0)
        client.hello(port.addr, 5.0)
        for _ in range(3):  # (on one kept-alive connection: the answers' framing holds)
            assert client.get(port.addr, request(len(data))) == data
        served = port.server.stats.served_bytes
    finally:
        port.close()
    assert port.asked == [True] * 3 and len(done) == 3 and served == 3 * len(data)


def test_a_block_that_rotted_on_the_owners_disk_is_refused_by_the_member(block_file):
    path, offset, data = block_file
    done: list[int] = []
    port = Port(answer=_bound_of(path, offset, data, done), stall=1.0)
    with open(path, "r+b") as f:  # (one bit, after the digest was taken)
        f.seek(offset + len(data) // 3)
        byte = f.read(1)[0]
        f.seek(offset + len(data) // 3)
        f.write(bytes([byte ^ 1]))
    try:
        client = PeerClient(KEYS, timeout=5.0)
        client.hello(port.addr, 5.0)
        with pytest.raises(PeerFailure) as failed:
            client.get(port.addr, request(len(data)))
    finally:
        port.close()
    assert failed.value.kind == "bad" and len(done) == 1


def test_an_answer_by_digest_fits_no_other_request_and_no_other_body():
    mac, body = "ab" * 16, os.urandom(70_000)
    d = digest(body)
    good = KEYS.digest_mac(mac, 200, d, len(body))
    assert KEYS.answer_ok(mac, 200, body, good, d.hex())
    assert not KEYS.answer_ok("cd" * 16, 200, body, good, d.hex())  # another request's
    assert not KEYS.answer_ok(mac, 200, body[:-1] + bytes([body[-1] ^ 1]), good, d.hex())  # a changed body
    assert not KEYS.answer_ok(mac, 200, body + b"x", good, d.hex())  # a longer one
    assert not KEYS.answer_ok(mac, 200, body, good, None)  # the digest stripped: a MAC over the body
    assert not KEYS.answer_ok(mac, 200, body, KEYS.answer_mac(mac, 200, body), d.hex())  # one added
    rng = random.Random(7)
    alphabet = "0123456789abcdefABCDEF xz\x00é"
    for _ in range(3000):  # (whatever an endpoint puts in the header: no error, never accepted)
        junk = "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 63, 64, 65, rng.randrange(200)])))
        assert not KEYS.answer_ok(mac, 200, body, good, junk) or junk == d.hex()


def test_a_member_of_an_older_version_gets_an_answer_macd_over_its_body(block_file):
    import pycurl

    from epochfs.transport import curlio

    path, offset, data = block_file
    done: list[int] = []
    port = Port(answer=_bound_of(path, offset, data, done), stall=1.0)
    try:
        client = PeerClient(KEYS, timeout=5.0)
        client.hello(port.addr, 5.0)
        target = request(len(data)).target()
        headers, mac = KEYS.headers(port.addr, target, time.time() + 2)
        curl = curlio.Easy()  # (asked as an older member asks: without X-Epochfs-Bind)
        curl.setopt(pycurl.URL, f"http://{port.addr}{target}")
        curl.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in headers.items()])
        fields, body = curl.perform(len(data) + 1)
    finally:
        port.close()
    assert port.asked == [False] and wire.DIGEST_HEADER not in fields
    assert bytes(body) == data and KEYS.answer_ok(mac, 200, body, fields.get(wire.ANSWER_HEADER))


def test_a_member_that_stops_reading_a_sent_block_is_closed_and_its_range_handed_back(tmp_path):
    import socket

    data = os.urandom(64 * MiB)
    path = tmp_path / "object"
    path.write_bytes(data)
    done: list[int] = []
    port = Port(answer=_bound_of(path, 0, data, done), stall=1.0)
    try:
        target = request(len(data)).target()
        headers, _ = KEYS.headers(port.addr, target, time.time() + 2)
        sock = socket.create_connection(("127.0.0.1", port.server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, wire.BIND_HEADER: "digest"}.items())
        sock.sendall(f"GET {target} HTTP/1.1\r\nhost: x\r\n{head}\r\n".encode())
        sock.recv(1024)  # (the answer began; nothing more is read)
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.1)
        stalled = port.server.stats.closed["stalled"]
        sock.close()
    finally:
        port.close()
    assert done == [1] and stalled == 1
