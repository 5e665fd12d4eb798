"""Real mounts against a real local S3 endpoint (SeaweedFS) and a real directory."""

from __future__ import annotations

import errno
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from epochfs.core.blocks import block_id
from epochfs.dev.sample import SampleFile, pattern, sample_layout, upload, write_tree

from .conftest import requires_fuse
from .helpers import EPOCHFS, Mount, drop_all_caches, read_all, run_with_deadline, wait_idle

pytestmark = requires_fuse

MiB = 1 << 20


def large(files: list[SampleFile]) -> list[SampleFile]:
    return [f for f in files if f.size > 4 * MiB]


def test_whole_dataset_reads_byte_for_byte(mount_factory, sample_bucket, sample_files, s3_client):
    with mount_factory(f"s3://{sample_bucket}/data", "--cache-size", "1G") as m:
        seen = set()
        for dirpath, _dirs, names in os.walk(m.mountpoint):
            for name in names:
                seen.add(os.path.relpath(os.path.join(dirpath, name), m.mountpoint))
        assert seen == {f.key for f in sample_files}
        for f in sample_files:
            assert read_all(m.path(f.key)) == f.content(), f.key
        # sizes and mtimes come from the objects
        f = large(sample_files)[0]
        head = s3_client.head_object(Bucket=sample_bucket, Key="data/" + f.key)
        st = os.stat(m.path(f.key))
        assert st.st_size == f.size
        assert abs(st.st_mtime - head["LastModified"].timestamp()) < 1.0
        assert oct(st.st_mode & 0o777) == oct(0o444)


@pytest.mark.quick  # the quick tier's real mount: S3 through the cache, odd sizes, every block boundary
def test_a_listing_shows_dot_and_dot_dot_as_ls_a_expects(mount_factory, sample_bucket, sample_files):
    with mount_factory(f"s3://{sample_bucket}/data") as m:
        sub = next(p for p in m.mountpoint.iterdir() if p.is_dir())
        for d in (m.mountpoint, sub):
            out = subprocess.run(["ls", "-a1", str(d)], capture_output=True, text=True, check=True).stdout.split()
            assert out[:2] == [".", ".."] and sorted(out[2:]) == sorted(os.listdir(d)), out
        lines = subprocess.run(["ls", "-lai", str(sub)], capture_output=True, text=True, check=True).stdout
        dots = {ln.split()[-1]: int(ln.split()[0]) for ln in lines.splitlines()[1:] if ln.split()[-1] in (".", "..")}
        assert dots == {".": os.stat(sub).st_ino, "..": os.stat(m.mountpoint).st_ino}, lines


