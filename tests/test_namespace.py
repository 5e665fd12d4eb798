import logging

from epochfs.core.records import ObjectInfo, unsafe_reason
from epochfs.meta.entries import name_cookie
from epochfs.meta.index import build as build_namespace
from epochfs.meta.namespace import ROOT_INODE
from epochfs.meta.nodes import Dir, File


def obj(key, size=1):
    return ObjectInfo(key, size, 1_000, '"e"')


def names(ns, node):
    """A directory's names, sorted (a listing gives them in cookie order: checked here too)."""
    listed = [name for name, _ in ns.entries(node.inode)]
    assert listed == sorted(listed, key=lambda n: (name_cookie(n), n))
    return sorted(listed)


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


def shape(ns):
    """Every path with its kind and record, read through the view's lookups (not its tables)."""
    out = {}
    stack = [ns.node(ROOT_INODE)]
    while stack:
        d = stack.pop()
        out[d.path] = ("dir", d.info)
        for name, child in ns.entries(d.inode):
            assert ns.lookup(d.inode, name) == child and ns.resolve(child.path) == child
            if child.is_dir:
                stack.append(child)
            else:
                out[child.path] = ("file", child.obj)
    return out


def test_a_change_set_gives_the_tree_a_build_of_the_merged_listing_gives():
    """Random uploads and deletions (files, markers, files in the way of directories, the last file of
    a directory) applied to the index: the same tree as building the merged listing, the same counts,
    unchanged paths keep their inodes, new ones get numbers never used, and the kernel is told of
    every entry that changed."""
    import random

    from epochfs.meta.base import merged
    from epochfs.meta.index import NamespaceIndex

    rng = random.Random(11)
    names = ["a", "b", "a/b", "a/c", "a/b/c", "d/", "a/", "a/b/", "e/f/g", "e/f/", "h", "e", "a/b/c/d"]
    for trial in range(60):
        listing = {k: ObjectInfo(k, 0 if k.endswith("/") else rng.randrange(1, 9), 1, f'"{trial}"')
                   for k in rng.sample(names, rng.randrange(0, len(names)))}
        index = NamespaceIndex.temporary()
        before = index.build(listing.values(), source="s", version=1, created=1.0, mtime_ns=5)
        old_shape = shape(before)
        old_inodes = {p: before.resolve(p).inode for p in old_shape}
        for step in range(4):
            added = {k: ObjectInfo(k, 0 if k.endswith("/") else rng.randrange(1, 9), 2, f'"{trial}.{step}"')
                     for k in rng.sample(names, rng.randrange(0, 4))}
            removed = set(rng.sample(names, rng.randrange(0, 4))) - added.keys()
            after, (entries, inodes) = index.apply(added, removed, version=2 + step, created=2.0, mtime_ns=5)
            listing = {o.key: o for o in merged(listing.values(), added, removed)}
            expected = build_namespace(listing.values(), mtime_ns=5)
            assert shape(after) == shape(expected), (trial, step, added, removed)
            assert (after.file_count, after.dir_count, after.total_bytes) == (
                expected.file_count, expected.dir_count, expected.total_bytes)
            assert after.info["objects"] == len(listing), "the snapshot's object count follows"
            new_shape = shape(after)
            for path, what in new_shape.items():
                inode = after.resolve(path).inode
                if path in old_shape and old_shape[path][0] == what[0]:
                    assert inode == old_inodes[path], (path, "kept its inode")
                elif path:
                    assert inode > before.max_inode, (path, "a new number")
                if path and (path not in old_shape or old_shape[path] != what):
                    assert (after.resolve(path.rpartition("/")[0]).inode, path.rpartition("/")[2].encode()) in entries
            for path in old_shape.keys() - new_shape.keys():
                assert old_inodes[path] in inodes
            assert shape(before) == old_shape, "a view keeps its version"
            before, old_shape = after, new_shape
            old_inodes = {p: after.resolve(p).inode for p in new_shape}


