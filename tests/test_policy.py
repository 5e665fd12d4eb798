from epochfs.cache.policy import LruPolicy, make_policy


def test_lru_evicts_least_recently_used():
    p = LruPolicy()
    for b in (b"a", b"b", b"c"):
        p.inserted(b, 1)
    assert p.victim() == b"a"
    p.accessed(b"a")
    assert p.victim() == b"b"
    p.removed(b"b")
    assert p.victim() == b"c"
    p.removed(b"c")
    p.removed(b"a")
    assert p.victim() is None
    assert p.admit(b"z")


def test_lru_access_of_unknown_block_is_ignored():
    p = LruPolicy()
    p.accessed(b"ghost")
    assert p.victim() is None and len(p) == 0


def test_lru_miss_count_on_cyclic_scan():
    """A scan larger than the cache misses every time under LRU (the case a manifest policy fixes)."""
    p, resident, capacity, misses = LruPolicy(), set(), 3, 0
    for _ in range(3):
        for b in (b"1", b"2", b"3", b"4"):
            if b in resident:
                p.accessed(b)
                continue
            misses += 1
            if len(resident) == capacity:
                v = p.victim()
                p.removed(v)
                resident.discard(v)
            p.inserted(b, 1)
            resident.add(b)
    assert misses == 12


def test_make_policy():
    assert make_policy("lru").name == "lru"
