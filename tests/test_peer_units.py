"""The cluster tier's pure parts without a daemon: block ownership (rendezvous hashing), the signed
request format and its checks (fuzzed: every malformed target is a Rejected, never another exception),
the member list from the store, the token file, and the mount options."""

from __future__ import annotations

import hashlib
import os
import random
import time
import urllib.parse
from collections import Counter

import pytest
import trio

from epochfs.core.errors import BackendUnavailable, ConfigError
from epochfs.daemon.config import Config, Source
from epochfs.peer import wire
from epochfs.peer.members import Membership
from epochfs.peer.ring import Ring


def bids(n: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(n)]


def test_ownership_is_even_and_a_change_moves_only_one_share():
    members = [f"10.0.0.{i}:9570" for i in range(1, 6)]
    ring = Ring(members)
    blocks = bids(20_000)
    owners = {b: ring.owner(b) for b in blocks}
    counts = Counter(owners.values())
    assert set(counts) == set(members)
    assert all(abs(n - 4000) < 400 for n in counts.values()), counts
    assert Ring(reversed(members)).owner(blocks[0]) == owners[blocks[0]]  # order does not matter
    joined = Ring([*members, "10.0.0.9:9570"])
    moved = [b for b in blocks if joined.owner(b) != owners[b]]
    assert all(joined.owner(b) == "10.0.0.9:9570" for b in moved)  # only to the newcomer
    assert abs(len(moved) - 20_000 / 6) < 400
    left = Ring(members[1:])
    changed = [b for b in blocks if left.owner(b) != owners[b]]
    assert {owners[b] for b in changed} == {members[0]}  # only the leaver's blocks move
    assert all(ring.owner(b, exclude={members[0]}) == left.owner(b) for b in blocks[:2000])
    assert Ring([]).owner(blocks[0]) is None and ring.owner(blocks[0], exclude=set(members)) is None


def test_members_are_ranked_in_proportion_to_their_caches_and_a_change_still_moves_only_one_share():
    """Weighted rendezvous: a member's share follows its weight (its cache's size); a member joining takes
    blocks only for itself and one leaving hands over only its own; equal weights (any value) rank
    exactly as the plain ring does, so a fleet of equal nodes places every block where it did before."""
    members = [f"10.0.0.{i}:9570" for i in range(1, 5)]
    weights = {members[0]: 1000, members[1]: 3000, members[2]: 1000, members[3]: 5000}
    ring = Ring(members, weights)
    blocks = bids(40_000)
    owners = {b: ring.owner(b) for b in blocks}
    counts = Counter(owners.values())
    for m in members:
        assert abs(counts[m] / len(blocks) - weights[m] / 10_000) < 0.01, counts
    assert all(ring.owners(b, 3)[0] == owners[b] for b in blocks[:2000])
    assert all(len(set(ring.owners(b, 3))) == 3 for b in blocks[:200])
    assert Ring(reversed(members), weights) == ring and Ring(members) != ring  # (the weights are the ring's)
    # two replicas: the second holder is the first choice once the first is left out
    assert all(ring.owners(b, 2)[1] == ring.owner(b, exclude={owners[b]}) for b in blocks[:2000])
    joined = Ring([*members, "10.0.0.9:9570"], {**weights, "10.0.0.9:9570": 10_000})
    moved = [b for b in blocks if joined.owner(b) != owners[b]]
    assert all(joined.owner(b) == "10.0.0.9:9570" for b in moved)  # only to the newcomer ...
    assert abs(len(moved) / len(blocks) - 0.5) < 0.01  # ... its weight's part of them
    left = Ring(members[1:], weights)
    assert {owners[b] for b in blocks if left.owner(b) != owners[b]} == {members[0]}
    assert all(ring.owner(b, exclude={members[0]}) == left.owner(b) for b in blocks[:2000])
    grown = Ring(members, {**weights, members[0]: 2000})  # a member whose cache doubled gains, nobody else does
    assert {grown.owner(b) for b in blocks if grown.owner(b) != owners[b]} == {members[0]}
    plain = Ring(members)
    for same in (7, 1 << 40):
        alike = Ring(members, dict.fromkeys(members, same))
        assert all(alike.owners(b, 4) == plain.owners(b, 4) and alike.owner(b) == plain.owner(b) for b in blocks[:5000])
    huge = Ring(members, {**weights, members[0]: 1 << 80, members[1]: -5})  # bounded, never an error
    assert huge.weight(members[0]) == 1 << 40 and huge.weight(members[1]) == 1 and huge.weight("x") == 1


