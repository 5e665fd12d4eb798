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

from epochfs.config import Config, Source
from epochfs.errors import BackendUnavailable, ConfigError
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


TOKEN = b"s3cret-token-of-enough-length"


def signed(req: wire.BlockRequest, token: bytes = TOKEN, now: float | None = None) -> tuple[str, dict[str, str]]:
    target = req.target()
    return target, wire.headers(token, target, time.time() if now is None else now)


def test_a_signed_request_round_trips_and_any_change_is_refused():
    req = wire.BlockRequest(bytes(range(16)), "train/a b/ü?&=.jpg", '"abc-3"', 7, 1 << 20)
    target, h = signed(req)
    now = time.time()
    wire.verify(TOKEN, target, h[wire.TIME_HEADER], h[wire.AUTH_HEADER], now)
    assert wire.parse_target(target.encode()) == req
    tampered = target.replace("i=7", "i=8")
    for args in [(b"another-token-of-enough-length", target, h[wire.TIME_HEADER], h[wire.AUTH_HEADER]),
                 (TOKEN, tampered, h[wire.TIME_HEADER], h[wire.AUTH_HEADER]),
                 (TOKEN, target, str(int(h[wire.TIME_HEADER]) + 1), h[wire.AUTH_HEADER]),
                 (TOKEN, target, None, h[wire.AUTH_HEADER]), (TOKEN, target, h[wire.TIME_HEADER], None),
                 (TOKEN, target, "-5", h[wire.AUTH_HEADER]), (TOKEN, target, "1e9", h[wire.AUTH_HEADER]),
                 (TOKEN, target, h[wire.TIME_HEADER], "ü")]:
        with pytest.raises(wire.Rejected) as exc:
            wire.verify(*args, now)
        assert exc.value.status == 401
    old_target, old = signed(req, now=now - wire.CLOCK_SKEW - 5)
    with pytest.raises(wire.Rejected, match="off this node's clock"):
        wire.verify(TOKEN, old_target, old[wire.TIME_HEADER], old[wire.AUTH_HEADER], now)


@pytest.mark.parametrize("target,status", [
    (b"/", 404), (b"/d/00.bin", 404), (b"/v1/block/xyz", 404), (b"/v1/block/" + b"AB" * 16, 404),
    (b"/v1/block/" + b"ab" * 16, 400), (b"/v1/block/" + b"ab" * 16 + b"?k=a&e=b&i=0", 400),
    (b"/v1/block/" + b"ab" * 16 + b"?k=a&e=b&i=-1&n=1", 400), (b"/v1/block/" + b"ab" * 16 + b"?k=a&e=b&i=0&n=1&z=1", 400),
    (b"/v1/block/" + b"ab" * 16 + b"?k=a&k=b&e=b&i=0&n=1", 400), (b"/v1/block/" + b"ab" * 16 + b"?k=&e=b&i=0&n=1", 400),
    (b"/v1/block/" + b"ab" * 16 + b"?k=%00&e=b&i=0&n=1", 400), (b"/v1/block/" + b"ab" * 16 + b"?k=%ff&e=b&i=0&n=1", 400),
    (b"/v1/block/" + b"ab" * 16 + b"?k=a&e=b&i=0&n=99999999999", 400), (b"/v1/block/" + b"ab" * 16 + b"?k=a&e=b&i=0&n=1&w=2", 400),
    (b"/v1/block/" + b"ab" * 16 + b"?k=a&e=b&i=0&n=1\xff", 400), (b"/v1/block/" + b"a" * 20_000, 414),
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


class FakeStore:
    def __init__(self, answer):
        self.answer = answer
        self.left = []

    def heartbeat(self, source, member, ttl, limit):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def leave(self, source, member):
        self.left.append(member)


def test_the_member_list_from_the_store_is_checked():
    store = FakeStore([b"10.0.0.2:9570", b"10.0.0.3:9570", b"evil\n:1", b"\xff\xfe:1", b"x" * 400, b"host:99999",
                       b"10.0.0.4:9570"])
    m = Membership(store, "s3://b/p/", "10.0.0.1:9570")

    async def main():
        await m.beat()
        assert m.ring.members == ("10.0.0.1:9570", "10.0.0.2:9570", "10.0.0.3:9570", "10.0.0.4:9570")
        store.answer = BackendUnavailable("redis is down")
        await m.beat()
        assert not m.reachable and len(m.ring) == 4  # the last list is kept
        store.answer = []
        await m.beat()
        assert m.reachable and m.ring.members == ("10.0.0.1:9570",)  # never without itself
        async with trio.open_nursery() as nursery:
            await nursery.start(m.run)
            nursery.cancel_scope.cancel()
        assert store.left == ["10.0.0.1:9570"]

    trio.run(main)


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


def config(**kw):
    base = dict(source=Source.parse("s3://b/p"), mountpoint="/mnt/x", cache_dir="/tmp/epochfs-test-cache",
                meta="redis://127.0.0.1:6379/0", peer_token_file="/etc/epochfs/peer-token")
    return Config(**{**base, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(peer_listen="10.0.0.1:9570", meta=None), "needs a shared store"),
    (dict(peer_listen="10.0.0.1:9570", peer_token_file=None), "needs --peer-token-file"),
    (dict(peer_listen="0.0.0.0:9570"), "wildcard"),
    (dict(peer_listen="10.0.0.1"), "expected HOST:PORT"),
    (dict(peer_listen="10.0.0.1:9570", peer_advertise="0.0.0.0:1"), "--peer-advertise"),
    (dict(peer_listen="10.0.0.1:0", peer_advertise="10.0.0.1:1"), "port 0"),
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
