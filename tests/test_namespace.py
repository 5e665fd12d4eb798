import logging

from epochfs.meta.index import build as build_namespace
from epochfs.meta.namespace import ROOT_INODE, Dir, File, unsafe_reason
from epochfs.records import ObjectInfo


def obj(key, size=1):
    return ObjectInfo(key, size, 1_000, '"e"')


def names(ns, node):
    return [name for name, _ in ns.entries(node.inode)]


def test_tree_and_lookup():
    ns = build_namespace([obj("a/b/c.bin", 10), obj("a/d.bin", 5), obj("top", 2)])
    root = ns.node(ROOT_INODE)
    assert isinstance(root, Dir) and names(ns, root) == [b"a", b"top"]
    a = ns.lookup(ROOT_INODE, b"a")
    assert isinstance(a, Dir) and names(ns, a) == [b"b", b"d.bin"]
    c = ns.lookup(ns.lookup(a.inode, b"b").inode, b"c.bin")
    assert isinstance(c, File) and c.obj.size == 10 and c.path == "a/b/c.bin"
    assert ns.lookup(ROOT_INODE, b"missing") is None
    assert ns.lookup(c.inode, b"x") is None
    assert ns.total_bytes == 17 and ns.file_count == 3 and ns.dir_count == 3
    assert ns.resolve("a/b/c.bin") == c and ns.resolve("/a/") == a


def test_inodes_are_stable_for_the_same_listing():
    objs = [obj(f"d{i % 3}/f{i}") for i in range(50)]
    a, b = build_namespace(objs), build_namespace(list(reversed(objs)))
    assert [(f.path, f.inode) for f in a.files()] == [(f.path, f.inode) for f in b.files()]


def test_directory_markers():
    ns = build_namespace([obj("empty/", 0), obj("x/y/", 0), obj("x/y/z", 3)])
    assert isinstance(ns.resolve("empty"), Dir)
    assert isinstance(ns.resolve("x/y"), Dir) and isinstance(ns.resolve("x/y/z"), File)


def test_unsafe_keys_are_skipped_and_logged(caplog):
    bad = ["../escape", "a/../b", "./x", "a/./b", "/abs", "a//b", "nul\x00byte", "ctl\x07", "x" * 256,
           "d/" + "y" * 300, "ok/" * 1500 + "deep", "marker-with-data/", "bad\udcff"]
    with caplog.at_level(logging.WARNING):
        ns = build_namespace([obj(k) for k in bad] + [obj("fine/name.txt"), obj("x" * 255)])
    assert sorted(f.path for f in ns.files()) == ["fine/name.txt", "x" * 255]
    assert len([r for r in caplog.records if "skipping object" in r.message]) == len(bad)


def test_file_and_directory_of_the_same_name(caplog):
    with caplog.at_level(logging.WARNING):
        ns = build_namespace([obj("a/b"), obj("a/b/c"), obj("a/b2")])
    assert isinstance(ns.resolve("a/b"), Dir)
    assert isinstance(ns.resolve("a/b/c"), File)
    assert isinstance(ns.resolve("a/b2"), File)
    assert sum("also a directory prefix" in r.message for r in caplog.records) == 1


def test_unsafe_reason_accepts_ordinary_names():
    for key in ("a", "a/b.c", "with space/ü.bin", "...", "..hidden", "a.", "dir/"):
        assert unsafe_reason(key) is None, key


def test_unsafe_reason_agrees_with_the_rules_on_random_keys():
    """The rules of the module docstring, stated plainly, against random keys built from the parts that
    break them (and ordinary ones, which take the one-step check)."""
    import random

    rng = random.Random(7)
    parts = ["a", "b.c", "a b", ".", "..", "", "...", ".x", "x" * 255, "x" * 256, "é" * 127, "é" * 128,
             "c\x00", "\x1f", "\x7f", "\udc80", "ü", "d" * 1000]

    def safe(key: str) -> bool:
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError:
            return False
        comps = (key[:-1] if key.endswith("/") else key).split("/")
        return (len(raw) <= 4000 and not any(ord(c) < 32 or ord(c) == 127 for c in key)
                and all(c not in ("", ".", "..") and len(c.encode("utf-8")) <= 255 for c in comps))

    for _ in range(20000):
        key = "/".join(rng.choice(parts) for _ in range(rng.randrange(1, 7)))
        key = rng.choice(["", "/"]) * (rng.random() < 0.1) + key + "/" * (rng.random() < 0.2)
        assert (unsafe_reason(key) is None) == safe(key), repr(key)
