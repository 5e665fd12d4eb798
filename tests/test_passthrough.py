"""FUSE passthrough (on by default), mounted for real against the local S3 endpoint: once an object's
blocks are all cached its file in the store is the object, and later opens are read by the kernel from
it with no daemon work and no second copy; every byte is still the object's (odd sizes, seeded random
offsets); an inode read through the daemon and one read by the kernel never mix (no open fails); a file
that rots (found by the scrub) or is changed or replaced (found at open) is never served as it is; a
byte changed every 32 KiB of every cache file is never read back; a restart and a kill -9 keep the
fingerprints, a machine's reboot does not; a new version is never served from the old one's file."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from epochfs.cache import passthrough as passthrough_mod
from epochfs.core.records import ObjectInfo
from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import EPOCHFS, kill_daemon

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
    """READ requests the daemon answered."""
    return m.status()["read_seconds"]["count"]


def wait_whole(m, n: int, timeout: float = 30) -> dict:  # noqa: ANN001
    """The passthrough state once ``n`` objects are whole and none is waiting for its check."""
    deadline = time.monotonic() + timeout
    while True:
        p = m.status()["passthrough"]
        if p["whole_files"] >= n and not p["unchecked"]:
            return p
        assert time.monotonic() < deadline, f"{n} whole objects never checked: {p}"
        time.sleep(0.1)


def read_until_whole(m, files: list[SampleFile]) -> dict:  # noqa: ANN001
    """Read each of ``files`` whole through the mount (every byte right), then :func:`wait_whole` for them."""
    for f in files:
        assert m.path(f.key).read_bytes() == f.content()
    return wait_whole(m, len(files))


def object_files(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "blocks").rglob("*") if p.is_file())


def flip(path: Path, at: int, keep_mtime: bool = False) -> None:
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def dataset(s3_client, fresh_bucket):
    upload(s3_client, fresh_bucket, "ds/", FILES)
    return f"s3://{fresh_bucket}/ds"


@needs_passthrough
def test_a_cached_object_is_read_by_the_kernel_from_its_own_file_with_every_byte_its_own(dataset, mount_factory,
                                                                                          tmp_path):
    cache = tmp_path / "cache"
    m = mount_factory(dataset, "--cache-size", "256M", cache_dir=cache)  # (the defaults)
    with m:
        f = FILES[0]
        assert m.path(f.key).read_bytes() == f.content()  # through the daemon: fetched and cached
        p = wait_whole(m, 1)
        assert p["active"] and p["opens"] == 0 and p["cached_opens"] == 1
        before, hits = daemon_reads(m), m.status()["cache"]
        read_odd(m.path(f.key), f, seed=2)
        with open(m.path(f.key), "rb") as fh:  # and mapped
            import mmap

            with mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
                assert mm[f.size - 5000:] == f.content(f.size - 5000)
        assert daemon_reads(m) == before, "a passthrough open's reads reached the daemon"
        time.sleep(0.2)  # (the releases reach the daemon after close returns)
        p = m.status()["passthrough"]
        assert p["opens"] == 3 and p["open_files"] == 0  # read_odd's two opens and the mapping
        c = m.status()["cache"]  # counted per open: each its object's size, as a hit
        assert c["hits"] - hits["hits"] == 3 and c["hit_bytes"] - hits["hit_bytes"] == 3 * f.size
        assert c["misses"] == hits["misses"] and p["bytes_opened"] == 3 * f.size
        text = subprocess.run([*EPOCHFS, "status", str(m.mountpoint)], capture_output=True, text=True).stdout
        assert "passthrough on: 3 opens read by the kernel" in text and "1 files whole in the cache" in text
        # No second copy: the object's one file is all the cache holds of it.
        files = object_files(cache)
        assert [p.stat().st_size for p in files] == [f.size]
        assert files[0].stat().st_blocks * 512 < f.size + (1 << 20)
        assert m.status()["store"]["used_bytes"] == f.size and m.status()["store"]["pinned_bytes"] == 0
        import urllib.request

        page = urllib.request.urlopen(f"http://{m.status()['metrics_addr']}/metrics", timeout=10).read().decode()
        assert "epochfs_passthrough_opens_total{" in page and "epochfs_passthrough_damaged_total{" in page
        assert [float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                if line.startswith("epochfs_passthrough_whole_bytes{")] == [f.size]


@needs_passthrough
def test_small_objects_pass_through_too_when_asked(s3_client, fresh_bucket, mount_factory):
    small = [SampleFile(f"s/f{i}.bin", 100 * 1024 + 7 * i, version=i) for i in range(20)]
    upload(s3_client, fresh_bucket, "small/", small)
    m = mount_factory(f"s3://{fresh_bucket}/small", "--passthrough")
    with m:
        read_until_whole(m, small)
        before = daemon_reads(m)
        for f in small:
            read_odd(m.path(f.key), f, seed=9)
        assert daemon_reads(m) == before
        assert m.status()["passthrough"]["opens"] >= 2 * len(small)
        assert not list((m.cache_dir / "packs").iterdir())  # (a packed block cannot be a backing file)


@needs_passthrough
def test_an_inode_is_read_one_way_at_a_time_and_no_open_fails(dataset, mount_factory):
    m = mount_factory(dataset)
    with m:
        f = FILES[1]
        path = m.path(f.key)
        first = open(path, "rb")  # read through the daemon
        assert first.read() == f.content()
        wait_whole(m, 1)
        second = open(path, "rb")  # whole now, but the first is still open: through the daemon
        assert m.status()["passthrough"]["opens"] == 0
        assert second.read(5000) == f.content(0, 5000)
        for fh in (first, second):
            fh.close()
        time.sleep(0.2)  # (the releases reach the daemon after close returns)
        third = open(path, "rb")  # the kernel's
        fourth = open(path, "rb")  # the same backing file
        assert m.status()["passthrough"]["opens"] == 2
        assert third.read() == f.content() and fourth.read(3) == f.content(0, 3)
        third.close()
        fourth.close()
        time.sleep(0.2)
        assert m.status()["passthrough"]["open_files"] == 0
        with open(path, "rb") as again:  # the backing file kept registered is used again
            assert again.read() == f.content()
        assert m.status()["passthrough"]["opens"] == 3


@needs_passthrough
def test_a_rotten_file_found_by_the_scrub_and_a_replaced_one_found_at_open_are_never_served(dataset, mount_factory,
                                                                                          tmp_path):
    cache = tmp_path / "cache"
    m = mount_factory(dataset, "--passthrough-scrub", "1", cache_dir=cache)
    with m:
        read_until_whole(m, FILES[:2])
        files = object_files(cache)
        assert len(files) == 2
        # One rots in place (the scrub hashes every whole file each second here).
        flip(files[0], 5 * MIB, keep_mtime=True)
        deadline = time.monotonic() + 30
        while m.status()["passthrough"]["damaged"] < 1:
            assert time.monotonic() < deadline, "the scrub never found the damaged file"
            time.sleep(0.2)
        # The other is replaced by a file of the same size (its bytes changed): found at the next open.
        data = bytearray(files[1].read_bytes())
        data[100] ^= 0xFF
        replacement = files[1].with_name("replacement")
        replacement.write_bytes(bytes(data))
        os.rename(replacement, files[1])
        for f in FILES[:2]:  # the object's bytes, whichever way they are read now
            read_odd(m.path(f.key), f, seed=3)
        p = m.status()["passthrough"]
        assert p["damaged"] >= 2, p
        assert "damaged" in m.log() and "changed since its fingerprint was taken" in m.log()
    with m:  # (the mount's page cache is gone: what was dropped is refetched)
        read_until_whole(m, FILES[:2])  # and the kernel's again
        before = daemon_reads(m)
        for f in FILES[:2]:
            read_odd(m.path(f.key), f, seed=8)
        assert daemon_reads(m) == before


@needs_passthrough
def test_a_byte_changed_every_32_kib_of_every_cache_file_is_never_read_back(s3_client, fresh_bucket, dataset,
                                                                           mount_factory, tmp_path):
    """With the defaults (the daily scrub far off): every file under the cache directory but the index
    changed on disk while the mount runs, every file read again, every byte right; the same after a
    restart."""
    small = [SampleFile(f"s/f{i}.bin", 50 * 1024 + 3 * i, version=i) for i in range(8)]
    upload(s3_client, fresh_bucket, "ds/", small)
    everything = FILES + small
    cache = tmp_path / "cache"
    m = mount_factory(dataset, cache_dir=cache)
    with m:
        read_until_whole(m, everything)
        for f in everything:
            assert m.path(f.key).read_bytes() == f.content()  # (the kernel's)
        changed = 0
        for path in (p for p in cache.rglob("*") if p.is_file() and not p.is_symlink() and "index" not in p.parts):
            size = path.stat().st_size
            if path.name in ("lock", "clean", "sources") or not size:
                continue
            for at in range(0, size, 32 * 1024):
                flip(path, at)
            changed += 1
        assert changed >= len(everything)
        for f in everything:
            read_odd(m.path(f.key), f, seed=7)
        assert m.status()["store"]["corrupt_blocks"] >= 1
    with m:
        for f in everything:
            assert m.path(f.key).read_bytes() == f.content()


@needs_passthrough
def test_fingerprints_survive_a_restart_and_a_kill_9_not_a_reboot(dataset, mount_factory, tmp_path):

    import lmdb

    cache = tmp_path / "cache"
    m = mount_factory(dataset, cache_dir=cache)
    with m:
        read_until_whole(m, FILES)
    with m:  # a clean restart: the kernel's at once, nothing hashed again
        assert m.status()["passthrough"]["unchecked"] == 0
        before = daemon_reads(m)
        read_odd(m.path(FILES[2].key), FILES[2], seed=4)
        assert daemon_reads(m) == before and m.status()["passthrough"]["opens"] >= 1
    m.start()
    kill_daemon(m)
    m.start()  # killed in this boot: what it wrote is what the files hold
    assert m.status()["passthrough"]["unchecked"] == 0
    for f in FILES:
        read_odd(m.path(f.key), f, seed=5)
    m.stop()
    env = lmdb.open(str(cache / "index"))  # as if the machine had crashed and rebooted
    with env.begin(write=True) as txn:
        txn.put(b"\x00boot", b"another boot")
    env.close()
    (cache / "clean").unlink()
    with m:
        p = m.status()["passthrough"]
        assert p["whole_files"] == len(FILES)
        wait_whole(m, len(FILES))  # each hashed before the kernel reads it
        for f in FILES:
            read_odd(m.path(f.key), f, seed=6)


@needs_passthrough
def test_a_new_version_is_never_read_from_the_old_ones_file(dataset, mount_factory, s3_client, fresh_bucket):
    m = mount_factory(dataset)
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
def test_kill_9_while_objects_are_filled_leaves_no_wrong_byte(dataset, mount_factory, tmp_path, seed):
    """The daemon killed at a random moment while it fills objects: the next mount serves every byte
    right, through the kernel or the daemon."""
    import signal

    rng = random.Random(seed)
    cache = tmp_path / "cache"
    m = mount_factory(dataset, cache_dir=cache)
    m.start()
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    for f in FILES:
        with open(m.path(f.key), "rb") as fh:
            assert fh.read(1 << 20) == f.content(0, 1 << 20)  # (the rest is read ahead and filled)
    time.sleep(rng.uniform(0.0, 0.3))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    m.start()  # recovers the dead mount point
    for f in FILES:
        read_odd(m.path(f.key), f, seed=seed)
    wait_whole(m, len(FILES))
    for f in FILES:
        read_odd(m.path(f.key), f, seed=seed + 10)
    m.stop()


def deleted_files_held(pid: int, under: Path) -> list[str]:
    """The files under ``under`` that process ``pid`` holds open though they were deleted (their bytes
    stay on disk until the last is closed)."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(under)) and target.endswith(" (deleted)"):
            held.append(target)
    return held


