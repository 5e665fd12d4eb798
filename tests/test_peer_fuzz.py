"""Fuzz loops over the peer wire: what a member answers, and what the shared store lists as members.

A peer without the token (or a man in the middle) answers block requests and hellos with random
mutations of an authenticated answer: statuses, MACs (dropped, of another request, another body,
another token), bodies (flipped, cut, extended), answers bound by digest (the digest of another body, junk,
dropped, or added to a MAC over the body) and framings. Whatever it sends, the client returns
exactly the block's bytes only for an untouched authenticated answer, and otherwise raises
:class:`PeerFailure` within its timeout: nothing unauthenticated reaches the cache. Member entries of
random bytes are either a canonical literal IP:PORT of this node's family or ignored."""

from __future__ import annotations

import http.server
import random
import threading
import time

import pytest
import trio

from epochfs.blockstore.format import digest
from epochfs.peer import wire
from epochfs.peer.client import PeerClient, PeerFailure
from epochfs.peer.members import Membership

TOKEN = b"fuzzing-token-of-enough-length"
KEYS = wire.Keys(TOKEN)
OTHER = wire.Keys(b"another-token-of-enough-length")
BLOCK = bytes(random.Random(0).getrandbits(8) for _ in range(70_001))
SINCE = str(int(time.time()) - 60).encode()  # a hello's answer: the second the member started


class Hostile:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.honest = False
        self.old = False  # answers like a member of an older version (no hello stating its cache size)
        self.asked: list[str] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with outer.lock:
                    status, headers, body, close = outer.answer(self)
                try:
                    self.send_response_only(status)
                    for name, value in headers:
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(body)
                    if close:
                        self.close_connection = True
                except OSError:
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, h: http.server.BaseHTTPRequestHandler) -> tuple[int, list[tuple[str, str]], bytes, bool]:
        mac, _, _ = KEYS.verify(self.addr, h.path, h.headers.get(wire.TIME_HEADER), h.headers.get(wire.NONCE_HEADER),
                                h.headers.get(wire.AUTH_HEADER), time.time())
        hello = h.path in (wire.HELLO, wire.HELLO_SIZED)
        right = (200, SINCE + b" 5368709120" if h.path == wire.HELLO_SIZED else SINCE) if hello else (200, BLOCK)
        if self.old and h.path == wire.HELLO_SIZED:  # (a member of an older version: no such route)
            right = (404, b"this port serves blocks by id only")
        self.asked.append(h.path)
        status, body = right
        if self.honest:
            return status, [("Content-Length", str(len(body))), (wire.ANSWER_HEADER, KEYS.answer_mac(mac, status, body))], \
                body, False
        rng = self.rng
        signed_status, signed_body, keys, signed_mac = status, body, KEYS, mac
        what = rng.randrange(9)
        if what == 0:
            status = rng.choice([200, 204, 206, 301, 401, 404, 409, 412, 500, 503])
        elif what == 1 and body:
            b = bytearray(body)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            body = bytes(b)
        elif what == 2 and body:
            body = body[:rng.randrange(len(body))]
        elif what == 3:
            body = body + bytes(rng.randrange(1, 100))
        elif what == 4:
            keys = OTHER
        elif what == 5:
            _, signed_mac = KEYS.headers(self.addr, h.path, time.time())  # the MAC of another request
        elif what == 6:
            signed_status = rng.choice([200, 204, 404])
            signed_body = rng.choice([b"", BLOCK, BLOCK[:-1], SINCE + b"0", b"-1"])
        headers = [("Content-Length", str(len(body)))]
        bound = not hello and rng.random() < 0.5  # (bound by the block's digest, as one sent from its file)
        if bound:
            signed_digest = digest(signed_body)
            answer = keys.digest_mac(signed_mac, signed_status, signed_digest, len(signed_body))
            sent_digest: str | None = signed_digest.hex()
            if rng.random() < 0.3:  # its digest header changed: of another body, junk, cut, dropped
                what = 9
                sent_digest = rng.choice([digest(BLOCK[:-1]).hex(), "0" * 64, sent_digest[:-2], sent_digest.upper(),
                                          sent_digest + "00", "zz" * 32, None])
            if sent_digest is not None:
                headers.append((wire.DIGEST_HEADER, sent_digest))
        else:
            answer = keys.answer_mac(signed_mac, signed_status, signed_body)
            if rng.random() < 0.1:  # a MAC over the body, with a digest header added
                what = 9
                headers.append((wire.DIGEST_HEADER, digest(body).hex()))
        if what == 7:
            answer = rng.choice(["", "0" * 32, answer.upper(), answer[:-1], answer + "0", "\u00ff" * 32])
        if what != 8:
            headers.append((wire.ANSWER_HEADER, answer))
        honest = (status, body, signed_status, signed_body, keys, signed_mac) == right + right + (KEYS, mac) \
            and what not in (7, 8, 9)
        return status, headers, body, not honest and rng.random() < 0.3

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_member_of_an_older_version_is_asked_the_plain_hello():
    """A member that does not know the hello stating its cache size answers it 404 (authenticated): it is
    asked the plain hello, proves itself, and states no size (the ring then weighs every member alike)."""
    for old, size in ((True, None), (False, 5 << 30)):
        peer = Hostile(0)
        peer.honest, peer.old = True, old
        try:
            assert PeerClient(KEYS, timeout=2.0).hello(peer.addr, 2.0) == size
            assert peer.asked == ([wire.HELLO_SIZED, wire.HELLO] if old else [wire.HELLO_SIZED])
        finally:
            peer.close()


