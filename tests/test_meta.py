"""The shared metadata store: Redis started by the fixture, two daemons on one snapshot, refresh
without unmounting, Redis going away, published manifests, a large synthetic namespace."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from epochfs.core.records import ObjectInfo
from epochfs.dev.sample import SampleFile, pattern, upload
from epochfs.dev.servers import LocalRedis
from epochfs.meta import open_meta
from epochfs.meta.index import build as build_namespace
from epochfs.meta.namespace import diff

from .conftest import requires_fuse
from .helpers import EPOCHFS, drop_all_caches, read_all, wait_idle

KiB, MiB = 1 << 10, 1 << 20


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def redis_server(tmp_path):
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


def objs(n: int) -> list[ObjectInfo]:
    return [ObjectInfo(f"d{i % 100}/f{i:07d}.bin", i, 1_700_000_000_000_000_000 + i, f'"{i:x}"') for i in range(n)]


def test_redis_store_versions_and_manifests(redis_server):
    store = open_meta(redis_server.url, Path("."), None)
    assert store.load("s3://b/p/") is None
    v1 = store.save("s3://b/p/", objs(50_001))
    v2 = store.save("s3://b/p/", objs(10))
    assert (v1.version, v2.version) == (1, 2)
    loaded = store.load("s3://b/p/")
    assert loaded.version == 2 and sorted(loaded.objects) == sorted(objs(10))  # a snapshot is a set
    store.save("s3://b/p/", objs(3))
    import redis

    keys = {k.decode() for k in redis.Redis(port=redis_server.port).keys("epochfs:*")}
    assert not any(":v1:" in k for k in keys), "versions before the previous one are deleted"
    store.put_manifest("s3://b/p/", "epoch3", "a\nb\n")
    assert store.get_manifest("s3://b/p/", "epoch3") == "a\nb\n"
    assert store.get_manifest("s3://b/p/", "nope") is None


def test_lmdb_store_keeps_manifests_across_versions(tmp_path):
    store = open_meta(None, tmp_path, None)
    store.save("s3://b/", objs(5))
    store.put_manifest("s3://b/", "m", "x\n")
    snap = store.save("s3://b/", objs(25_000))
    assert snap.version == 2 and sorted(store.load("s3://b/").objects) == sorted(objs(25_000))
    assert store.get_manifest("s3://b/", "m") == "x\n"


def test_inodes_stay_stable_across_versions_and_the_diff_names_what_changed():
    a = build_namespace([ObjectInfo("x/1", 1, 0, "e1"), ObjectInfo("x/2", 2, 0, "e2"), ObjectInfo("y", 3, 0, "e3")])
    b = build_namespace([ObjectInfo("x/1", 1, 0, "e1"), ObjectInfo("x/2", 5, 0, "NEW"), ObjectInfo("z", 4, 0, "e4")],
                        previous=a)
    assert b.resolve("x/1").inode == a.resolve("x/1").inode
    assert b.resolve("x/2").inode == a.resolve("x/2").inode
    assert b.resolve("z").inode > a.max_inode, "a new path never reuses an inode number"
    entries, inodes = diff(a, b)
    names = {name for _, name in entries}
    assert names == {b"2", b"y", b"z"}
    assert a.resolve("x/2").inode in inodes and a.resolve("y").inode in inodes


@requires_fuse
def test_two_daemons_share_one_snapshot_and_never_list(s3, s3_client, fresh_bucket, mount_factory, redis_server,
                                                       tmp_path):
    files = [SampleFile(f"set/{i:03d}.bin", 50 * KiB + i) for i in range(30)]
    upload(s3_client, fresh_bucket, "", files)
    result = subprocess.run([*EPOCHFS, "import", f"s3://{fresh_bucket}", "--meta", redis_server.url,
                             "--endpoint-url", s3.endpoint], env=s3.env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "published version 1" in result.stdout
    gets = s3.request_count(fresh_bucket)
    a = mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, name="a", cache_dir=tmp_path / "ca")
    b = mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, name="b", cache_dir=tmp_path / "cb")
    with a, b:
        assert s3.request_count(fresh_bucket) == gets, "a daemon listed the bucket"
        assert a.status()["snapshot"]["version"] == b.status()["snapshot"]["version"] == 1
        for f in files:
            assert read_all(a.path(f.key)) == read_all(b.path(f.key)) == f.content()


@requires_fuse
@pytest.mark.page_cache
def test_refresh_switches_versions_without_mixing_open_files(s3, s3_client, fresh_bucket, mount_factory,
                                                             redis_server):
    key, size = "data/obj.bin", 2 * MiB + 5
    s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 0, 0, size))
    s3_client.put_object(Bucket=fresh_bucket, Key="data/stays.txt", Body=b"same")

    def publish() -> None:
        r = subprocess.run([*EPOCHFS, "import", f"s3://{fresh_bucket}", "--meta", redis_server.url,
                            "--endpoint-url", s3.endpoint], env=s3.env(), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    publish()
    with mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, "--block-size", "512K",
                       "--readahead", "0") as m:
        held = open(m.path(key), "rb", buffering=0)  # noqa: SIM115 - held across the refresh
        assert held.read(600 * KiB) == pattern(key, 0, 0, 600 * KiB)
        wait_idle(m)
        s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 1, 0, size + 77))
        s3_client.put_object(Bucket=fresh_bucket, Key="data/new.txt", Body=b"new file")
        publish()
        r = subprocess.run([*EPOCHFS, "refresh", str(m.mountpoint)], capture_output=True, text=True)
        assert r.returncode == 0 and "version 2" in r.stdout, r.stderr
        assert sorted(os.listdir(m.path("data"))) == ["new.txt", "obj.bin", "stays.txt"]
        assert os.stat(m.path(key)).st_size == size + 77
        assert read_all(m.path(key)) == pattern(key, 1, 0, size + 77)  # reopened: the new version
        drop_all_caches()
        for off in range(0, size, 300 * KiB):  # the held file: old bytes or ESTALE, never the new ones
            try:
                data = os.pread(held.fileno(), 300 * KiB, off)
            except OSError as exc:
                assert exc.errno in (errno.ESTALE, errno.EIO)
                continue
            assert data == pattern(key, 0, off, len(data))
        held.close()
        assert m.path("data/stays.txt").read_bytes() == b"same"


@requires_fuse
@pytest.mark.page_cache
def test_redis_down_keeps_serving_and_reports_it(s3, s3_client, fresh_bucket, mount_factory, redis_server,
                                                 tmp_path):
    files = [SampleFile(f"r/{i}.bin", 20 * KiB + i) for i in range(10)]
    upload(s3_client, fresh_bucket, "", files)
    subprocess.run([*EPOCHFS, "import", f"s3://{fresh_bucket}", "--meta", redis_server.url, "--endpoint-url",
                    s3.endpoint], env=s3.env(), check=True, capture_output=True)
    with mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, "--meta-poll", "0.3") as m:
        wait_for(lambda: "kept a copy of snapshot version 1" in m.log())
        redis_server.stop()
        time.sleep(1.5)
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        status = m.status()
        assert status["meta"]["reachable"] is False and status["meta"]["error"]
        import urllib.request

        with urllib.request.urlopen(f"http://{status['metrics_addr']}/metrics") as resp:
            labels = f'mountpoint="{m.mountpoint}",node="{status["node"]}"'
            assert f'epochfs_meta_reachable{{{labels}}} 0.0' in resp.read().decode()
        assert "metadata store unreachable" in m.log()
        r = subprocess.run([*EPOCHFS, "refresh", str(m.mountpoint)], capture_output=True, text=True)
        assert r.returncode == 1 and "unreachable" in r.stderr

    with m:  # the node restarts while the store is still down: it mounts from its own copy
        assert "serving this node's copy of snapshot version 1" in m.log()
        status = m.status()
        assert status["meta"]["reachable"] is False and status["snapshot"]["version"] == 1
        drop_all_caches()
        assert sorted(os.listdir(m.path("r"))) == sorted(f.key[2:] for f in files)
        for f in files:
            assert read_all(m.path(f.key)) == f.content()

    fresh = mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, name="fresh",
                          cache_dir=tmp_path / "fresh-cache")
    r = fresh.start(expect_ok=False)  # a node that never loaded a snapshot has nothing to serve
    assert r.returncode != 0 and "unreachable" in r.stderr and "no copy of a snapshot" in r.stderr
    assert not os.path.ismount(fresh.mountpoint)


@requires_fuse
def test_manifests_published_to_the_store_reach_other_daemons(s3, s3_client, fresh_bucket, mount_factory,
                                                             redis_server, tmp_path):
    files = [SampleFile(f"m/{i:02d}.bin", 30 * KiB + i) for i in range(16)]
    upload(s3_client, fresh_bucket, "", files)
    subprocess.run([*EPOCHFS, "import", f"s3://{fresh_bucket}", "--meta", redis_server.url, "--endpoint-url",
                    s3.endpoint], env=s3.env(), check=True, capture_output=True)
    manifest = tmp_path / "epoch0.txt"
    manifest.write_text("".join(f.key + "\n" for f in reversed(files)))
    a = mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, name="a", cache_dir=tmp_path / "ca")
    b = mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, name="b", cache_dir=tmp_path / "cb")
    with a, b:
        r = subprocess.run([*EPOCHFS, "prefetch", str(a.mountpoint), "--manifest", str(manifest), "--publish",
                            "epoch0", "--rank", "0", "--world-size", "2"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([*EPOCHFS, "prefetch", str(b.mountpoint), "--stored", "epoch0", "--rank", "1",
                            "--world-size", "2"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert a.status()["prefetch"]["files"] == b.status()["prefetch"]["files"] == 8
        r = subprocess.run([*EPOCHFS, "prefetch", str(b.mountpoint), "--stored", "missing"], capture_output=True,
                           text=True)
        assert r.returncode == 2 and "no manifest named 'missing'" in r.stderr


@requires_fuse
@pytest.mark.slow  # 8 s; a large namespace through a mount is also held by test_hostile's long manifest (150,000)
def test_large_synthetic_namespace_imports_and_mounts(tmp_path, redis_server, mount_factory, fresh_bucket):
    """200,000 entries published to Redis and mounted from it (timings go to the benchmark report).

    The bucket exists but is empty: a mount checks its backend before it serves, and the listing is the store's."""
    store = open_meta(redis_server.url, Path("."), "synthetic")
    started = time.monotonic()
    store.save(f"s3://{fresh_bucket}/", objs(200_000))
    publish_s = time.monotonic() - started
    m = mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, "--meta-name", "synthetic")
    started = time.monotonic()
    m.start()
    mount_s = time.monotonic() - started
    assert m.status()["snapshot"]["files"] == 200_000
    assert len(os.listdir(m.path("d7"))) == 2000
    m.stop()
    print(f"published 200,000 entries in {publish_s:.1f}s, mounted in {mount_s:.1f}s")