@needs_passthrough
def test_an_evicted_object_is_let_go_by_the_kernel_and_its_bytes_freed(s3_client, fresh_bucket, mount_factory):
    """A backing file kept registered for the next open of its object lets go when the object is evicted:
    otherwise the kernel holds the deleted file, and the cache's disk holds more than --cache-size."""
    files = [SampleFile(f"s/f{i:02d}.bin", MIB - 7 * i, version=i) for i in range(24)]  # one block each
    upload(s3_client, fresh_bucket, "s/", files)
    m = mount_factory(f"s3://{fresh_bucket}/s", "--passthrough", "--block-size", "1M", "--cache-size", "8M",
                      "--readahead", "0")
    with m:
        pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
        first = files[:6]
        read_until_whole(m, first)
        for f in first:  # (opened again: passed through, and kept registered once released)
            read_odd(m.path(f.key), f, seed=3)
        assert m.status()["passthrough"]["opens"] >= len(first)
        for f in files[6:]:  # (evicts the first ones)
            assert m.path(f.key).read_bytes() == f.content()
        wait_whole(m, 1)
        assert m.status()["store"]["evictions"] >= len(first)
        assert deleted_files_held(pid, m.cache_dir) == []
        p = m.status()["passthrough"]
        assert p["kept"] <= p["whole_files"], p
        on_disk = sum(p.stat().st_blocks * 512 for p in object_files(m.cache_dir))
        assert on_disk <= 8 * MIB + 64 * 1024, on_disk
        for f in files:  # (every byte right, evicted ones fetched again)
            assert m.path(f.key).read_bytes() == f.content()