@pytest.mark.parametrize("seed", range(3))
def test_only_authenticated_answers_are_taken(seed):
    peer = Hostile(seed)
    client = PeerClient(KEYS, timeout=2.0)
    req = wire.BlockRequest(b"\x07" * 16, "d/x.bin", '"e1"', 0, len(BLOCK))
    taken = refused = 0
    try:
        for _ in range(300):
            start = time.monotonic()
            try:
                data = client.get(peer.addr, req)
            except PeerFailure:
                refused += 1
            else:
                assert data == BLOCK
                taken += 1
            try:
                client.hello(peer.addr, 2.0)
            except PeerFailure:
                refused += 1
            assert time.monotonic() - start < 5
        peer.honest = True  # nothing a hostile answer did keeps the client from an honest one (a kept
        try:  # connection may still hold the rest of the last hostile answer: that costs one request)
            client.hello(peer.addr, 2.0)
        except PeerFailure:
            pass
        for _ in range(3):
            assert client.get(peer.addr, req) == BLOCK
            client.hello(peer.addr, 2.0)
    finally:
        peer.close()
    assert refused > 400 and taken > 0  # (most answers are mutated; some are left alone)


def test_random_member_entries_are_literal_addresses_of_the_family_or_ignored():
    rng = random.Random(5)
    pieces = [b"10.0.0.1", b"127.0.0.1", b"[::1]", b"[fd00::1]", b"localhost", b"0.0.0.0", b"1.2.3.4.5", b":",
              b"9570", b"0", b"65536", b"\n", b"\x9b", b"\xff", b"-", b"[", b"]", b"01", b" ", b"%", b"\x00"]
    entries = []
    for _ in range(5000):
        if rng.random() < 0.5:
            entries.append(b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 6))))
        else:
            entries.append(bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 80))))
    entries += [b"10.0.0.2:9570", b"[fd00::2]:9570"]

    class Store:
        def heartbeat(self, *args: object) -> dict[str, list[object]]:
            junk = [*entries, 7, None, "10.0.0.3:9570"]  # (not bytes: as a broken store might answer)
            return {"peer": junk, "server": junk[::-1]}

        def leave(self, *args: object) -> None:
            pass

    for me, family_member in (("10.0.0.1:9570", "10.0.0.2:9570"), ("[fd00::1]:9570", "[fd00::2]:9570")):
        m = Membership(Store(), "s3://b/p/", me, lambda member: None)

        async def main(m: Membership = m) -> None:
            await m.beat()
            await m.prove_due()

        trio.run(main)
        assert family_member in m.ring
        for member in m.ring.members:
            assert wire.member_addr(member) == member and wire.same_family(member, me)