def test_odd_read_sizes_and_random_offsets(mount_factory, sample_bucket, sample_files):
    with mount_factory(f"s3://{sample_bucket}/data", "--block-size", "1M") as m:
        rng = random.Random(1234)
        for f in large(sample_files):
            with open(m.path(f.key), "rb", buffering=0) as fh:
                off = 0
                while chunk := fh.read(70_000):
                    assert chunk == f.content(off, 70_000), (f.key, off)
                    off += len(chunk)
                assert off == f.size
                for _ in range(300):
                    pos = rng.randrange(0, f.size + 10)
                    n = rng.choice([1, 2, 4095, 4097, 65537, 70_000, MiB - 1, MiB + 1, 3 * MiB])
                    assert os.pread(fh.fileno(), n, pos) == f.content(pos, n), (f.key, pos, n)
                # reads straddling every block boundary
                for b in range(1, f.size // MiB + 1):
                    assert os.pread(fh.fileno(), 10, b * MiB - 5) == f.content(b * MiB - 5, 10)


def test_sixteen_concurrent_reader_threads(mount_factory, sample_bucket, sample_files):
    with mount_factory(f"s3://{sample_bucket}/data", "--block-size", "1M") as m:
        def worker(seed: int) -> int:
            rng = random.Random(seed)
            checked = 0
            for _ in range(40):
                f = rng.choice(sample_files)
                if f.size == 0:
                    continue
                pos = rng.randrange(0, f.size)
                n = rng.randrange(1, 300_000)
                with open(m.path(f.key), "rb", buffering=0) as fh:
                    assert os.pread(fh.fileno(), n, pos) == f.content(pos, n), (f.key, pos, n)
                checked += 1
            return checked

        with ThreadPoolExecutor(16) as pool:
            assert sum(pool.map(worker, range(16))) > 500
        status = wait_idle(m)
        assert status["store"]["corrupt_blocks"] == 0


def test_mmap_and_seek(mount_factory, sample_bucket, sample_files):
    f = large(sample_files)[0]
    with mount_factory(f"s3://{sample_bucket}/data") as m:
        with open(m.path(f.key), "rb") as fh:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                assert len(mm) == f.size
                assert mm[5 * MiB - 3:5 * MiB + 3] == f.content(5 * MiB - 3, 6)
                assert mm[-100:] == f.content(f.size - 100, 100)
            fh.seek(4 * MiB + 1)
            assert fh.read(10) == f.content(4 * MiB + 1, 10)
            fh.seek(-7, os.SEEK_END)
            assert fh.read() == f.content(f.size - 7, 7)


def test_writes_fail_with_erofs(mount_factory, sample_bucket, sample_files):
    f = sample_files[20]
    with mount_factory(f"s3://{sample_bucket}/data") as m:
        attempts = [
            lambda: open(m.path(f.key), "r+b"),
            lambda: open(m.path(f.key), "ab"),
            lambda: open(m.path("new-file"), "wb"),
            lambda: os.mkdir(m.path("newdir")),
            lambda: os.unlink(m.path(f.key)),
            lambda: os.rename(m.path(f.key), m.path("renamed")),
            lambda: os.truncate(m.path(f.key), 0),
            lambda: os.chmod(m.path(f.key), 0o777),
        ]
        for attempt in attempts:
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.EROFS
        assert read_all(m.path(f.key)) == f.content()


@pytest.mark.page_cache
def test_warm_pass_makes_no_data_requests(s3, s3_client, fresh_bucket, mount_factory, tmp_path):
    files = sample_layout(small=60, large=1, large_mib=9, seed=3)
    upload(s3_client, fresh_bucket, "", files)
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M") as m:
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        cold = wait_idle(m)
        gets_after_cold = s3.request_count(fresh_bucket)
        assert cold["cache"]["hits"] == 0 or cold["cache"]["prefetch_fetches"] > 0
        drop_all_caches()
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        warm = wait_idle(m)
        assert s3.request_count(fresh_bucket) == gets_after_cold, "the warm pass reached the endpoint"
        assert warm["cache"]["misses"] == cold["cache"]["misses"], "the warm pass missed the cache"
        assert warm["cache"]["hit_bytes"] - cold["cache"]["hit_bytes"] == sum(f.size for f in files)
        assert warm["cache"]["demand_fetches"] + warm["cache"]["prefetch_fetches"] == \
            cold["cache"]["demand_fetches"] + cold["cache"]["prefetch_fetches"]


def test_remount_serves_warm_data_with_the_endpoint_stopped(private_s3, mount_factory):
    files = sample_layout(small=40, large=1, large_mib=6, seed=5)
    upload(private_s3.client(), "warm", "ds/", files)
    m = mount_factory("s3://warm/ds", "--endpoint-url", private_s3.endpoint, env=private_s3.env())
    with m:
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        wait_idle(m)
    private_s3.stop()
    with m:  # same cache dir, endpoint down: the snapshot and every block come from the cache
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        assert m.status()["cache"]["misses"] == 0


def _block_file(m: Mount, s3_client, bucket: str, prefix: str, f: SampleFile, index: int, bs: int
                ) -> tuple[Path, int, int]:
    """Where block ``index`` of ``f`` is in the mount's cache: (file, offset, length)."""
    from epochfs.blockstore.format import locate

    etag = s3_client.head_object(Bucket=bucket, Key=prefix + f.key)["ETag"]
    bid = block_id(f"s3://{bucket}/{prefix}", f.key, etag, index, block_size=bs)
    where = locate(m.cache_dir, bid)
    assert where is not None, "the block is not cached"
    return where


@pytest.mark.parametrize("damage", ["flip", "hole"])
@pytest.mark.page_cache
def test_corrupt_cache_block_is_refetched(mount_factory, sample_bucket, sample_files, s3_client, damage):
    f = large(sample_files)[0]
    with mount_factory(f"s3://{sample_bucket}/data", "--block-size", "1M", "--readahead", "0") as m:
        assert read_all(m.path(f.key)) == f.content()
        wait_idle(m)
        path, at, _ = _block_file(m, s3_client, sample_bucket, "data/", f, 2, MiB)
        assert path.exists()
        if damage == "flip":
            raw = bytearray(path.read_bytes())
            raw[at + 12345] ^= 0x40
            path.write_bytes(raw)
        else:  # (block 2's range of its object's file punched out: it reads as zeros)
            from epochfs.blockstore.packs import punch_hole

            fd = os.open(path, os.O_WRONLY)
            try:
                punch_hole(fd, at, MiB)
            finally:
                os.close(fd)
        drop_all_caches()
        assert read_all(m.path(f.key)) == f.content()
        status = wait_idle(m)
        assert status["store"]["corrupt_blocks"] == 1
        assert status["cache"]["demand_fetches"] == -(-f.size // MiB) + 1
        drop_all_caches()
        assert read_all(m.path(f.key)) == f.content()  # the refetched block is cached again, intact
        assert wait_idle(m)["store"]["corrupt_blocks"] == 1


@pytest.mark.page_cache
def test_object_overwritten_after_snapshot_never_mixes(s3_client, fresh_bucket, mount_factory):
    key, size = "big.bin", 6 * MiB + 4321
    s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 0, 0, size))
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", "--readahead", "0") as m:
        with open(m.path(key), "rb", buffering=0) as fh:
            assert fh.read(MiB + 10) == pattern(key, 0, 0, MiB + 10)  # blocks 0-1 cached
        wait_idle(m)
        s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 1, 0, size))
        drop_all_caches()
        outcomes = []
        with open(m.path(key), "rb", buffering=0) as fh:
            for off in range(0, size, 300_000):
                try:
                    data = run_with_deadline(lambda off=off: os.pread(fh.fileno(), 300_000, off), 60)
                except OSError as exc:
                    assert exc.errno in (errno.ESTALE, errno.EIO)
                    outcomes.append("error")
                    continue
                assert data == pattern(key, 0, off, len(data)), f"not the snapshot's bytes at {off}"
                outcomes.append("old")
        assert outcomes[0] == "old" and "error" in outcomes
        # A shorter replacement: still never the new bytes.
        s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 2, 0, 1000))
        with open(m.path(key), "rb", buffering=0) as fh:
            with pytest.raises(OSError) as info:
                os.pread(fh.fileno(), 100, 5 * MiB)
            assert info.value.errno in (errno.ESTALE, errno.EIO)