@pytest.mark.page_cache  # (counts on the page cache: a hot file read with no request)
def test_a_dataset_of_small_files_is_opened_with_no_request_by_default(s3_client, fresh_bucket, mount_factory):
    """Most of its bytes in files under 1 MiB: passthrough would cost a request at every open, so the
    mount opens files with no request instead (a hot file is then read with no daemon work at all), and
    says why in status; one large file among them changes nothing."""
    small = [SampleFile(f"s/f{i}.bin", 100 * 1024 + 7 * i, version=i) for i in range(40)]
    upload(s3_client, fresh_bucket, "small/", [*small, SampleFile("large.bin", 3 * MIB)])
    m = mount_factory(f"s3://{fresh_bucket}/small")
    with m:
        p = m.status()["passthrough"]
        assert not p["active"] and "most of the dataset's bytes" in p["off"] and "--passthrough" in p["off"]
        for f in small:
            assert m.path(f.key).read_bytes() == f.content()
        before = daemon_reads(m)
        for f in small:  # (hot: from the page cache, no request)
            assert m.path(f.key).read_bytes() == f.content()
        assert daemon_reads(m) == before and m.status()["passthrough"]["opens"] == 0
    assert passthrough_mod.small_files([*[ObjectInfo(f.key, f.size, 0, '"e"') for f in small],
                                        ObjectInfo("large.bin", 3 * MIB, 0, '"e"')])
    assert passthrough_mod.small_files([ObjectInfo("a", 5 * MIB, 0, '"e"'), ObjectInfo("b", 1000, 0, '"e"')]) is None


def test_no_passthrough_reads_through_the_daemon(dataset, mount_factory):
    m = mount_factory(dataset, "--no-passthrough")
    with m:
        f = FILES[0]
        for seed in (1, 2):
            read_odd(m.path(f.key), f, seed=seed)
        assert m.status()["passthrough"] is None and daemon_reads(m) > 0
        assert list((m.cache_dir / "blocks").rglob("*"))
