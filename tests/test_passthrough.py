"""FUSE passthrough (``--passthrough``), mounted for real against the local S3 endpoint: a cached object
is copied whole once and later opens are read by the kernel from that copy with no daemon work; every
byte is still the object's (odd sizes, seeded random offsets); an inode read through the daemon and one
read by the kernel never mix (no open fails); a copy that is damaged (found by the scrub) or replaced
(found at open) is never served again; the copies stay within their bound and the cache's; a restart
takes them up; a new version of an object is never served from the old one's copy."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import EPOCHFS

pytestmark = requires_fuse


def _kernel_passthrough() -> bool:
    """Linux 6.9 or later built with FUSE passthrough (where its config says), and root (the kernel
    registers backing files only for CAP_SYS_ADMIN)."""
    import gzip

    try:
        major, minor = (int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            built = "CONFIG_FUSE_PASSTHROUGH=y" in f.read()
    except OSError:
        built = True  # (no config to read: the version decides)
    return (major, minor) >= (6, 9) and built and os.geteuid() == 0


needs_passthrough = pytest.mark.skipif(not _kernel_passthrough(), reason="FUSE passthrough: Linux 6.9+, as root")

MIB = 1 << 20
FILES = [SampleFile(f"d/large-{i}.bin", 9 * MIB + 12345 * (i + 1), version=i) for i in range(3)]


def read_odd(path: Path, f: SampleFile, seed: int) -> None:
    """Reads of odd sizes at seeded random offsets, and the whole file, compared with the object."""
    rng = random.Random(seed)
    with open(path, "rb", buffering=0) as fh:
        for _ in range(40):
            off = rng.randrange(0, f.size)
            size = rng.choice([1, 4095, 4097, 65537, 1 << 20, 3 * MIB + 7])
            fh.seek(off)
            assert fh.read(size) == f.content(off, min(size, f.size - off)), (f.key, off, size)
    assert path.read_bytes() == f.content()


def daemon_reads(m) -> int:  # noqa: ANN001
    c = m.status()["cache"]
    return c["hits"] + c["misses"]


def wait_whole(m, n: int, timeout: float = 30) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        p = m.status()["passthrough"]
        if p["whole_files"] >= n:
            return p
        assert time.monotonic() < deadline, f"{n} whole copies never made: {p}"
        time.sleep(0.1)


@pytest.fixture
def dataset(s3_client, fresh_bucket):
    upload(s3_client, fresh_bucket, "ds/", FILES)
    return f"s3://{fresh_bucket}/ds"


@needs_passthrough
def test_a_cached_object_is_read_by_the_kernel_with_every_byte_its_own(dataset, mount_factory):
    m = mount_factory(dataset, "--passthrough", "--cache-size", "256M")
    with m:
        f = FILES[0]
        read_odd(m.path(f.key), f, seed=1)  # through the daemon: cached, then copied whole
        p = wait_whole(m, 1)
        assert p["active"] and p["opens"] == 0 and p["cached_opens"] >= 1
        before = daemon_reads(m)
        read_odd(m.path(f.key), f, seed=2)
        with open(m.path(f.key), "rb") as fh:  # and mapped
            import mmap

            with mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
                assert mm[f.size - 5000:] == f.content(f.size - 5000)
        assert daemon_reads(m) == before, "a passthrough open's reads reached the daemon"
        time.sleep(0.2)  # (the releases reach the daemon after close returns)
        p = m.status()["passthrough"]
        assert p["opens"] == 3 and p["open_files"] == 0  # read_odd's two opens and the mapping
        text = subprocess.run([*EPOCHFS, "status", str(m.mountpoint)], capture_output=True, text=True).stdout
        assert "passthrough on: " in text and "1 whole copies" in text
        st = m.status()["store"]  # the copy counts against the cache's bound
        assert st["pinned_bytes"] == f.size and st["used_bytes"] + st["pinned_bytes"] <= 256 * MIB
        import urllib.request

        page = urllib.request.urlopen(f"http://{m.status()['metrics_addr']}/metrics", timeout=10).read().decode()
        assert "epochfs_passthrough_opens_total{" in page and "epochfs_passthrough_damaged_total{" in page
        assert [float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                if line.startswith("epochfs_passthrough_whole_bytes{")] == [f.size]


@needs_passthrough
def test_an_inode_is_read_one_way_at_a_time_and_no_open_fails(dataset, mount_factory):
    m = mount_factory(dataset, "--passthrough")
    with m:
        f = FILES[1]
        path = m.path(f.key)
        first = open(path, "rb")  # read through the daemon
        assert first.read() == f.content()
        second = open(path, "rb")  # all cached now: copied whole; the first is still open, so through the daemon
        wait_whole(m, 1)
        third = open(path, "rb")  # the copy is there, the first two still open: through the daemon too
        assert m.status()["passthrough"]["opens"] == 0
        assert second.read(5000) == f.content(0, 5000) and third.read() == f.content()
        for fh in (first, second, third):
            fh.close()
        time.sleep(0.2)  # (the releases reach the daemon after close returns)
        fourth = open(path, "rb")  # the kernel's
        fifth = open(path, "rb")  # the same backing file
        assert m.status()["passthrough"]["opens"] == 2
        assert fourth.read() == f.content() and fifth.read(3) == f.content(0, 3)
        fourth.close()
        fifth.close()
        time.sleep(0.2)
        assert m.status()["passthrough"]["open_files"] == 0
        with open(path, "rb") as again:  # the backing id was let go and a new one taken
            assert again.read() == f.content()
        assert m.status()["passthrough"]["opens"] == 3


@needs_passthrough
def test_a_damaged_copy_found_by_the_scrub_or_at_open_is_never_served_again(dataset, mount_factory, tmp_path):
    m = mount_factory(dataset, "--passthrough", "--passthrough-scrub", "1", cache_dir=tmp_path / "cache")
    with m:
        for f in FILES[:2]:
            assert m.path(f.key).read_bytes() == f.content()
        wait_whole(m, 2)
        copies = sorted((tmp_path / "cache" / "whole").iterdir(), key=lambda p: p.stat().st_mtime_ns)
        assert len(copies) == 2
        # One copy rots in place (same inode, same mtime): the scrub finds it.
        damaged = copies[0]
        st = damaged.stat()
        with open(damaged, "r+b") as fh:
            fh.seek(5 * MIB)
            byte = fh.read(1)
            fh.seek(5 * MIB)
            fh.write(bytes([byte[0] ^ 0xFF]))
        os.utime(damaged, ns=(st.st_atime_ns, st.st_mtime_ns))
        deadline = time.monotonic() + 30
        while m.status()["passthrough"]["damaged"] < 1:
            assert time.monotonic() < deadline, "the scrub never found the damaged copy"
            time.sleep(0.2)
        assert not damaged.exists()
        # The other is replaced by a file of the same size: found at the next open.
        other = copies[1]
        data = bytearray(other.read_bytes())
        data[100] ^= 0xFF
        replacement = other.with_name("replacement")
        replacement.write_bytes(bytes(data))
        os.rename(replacement, other)
        for f in FILES[:2]:  # both read through the daemon now: the object's bytes
            read_odd(m.path(f.key), f, seed=3)
        p = m.status()["passthrough"]
        assert p["damaged"] == 2, p
        assert "damaged" in m.log()


@needs_passthrough
def test_copies_stay_in_their_bound_and_a_restart_takes_them_up(dataset, mount_factory, tmp_path):
    cache = tmp_path / "cache"
    m = mount_factory(dataset, "--passthrough", "--passthrough-size", "20M", cache_dir=cache)
    with m:
        for f in FILES:
            assert m.path(f.key).read_bytes() == f.content()
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while m.status()["passthrough"]["assembled"] < 3:
            assert time.monotonic() < deadline, m.status()["passthrough"]
            time.sleep(0.1)
        p = m.status()["passthrough"]
        assert p["whole_files"] == 2 and p["evicted"] == 1 and p["whole_bytes"] <= 20 * MIB
        kept = {c.name for c in (cache / "whole").iterdir()}
    with m:  # a restart: the copies are taken up, hashed once by this daemon, then served
        p = m.status()["passthrough"]
        assert p["whole_files"] == 2 and {c.name for c in (cache / "whole").iterdir()} == kept
        assert m.status()["store"]["pinned_bytes"] == p["whole_bytes"]
        deadline = time.monotonic() + 30
        while m.status()["passthrough"]["unchecked"]:
            assert time.monotonic() < deadline, m.status()["passthrough"]
            time.sleep(0.1)
        before = daemon_reads(m)
        read_odd(m.path(FILES[2].key), FILES[2], seed=4)
        assert daemon_reads(m) == before and m.status()["passthrough"]["opens"] >= 1


@needs_passthrough
def test_a_new_version_is_never_read_from_the_old_ones_copy(dataset, mount_factory, s3_client, fresh_bucket):
    m = mount_factory(dataset, "--passthrough")
    with m:
        f = FILES[0]
        assert m.path(f.key).read_bytes() == f.content()
        wait_whole(m, 1)
        new = SampleFile(f.key, f.size, version=99)  # the same size, other bytes
        s3_client.put_object(Bucket=fresh_bucket, Key=f"ds/{f.key}", Body=new.content())
        r = subprocess.run([*EPOCHFS, "refresh", str(m.mountpoint)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        read_odd(m.path(f.key), new, seed=5)


@needs_passthrough
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_kill_9_while_copies_are_made_leaves_no_partial_copy_served(dataset, mount_factory, tmp_path, seed):
    """The daemon killed at a random moment while it copies objects whole: the next mount takes up only
    copies that were finished (named by their digest), every byte read after it is the object's."""
    import signal

    rng = random.Random(seed)
    cache = tmp_path / "cache"
    m = mount_factory(dataset, "--passthrough", cache_dir=cache)
    m.start()
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    for f in FILES:
        assert m.path(f.key).read_bytes() == f.content()  # each copied on its release, one at a time
    time.sleep(rng.uniform(0.0, 0.3))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    m.start()  # recovers the dead mount point
    names = sorted(c.name for c in (cache / "whole").iterdir())
    assert all(len(n) == 65 and "." in n and not n.endswith(".tmp") for n in names), names
    p = m.status()["passthrough"]
    assert p["whole_files"] == len(names) and m.status()["store"]["pinned_bytes"] == p["whole_bytes"]
    for f in FILES:
        read_odd(m.path(f.key), f, seed=seed)
    m.stop()