def test_the_ring_weights_come_from_every_member_or_none():
    from epochfs.peer.ring import WEIGHT_UNIT, ring_weights, weight_of

    assert weight_of(0) == 1 and weight_of(10 << 30) == (10 << 30) // WEIGHT_UNIT and weight_of(1 << 90) == 1 << 40
    assert ring_weights(["a", "b"], {"a": 2 << 20, "b": 6 << 20}) == {"a": 2, "b": 6}
    assert ring_weights(["a", "b"], {"a": 2 << 20, "b": None}) is None  # (one that says nothing: all alike)
    assert ring_weights(["a", "b"], {"a": 2 << 20}) is None
    sized = Ring(["a", "b"], {"a": 2, "b": 6})
    assert (sized.cache_of("a"), sized.cache_of("x"), sized.cache_bytes()) == (2 << 20, None, 8 << 20)
    assert Ring(["a", "b"]).cache_of("a") is None and Ring(["a", "b"]).cache_bytes() is None


def test_a_hello_says_when_the_member_started_and_how_large_its_cache_is():
    assert wire.parse_hello(wire.hello_body(1700000000, 10 << 30)) == (1700000000, 10 << 30)
    assert wire.parse_hello(b"1700000000") == (1700000000, None)  # a member that states no cache size
    for bad in (b"", b" ", b"17 ", b" 17", b"x", b"17 x", b"-1 5", b"17 -5", b"1" * 13, b"17 " + b"9" * 25,
                b"17 5 6", b"17\n5", "١٧".encode()):
        assert wire.parse_hello(bad) is None, bad
    rnd = random.Random(11)
    for _ in range(3000):
        body = bytes(rnd.choice(b"0123456789 x-\n\xff") for _ in range(rnd.randrange(0, 40)))
        answer = wire.parse_hello(body)
        assert answer is None or answer[0] < 10 ** 12 and (answer[1] is None or answer[1] < 10 ** 24)