# -- malformed shared snapshots ---------------------------------------------------------------------

def test_decode_refuses_every_malformed_record():
    from epochfs.meta.base import _RECORD, SnapshotInvalid, decode_objects, encode_objects

    good = encode_objects(objs(3))
    assert decode_objects(good) == objs(3)
    rec = _RECORD.pack(10, 0, 3, 2, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    bad = {
        "truncated head": good + rec[:10],
        "truncated key": good + rec + b"ab",
        "non-UTF-8 key": rec + b"a\xffb" + b'"e',
        "non-UTF-8 etag": rec + b"abc" + b"\xc3(",
        "size out of range": _RECORD.pack(1 << 62, 0, 1, 1, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF) + b"ae",
        "key length absurd": _RECORD.pack(1, 0, 1 << 31, 1, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF) + b"ae",
        "mode not a mode": _RECORD.pack(1, 0, 1, 1, 0o170000, 0, 0) + b"ae",
    }
    for what, raw in bad.items():
        with pytest.raises(SnapshotInvalid):
            decode_objects(raw)
        print("refused:", what)


@pytest.fixture
def published(s3, s3_client, fresh_bucket, redis_server):
    files = [SampleFile(f"p/{i}.bin", 40 * KiB + i) for i in range(6)]
    upload(s3_client, fresh_bucket, "", files)
    subprocess.run([*EPOCHFS, "import", f"s3://{fresh_bucket}", "--meta", redis_server.url, "--endpoint-url",
                    s3.endpoint], env=s3.env(), check=True, capture_output=True)
    import redis

    yield files, redis.Redis(port=redis_server.port), f"epochfs:s3://{fresh_bucket}/:"


def plain(value: bytes | str) -> bytes:
    """A value as a store without a password holds it (format 3: a first byte 0, then the payload)."""
    return b"\x00" + (value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value)


def _corruptions(prefix: str):
    """(what, {key: value}) pairs, each a malformed field a shared store could hold for version 2."""
    from epochfs.meta.base import _RECORD

    info = {"format": 3, "source": "x", "version": 2, "created": 1.0, "objects": 1, "chunks": 1}
    v = f"{prefix}v2:"
    rec = _RECORD.pack(5, 0, 3, 3, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    cases = [
        ("version not a number", {prefix + "current": b"two"}),
        ("version negative", {prefix + "current": b"-2"}),
        ("version huge", {prefix + "current": b"9" * 40}),
        ("info not JSON", {prefix + "current": b"2", v + "info": b"{oops"}),
        ("info a list", {prefix + "current": b"2", v + "info": b"[1]"}),
        ("info too long", {prefix + "current": b"2", v + "info": json.dumps({**info, "pad": "x" * 5000})}),
        ("old format", {prefix + "current": b"2", v + "info": json.dumps({**info, "format": 2})}),
        ("absurd chunk count", {prefix + "current": b"2", v + "info": json.dumps({**info, "chunks": 10**9})}),
        ("absurd object count", {prefix + "current": b"2", v + "info": json.dumps({**info, "objects": 10**12})}),
        ("created not a number", {prefix + "current": b"2", v + "info": json.dumps({**info, "created": "now"})}),
        ("truncated chunk", {prefix + "current": b"2", v + "info": json.dumps(info), v + "chunk:0": rec[:9]}),
        ("non-UTF-8 name", {prefix + "current": b"2", v + "info": json.dumps(info),
                            v + "chunk:0": rec + b"a\xff/" + b'"e"'}),
        ("size out of range", {prefix + "current": b"2", v + "info": json.dumps(info),
                               v + "chunk:0": _RECORD.pack(1 << 62, 0, 3, 3, 0xFFFFFFFF, 0xFFFFFFFF,
                                                           0xFFFFFFFF) + b'big"e"'}),
        ("fewer objects than the info says", {prefix + "current": b"2", v + "info": json.dumps({**info, "objects": 2}),
                                              v + "chunk:0": rec + b'abc"e"'}),
    ]
    wrapped = [(what, {k: plain(val) for k, val in values.items()}) for what, values in cases]
    # values of an earlier format (no first byte), or signed where this node holds no key to check
    return [*wrapped, ("a value of the earlier format", {prefix + "current": b"2"}),
            ("a value of no format", {prefix + "current": b"\x07" + b"2"})]


@requires_fuse
def test_every_malformed_shared_snapshot_is_refused_and_the_mount_keeps_serving(
        s3, fresh_bucket, mount_factory, redis_server, published):
    files, r, prefix = published
    with mount_factory(f"s3://{fresh_bucket}", "--meta", redis_server.url, "--meta-poll", "0.2") as m:
        wait_for(lambda: "kept a copy of snapshot version 1" in m.log())
        for what, values in _corruptions(prefix):
            r.mset(values)
            time.sleep(0.5)  # a few polls (every 0.2 s)
            assert m.status()["snapshot"]["version"] == 1, what
            refused = subprocess.run([*EPOCHFS, "refresh", str(m.mountpoint)], capture_output=True, text=True)
            assert refused.returncode != 0 and "Traceback" not in refused.stderr, (what, refused.stderr)
            stale = [k for k in values if not k.endswith("current")]
            if stale:
                r.delete(*stale)
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        assert "still serving version 1" in m.log()
        assert "Traceback" not in m.log()

    r.set(prefix + "current", plain(b"not-a-version"))  # restarting on an invalid snapshot: this node's copy
    with m:
        assert "serving this node's copy of snapshot version 1" in m.log()
        for f in files:
            assert read_all(m.path(f.key)) == f.content()


def test_lmdb_store_update_applies_the_change_set(tmp_path):
    """A node's writes change the stored snapshot in place: the next version holds the merged listing,
    its count is the objects it holds, and keys longer than an LMDB key are kept."""
    from epochfs.meta.base import merged

    store = open_meta(None, tmp_path, None)
    base = objs(30_000) + [ObjectInfo("long/" + "k" * 3000, 1, 0, '"l"')]
    store.save("s3://b/", base)
    added = {"new/one": ObjectInfo("new/one", 5, 0, '"n"'), base[7].key: base[7]._replace(size=99, etag='"c"')}
    removed = {base[3].key, "never/there", "long/" + "k" * 3000}
    head = store.update("s3://b/", added, removed)
    expected = merged(base, added, removed)
    assert head.version == 2 and head.objects == len(expected) == store.head("s3://b/").objects
    assert sorted(store.load("s3://b/").objects) == sorted(expected)


def test_redis_change_sets_publish_the_change_and_load_whole(redis_server, monkeypatch):
    """A node's writes are a change set on the version before: loading gives the merged listing,
    ``changes`` gives the way from one version to another, an import in between breaks it (load
    whole), and a full copy written beside a change set is what a node without a version loads."""
    import redis

    from epochfs.meta import redis as redis_store
    from epochfs.meta.base import merged

    store = open_meta(redis_server.url, Path("."), "cs")
    base = objs(50)
    store.save("s3://b/", base)
    listing = list(base)
    for n in range(3):
        added = {f"ckpt/{n}.pt": ObjectInfo(f"ckpt/{n}.pt", 10 + n, 5, f'"c{n}"')}
        removed = {base[n].key}
        head = store.update("s3://b/", added, removed)
        assert head.version == n + 2 and head.objects == -1
        listing = merged(listing, added, removed)
    assert sorted(store.load("s3://b/").objects) == sorted(listing)
    changes = store.changes("s3://b/", 1, 4)
    assert [c.version for c in changes] == [2, 3, 4] and changes[0].removed == {base[0].key}
    assert store.changes("s3://b/", 0, 4) is None
    r = redis.Redis(port=redis_server.port)
    keys = {k.decode() for k in r.keys("epochfs:cs:v4:*")}
    assert keys == {"epochfs:cs:v4:info", "epochfs:cs:v4:chunk:0", "epochfs:cs:v4:removed"}, "only the change"

    monkeypatch.setattr(redis_store, "COMPACT_AFTER", 3)
    assert store.compaction_due("s3://b/")
    assert store.compact("s3://b/") == 4 and not store.compaction_due("s3://b/")
    for v in (2, 3):  # the change sets before the full copy are not needed to load
        r.delete(*r.keys(f"epochfs:cs:v{v}:*"))
    assert sorted(store.load("s3://b/").objects) == sorted(listing)

    store.save("s3://b/", objs(5))  # an import: a full version, no change set on the one before
    assert store.changes("s3://b/", 4, store.current_version("s3://b/")) is None
    store.close()


def test_an_update_lock_left_by_a_lost_answer_is_released_by_its_holder_and_no_other(redis_server, monkeypatch):
    """The master went away before the update lock was released (a failover, a dropped connection): the
    same store's next update releases it at once instead of waiting out its 30 s timeout, and a lock that
    expired meanwhile and another node took is left to that node."""
    import redis
    import redis.lock

    from epochfs.meta.redis_link import MetaUnavailable

    store = open_meta(redis_server.url, Path("."), "locks")
    store.save("s3://b/", objs(3))
    real = redis.lock.Lock.do_release
    failures = []

    def lost(self, token):
        if not failures:  # the first release does not reach the master
            failures.append(token)
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return real(self, token)

    monkeypatch.setattr(redis.lock.Lock, "do_release", lost)
    store.update("s3://b/", {"a": ObjectInfo("a", 1, 5, '"a"')}, set())
    r = redis.Redis(port=redis_server.port)
    name = "epochfs:locks:update-lock"
    assert failures and r.get(name) == failures[0], "the lock is left held, as after a lost release"

    # The master is still away at the next try: the release of the lost lock and the new acquire fail too.
    def away(*args, **kwargs):
        raise redis.exceptions.ConnectionError("Connection refused.")

    with monkeypatch.context() as m:
        m.setattr(redis.lock.Lock, "do_acquire", away)
        m.setattr(store._redis, "eval", away)
        with pytest.raises(MetaUnavailable):
            store.update("s3://b/", {"b": ObjectInfo("b", 1, 5, '"b"')}, set())
    assert r.get(name) == failures[0]
    started = time.monotonic()
    store.update("s3://b/", {"b": ObjectInfo("b", 1, 5, '"b"')}, set())
    assert time.monotonic() - started < 5, "the store's own lost lock was waited out"
    assert r.get(name) is None

    # Lost again; meanwhile the lock expires and another node takes it: that one is not released for it.
    failures.clear()
    store.update("s3://b/", {"c": ObjectInfo("c", 1, 5, '"c"')}, set())
    r.set(name, b"another-node", px=1500)
    started = time.monotonic()
    store.update("s3://b/", {"d": ObjectInfo("d", 1, 5, '"d"')}, set())
    assert time.monotonic() - started > 1.0, "another node's lock was released by a store that did not hold it"
    assert sorted(o.key for o in store.load("s3://b/").objects if len(o.key) == 1) == ["a", "b", "c", "d"]
    store.close()


def test_nodes_apply_each_others_change_sets_in_proportion(redis_server, tmp_path, caplog):
    """Two nodes on one shared snapshot: each publishes its writes as change sets, the other refreshes
    to them without loading the dataset, a node restarted after others published catches up by change
    sets, and a malformed change set is refused whole while the node keeps serving."""
    import logging

    import redis
    import trio

    from epochfs.meta.base import SnapshotInvalid
    from epochfs.meta.snapshots import Snapshots, SnapshotSettings

    store = open_meta(redis_server.url, Path("."), "two")
    store.save("s3://b/", objs(2000))
    store.close()

    def node(name):
        return Snapshots(open_meta(redis_server.url, Path("."), "two"),
                         SnapshotSettings(source_id="s3://b/", cache_dir=tmp_path / name, name="two"), lambda: iter(()))

    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "b").mkdir(mode=0o700)
    a, b = node("a"), node("b")
    loads = []
    b.store.load = lambda source, _load=b.store.load: loads.append(source) or _load(source)

    async def scenario():
        await a.apply({"ckpt/1.pt": ObjectInfo("ckpt/1.pt", 7, 1, '"x"')}, {"d0/f0000000.bin"})
        assert (await b.refresh())["changed"]
        assert b.namespace.resolve("ckpt/1.pt").obj.size == 7 and b.namespace.resolve("d0/f0000000.bin") is None
        await b.apply({"ckpt/2.pt": ObjectInfo("ckpt/2.pt", 8, 1, '"y"')}, set())
        await a.refresh()
        assert a.namespace.resolve("ckpt/2.pt") is not None and a.namespace.version == b.namespace.version
        assert a.statistics().objects == b.statistics().objects == 2001
        await a.apply({"ckpt/4.pt": ObjectInfo("ckpt/4.pt", 4, 1, '"w"')}, set())
        await b.apply({"ckpt/5.pt": ObjectInfo("ckpt/5.pt", 5, 1, '"v"')}, set())  # on top of a's, unseen
        assert b.namespace.resolve("ckpt/4.pt") is not None and b.namespace.resolve("ckpt/5.pt") is not None
        assert b.statistics().objects == 2003
    trio.run(scenario)
    assert loads == [], "no node loaded the dataset whole"
    b.close()

    async def more():
        await a.apply({"ckpt/3.pt": ObjectInfo("ckpt/3.pt", 9, 1, '"z"')}, set())
    trio.run(more)
    with caplog.at_level(logging.INFO):
        b = node("b")
    assert "caught up from version 5 to 6 by 1 change sets" in caplog.text
    assert b.namespace.resolve("ckpt/3.pt") is not None and b.statistics().objects == 2004

    from epochfs.meta.redis import _encode_removed

    r = redis.Redis(port=redis_server.port)
    prefix = "epochfs:two:"
    bad = {"format": 3, "source": "s3://b/", "version": 7, "created": 1.0, "objects": -1, "chunks": 0,
           "base": 6, "removed": 1}
    one = _encode_removed(["a"])
    for what, values in [
        ("deleted keys not decodable", {f"{prefix}v7:info": json.dumps(bad), f"{prefix}v7:removed": b"{"}),
        ("deleted keys miscounted", {f"{prefix}v7:info": json.dumps(bad), f"{prefix}v7:removed": _encode_removed([])}),
        ("deleted keys cut short", {f"{prefix}v7:info": json.dumps(bad), f"{prefix}v7:removed": one[:-1]}),
        ("deleted keys followed by bytes", {f"{prefix}v7:info": json.dumps(bad), f"{prefix}v7:removed": one + b"x"}),
        ("a deleted key too long", {f"{prefix}v7:info": json.dumps(bad),
                                    f"{prefix}v7:removed": _encode_removed(["k" * 5000])}),
        ("base not before it", {f"{prefix}v7:info": json.dumps({**bad, "base": 7}), f"{prefix}v7:removed": one}),
        ("a count on a change set", {f"{prefix}v7:info": json.dumps({**bad, "objects": 3}),
                                     f"{prefix}v7:removed": one}),
    ]:
        r.mset({**{k: plain(v) for k, v in values.items()}, f"{prefix}current": plain(b"7")})
        with pytest.raises(SnapshotInvalid):
            trio.run(b.refresh)
        assert b.namespace.version == 6 and b.namespace.resolve("ckpt/3.pt") is not None, what
    a.close()
    b.close()


def test_a_damaged_stored_snapshot_is_listed_again(tmp_path, caplog):
    """A record of the embedded store that does not decode (found only as the index is first built
    from it) makes the mount list the source again, not fail or serve part of it."""
    import logging

    from epochfs.meta.snapshots import Snapshots, SnapshotSettings

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    open_meta(None, cache, None).save("s3://b/", objs(30))
    store = open_meta(None, cache, None)
    env = store._env()
    with env.begin(write=True) as txn:
        key = next(k for k, _ in txn.cursor() if k.startswith(b"o/"))
        txn.put(key, b"\x01\x02garbage")
    listed = [ObjectInfo("fresh/listing.bin", 3, 0, '"f"')]
    with caplog.at_level(logging.WARNING):
        snaps = Snapshots(store, SnapshotSettings(source_id="s3://b/", cache_dir=cache), lambda: iter(listed))
    assert "the stored snapshot is damaged" in caplog.text
    assert [f.path for f in snaps.namespace.files()] == ["fresh/listing.bin"]
    assert snaps.snapshot.version == 2
    snaps.close()


def test_fuzzed_change_sets_are_refused_or_applied_and_the_node_keeps_serving(redis_server, tmp_path):
    """Random damage to a published change set (its info, its deleted keys, its records): a node that
    refreshes to it either serves a valid version or refuses it with the store's error, and keeps
    serving what it had: never another exception, never a part of a change."""
    import random

    import redis
    import trio

    from epochfs.core.errors import EpochfsError
    from epochfs.meta.base import encode_objects
    from epochfs.meta.snapshots import Snapshots, SnapshotSettings

    store = open_meta(redis_server.url, Path("."), "fz")
    store.save("s3://b/", objs(200))
    store.close()
    (tmp_path / "n").mkdir(mode=0o700)
    node = Snapshots(open_meta(redis_server.url, Path("."), "fz"),
                     SnapshotSettings(source_id="s3://b/", cache_dir=tmp_path / "n", name="fz"), lambda: iter(()))
    r = redis.Redis(port=redis_server.port)
    rng = random.Random(5)
    prefix = "epochfs:fz:"
    junk = [None, True, -1, 0, 1, 2, 10**20, 1.5, float("nan"), "x", "", [], {}, ["a"], [1], ["\udcff"],
            ["a" * 5000], ["../x", "", "a//b", "d0/"]]
    outcomes = {"applied": 0, "refused": 0}
    from epochfs.meta.redis import _encode_removed

    for _ in range(150):
        version = node.namespace.version + 1
        info = {"format": 3, "source": "s3://b/", "version": version, "created": 1.0, "objects": -1,
                "chunks": 1, "base": node.namespace.version, "removed": 1}
        removed: object = [objs(200)[rng.randrange(2, 200)].key]  # (d1/f0000001.bin stays: the probe below)
        chunk = encode_objects([ObjectInfo(f"new/{version}", 3, 0, '"n"')])
        for _ in range(rng.randrange(1, 3)):
            what = rng.choice(["info", "removed", "chunk"])
            if what == "info":
                info[rng.choice(list(info))] = rng.choice(junk)
            elif what == "removed":
                removed = rng.choice(junk)
            else:
                b = bytearray(chunk)
                for _ in range(rng.randrange(1, 4)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                chunk = bytes(b[:rng.randrange(len(b) + 1)]) if rng.random() < 0.3 else bytes(b)
        try:
            raw_removed = _encode_removed(removed)  # type: ignore[arg-type]
        except (TypeError, AttributeError, UnicodeEncodeError):
            raw_removed = rng.randbytes(rng.randrange(12))
        before, serving = node.namespace.version, node.namespace
        r.mset({f"{prefix}v{version}:info": plain(json.dumps(info)),
                f"{prefix}v{version}:removed": plain(raw_removed), f"{prefix}v{version}:chunk:0": plain(chunk),
                f"{prefix}current": plain(str(version))})
        try:
            trio.run(node.refresh)
        except EpochfsError:
            outcomes["refused"] += 1
            assert node.namespace is serving and node.namespace.version == before
        else:
            outcomes["applied"] += 1
        assert node.namespace.resolve("d1/f0000001.bin") is not None or node.namespace.version > before
        r.delete(*r.keys(f"{prefix}v{version}:*"))
        r.set(f"{prefix}current", plain(str(node.namespace.version)))
        r.set(f"{prefix}next-version", str(node.namespace.version))
    assert outcomes["refused"] > 50 and outcomes["applied"] > 0, outcomes
    node.close()