def test_passthrough_is_refused_with_writeback(fresh_bucket, mount_factory):
    m = mount_factory(f"s3://{fresh_bucket}/x", "--passthrough", "--writeback")
    r = m.start(expect_ok=False)
    assert r.returncode != 0 and "--passthrough" in r.stderr and "--writeback" in r.stderr


def test_whole_files_left_by_a_run_are_taken_up_and_anything_else_removed(tmp_path):
    """What a killed daemon or another hand left in ``whole/``: a copy half written, a link, a directory,
    a name that is not a copy's; only copies are taken up (pinned again), the rest removed."""
    from epochfs.blockstore.store import BlockStore
    from epochfs.blockstore.whole import WholeFiles
    from epochfs.eviction import make_policy

    store = BlockStore(tmp_path / "c", 64 * MIB, 0.0, make_policy("lru"))
    store.open()
    whole = WholeFiles(tmp_path / "c", store, 32 * MIB)
    good = whole.dir / f"{'a' * 32}.{'b' * 32}"
    good.write_bytes(b"x" * 1000)
    leftovers = [whole.dir / f"{'c' * 32}.tmp", whole.dir / "notes.txt", whole.dir / f"{'d' * 32}.{'Z' * 32}"]
    for p in leftovers:
        p.write_bytes(b"y")
    os.symlink("/etc/passwd", whole.dir / f"{'e' * 32}.{'f' * 32}")
    (whole.dir / f"{'9' * 32}.{'8' * 32}").mkdir()  # (a directory under a copy's name)
    (whole.dir / f"{'9' * 32}.{'8' * 32}" / "x").write_bytes(b"z")
    whole.open()
    assert list(whole.files) == ["a" * 32] and whole.held == 1000 and store.pinned == 1000
    assert sorted(p.name for p in whole.dir.iterdir()) == [good.name]
    w = whole.get("a" * 32, 999)  # not the object's size: removed
    assert w is None and whole.held == 0 and store.pinned == 0 and not good.exists()
    assert whole.admit(40 * MIB) is False and whole.admit(8 * MIB) and store.pinned == 8 * MIB
    whole.abandon("a" * 32, 8 * MIB)
    store.close()