def test_cache_size_is_a_bound(mount_factory, sample_bucket, sample_files):
    cap = 6 * MiB
    with mount_factory(f"s3://{sample_bucket}/data", "--block-size", "1M", "--cache-size", "6M") as m:
        for f in sample_files:
            assert read_all(m.path(f.key)) == f.content(), f.key
            assert m.status()["store"]["used_bytes"] <= cap
        status = wait_idle(m)
        # What the cache takes on disk: block files and packs, whole pages (a packed block starts on one).
        files = [p for d in ("blocks", "packs") for p in (m.cache_dir / d).rglob("*") if p.is_file()]
        on_disk = sum(p.stat().st_blocks * 512 for p in files)
        assert status["store"]["used_bytes"] <= cap and on_disk <= cap + 4096 * status["store"]["blocks"]
        assert status["store"]["evictions"] > 0


def test_directory_source_through_the_cache(tmp_path, mount_factory):
    files = sample_layout(small=30, large=1, large_mib=5, seed=9)
    src = tmp_path / "shared-fs"
    write_tree(str(src), files)
    m = mount_factory(f"file://{src}", "--block-size", "1M")
    with m:
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        wait_idle(m)
    os.rename(src, tmp_path / "gone")  # the slow file system is unreachable now
    with m:
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        assert m.status()["cache"]["misses"] == 0


