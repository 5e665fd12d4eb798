"""Objects shared between a node's mounts by content, mounted for real against the local S3 endpoint: a
new version of a dataset (``v2/`` beside ``v1/``, most files the same) read through a mount of its own
fetches only what changed, the rest copied from the ``v1`` mount's cache; every byte of both is right,
before and after a remount; a copy that is not the content its ETag names (a cache file changed on disk,
an index entry that lies or names a file it must not) is refused and fetched; the offers' decoding never
fails on garbage."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from epochfs.blockstore.content import (
    ContentIndex,
    Entry,
    Refused,
    content_md5,
    copy_checked,
    key_of,
    open_source,
    read_checked,
)
from epochfs.blockstore.format import checksums, digest
from epochfs.core.blocks import scope_id
from epochfs.core.records import Source
from epochfs.daemon.config import Config, default_cache_dir, default_root
from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import EPOCHFS, kill_daemon

MIB = 1 << 20

LARGE = [SampleFile(f"large-{i}.bin", 5 * MIB + 77_777 * (i + 1)) for i in range(4)]
SMALL = [SampleFile(f"small/s{i:02d}.bin", 60_000 + 1_013 * i) for i in range(30)]


def versions(s3_client, bucket: str, files: list[SampleFile], changed: set[int]  # noqa: ANN001
             ) -> tuple[list[SampleFile], list[SampleFile]]:
    """``v1``, and ``v2``: the files of ``changed`` (indices) in a new version, and one file added; both
    uploaded, under ``v1/`` and ``v2/`` of ``bucket``."""
    v2 = [SampleFile(f.key, f.size, version=1) if i in changed else f for i, f in enumerate(files)]
    v2.append(SampleFile("added.bin", 3 * MIB + 5, version=2))
    upload(s3_client, bucket, "v1/", files)
    upload(s3_client, bucket, "v2/", v2)
    return files, v2


def read_all(m, files: list[SampleFile]) -> None:  # noqa: ANN001
    for f in files:
        assert m.path(f.key).read_bytes() == f.content(), f.key


def read_odd(m, f: SampleFile, seed: int) -> None:  # noqa: ANN001
    """Odd sizes at seeded random offsets."""
    rng = random.Random(seed)
    with open(m.path(f.key), "rb", buffering=0) as fh:
        for _ in range(12):
            off = rng.randrange(0, f.size)
            size = rng.choice([1, 4095, 65537, MIB + 3])
            fh.seek(off)
            assert fh.read(size) == f.content(off, min(size, f.size - off)), (f.key, off, size)


def wait_offered(m, n: int, timeout: float = 20) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while (m.status()["shared"] or {}).get("offered", 0) < n:
        assert time.monotonic() < deadline, m.status()["shared"]
        time.sleep(0.1)


def two_mounts(mount_factory, tmp_path: Path, bucket: str, *args: str):  # noqa: ANN001, ANN201
    share = str(tmp_path / "shared")
    m1 = mount_factory(f"s3://{bucket}/v1", "--share-dir", share, *args, cache_dir=tmp_path / "c1", name="m1")
    m2 = mount_factory(f"s3://{bucket}/v2", "--share-dir", share, *args, cache_dir=tmp_path / "c2", name="m2")
    return m1, m2


@requires_fuse
@pytest.mark.parametrize("files,args", [(LARGE, ()), (SMALL, ("--no-passthrough",))], ids=["object-files", "packs"])
def test_a_new_version_fetches_only_what_changed(s3_client, fresh_bucket, mount_factory, tmp_path, files, args):
    v1, v2 = versions(s3_client, fresh_bucket, files, changed={1, 5})
    changed = sum(f.size for f in v2 if f not in v1)
    m1, m2 = two_mounts(mount_factory, tmp_path, fresh_bucket, *args)
    with m1, m2:
        read_all(m1, v1)
        wait_offered(m1, len(v1))
        assert m2.status()["backend"]["bytes"] == 0
        manifest = tmp_path / "order.txt"  # (what `epochfs plan` predicts v2's first epoch fetches: what changed)
        manifest.write_text("".join(f"{f.key}\n" for f in v2))
        out = subprocess.run([*EPOCHFS, "plan", "--mount", str(m2.mountpoint), "--manifest", str(manifest),
                              "--cache-size", "1G", "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        plan = json.loads(out.stdout)
        assert plan["shared_files"] == sum(f in v1 for f in v2) and plan["shared_bytes"] == sum(
            f.size for f in v2 if f in v1), plan
        assert plan["policies"]["lru"]["backend_bytes"] == changed, plan
        read_odd(m2, v2[0], seed=7)  # (odd reads first: the copy is taken whole, then read block by block)
        read_all(m2, v2)
        s = m2.status()
        assert s["backend"]["bytes"] <= 1.2 * changed, (s["backend"]["bytes"], changed, s["shared"])
        assert s["shared"]["adopted_objects"] == sum(f in v1 for f in v2) and not s["shared"]["refused"], s["shared"]
        linked = s["shared"]["adopted_objects"] if not args else 0  # (object files are linked; packs' ranges copied)
        assert s["shared"]["linked"] == linked, s["shared"]
        if linked:  # (on disk once: v2's files of unchanged objects are v1's inodes)
            inodes = {p.stat().st_ino for p in (tmp_path / "c1" / "blocks").rglob("*") if p.is_file()}
            mine = [p for p in (tmp_path / "c2" / "blocks").rglob("*") if p.is_file()]
            assert sum(p.stat().st_ino in inodes for p in mine) == linked
        wait_offered(m2, len(v2))  # (what it fetched and what it copied: offered in turn)
        read_all(m1, v1)  # (v1 unchanged by what v2 took)
    with m2:  # (a remount: every byte from its own cache, nothing fetched)
        read_all(m2, v2)
        read_odd(m2, v2[-1], seed=8)
        assert m2.status()["backend"]["bytes"] == 0


@requires_fuse
def test_a_copy_that_is_not_the_content_is_refused_and_fetched(s3_client, fresh_bucket, mount_factory, tmp_path):
    """The v1 mount's cache files changed on disk after they were offered: the copies do not hash to their
    ETags, so each is refused, its entry dropped, and the object fetched; every byte right."""
    v1, v2 = versions(s3_client, fresh_bucket, LARGE, changed=set())
    m1, m2 = two_mounts(mount_factory, tmp_path, fresh_bucket)
    with m1:
        read_all(m1, v1)
        wait_offered(m1, len(v1))
    for path in (tmp_path / "c1" / "blocks").rglob("*"):
        if path.is_file():
            with open(path, "r+b") as fh:  # (a byte flipped every 32 KiB)
                for at in range(0, path.stat().st_size, 32 << 10):
                    fh.seek(at)
                    b = fh.read(1)
                    fh.seek(at)
                    fh.write(bytes([b[0] ^ 0x5A]))
    with m2:
        read_all(m2, v2)
        s = m2.status()["shared"]
        assert s["adopted_objects"] == 0 and s["refused"] == len(v1), s
        assert m2.status()["backend"]["bytes"] >= sum(f.size for f in v2)
    index = ContentIndex(tmp_path / "shared")
    index.open()
    try:
        assert len(index) == len(v2), "the refused entries were dropped, the fetched objects offered"
    finally:
        index.close()


@requires_fuse
def test_entries_that_lie_or_name_what_they_must_not_cost_a_fetch(s3_client, fresh_bucket, mount_factory, tmp_path):
    """Index entries for v2's objects written by hand: a file outside the caches' tree with the right bytes,
    a symlink to one, a file of the right bytes under another inode, a plain garbage value, a truncated one:
    none is taken; every byte right; the daemon serves on."""
    files = LARGE[:3] + [SampleFile("one.bin", 700_001)]
    upload(s3_client, fresh_bucket, "v2/", files)
    m2 = mount_factory(f"s3://{fresh_bucket}/v2", "--share-dir", str(tmp_path / "shared"),
                       cache_dir=tmp_path / "c2", name="m2")
    outside = tmp_path.parent / f"outside-{tmp_path.name}"
    outside.mkdir()
    inside = tmp_path / "inside"
    inside.mkdir()
    try:
        with m2:
            scope = _scope_of(m2)
            index = ContentIndex(tmp_path / "shared")
            index.open()
            entries = []
            for i, f in enumerate(files):
                md5 = hashlib.md5(f.content()).digest()
                good = outside / f"{i}.bin"
                good.write_bytes(f.content())
                link = inside / f"{i}.lnk"
                link.symlink_to(good)
                other = inside / f"{i}.bin"
                other.write_bytes(f.content())
                lies = [Entry(good.stat().st_ino, 0, str(good)), Entry(good.stat().st_ino, 0, str(link)),
                        Entry(other.stat().st_ino + 1, 0, str(other))]
                entries.append((key_of(scope, md5, f.size), lies[i % 3]))
            index.offer(entries)
            with index.env.begin(write=True) as txn:  # (garbage values: not entries at all)
                txn.put(key_of(scope, hashlib.md5(files[3].content()).digest(), files[3].size), b"\x01" * 7)
            index.close()
            read_all(m2, files)
            s = m2.status()
            assert s["shared"]["adopted_objects"] == 0 and s["shared"]["refused"] == 3, s["shared"]
            assert s["backend"]["bytes"] >= sum(f.size for f in files)
            read_all(m2, files)
    finally:
        for p in outside.iterdir():
            p.unlink()
        outside.rmdir()


def _scope_of(m) -> bytes:  # noqa: ANN001
    """The scope the daemon computes for the local endpoint (its bucket, the test credentials)."""
    from epochfs.backend.base import BackendSettings
    from epochfs.backend.kinds import open_backend

    env = {k: v for k, v in m.env.items() if k.startswith("AWS_")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        endpoint = m.args[m.args.index("--endpoint-url") + 1]
        backend = open_backend(BackendSettings(Source.parse(m.source), endpoint_url=endpoint))
        try:
            return backend.content_scope()
        finally:
            backend.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_an_etag_names_content_only_when_it_is_one_md5() -> None:
    md5 = hashlib.md5(b"x").hexdigest()
    assert content_md5(f'"{md5}"') == bytes.fromhex(md5) == content_md5(md5.upper())
    assert content_md5(f'"{md5}-3"') is None  # (multipart: the MD5 of the parts' MD5s)
    assert content_md5('"' + "g" * 32 + '"') is None and content_md5("1234-5678") is None and content_md5("") is None
    assert scope_id("s3", "http://a", "b", "K") != scope_id("s3", "http://a", "b", "L") != scope_id("s3", "http://a", "c", "K")


def test_a_copy_is_taken_only_from_a_file_of_this_user_under_the_root_and_only_if_it_is_the_content(tmp_path):
    root = tmp_path / "root"
    (root / "store").mkdir(parents=True)
    data = os.urandom(3 * MIB + 17)
    md5 = hashlib.md5(data).digest()
    src = root / "store" / "obj"
    src.write_bytes(b"\0" * 100 + data)
    entry = Entry(src.stat().st_ino, 100, str(src))
    dst = tmp_path / "copy"
    blocks = [(bytes([i]) * 16, i * 2 * MIB, min(2 * MIB, len(data) - i * 2 * MIB)) for i in range(2)]
    sums = copy_checked(str(root), entry, len(data), md5, str(dst), blocks, True)
    assert dst.read_bytes() == data and read_checked(str(root), entry, len(data), md5) == data
    assert sums == [(checksums(bid, data[at:at + n]), digest(data[at:at + n])) for bid, at, n in blocks]
    dst.unlink()
    with pytest.raises(Refused):  # (other bytes: the copy made is removed)
        copy_checked(str(root), entry, len(data), hashlib.md5(b"other").digest(), str(dst), blocks, False)
    assert not dst.exists()
    with pytest.raises(Refused):
        read_checked(str(root), entry, len(data), hashlib.md5(b"other").digest())
    with pytest.raises(Refused):  # (longer than the file)
        open_source(str(root), entry, len(data) + 1)
    with pytest.raises(Refused):  # (another inode at the path)
        open_source(str(root), entry._replace(ino=entry.ino + 1), len(data))
    with pytest.raises(Refused):  # (outside the root)
        open_source(str(root / "other"), entry, len(data))
    (root / "store" / "lnk").symlink_to(src)
    (root / "dirlink").symlink_to(root / "store")
    for linked in (root / "store" / "lnk", root / "dirlink" / "obj"):  # (a link at the end, or on the way)
        with pytest.raises(Refused):
            open_source(str(root), entry._replace(path=str(linked)), len(data))
    if os.geteuid() == 0:
        os.chown(src, 65534, 65534)
        with pytest.raises(Refused):  # (another user's file)
            open_source(str(root), entry, len(data))


def test_entries_decode_garbage_to_nothing_and_never_raise() -> None:
    rng = random.Random(80)
    good = Entry(12345, 4096, "/var/cache/epochfs/abc/blocks/ab/cdef")
    assert Entry.decode(good.encode()) == good
    for _ in range(20_000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
        if rng.random() < 0.5:
            raw = good.encode()[:rng.randrange(0, 60)] + raw
        e = Entry.decode(raw)
        assert e is None or (e.path.startswith("/") and "\0" not in e.path and "/../" not in e.path + "/")
    assert Entry.decode(Entry(1, 0, "relative/path").encode()) is None
    assert Entry.decode(Entry(1, 0, "/a/../etc/shadow").encode()) is None
    assert Entry.decode(Entry(1, 0, "/" + "a" * 2000).encode()) is None


def test_mounts_share_by_default_only_in_the_default_cache_directories(tmp_path) -> None:
    src, mnt = Source.parse("s3://bucket/v1"), Path("/mnt/x")
    assert Config(source=src, mountpoint=mnt).shared_dir() == default_root() / "shared"
    assert Config(source=src, mountpoint=mnt).cache_dir == default_cache_dir(src)
    assert Config(source=src, mountpoint=mnt, cache_dir=tmp_path / "c").shared_dir() is None
    assert Config(source=src, mountpoint=mnt, cache_dir=tmp_path / "c",
                  share_dir=str(tmp_path / "s")).shared_dir() == tmp_path / "s"
    assert Config(source=src, mountpoint=mnt, share_dir="off").shared_dir() is None


@requires_fuse
def test_the_offering_mount_killed_or_its_cache_gone_costs_the_other_nothing_but_fetches(
        s3_client, fresh_bucket, mount_factory, tmp_path):
    """kill -9 of the mount that offered: its files stay, the other copies them, and it restarts right;
    its cache directory removed: every offer is refused and fetched; no mount stops serving."""
    v1, v2 = versions(s3_client, fresh_bucket, LARGE, changed={0})
    m1, m2 = two_mounts(mount_factory, tmp_path, fresh_bucket)
    m1.start()
    read_all(m1, v1)
    wait_offered(m1, len(v1))
    kill_daemon(m1)
    with m2:
        read_all(m2, v2)
        s = m2.status()
        assert s["shared"]["adopted_objects"] == len(v1) - 1 and not s["shared"]["refused"], s["shared"]
    with m1:  # (restarted after the kill: its own cache, right)
        read_all(m1, v1)
        assert m1.status()["backend"]["bytes"] == 0
    shutil.rmtree(tmp_path / "c1")
    m3 = mount_factory(f"s3://{fresh_bucket}/v1", "--share-dir", str(tmp_path / "shared"),
                       cache_dir=tmp_path / "c3", name="m3")
    with m3:  # (v2's mount offered what it holds now: v1's files come from there; none from c1)
        read_all(m3, v1)
        s = m3.status()["shared"]
        assert s["adopted_objects"] == len(v1) - 1, s
    shutil.rmtree(tmp_path / "c2")
    shutil.rmtree(tmp_path / "c3")
    m4 = mount_factory(f"s3://{fresh_bucket}/v2", "--share-dir", str(tmp_path / "shared"),
                       cache_dir=tmp_path / "c4", name="m4")
    with m4:  # (every cache that offered is gone: each offer refused, each object fetched)
        read_all(m4, v2)
        s = m4.status()
        assert s["shared"]["adopted_objects"] == 0 and s["shared"]["refused"] >= 1, s["shared"]
        assert s["backend"]["bytes"] >= sum(f.size for f in v2)


@requires_fuse
def test_both_versions_read_at_once_and_offers_swapped_between_contents_never_give_a_wrong_byte(
        s3_client, fresh_bucket, mount_factory, tmp_path):
    """v1 and v2 read side by side by 8 readers each (v2's mount copies what v1's has made whole, fetches the
    rest); then every entry of the index is given another content's value (real files of the node's caches,
    the right inode and length for some): every such copy is refused by its MD5, every byte right."""
    from concurrent.futures import ThreadPoolExecutor

    files = LARGE[:2] + SMALL[:16]
    v1, v2 = versions(s3_client, fresh_bucket, files, changed={3})
    m1, m2 = two_mounts(mount_factory, tmp_path, fresh_bucket)
    with m1, m2:
        def check(m, f: SampleFile) -> None:  # noqa: ANN001
            assert m.path(f.key).read_bytes() == f.content(), f.key

        jobs = [(m1, f) for f in v1] + [(m2, f) for f in v2]
        random.Random(3).shuffle(jobs)
        with ThreadPoolExecutor(16) as pool:
            for fut in [pool.submit(check, m, f) for m, f in jobs]:
                fut.result()
        wait_offered(m2, 1)
    index = ContentIndex(tmp_path / "shared")
    index.open()
    with index.env.begin(write=True) as txn:
        pairs = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
        size = {k: int.from_bytes(k[32:40], "little") for k, _ in pairs}
        for i, (k, _) in enumerate(pairs):  # (another content's file, long enough where one is: its MD5 decides)
            others = [v for j, (o, v) in enumerate(pairs) if j != i and size[o] >= size[k]] or [pairs[i - 1][1]]
            txn.put(k, others[0])
    index.close()
    m3 = mount_factory(f"s3://{fresh_bucket}/v2", "--share-dir", str(tmp_path / "shared"),
                       cache_dir=tmp_path / "c3", name="m3")
    with m3:
        read_all(m3, v2)
        s = m3.status()["shared"]
        assert s["adopted_objects"] == 0 and s["refused"] == len(v2), s
        assert "not the bytes the ETag names" in m3.log()


@requires_fuse
def test_what_other_mounts_hold_is_told_to_an_operator_only(s3_client, fresh_bucket, mount_factory, tmp_path):
    """`epochfs plan --mount` as root counts the files the node's other mounts hold; as another local user
    of the mount, it is told of none (what another mount holds is not that user's to learn)."""
    from .helpers import epochfs_as, passable

    v1, v2 = versions(s3_client, fresh_bucket, LARGE[:2], changed=set())
    m1, m2 = two_mounts(mount_factory, tmp_path, fresh_bucket)
    m2.args.append("--allow-other")
    with m1, passable(m2):
        read_all(m1, v1)
        wait_offered(m1, len(v1))
        manifest = m2.mountpoint.parent / "order.txt"
        manifest.write_text("".join(f"{f.key}\n" for f in v2))
        manifest.chmod(0o644)
        args = ("plan", "--mount", str(m2.mountpoint), "--manifest", str(manifest), "--cache-size", "1G", "--json")
        as_root = subprocess.run([*EPOCHFS, *args], capture_output=True, text=True, timeout=60)
        assert as_root.returncode == 0 and json.loads(as_root.stdout)["shared_files"] == len(v1), as_root
        as_user = epochfs_as("nobody", *args)
        assert as_user.returncode == 0, as_user.stderr
        assert json.loads(as_user.stdout)["shared_files"] == 0


@requires_fuse
def test_evicting_a_linked_object_in_one_mount_leaves_the_others_bytes(s3_client, fresh_bucket, mount_factory,
                                                                        tmp_path):
    """v2's mount linked v1's files; v1's mount then evicts them (a small cache and other files read): it
    drops them whole and punches nothing, so v2's files stay whole and right, read by the kernel
    (passthrough) and after a remount, with nothing fetched."""
    v1, v2 = versions(s3_client, fresh_bucket, LARGE[:3], changed=set())
    filler = [SampleFile(f"fill-{i}.bin", 5 * MIB + i) for i in range(5)]
    upload(s3_client, fresh_bucket, "v1/", filler)
    m1, m2 = two_mounts(mount_factory, tmp_path, fresh_bucket, "--cache-size", "24M")
    with m1, m2:
        read_all(m1, v1)
        wait_offered(m1, len(v1))
        read_all(m2, v2)
        assert m2.status()["shared"]["linked"] == len(v1)
    m1.start()
    for f in filler:  # (v1's mount evicts its copies of the shared objects)
        assert m1.path(f.key).read_bytes() == f.content()
    s = m1.status()["store"]
    assert s["evictions"] > 0 and s["used_bytes"] <= 24 * MIB, s
    m1.stop()
    with m2:
        for f in v2:
            read_odd(m2, f, seed=9)
            assert m2.path(f.key).read_bytes() == f.content()
        s = m2.status()
        assert s["backend"]["bytes"] == 0 and s["store"]["corrupt_blocks"] == 0, (s["backend"], s["store"])
        assert s["passthrough"]["opens"] >= 1, s["passthrough"]


@requires_fuse
def test_a_link_made_or_let_go_by_another_mount_is_not_taken_for_a_change(s3_client, fresh_bucket, mount_factory,
                                                                          tmp_path):
    """v1's files are read by the kernel (passthrough) and held open while v2's mount links them and later
    lets its names go: v1's new opens of them still pass through (no EIO, nothing counted damaged, nothing
    hashed again), every byte right."""
    v1, v2 = versions(s3_client, fresh_bucket, LARGE[:2], changed=set())
    m1, m2 = two_mounts(mount_factory, tmp_path, fresh_bucket)
    with m1:
        read_all(m1, v1)
        wait_offered(m1, len(v1))
        held = [open(m1.path(f.key), "rb") for f in v1]  # (passed through: whole and checked)
        try:
            assert m1.status()["passthrough"]["opens"] >= len(v1)
            with m2:
                read_all(m2, v2)
                assert m2.status()["shared"]["linked"] == len(v1)
                for f in v1:  # (new opens while the first are held: the same backing, still known right)
                    read_odd(m1, f, seed=11)
            for p in (tmp_path / "c2" / "blocks").rglob("*"):  # (v2's names of them let go)
                if p.is_file():
                    p.unlink()
            for f, fh in zip(v1, held, strict=True):
                read_odd(m1, f, seed=12)
                assert fh.read() == f.content()
        finally:
            for fh in held:
                fh.close()
        p = m1.status()["passthrough"]
        assert p["damaged"] == 0 and p["unchecked"] == 0, p


def test_an_index_that_cannot_be_read_costs_a_fetch_not_the_read(tmp_path):
    import lmdb

    index = ContentIndex(tmp_path / "shared")
    index.open()
    index.offer([(key_of(b"s" * 16, b"m" * 16, 5), Entry(1, 0, "/a/b"))])
    assert index.find(key_of(b"s" * 16, b"m" * 16, 5)) == Entry(1, 0, "/a/b")
    index.close()

    class Broken:
        def begin(self, **_):
            raise lmdb.ReadersFullError("readers full")

    index.env = Broken()
    assert index.find(key_of(b"s" * 16, b"m" * 16, 5)) is None