def test_the_shares_of_a_snapshot_are_its_blocks_as_the_members_rank_them():
    """`ownership` (what `epochfs cluster status` sets against each member's cache): every block of every
    stored object once (a shard behind several packed members once), each counted for each of its
    holders, exactly as `Ring.owners` ranks it; a dataset of more blocks than the sample is estimated
    from an even sample, close to the exact figure."""
    from epochfs.core.blocks import block_id
    from epochfs.core.records import ObjectInfo, member_etag
    from epochfs.peer.share import ownership

    rng = random.Random(7)
    members = [f"10.0.0.{i}:9570" for i in range(1, 5)]
    ring, bs, src = Ring(members), 1 << 20, "s3://bucket/data/"
    plain = [ObjectInfo(f"f{i}", rng.randrange(0, 9 << 20), 0, f"e{i}") for i in range(300)]
    shard = ObjectInfo("shards/0.tar", 5 << 20, 0, "shard-etag")
    packed = [ObjectInfo(f"p{i}", 1000, 0, member_etag(shard, i * 1000, "0" * 16)) for i in range(4)]
    for replicas in (1, 2):
        got = ownership([*plain, *packed, plain[0]], src, ring, bs, replicas)
        want: Counter[str] = Counter()
        for o in [*plain, shard]:
            for index in range(-(-o.size // bs)):
                length = min(bs, o.size - index * bs)
                for m in ring.owners(block_id(src, o.key, o.etag, index, block_size=bs), replicas):
                    want[m] += length
        assert not got.sampled and got.total == sum(o.size for o in plain) + shard.size
        assert got.owned == {m: want[m] for m in members} and sum(got.owned.values()) == replicas * got.total
        assert got.ranked == sum(-(-o.size // bs) for o in [*plain, shard])
        many = [ObjectInfo(f"g{i}", rng.randrange(1, 3 << 20), 0, f"e{i}") for i in range(3000)]
        exact = ownership(many, src, ring, bs, replicas)
        assert not exact.sampled and exact.total == sum(o.size for o in many)
        # past the sample, the shares of the first blocks are scaled to the rest: listed, or told
        for estimate in (ownership(many, src, ring, bs, replicas, sample=exact.ranked // 3),
                         ownership(iter(many), src, ring, bs, replicas, sample=exact.ranked // 3, total=exact.total)):
            assert estimate.sampled and estimate.total == exact.total and estimate.ranked == exact.ranked // 3
            for m in members:
                assert abs(estimate.owned[m] - exact.owned[m]) < 0.1 * exact.owned[m], (m, estimate, exact)
    assert ownership([], src, ring, bs, 1).owned == dict.fromkeys(members, 0)


def test_a_node_ranks_its_own_share_when_the_ring_changes_and_a_failed_ranking_costs_nothing(caplog):
    """`ShareWatch`: this node's share once its members are settled, again when the ring changes (not
    before), a warning when a node keeping only its own blocks owns more than its cache; a namespace
    that fails while walked leaves the figure unknown and the watch running."""
    from types import SimpleNamespace

    from epochfs.core.records import ObjectInfo
    from epochfs.peer.share import ShareWatch, ownership

    objs = [ObjectInfo(f"f{i}", 3 << 20, 0, f"e{i}") for i in range(40)]
    good = SimpleNamespace(files=lambda: (SimpleNamespace(obj=o) for o in objs), total_bytes=120 << 20)

    def broken_files():
        raise OSError("the snapshot was closed")
        yield

    broken = SimpleNamespace(files=broken_files, total_bytes=120 << 20)
    members = SimpleNamespace(me=ME, ring=Ring([ME, "10.0.0.2:9570"]), settled=lambda: True)
    tier = SimpleNamespace(members=members, replicas=1, mode="owned")
    namespace = [broken]
    watch = ShareWatch(tier, lambda: namespace[0], lambda: 7, "s3://b/", 1 << 20, lambda: 10 << 20)

    async def main() -> None:
        assert watch.due()
        await watch.rank()
        assert watch.owned is None and watch.due() and "could not rank" in caplog.text
        namespace[0] = good
        await watch.rank()
        assert not watch.due()
        want = ownership(objs, "s3://b/", members.ring, 1 << 20, 1)
        assert (watch.owned, watch.total) == (want.owned[ME], 120 << 20) and watch.owned > 10 << 20
        assert "evicts blocks it owns" in caplog.text
        members.ring = Ring([ME, "10.0.0.2:9570", "10.0.0.3:9570"])
        assert watch.due()
        members.settled = lambda: False  # (still proving a member: not yet)
        assert not watch.due()

    with caplog.at_level("WARNING"):
        trio.run(main)


def test_the_first_node_of_a_tier_ranks_again_as_soon_as_the_others_join():
    """A node that ranked itself alone (the tier's first, its members starting seconds later) ranks again
    at the next look once they join, not after INTERVAL; after that, rankings are INTERVAL apart."""
    from types import SimpleNamespace

    from epochfs.core.records import ObjectInfo
    from epochfs.peer.share import ShareWatch

    objs = [ObjectInfo(f"f{i}", 3 << 20, 0, f"e{i}") for i in range(40)]
    namespace = SimpleNamespace(files=lambda: (SimpleNamespace(obj=o) for o in objs), total_bytes=120 << 20)
    members = SimpleNamespace(me=ME, ring=Ring([ME]), settled=lambda: True)
    tier = SimpleNamespace(members=members, replicas=1, mode="owned")
    watch = ShareWatch(tier, lambda: namespace, lambda: 7, "s3://b/", 1 << 20, lambda: 1 << 30)
    watch.CHECK, watch.INTERVAL = 0.05, 1.5
    ranked: list[tuple[float, tuple[str, ...]]] = []
    rank = watch.rank
    changed = [trio.Event()]

    async def timed_rank() -> None:
        await rank()
        ranked.append((trio.current_time(), watch._seen[0].members))
        changed[0].set()

    watch.rank = timed_rank  # type: ignore[method-assign]

    async def until(n: int) -> None:
        while len(ranked) < n:
            changed[0] = trio.Event()
            await changed[0].wait()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch.run)
            await until(1)
            assert watch.owned == 120 << 20  # alone: all of it
            members.ring = Ring([ME, "10.0.0.2:9570"])
            await until(2)
            assert ranked[1][0] - ranked[0][0] < watch.INTERVAL / 2  # at the next look, not INTERVAL later
            members.ring = Ring([ME, "10.0.0.2:9570", "10.0.0.3:9570"])
            await until(3)
            assert ranked[2][0] - ranked[1][0] >= watch.INTERVAL - watch.CHECK  # then at most every INTERVAL
            nursery.cancel_scope.cancel()

    trio.run(main)


TOKEN = b"s3cret-token-of-enough-length"
KEYS = wire.Keys(TOKEN)
ME = "10.0.0.1:9570"


def test_a_signed_request_round_trips_and_any_change_is_refused():
    req = wire.BlockRequest(bytes(range(16)), "train/a b/ü?&=.jpg", '"abc-3"', 7, 1 << 20)
    target = req.target()
    now = time.time()
    h, mac = KEYS.headers(ME, target, now)
    got_mac, nonce, sent = KEYS.verify(ME, target, h[wire.TIME_HEADER], h[wire.NONCE_HEADER], h[wire.AUTH_HEADER], now)
    assert got_mac == mac and nonce == h[wire.NONCE_HEADER] and sent == int(now)
    assert wire.parse_target(target.encode()) == req
    other = wire.Keys(b"another-token-of-enough-length")
    t, n, a = h[wire.TIME_HEADER], h[wire.NONCE_HEADER], h[wire.AUTH_HEADER]
    for keys, args in [(other, (ME, target, t, n, a)),
                       (KEYS, (ME, target.replace("i=7", "i=8"), t, n, a)),
                       (KEYS, ("10.0.0.2:9570", target, t, n, a)),  # made for another member
                       (KEYS, (ME, target, str(int(t) + 1), n, a)),
                       (KEYS, (ME, target, t, n[:-1] + ("0" if n[-1] != "0" else "1"), a)),
                       (KEYS, (ME, target, None, n, a)), (KEYS, (ME, target, t, None, a)),
                       (KEYS, (ME, target, t, n, None)), (KEYS, (ME, target, "-5", n, a)),
                       (KEYS, (ME, target, "1e9", n, a)), (KEYS, (ME, target, t, "zz" * 16, a)),
                       (KEYS, (ME, target, t, n, "ü"))]:
        with pytest.raises(wire.Rejected) as exc:
            keys.verify(*args, now)
        assert exc.value.status == 401
    old, _ = KEYS.headers(ME, target, now - wire.CLOCK_SKEW - 5)
    with pytest.raises(wire.Rejected, match="off this node's clock"):
        KEYS.verify(ME, target, old[wire.TIME_HEADER], old[wire.NONCE_HEADER], old[wire.AUTH_HEADER], now)


def test_an_answer_is_bound_to_its_request_its_status_and_its_body():
    now = time.time()
    _, mac = KEYS.headers(ME, "/v2/hello", now)
    _, other_mac = KEYS.headers(ME, "/v2/hello", now)  # the same request again: another nonce
    body = os.urandom(70_001)
    good = KEYS.answer_mac(mac, 200, body)
    assert KEYS.answer_ok(mac, 200, body, good) and KEYS.answer_ok(mac, 200, bytearray(body), good)
    flipped = bytearray(body)
    flipped[12345] ^= 1
    for args in [(other_mac, 200, body, good), (mac, 204, body, good), (mac, 200, bytes(flipped), good),
                 (mac, 200, body[:-1], good), (mac, 200, body, None), (mac, 200, body, "0" * 32),
                 (mac, 200, body, good.upper())]:
        assert not KEYS.answer_ok(*args)
    assert not wire.Keys(b"another-token-of-enough-length").answer_ok(mac, 200, body, good)


def test_a_request_is_accepted_once_and_the_memory_of_nonces_is_bounded():
    now = 1_000_000.0
    replays = wire.Replays(capacity=3, started=now - 0.5)
    with pytest.raises(wire.Rejected, match="before this member started") as exc:  # (its memory begins then)
        replays.admit("z" * 32, int(now) - 1, now)
    assert exc.value.status == 401
    replays.admit("a" * 32, int(now), now)
    with pytest.raises(wire.Rejected, match="replayed") as exc:
        replays.admit("a" * 32, int(now), now + 10)
    assert exc.value.status == 401
    replays.admit("b" * 32, int(now), now)
    replays.admit("c" * 32, int(now), now)
    with pytest.raises(wire.Rejected) as exc:
        replays.admit("d" * 32, int(now), now)
    assert exc.value.status == 503 and len(replays) == 3
    later = now + wire.CLOCK_SKEW + 2  # the signatures have expired: their nonces are forgotten
    replays.admit("d" * 32, int(later), later)
    assert len(replays) == 1


@pytest.mark.parametrize("target,status", [
    (b"/", 404), (b"/d/00.bin", 404), (b"/v1/block/xyz", 404), (b"/v2/block/" + b"AB" * 16, 404),
    (b"/v2/block/" + b"ab" * 16, 400), (b"/v2/block/" + b"ab" * 16 + b"?k=a&e=b&i=0", 400),
    (b"/v2/block/" + b"ab" * 16 + b"?k=a&e=b&i=-1&n=1", 400), (b"/v2/block/" + b"ab" * 16 + b"?k=a&e=b&i=0&n=1&z=1", 400),
    (b"/v2/block/" + b"ab" * 16 + b"?k=a&k=b&e=b&i=0&n=1", 400), (b"/v2/block/" + b"ab" * 16 + b"?k=&e=b&i=0&n=1", 400),
    (b"/v2/block/" + b"ab" * 16 + b"?k=%00&e=b&i=0&n=1", 400), (b"/v2/block/" + b"ab" * 16 + b"?k=%ff&e=b&i=0&n=1", 400),
    (b"/v2/block/" + b"ab" * 16 + b"?k=a&e=b&i=0&n=99999999999", 400), (b"/v2/block/" + b"ab" * 16 + b"?k=a&e=b&i=0&n=1&w=2", 400),
    (b"/v2/block/" + b"ab" * 16 + b"?k=a&e=b&i=0&n=1\xff", 400), (b"/v2/block/" + b"a" * 20_000, 414),
])
def test_malformed_targets_are_refused_with_a_status(target, status):
    with pytest.raises(wire.Rejected) as exc:
        wire.parse_target(target)
    assert exc.value.status == status


def test_random_targets_only_ever_raise_rejected():
    rng = random.Random(3)
    good = wire.BlockRequest(b"\x01" * 16, "k", "e", 0, 1).target()
    for _ in range(5000):
        kind = rng.random()
        if kind < 0.3:
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 120)))
        elif kind < 0.7:
            raw = bytearray(good.encode())
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.getrandbits(8)
            raw = bytes(raw)
        else:
            fields = {k: rng.choice(["", "1", "-1", "x" * 5000, "\u0000", "%ff", "99999999999999999999", "a"])
                      for k in rng.sample(["k", "e", "i", "n", "w", "q"], rng.randrange(0, 6))}
            raw = (wire.PREFIX + "ab" * 16 + "?" + urllib.parse.urlencode(fields)).encode()
        try:
            req = wire.parse_target(raw)
        except wire.Rejected:
            continue
        assert len(req.bid) == 16 and req.key and req.etag and req.index >= 0 and req.length >= 0


def test_member_addresses():
    assert wire.split_addr("10.0.0.1:9570") == ("10.0.0.1", 9570)
    assert wire.split_addr("gpu-17.cluster.local:1") == ("gpu-17.cluster.local", 1)
    assert wire.split_addr("[fd00::1]:9570") == ("[fd00::1]", 9570)
    assert wire.split_addr("10.0.0.1:0") is None and wire.split_addr("10.0.0.1:0", any_port=True) == ("10.0.0.1", 0)
    for bad in ["", ":1", "host", "host:", "host:65536", "host:-1", "ho st:1", "[zz]:1", "a/b:1", "ü:1",
                "host:1\n", "-host:1", "x" * 300 + ":1", "host:١٢"]:
        assert wire.split_addr(bad) is None, bad
    for good in ["10.0.0.1:9570", "127.0.0.2:1", "[fd00::1]:9570", "[::1]:65535"]:
        assert wire.member_addr(good) == good
    for bad in ["gpu-17:9570", "localhost:9570", "1.2.3.4.5:99", "010.0.0.1:9570", "10.0.0.1:09570",
                "0.0.0.0:9570", "[::]:9570", "224.0.0.1:9570", "[FD00::1]:9570", "[fd00:0::1]:9570",
                "10.0.0.1:0", "10.0.0.1", "fd00::1:9570", "10.0.0.1:9570\n", " 10.0.0.1:9570", "١.٢.٣.٤:1"]:
        assert wire.member_addr(bad) is None, bad


class FakeStore:
    def __init__(self, answer):
        self.answer = answer
        self.left = []

    def heartbeat(self, source, member, ttl, limit, role="peer"):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer if isinstance(self.answer, dict) else {"peer": self.answer}

    def leave(self, source, member, role="peer"):
        self.left.append(member)


def test_the_member_list_from_the_store_is_checked_and_every_member_proven():
    store = FakeStore([b"10.0.0.2:9570", b"10.0.0.3:9570", b"evil\n:1", b"\xff\xfe:1", b"x" * 400, b"host:99999",
                       b"gpu-7:9570", b"[fd00::9]:9570", b"10.0.0.4:9570", b"10.0.0.5:9570", b"10.0.0.1:9570"])
    asked = []

    def prove(member):
        asked.append(member)
        if member == "10.0.0.5:9570":
            raise RuntimeError("HTTP 404 to a hello")

    m = Membership(store, "s3://b/p/", ME, prove)

    async def main():
        await m.beat()
        assert m.ring.members == (ME,)  # nobody is asked for a block before it proved itself
        await m.prove_due()
        assert sorted(asked) == ["10.0.0.2:9570", "10.0.0.3:9570", "10.0.0.4:9570", "10.0.0.5:9570"]
        assert m.ring.members == (ME, "10.0.0.2:9570", "10.0.0.3:9570", "10.0.0.4:9570")
        assert m.down() == ("10.0.0.5:9570",)
        asked.clear()
        await m.prove_due()
        assert asked == []  # the failed one waits out its backoff; the proven ones are not asked again
        m.distrust("10.0.0.3:9570", "an answer not authenticated")
        assert "10.0.0.3:9570" not in m.ring and m.down() == ("10.0.0.3:9570", "10.0.0.5:9570")
        m._retry["10.0.0.3:9570"] = (0.0, m.RETRY_MIN)  # its backoff is over
        await m.prove_due()
        assert asked == ["10.0.0.3:9570"] and "10.0.0.3:9570" in m.ring
        store.answer = BackendUnavailable("redis is down")
        await m.beat()
        assert not m.reachable and len(m.ring) == 4  # the last list is kept
        store.answer = []
        await m.beat()
        assert m.reachable and m.ring.members == (ME,) and m.down() == ()  # never without itself
        async with trio.open_nursery() as nursery:
            await nursery.start(m.run)
            nursery.cancel_scope.cancel()
        assert store.left == [ME]

    trio.run(main)


def test_each_member_is_weighted_by_the_cache_its_proof_stated():
    """The ring's weights are the cache sizes the members stated in their proofs and this node's own;
    one that stated none ranks everybody alike; a member asked again (every REPROVE seconds) that states
    another size is reweighted; one that fails to answer that is kept with the size it stated (a hello
    slow under load must not move its blocks; its answers to readers decide whether it is trusted)."""
    store = FakeStore([b"10.0.0.2:9570", b"10.0.0.3:9570"])
    stated = {"10.0.0.2:9570": 4 << 20, "10.0.0.3:9570": 1 << 20}

    def prove(member):
        answer = stated[member]
        if isinstance(answer, Exception):
            raise answer
        return answer

    m = Membership(store, "s3://b/p/", ME, prove, capacity=2 << 20)

    async def main():
        await m.beat()
        await m.prove_due()
        assert dict(zip(m.ring.members, m.ring.weights, strict=True)) == {
            ME: 2, "10.0.0.2:9570": 4, "10.0.0.3:9570": 1}
        stated["10.0.0.3:9570"] = 8 << 20  # it restarted with a larger cache
        await m.prove_due()
        assert m.ring.weight("10.0.0.3:9570") == 1  # (not asked again before REPROVE)
        m.REPROVE = 0.0
        await m.prove_due()
        assert m.ring.weight("10.0.0.3:9570") == 8
        stated["10.0.0.2:9570"] = None  # a member of an older version: it states no size
        await m.prove_due()
        assert m.ring.weights == (1, 1, 1) and len(m.ring) == 3
        stated["10.0.0.2:9570"] = 16 << 20
        await m.prove_due()
        assert m.ring.weights == (2, 16, 8)
        stated["10.0.0.2:9570"] = TimeoutError("no answer within 2 s")
        await m.prove_due()
        assert m.ring.weights == (2, 16, 8) and m.down() == ()  # kept as it was ...
        asked_again = m._proved_at["10.0.0.2:9570"] + m.REPROVE - time.monotonic()
        assert 0 < asked_again <= m.RETRY_MIN  # ... and asked again after a backoff
        m.distrust("10.0.0.2:9570", "an answer not authenticated")  # (what readers get decides)
        assert "10.0.0.2:9570" not in m.ring and dict(zip(m.ring.members, m.ring.weights, strict=True)) == {
            ME: 2, "10.0.0.3:9570": 8}

    trio.run(main)


def test_proofs_that_never_answer_do_not_hold_up_the_heartbeat():
    store = FakeStore([f"10.0.1.{i}:9570".encode() for i in range(1, 101)])
    beats = []
    store.heartbeat = lambda *a: beats.append(1) or {"peer": store.answer}

    def prove(member):
        time.sleep(1.0)
        raise TimeoutError("no answer")

    m = Membership(store, "s3://b/p/", ME, prove)
    m.HEARTBEAT = 0.1

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(m.run)
            await trio.sleep(1.5)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(beats) >= 8 and m.ring.members == (ME,) and len(m.down()) == 100


def test_the_token_file_must_be_private_and_long_enough(tmp_path):
    path = tmp_path / "token"
    path.write_text("a" * 64 + "\n")
    path.chmod(0o600)
    assert wire.load_token(path) == b"a" * 64
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        wire.load_token(path)
    path.chmod(0o600)
    path.write_text("short")
    with pytest.raises(ConfigError, match="16 to 4096 bytes"):
        wire.load_token(path)
    with pytest.raises(ConfigError, match="No such file"):
        wire.load_token(tmp_path / "missing")
    os.symlink(path, tmp_path / "link")
    with pytest.raises(ConfigError):
        wire.load_token(tmp_path / "link")
    os.mkfifo(tmp_path / "fifo", 0o600)  # opened, it would wait for a writer forever
    start = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file"):
        wire.load_token(tmp_path / "fifo")
    assert time.monotonic() - start < 2


def config(**kw):
    base = dict(source=Source.parse("s3://b/p"), mountpoint="/mnt/x", cache_dir="/tmp/epochfs-test-cache",
                meta="redis://127.0.0.1:6379/0", peer_token_file="/etc/epochfs/peer-token")
    return Config(**{**base, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(peer_listen="10.0.0.1:9570", meta=None), "needs a shared store"),
    (dict(peer_listen="10.0.0.1:9570", meta="lmdb:///var/cache/meta"), "needs a shared store"),
    (dict(peer_listen="10.0.0.1:9570", peer_token_file=None), "needs --peer-token-file"),
    (dict(peer_listen="0.0.0.0:9570"), "wildcard"),
    (dict(peer_listen="10.0.0.1"), "expected HOST:PORT"),
    (dict(peer_listen="10.0.0.1:9570", peer_advertise="0.0.0.0:1"), "--peer-advertise"),
    (dict(peer_listen="10.0.0.1:0", peer_advertise="10.0.0.1:1"), "port 0"),
    (dict(peer_listen="10.0.0.1:9570", peer_advertise="gpu-7.cluster:9570"), "literal"),
    (dict(peer_listen="gpu-7.cluster:9570"), "literal IP"),
    (dict(peer_listen="10.0.0.1:9570", peer_cache="some"), "choose all or owned"),
    (dict(peer_listen="10.0.0.1:9570", peer_timeout=0), "--peer-timeout"),
    (dict(peer_advertise="10.0.0.1:9570"), "needs --peer-listen"),
])
def test_peer_options_are_checked(kw, message):
    if "peer_listen" not in kw:
        kw["peer_token_file"] = None
    with pytest.raises(ConfigError, match=message):
        config(**kw)


def test_peer_options_that_work():
    assert config(peer_listen="10.0.0.1:9570").peer_cache == "all"
    assert config(peer_listen="0.0.0.0:9570", peer_advertise="10.0.0.1:9570").peer_advertise == "10.0.0.1:9570"
    assert config(peer_listen="127.0.0.1:0").peer_listen == "127.0.0.1:0"
    # the members meet in a store found through Redis Sentinel as well
    sentinel = "redis+sentinel://10.0.0.7:26379,10.0.0.8:26379/epochfs/0"
    assert config(peer_listen="10.0.0.1:9570", meta=sentinel).meta == sentinel