def mounted_source(mountpoint) -> tuple[str, str]:
    """(type, source) of the mount at ``mountpoint``, as findmnt shows them (from mountinfo)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if fields[4].encode().decode("unicode_escape") == str(mountpoint):
            after = fields[fields.index("-") + 1:]
            return after[0], after[1].encode().decode("unicode_escape")
    raise AssertionError(f"{mountpoint} is not mounted")


def test_findmnt_shows_the_source(tmp_path, mount_factory, sample_bucket):
    with mount_factory(f"s3://{sample_bucket}/data") as m:
        assert mounted_source(m.mountpoint) == ("fuse.epochfs", f"s3://{sample_bucket}/data")
    src = tmp_path / "shared fs, v2"  # a comma is an option separator to libfuse
    write_tree(str(src), sample_layout(small=2, large=0, seed=1))
    with mount_factory(f"file://{src}") as m:
        assert mounted_source(m.mountpoint) == ("fuse.epochfs", f"file://{src}")


def test_foreground_unmounts_on_sigterm_and_sigint(tmp_path, s3, sample_bucket):
    for sig in (signal.SIGTERM, signal.SIGINT):
        mnt = tmp_path / f"fg-{sig.name}"
        mnt.mkdir()
        log = tmp_path / f"fg-{sig.name}.log"  # (a file, not a pipe nobody drains: a full pipe stops a daemon)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [*EPOCHFS, "mount", f"s3://{sample_bucket}/data", str(mnt), "--endpoint-url", s3.endpoint,
                 "--cache-dir", str(tmp_path / "cache-fg"), "--foreground", "--metrics-addr", "off"],
                env=s3.env(), stdout=out, stderr=subprocess.STDOUT, text=True,
            )
        try:
            deadline = time.monotonic() + 60
            while not os.path.ismount(mnt):
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            assert os.listdir(mnt)
            code = _signal_and_wait(proc, sig)
            assert code == 0, f"{sig.name}: exit status {code}\n{log.read_text()}"
            assert not os.path.ismount(mnt)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point, from /proc/self/mountinfo (a stat would wait for the daemon)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


# The daemon with its event loop held back for a few seconds after the mount is made: the window in
# which a stop signal used to kill it (its default action) and leave a dead mount behind.
_SLOW_TO_LISTEN = """
import runpy, sys, trio
import epochfs.daemon.mount as m
real_run = m.Daemon.run
async def run(self, *args):
    await trio.sleep(3)
    await real_run(self, *args)