def test_paths_longer_than_an_index_key_resolve_and_change():
    """Paths up to PATH_MAX bytes (an LMDB key holds 511): found by lookup, path and listing, and
    changed in place."""
    from epochfs.meta.index import NamespaceIndex

    deep = "/".join(["d" * 250] * 12)  # 3011 bytes
    index = NamespaceIndex.temporary()
    ns = index.build([obj(deep + "/f", 3), obj(deep + "/g", 4)], source="s", version=1, created=1.0)
    f = ns.resolve(deep + "/f")
    assert isinstance(f, File) and f.obj.size == 3
    parent = ns.resolve(deep)
    assert names(ns, parent) == [b"f", b"g"]
    assert ns.lookup(parent.inode, b"g").obj.size == 4
    ns2, _ = index.apply({deep + "/f": obj(deep + "/f", 9)}, {deep + "/g"}, version=2, created=2.0)
    assert ns2.info["objects"] == 1
    assert ns2.resolve(deep + "/f").obj.size == 9 and ns2.resolve(deep + "/f").inode == f.inode
    assert ns2.resolve(deep + "/g") is None and ns.resolve(deep + "/g") is not None


def test_walk_gives_every_file_under_a_directory_once():
    ns = build_namespace([obj(k) for k in ("a/x", "a/b/c", "a/b/d/e", "a.txt", "b/y", "a/b/d/f", "a/z")])
    a = ns.resolve("a")
    walked = [f.path for f in ns.walk(a.inode)]
    assert sorted(walked) == ["a/b/c", "a/b/d/e", "a/b/d/f", "a/x", "a/z"]
    for under in ("a/b/", "a/b/d/"):  # depth first: a directory's files come together
        at = [i for i, p in enumerate(walked) if p.startswith(under)]
        assert at == list(range(at[0], at[0] + len(at)))
    assert sorted(f.path for f in ns.walk(ROOT_INODE)) == sorted(f.path for f in ns.files())


def test_resolve_all_agrees_with_resolve():
    keys = [f"d{i % 7}/f{i}" for i in range(3000)] + ["x" * 255 + "/" + "y" * 200]
    ns = build_namespace([obj(k) for k in keys])
    asked = keys + ["d1", "/d2/", "missing", "d1/f1/", "", "bad\udcff", "d1//f1"]
    assert ns.resolve_all(asked) == [ns.resolve(p) for p in asked]


def test_an_index_that_renumbers_gives_a_changed_file_a_new_inode():
    """For mounts that open files with no request: an inode number names one version of a file. A build
    and a change set alike give a changed file a new number (never one used before); unchanged files and
    directories keep theirs; the diff names the entry and the old number for the kernel to forget."""
    from epochfs.meta.index import NamespaceIndex
    from epochfs.meta.namespace import diff

    index = NamespaceIndex.temporary()
    index.renumber_changed = True
    first = [obj("d/a"), obj("d/b"), obj("c")]
    v1 = index.build(first, source="", version=1, created=0.0)
    numbers = {p: v1.resolve(p).inode for p in ("d", "d/a", "d/b", "c")}
    v2 = index.build([ObjectInfo("d/a", 2, 0, "e2"), obj("d/b"), obj("c")], source="", version=2, created=0.0,
                     previous=v1)
    assert v2.resolve("d/a").inode > max(numbers.values()) and v2.resolve("d/a").obj.size == 2
    assert {p: v2.resolve(p).inode for p in ("d", "d/b", "c")} == {p: numbers[p] for p in ("d", "d/b", "c")}
    entries, inodes = diff(v1, v2)
    assert (numbers["d"], b"a") in entries and numbers["d/a"] in inodes
    v3, (entries, inodes) = index.apply({"c": ObjectInfo("c", 3, 0, "e3")}, [], version=3, created=0.0)
    assert v3.resolve("c").inode > v2.resolve("d/a").inode and v3.resolve("c").obj.size == 3
    assert (ROOT_INODE, b"c") in entries and numbers["c"] in inodes
    assert v3.resolve("d/a").inode == v2.resolve("d/a").inode
    assert sorted(f.path for f in v3.files()) == ["c", "d/a", "d/b"] and len(list(v3.files())) == 3
    plain = build_namespace(first)
    again = build_namespace([ObjectInfo("d/a", 2, 0, "e2"), obj("d/b"), obj("c")], previous=plain)
    assert again.resolve("d/a").inode == plain.resolve("d/a").inode  # (without: a path keeps its number)
