"""Eviction policies, checked against an independent offline Belady (MIN with bypass) computation."""

from __future__ import annotations

import random

import pytest

from epochfs.eviction import make_policy, names
from epochfs.eviction.lru import LruPolicy
from epochfs.eviction.manifest import NEVER, ManifestPolicy
from epochfs.eviction.none import NoEvictionPolicy
from epochfs.prefetch.manifest import shuffled
from epochfs.prefetch.simulate import block_sequence, simulate

from .helpers import offline_min_misses


def reshuffled_epochs(n_items: int, epochs: int, seed: int) -> list[bytes]:
    items = [f"f{i}".encode() for i in range(n_items)]
    seq: list[bytes] = []
    for e in range(epochs):
        seq += shuffled(items, seed, e)
    return seq


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_manifest_policy_misses_equal_the_offline_optimum(fraction, seed):
    n = 60
    seq = reshuffled_epochs(n, 3, seed)
    capacity = int(n * fraction)
    result = simulate([(b, 1) for b in seq], capacity, "manifest")
    optimum = offline_min_misses(seq, capacity)
    assert result.reads - result.hits == optimum
    lru = simulate([(b, 1) for b in seq], capacity, "lru")
    if fraction < 1.0:
        assert lru.reads - lru.hits > optimum, "LRU should be worse on reshuffled epochs"
    else:
        assert lru.reads - lru.hits == optimum == n


def random_sequences(seed: int, count: int) -> list[tuple[list[bytes], int]]:
    """(sequence with repeats, capacity) pairs: random block ids over a small universe."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        universe = [f"b{i}".encode() for i in range(rng.randrange(2, 25))]
        seq = [rng.choice(universe) for _ in range(rng.randrange(1, 120))]
        cases.append((seq, rng.randrange(1, len(universe) + 1)))
    return cases


def test_manifest_policy_matches_optimum_on_random_sequences_with_repeats():
    for seq, capacity in random_sequences(7, 30):
        got = simulate([(b, 1) for b in seq], capacity, "manifest")
        assert got.reads - got.hits == offline_min_misses(seq, capacity)


def test_lru_thrashes_on_a_cyclic_scan_larger_than_the_cache():
    seq = [b"1", b"2", b"3", b"4"] * 3
    assert simulate([(b, 1) for b in seq], 3, "lru").hits == 0
    assert simulate([(b, 1) for b in seq], 3, "manifest").hits == offline_hits(seq, 3)


def offline_hits(seq: list[bytes], capacity: int) -> int:
    return len(seq) - offline_min_misses(seq, capacity)


def test_none_policy_fills_once_and_keeps_it():
    seq = [b"a", b"b", b"c", b"a", b"b", b"c"]
    r = simulate([(b, 1) for b in seq], 2, "none")
    assert r.hits == 2  # a and b stay; c is read through both times
    p = NoEvictionPolicy()
    p.inserted(b"x", 1)
    assert p.victim() is None and not p.prefer(b"y", b"x")


def test_warm_start_from_the_previous_epoch():
    items = [f"f{i}".encode() for i in range(40)]
    e0, e1 = shuffled(items, 5, 0), shuffled(items, 5, 1)
    blocks0, blocks1 = [(b, 1) for b in e0], [(b, 1) for b in e1]
    r = simulate(blocks1, 20, "manifest", warmup=blocks0)
    assert r.hits == offline_hits(e0 + e1, 20) - offline_hits(e0, 20) or r.hits >= 20
    assert r.hits >= simulate(blocks1, 20, "lru", warmup=blocks0).hits


def test_manifest_policy_without_a_manifest_is_lru():
    m, lru = ManifestPolicy(), LruPolicy()
    rng = random.Random(3)
    resident: set[bytes] = set()
    for _ in range(500):
        b = f"{rng.randrange(12)}".encode()
        for p in (m, lru):
            if b in resident:
                p.accessed(b)
            else:
                p.inserted(b, 1)
        resident.add(b)
        if len(resident) > 6:
            v = lru.victim()
            assert m.victim() == v
            for p in (m, lru):
                p.removed(v)
            resident.discard(v)


def test_manifest_policy_advance_and_next_use():
    p = ManifestPolicy()
    p.plan([b"a", b"b", b"a", b"c"])
    for b in (b"a", b"b", b"c"):
        p.inserted(b, 1)
    assert p.victim() == b"c" and p.next_use(b"a") == 0
    p.advance(1)
    assert p.next_use(b"a") == 2 and p.victim() == b"c"
    p.advance(3)
    assert p.next_use(b"a") == NEVER and p.next_use(b"b") == NEVER
    assert p.victim() in (b"a", b"b")
    assert not p.prefer(b"zzz", b"c")  # an unplanned block does not replace a planned one
    assert p.prefer(b"c", b"a")


def test_make_policy():
    assert names() == ["manifest", "lru", "none"]  # every module of the package, the default first
    assert {make_policy(n).name for n in names()} == {"lru", "manifest", "none"}
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random")


def test_a_registered_policy_is_usable_everywhere_without_other_changes(tmp_path):
    from epochfs import eviction as policies
    from epochfs.cli import build_parser
    from epochfs.cli.options import config_from

    @policies.register("fifo-test", "evict the oldest block")
    class Fifo(LruPolicy):
        def accessed(self, bid: bytes) -> None:
            pass  # insertion order only

    try:
        assert "fifo-test" in names() and "fifo-test: evict the oldest block" in policies.describe()
        cfg = config_from(build_parser().parse_args(["mount", "s3://b", str(tmp_path), "--eviction", "fifo-test"]))
        assert make_policy(cfg.eviction).name == "fifo-test"
        seq = [bytes([i % 5]) for i in range(40)]
        assert simulate([(b, 1) for b in seq], 3, "fifo-test").reads == 40
    finally:
        policies._REGISTRY.pop("fifo-test")


def test_block_sequence():
    seq = block_sequence([("a", 10), ("b", 0), ("c", 25)], 10)
    assert [s for _, s in seq] == [10, 10, 10, 5]
    assert len({b for b, _ in seq}) == 4


def test_the_fast_offline_optimum_agrees_with_brute_force():
    from epochfs.prefetch.simulate import offline_optimum

    for seq, capacity in random_sequences(11, 200):
        assert offline_optimum(seq, capacity) == offline_min_misses(seq, capacity)


def test_every_policy_is_known_even_when_one_was_imported_first():
    import subprocess
    import sys

    code = ("import epochfs.eviction.lru\nfrom epochfs import eviction as policies\n"
            "print(','.join(policies.names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().split(",") == ["manifest", "lru", "none"]