m.Daemon.run = run
sys.argv[0] = "epochfs"
runpy.run_module("epochfs", run_name="__main__")
"""


def _signal_and_wait(proc: subprocess.Popen, sig: signal.Signals) -> int | None:
    """Send ``sig`` and wait for the daemon to end: its exit status, or None if it did not end in 30 s."""
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_between_the_mount_and_the_event_loop_unmounts(tmp_path, s3, sample_bucket, sig):
    """SIGTERM or SIGINT after the mount is made but before the event loop listens (services still
    starting, or a process held up): the daemon unmounts and exits 0 once it runs, never dies with the
    mount left dead (``Transport endpoint is not connected`` until someone unmounts it by hand)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "daemon.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SLOW_TO_LISTEN, "mount", f"s3://{sample_bucket}/data", str(mnt),
             "--endpoint-url", s3.endpoint, "--cache-dir", str(tmp_path / "cache"), "--foreground",
             "--metrics-addr", "off"],
            env=s3.env(), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _mounted(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        code = _signal_and_wait(proc, sig)
        assert code == 0, f"exit status {code}\n{log.read_text()}"
        assert not _mounted(mnt), "the daemon left its mount behind"
        text = log.read_text()
        assert f"received {sig.name} while starting; unmounting" in text
        assert f"stopped by {sig.name} before the mount was ready" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if _mounted(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_umount_and_fusermount(mount_factory, sample_bucket):
    m = mount_factory(f"s3://{sample_bucket}/data")
    m.start()
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    result = subprocess.run([*EPOCHFS, "umount", str(m.mountpoint)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not os.path.ismount(m.mountpoint)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]

    m.start()
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    subprocess.run(["fusermount3", "-u", str(m.mountpoint)], check=True)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]:
        assert time.monotonic() < deadline, "daemon did not exit after fusermount3 -u"
        time.sleep(0.05)
    assert "unmounted" in m.log()


def test_mount_errors_are_clear(tmp_path, mount_factory, sample_bucket, s3):
    bad = subprocess.run([*EPOCHFS, "mount", f"s3://{sample_bucket}/data", str(tmp_path / "missing"),
                          "--endpoint-url", s3.endpoint, "--cache-dir", str(tmp_path / "c0"), "--metrics-addr", "off"],
                         env=s3.env(), capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    m = mount_factory("s3://no-such-bucket-x/data", name="m1")
    result = m.start(expect_ok=False)
    assert result.returncode != 0 and "no-such-bucket-x" in result.stderr
    assert not os.path.ismount(m.mountpoint)
    first = mount_factory(f"s3://{sample_bucket}/data", name="m2", cache_dir=tmp_path / "shared-cache")
    first.start()
    second = mount_factory(f"s3://{sample_bucket}/data", name="m3", cache_dir=tmp_path / "shared-cache")
    result = second.start(expect_ok=False)
    assert result.returncode == 2 and "in use by pid" in result.stderr
    result = subprocess.run([*EPOCHFS, "mount", "http://x/y", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "s3://BUCKET" in result.stderr
    result = subprocess.run([*EPOCHFS, "mount", "s3://b", str(tmp_path), "--cache-size", "lots"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "not a size" in result.stderr


def test_snapshot_is_reused_until_refresh(s3_client, fresh_bucket, mount_factory):
    s3_client.put_object(Bucket=fresh_bucket, Key="a.txt", Body=b"first")
    m = mount_factory(f"s3://{fresh_bucket}")
    with m:
        assert os.listdir(m.mountpoint) == ["a.txt"]
        version = m.status()["snapshot"]["version"]
    s3_client.put_object(Bucket=fresh_bucket, Key="b.txt", Body=b"second")
    with m:
        assert os.listdir(m.mountpoint) == ["a.txt"]
        assert m.status()["snapshot"]["version"] == version
    m.args.append("--refresh")
    with m:
        assert sorted(os.listdir(m.mountpoint)) == ["a.txt", "b.txt"]
        assert m.status()["snapshot"]["version"] == version + 1
        assert m.path("b.txt").read_bytes() == b"second"


def test_unsafe_keys_are_hidden_and_large_directories_page(s3_client, fresh_bucket, mount_factory):
    keys = {"ok.txt": b"ok", "dir/inner.txt": b"inner", "dir": b"file-shadowed-by-dir",
            "x" * 300 + "/long.txt": b"long component", "ctl\x01name": b"control char"}
    for k, v in keys.items():
        s3_client.put_object(Bucket=fresh_bucket, Key=k, Body=v)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s3_client.put_object(Bucket=fresh_bucket, Key=f"many/f{i:05d}", Body=b"m"),
                      range(600)))  # (a readdir reply holds a few hundred names: this pages)
    with mount_factory(f"s3://{fresh_bucket}") as m:
        assert sorted(os.listdir(m.mountpoint)) == ["dir", "many", "ok.txt"]
        assert os.path.isdir(m.path("dir")) and m.path("dir/inner.txt").read_bytes() == b"inner"
        assert len(os.listdir(m.path("many"))) == 600
        assert sorted(os.listdir(m.path("many"))) == [f"f{i:05d}" for i in range(600)]
        log = m.log()
        assert "also a directory prefix" in log and "component longer than 255 bytes" in log
        assert "control character" in log
        assert not any(p.name.endswith(".txt") for p in m.cache_dir.rglob("*"))


def test_unreachable_backend_gives_eio_within_the_deadline(private_s3, mount_factory):
    files = sample_layout(small=5, large=1, large_mib=3, seed=11)
    upload(private_s3.client(), "dying", "", files)
    m = mount_factory("s3://dying", "--endpoint-url", private_s3.endpoint, "--backend-timeout", "6",
                      "--backend-attempts", "3", env=private_s3.env())
    m.start()
    assert read_all(m.path(files[5].key)) == files[5].content()
    private_s3.stop()
    f = files[3]  # never read: not cached
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        run_with_deadline(lambda: read_all(m.path(f.key)), 60)
    assert info.value.errno == errno.EIO
    assert time.monotonic() - started < 30
    assert read_all(m.path(files[5].key)) == files[5].content(), "cached data is still served"
    assert os.listdir(m.mountpoint), "the mount stays usable"


def test_kernel_readahead_is_raised_for_large_reads(mount_factory, sample_bucket):
    with mount_factory(f"s3://{sample_bucket}/data", "--kernel-readahead", "2M") as m:
        dev = os.stat(m.mountpoint).st_dev
        assert Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text().strip() == "2048"


@pytest.mark.page_cache
def test_concurrent_readers_get_a_small_file_in_one_request(s3_client, fresh_bucket, mount_factory):
    """With the large readahead window, a mount the kernel counts as congested (its default: 9 background
    requests) asks for a small file's first page alone, then the rest; the mount raises the limit."""
    files = [SampleFile(f"d/{i:03d}.bin", 100 * 1024) for i in range(200)]
    upload(s3_client, fresh_bucket, "", files)
    with mount_factory(f"s3://{fresh_bucket}") as m:
        conn = Path(f"/sys/fs/fuse/connections/{os.minor(os.stat(m.mountpoint).st_dev)}")
        assert (conn / "max_background").read_text().strip() == "64"
        assert (conn / "congestion_threshold").read_text().strip() == "48"
        # (Whether the default limit is reached depends on timing: on a busy machine, 1.7 requests per
        # file; benchmarks/peers/smallfiles.py shows it.)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda f: read_all(m.path(f.key)), files))  # cold: fetched and cached
        wait_idle(m)
        for _ in range(2):
            drop_all_caches()
            before = m.status()["read_seconds"]["count"]
            with ThreadPoolExecutor(16) as pool:
                assert list(pool.map(lambda f: read_all(m.path(f.key)), files)) == [f.content() for f in files]
            requests = m.status()["read_seconds"]["count"] - before
            assert requests <= 1.05 * len(files), f"{requests} read requests for {len(files)} files"


def test_concurrent_cold_readers_fetch_each_block_once(s3, s3_client, fresh_bucket, mount_factory):
    key, size = "shared.bin", 12 * MiB + 99
    s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 0, 0, size))
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M") as m:
        before = s3.request_count(fresh_bucket)

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            with open(m.path(key), "rb", buffering=0) as fh:
                for _ in range(30):
                    pos = rng.randrange(0, size)
                    assert os.pread(fh.fileno(), 200_000, pos) == pattern(key, 0, pos, min(200_000, size - pos))

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(reader, range(16)))
        wait_idle(m)
        gets = s3.request_count(fresh_bucket) - before
        assert gets <= -(-size // MiB), f"{gets} GETs for {-(-size // MiB)} blocks"


@pytest.mark.page_cache
def test_open_files_keep_the_kernel_page_cache(mount_factory, sample_bucket, sample_files):
    f = large(sample_files)[0]
    with mount_factory(f"s3://{sample_bucket}/data") as m:
        assert read_all(m.path(f.key)) == f.content()
        first = wait_idle(m)
        assert read_all(m.path(f.key)) == f.content()  # reopened: served by the kernel
        second = m.status()
        assert second["read_seconds"]["count"] == first["read_seconds"]["count"], "a READ reached the daemon"
        assert second["cache"]["misses"] == first["cache"]["misses"]


def test_snapshot_ttl_lists_again(s3_client, fresh_bucket, mount_factory):
    s3_client.put_object(Bucket=fresh_bucket, Key="one", Body=b"1")
    m = mount_factory(f"s3://{fresh_bucket}", "--snapshot-ttl", "3600")
    with m:
        assert os.listdir(m.mountpoint) == ["one"]
    s3_client.put_object(Bucket=fresh_bucket, Key="two", Body=b"2")
    with m:
        assert os.listdir(m.mountpoint) == ["one"]
    time.sleep(1.1)
    m.args[m.args.index("--snapshot-ttl") + 1] = "1"
    with m:
        assert sorted(os.listdir(m.mountpoint)) == ["one", "two"]


@pytest.mark.page_cache
def test_a_read_only_mount_opens_files_with_no_request(mount_factory, sample_bucket, sample_files):
    """Zero-message opens (where the kernel does not read cached files itself: here --no-passthrough): once
    a file is in the page cache, opening and reading it again needs no daemon at all (proved with the
    daemon stopped); with --open-requests the open waits for the daemon. A
    default-buffered Python open asks whether the file is a terminal (IOCTL, the one request it costs):
    ENOTTY."""
    import fcntl
    import termios

    f = next(f for f in sample_files if 0 < f.size <= 256 << 10)
    with mount_factory(f"s3://{sample_bucket}/data", "--no-passthrough") as m:
        assert read_all(m.path(f.key)) == f.content()
        asked = m.status()["isatty_asks"]
        with open(m.path(f.key), "rb") as buffered:
            assert not buffered.isatty() and buffered.read() == f.content()
            with pytest.raises(OSError) as raised:
                fcntl.ioctl(buffered.fileno(), termios.TCGETS, bytes(64))
            assert raised.value.errno == errno.ENOTTY
        assert read_all(m.path(f.key)) == f.content()  # (unbuffered: asks nothing)
        opens_ask = 1 if sys.version_info < (3, 14) else 0  # (3.14's open() no longer asks of a plain file)
        assert m.status()["isatty_asks"] - asked == opens_ask + 2  # and isatty(), and the ioctl
        pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
        os.kill(pid, signal.SIGSTOP)
        try:
            assert run_with_deadline(lambda: read_all(m.path(f.key)), 10) == f.content()
        finally:
            os.kill(pid, signal.SIGCONT)
    with mount_factory(f"s3://{sample_bucket}/data", "--open-requests", name="mnt2") as m:
        assert read_all(m.path(f.key)) == f.content()
        pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
        os.kill(pid, signal.SIGSTOP)
        reader = subprocess.Popen([sys.executable, "-c", f"open({str(m.path(f.key))!r}, 'rb').read()"])
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                reader.wait(2)  # the OPEN waits for the stopped daemon
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reader.wait(30) == 0