def test_random_published_statistics_are_shown_as_what_they_are_or_not_at_all():
    """`epochfs cluster status` takes what members publish of themselves from the store, which whoever
    holds its password writes: random JSON, wrong types, huge or non-finite numbers, escapes in names.
    Each figure is shown only if it has its type; the command always answers, text and JSON."""
    import json
    import math

    from epochfs.cli.cluster import _shares, member_row, status_lines
    from epochfs.core.records import ObjectInfo

    rng = random.Random(9)
    values = [None, True, False, -1, 0, 1, 7, 2**63, 10**400, 1.5, -0.5, "x", "\x1b[2J", "", [], {}, ["a"],
              [1, "b"], {"a": 1}, "owned", "all", 4 << 20, 1 << 20]
    keys = ["held_bytes", "capacity_bytes", "cache_size", "served_bytes", "replicas", "block_size", "snapshot", "mode",
            "node", "down", "out_bytes_per_second", "link_capacity", "utilization", "updated", "share_bytes", "other"]
    snapshot = type("S", (), {"objects": [ObjectInfo(f"f{i}", 3 << 20, 0, f"e{i}") for i in range(30)]})()
    for _ in range(400):
        rows = []
        for m in range(rng.randrange(1, 5)):
            what = rng.random()
            if what < 0.6:
                raw: object = json.dumps({k: rng.choice(values) for k in rng.sample(keys, rng.randrange(len(keys)))})
                raw = raw.replace("1" + "0" * 400, "1e400") if rng.random() < 0.1 else raw  # (inf, as JSON may say)
            elif what < 0.8:
                raw = bytes(rng.getrandbits(8) for _ in range(rng.randrange(40)))
            else:
                raw = rng.choice([None, 5, "[]", '"x"', "NaN", "Infinity", "[[[[" * 1000, "{" * 100_000])
            role = rng.choice(["server", "peer"])
            rows.append(member_row(f"10.0.0.{m}:9570", role, raw, 1e9, rng.choice(["", None, "refused"])))
        for r in rows:
            for k in ("held_bytes", "capacity_bytes", "served_bytes", "replicas", "block_size", "snapshot"):
                assert r.get(k) is None or (type(r[k]) is int and r[k] >= 0)
            for k in ("out_bytes_per_second", "link_capacity", "utilization", "age_seconds"):
                assert r.get(k) is None or (isinstance(r[k], float) and math.isfinite(r[k]))
            assert r.get("node") is None or r["node"].isprintable()
        shares, warnings = _shares(rows, snapshot, "s3://b/", set())
        text = "\n".join(status_lines("s3://b/", rows, shares, warnings))
        assert "\x1b" not in text and json.dumps({"members": rows, "shares": shares, "warnings": warnings})
        if shares:
            assert sum(r["share_bytes"] for r in rows if "share_bytes" in r) == shares["replicas"] * shares["total_bytes"]


def test_random_proofs_and_member_lists_keep_the_ring_consistent():
    """Members that come, go, state any cache size (or none, or fail their proof, or their re-proof),
    in random order: the ring always holds this node and proven listed members only, its weights are
    the stated sizes (every member alike while any stated none), and nothing raises."""
    from epochfs.peer.ring import weight_of

    rng = random.Random(17)
    me = "10.9.0.1:9570"
    pool = [f"10.9.0.{i}:9570" for i in range(2, 14)]
    answers: dict[str, object] = {}

    class Store:
        listed: list[bytes] = []

        def heartbeat(self, source, member, ttl, limit, role="peer"):
            return {"peer": self.listed}

        def publish_stats(self, source, member, stats):
            pass

        def leave(self, source, member, role="peer"):
            pass

    def prove(member):
        answer = answers[member]
        if isinstance(answer, Exception):
            raise answer
        return answer

    store = Store()
    m = Membership(store, "s3://b/p/", me, prove, capacity=3 << 30)

    async def main() -> None:
        for _ in range(400):
            store.listed = [a.encode() for a in pool if rng.random() < 0.6]
            for a in pool:
                answers[a] = rng.choice([None, 0, 1, 5 << 20, 7 << 30, 1 << 79, TimeoutError("no answer"),
                                         RuntimeError("not authenticated"), 3 << 30])
            if rng.random() < 0.3:
                m.REPROVE = rng.choice([0.0, 300.0])
            if rng.random() < 0.2 and len(m.ring) > 1:
                m.distrust(rng.choice([x for x in m.ring.members if x != me]), "fuzzed")
            for attempt in m._retry:
                m._retry[attempt] = (0.0, m.RETRY_MIN)
            await m.beat()
            await m.prove_due()
            ring = m.ring
            assert me in ring and set(ring.members) - {me} <= m._proven <= m._listed.keys()
            weights = dict(zip(ring.members, ring.weights, strict=True))
            if ring.sized:
                assert weights[me] == weight_of(3 << 30)
                assert all(m._capacity[x] is not None and weights[x] == weight_of(m._capacity[x])
                           for x in ring.members if x != me)
            else:
                assert set(weights.values()) == {1}
                assert any(m._capacity.get(x) is None for x in ring.members if x != me)

    trio.run(main)
