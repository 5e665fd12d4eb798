"""Breaking things: the cache disk, the daemon, the objects, the listing, many readers at once.
The rule everywhere: never a wrong byte, never a hang -- correct data or EIO/ESTALE, in bounded time."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from epochfs.blockstore.format import locate
from epochfs.core.blocks import block_id
from epochfs.dev.sample import SampleFile, pattern, sample_layout, upload, write_tree

from .conftest import requires_fuse
from .faultproxy import Fault, FaultProxy
from .helpers import EPOCHFS, damage_block, drop_all_caches, read_all, run_with_deadline, wait_idle

pytestmark = requires_fuse
KiB, MiB = 1 << 10, 1 << 20


def verify_all(m, files, deadline: float = 60.0) -> None:
    for f in files:
        assert run_with_deadline(lambda f=f: read_all(m.path(f.key)), deadline) == f.content(), f.key


# -- 1. backend faults at 1%, 10% and 100% -----------------------------------------------------------

@pytest.fixture
def proxied(s3, s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"f{i:02d}.bin", 700 * KiB + 13 * i) for i in range(12)]
    upload(s3_client, fresh_bucket, "", files)
    proxy = FaultProxy(s3.port).start()
    m = mount_factory(f"s3://{fresh_bucket}", "--endpoint-url", proxy.endpoint, "--block-size", "256K",
                      "--backend-timeout", "8", "--backend-attempts", "4")
    m.start()
    yield m, proxy, files
    m.stop()
    proxy.stop()


# (test_faults.py fails each kind on every other request in the default tier; these low rates, with a
# remount per kind, run in the slow tier)
@pytest.mark.parametrize("rate", [pytest.param(0.01, marks=pytest.mark.slow), pytest.param(0.1, marks=pytest.mark.slow)])
@pytest.mark.page_cache
def test_low_fault_rates_of_every_kind_give_correct_bytes(proxied, rate):
    m, proxy, files = proxied
    for seed, kind in enumerate(["error500", "slowdown", "throttle429", "reset", "truncate", "wrong_range",
                                 "full_200", "stall_body"]):
        proxy.set(Fault(kind, rate=rate, seed=seed, retry_after=0.05, stall=3.0))
        drop_all_caches()
        subprocess.run([*EPOCHFS, "umount", str(m.mountpoint)], check=True)
        for name in ("blocks", "packs", "index"):  # cold again, so every block is fetched
            shutil.rmtree(m.cache_dir / name)
        m.start()
        verify_all(m, files)
        assert wait_idle(m)["store"]["corrupt_blocks"] == 0


@pytest.mark.parametrize("kind", ["slowdown", "throttle429", "reset", "full_200"])
def test_every_request_failing_is_eio_in_bounded_time_then_heals(proxied, kind):
    m, proxy, files = proxied
    proxy.set(Fault(kind, rate=1.0, retry_after=0.5))
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        run_with_deadline(lambda: read_all(m.path(files[3].key)), 60)
    assert info.value.errno == errno.EIO
    assert time.monotonic() - started < 40
    assert wait_idle(m)["store"]["blocks"] == 0
    proxy.set(None)
    verify_all(m, files)


# -- 2. kill -9 during a cold fill ------------------------------------------------------------------

def kill_during_fill_and_check(s3, bucket: str, files, m, seed: int) -> None:
    rng = random.Random(seed)
    m.start()
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    readers = [subprocess.Popen([sys.executable, "-c", (
        "import sys\n"
        f"for p in {[str(m.path(f.key)) for f in files]!r}:\n"
        "    try:\n        open(p, 'rb').read()\n    except OSError:\n        sys.exit(0)\n")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(3)]
    time.sleep(rng.uniform(0.05, 0.8))
    os.kill(pid, signal.SIGKILL)
    for r in readers:
        r.wait(timeout=60)
    m.start()  # recovers the dead mount point
    assert not any((m.cache_dir / "tmp").iterdir()), "temp files of interrupted fills were left"
    drop_all_caches()
    verify_all(m, files)
    status = wait_idle(m)
    assert status["store"]["corrupt_blocks"] == 0, "the index pointed at a short or wrong block"
    m.stop()
    check = subprocess.run([*EPOCHFS, "fsck", "--cache-dir", str(m.cache_dir)], capture_output=True, text=True)
    assert check.returncode == 0 and " 0 damaged, 0 orphan" in check.stdout, \
        f"block files or packs the index does not know were left behind: {check.stdout}"


def test_unmount_during_a_cold_fill_leaves_a_consistent_cache(s3_client, fresh_bucket, mount_factory):
    """Fills still being written when the daemon is asked to stop are finished and indexed: the cache
    directory is marked clean with no block file the index does not know."""
    files = sample_layout(small=40, large=2, large_mib=8, seed=6)
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M")
    m.start()
    readers = [subprocess.Popen([sys.executable, "-c", (
        "import sys\n"
        f"for p in {[str(m.path(f.key)) for f in files[i::3]]!r}:\n"
        "    try:\n        open(p, 'rb').read()\n    except OSError:\n        sys.exit(0)\n")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(3)]
    time.sleep(0.5)
    subprocess.run([*EPOCHFS, "umount", "--lazy", str(m.mountpoint)], check=True, timeout=60)
    for r in readers:
        r.wait(timeout=60)
    deadline = time.monotonic() + 30
    while not (m.cache_dir / "clean").exists():  # a lazy unmount returns before the daemon has exited
        assert time.monotonic() < deadline, "the daemon did not shut down cleanly"
        time.sleep(0.05)
    check = subprocess.run([*EPOCHFS, "fsck", "--cache-dir", str(m.cache_dir)], capture_output=True, text=True)
    assert check.returncode == 0 and " 0 damaged, 0 orphan files" in check.stdout, check.stdout + check.stderr
    assert not check.stdout.startswith("0 blocks"), "nothing was cached before the unmount"
    with m:
        verify_all(m, files)


@pytest.mark.page_cache
def test_kill_9_during_a_cold_fill_once(s3, s3_client, fresh_bucket, mount_factory):
    files = sample_layout(small=60, large=2, large_mib=6, seed=4)
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M")
    kill_during_fill_and_check(s3, fresh_bucket, files, m, seed=1)


@pytest.mark.slow
@pytest.mark.page_cache
def test_kill_9_during_cold_fills_repeatedly(s3, s3_client, fresh_bucket, mount_factory):
    files = sample_layout(small=60, large=2, large_mib=6, seed=4)
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M")
    for seed in range(12):
        kill_during_fill_and_check(s3, fresh_bucket, files, m, seed=seed)


# -- 3. cache corruption, with the backend up and down -------------------------------------------

# (flip in the default tier; every damage kind is also in test_store_fuzz.py's loop)
@pytest.mark.parametrize("damage", ["flip", *(pytest.param(d, marks=pytest.mark.slow)
                                              for d in ("truncate", "empty", "delete", "swap"))])
@pytest.mark.page_cache
def test_damaged_blocks_with_the_backend_up_then_down(private_s3, mount_factory, damage):
    files = [SampleFile(f"k{i}.bin", 300 * KiB + i) for i in range(4)]
    upload(private_s3.client(), "dmg", "", files)
    etags = {f.key: private_s3.client().head_object(Bucket="dmg", Key=f.key)["ETag"] for f in files}
    m = mount_factory("s3://dmg", "--endpoint-url", private_s3.endpoint, "--backend-timeout", "5",
                      "--backend-attempts", "2", env=private_s3.env())
    m.start()
    verify_all(m, files)
    wait_idle(m)
    bids = [block_id("s3://dmg/", f.key, etags[f.key], 0, block_size=4 * MiB) for f in files]

    def hurt(i: int) -> None:  # (a swap is with the next file's block)
        where = locate(m.cache_dir, bids[i])
        assert where is not None
        damage_block(where, damage, locate(m.cache_dir, bids[i + 1]) if damage == "swap" else None)

    hurt(0)
    drop_all_caches()
    verify_all(m, files[:1])  # refetched from the backend
    assert m.status()["store"]["corrupt_blocks"] == 1
    private_s3.stop()
    hurt(2)
    drop_all_caches()
    with pytest.raises(OSError) as info:  # damaged and the backend is down: EIO, not wrong bytes
        run_with_deadline(lambda: read_all(m.path(files[2].key)), 60)
    assert info.value.errno == errno.EIO
    assert m.status()["store"]["corrupt_blocks"] >= 2
    assert read_all(m.path(files[0].key)) == files[0].content()  # the refetched block is intact
    m.stop()


def test_garbage_index_is_rebuilt_not_crash_looped(s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"g{i}.bin", 100 * KiB + i) for i in range(5)]
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}")
    with m:
        verify_all(m, files)
        wait_idle(m)
    for p in (m.cache_dir / "index").iterdir():
        p.write_bytes(os.urandom(p.stat().st_size or 4096))
    with m:
        assert "damaged" in m.log()
        verify_all(m, files)
        assert wait_idle(m)["store"]["blocks"] == len(files)  # fills are written behind the reads


# -- 4. cache disk full ---------------------------------------------------------------------------

@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A size-limited file system (tmpfs) for the cache directory."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.page_cache
def test_full_cache_disk_reads_through(tmp_path, s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"full/{i:02d}.bin", 900 * KiB + i) for i in range(20)]  # ~18 MiB
    upload(s3_client, fresh_bucket, "", files)
    with small_disk(tmp_path / "small-disk", "6m") as disk:
        m = mount_factory(f"s3://{fresh_bucket}", "--cache-size", "64M", "--free-space-ratio", "0",
                          "--block-size", "1M", cache_dir=disk / "cache")
        with m:
            for _ in range(2):
                drop_all_caches()
                verify_all(m, files)
            status = wait_idle(m)
            assert status["store"]["used_bytes"] <= 6 * MiB
            assert status["store"]["fill_errors"] > 0
            assert status["cache"]["hits"] > 0, "what fits is still served from the cache"
            assert "ENOSPC" not in status["errors"] and not status["errors"].get("EIO")


def test_free_space_floor_is_kept(tmp_path, s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"floor/{i:02d}.bin", 900 * KiB + i) for i in range(20)]
    upload(s3_client, fresh_bucket, "", files)
    with small_disk(tmp_path / "disk", "16m") as disk:
        m = mount_factory(f"s3://{fresh_bucket}", "--cache-size", "64M", "--free-space-ratio", "0.5",
                          "--block-size", "1M", cache_dir=disk / "cache")
        with m:
            verify_all(m, files)
            wait_idle(m)
            st = os.statvfs(disk)
            assert st.f_bavail / st.f_blocks >= 0.45
            assert m.status()["store"]["evictions"] > 0


# -- 5. objects that change during an epoch -----------------------------------------------------

@pytest.mark.parametrize("change", ["same-size", "longer", "shorter", "deleted"])
@pytest.mark.page_cache
def test_changed_objects_never_mix_versions(s3_client, fresh_bucket, mount_factory, change):
    key, size = "epoch/obj.bin", 3 * MiB + 777
    s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 0, 0, size))
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "512K", "--readahead", "0") as m:
        held = open(m.path(key), "rb", buffering=0)  # noqa: SIM115 - held open across the change
        assert os.pread(held.fileno(), 600 * KiB, 0) == pattern(key, 0, 0, 600 * KiB)  # partly cached
        wait_idle(m)
        if change == "deleted":
            s3_client.delete_object(Bucket=fresh_bucket, Key=key)
        else:
            new_size = {"same-size": size, "longer": size + MiB, "shorter": MiB // 3}[change]
            s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 1, 0, new_size))
        drop_all_caches()
        for handle in ("held", "reopened"):
            fh = held if handle == "held" else open(m.path(key), "rb", buffering=0)  # noqa: SIM115
            for off in range(0, size, 200 * KiB):
                try:
                    data = run_with_deadline(lambda fh=fh, off=off: os.pread(fh.fileno(), 200 * KiB, off), 60)
                except OSError as exc:
                    assert exc.errno in (errno.ESTALE, errno.EIO), exc
                    continue
                assert data == pattern(key, 0, off, len(data)), f"{handle}: not the snapshot's bytes at {off}"
            fh.close()
        assert m.status()["errors"].get("ESTALE", 0) > 0


# -- 6. many concurrent readers on a cold cache --------------------------------------------------

def test_64_concurrent_readers_threads_and_processes(s3, s3_client, fresh_bucket, mount_factory):
    hot = [SampleFile(f"hot/{i}.bin", 2 * MiB + 1000 * i) for i in range(3)]
    cold = [SampleFile(f"cold/{i:03d}.bin", 64 * KiB + 997 * i) for i in range(120)]
    files = hot + cold
    upload(s3_client, fresh_bucket, "", files)
    blocks = sum(-(-f.size // MiB) for f in files)
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M") as m:
        pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
        gets_before = s3.request_count(fresh_bucket)
        errors: list[str] = []

        def thread_reader(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(25):
                f = rng.choice(hot) if rng.random() < 0.5 else rng.choice(cold)
                pos = rng.randrange(0, f.size)
                n = rng.randrange(1, 400 * KiB)
                with open(m.path(f.key), "rb", buffering=0) as fh:
                    if os.pread(fh.fileno(), n, pos) != f.content(pos, n):
                        errors.append(f"{f.key}@{pos}+{n}")

        script = (
            "import os, random, sys, hashlib\n"
            "from epochfs.dev.sample import SampleFile\n"
            f"files = [SampleFile(k, s) for k, s in {[(f.key, f.size) for f in files]!r}]\n"
            "rng = random.Random(int(sys.argv[1]))\n"
            "bad = 0\n"
            "for _ in range(25):\n"
            "    f = rng.choice(files)\n"
            "    pos = rng.randrange(0, f.size); n = rng.randrange(1, 400 * 1024)\n"
            f"    with open(os.path.join({str(m.mountpoint)!r}, f.key), 'rb', buffering=0) as fh:\n"
            "        bad += os.pread(fh.fileno(), n, pos) != f.content(pos, n)\n"
            "sys.exit(1 if bad else 0)\n"
        )
        procs = [subprocess.Popen([sys.executable, "-c", script, str(100 + i)]) for i in range(32)]
        threads = [threading.Thread(target=thread_reader, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
            assert not t.is_alive(), "a reader thread hung"
        for p in procs:
            assert p.wait(timeout=240) == 0, "a reader process saw wrong bytes"
        assert not errors, errors[:5]
        wait_idle(m)
        gets = s3.request_count(fresh_bucket) - gets_before
        assert gets <= blocks, f"{gets} GETs for {blocks} blocks: single flight failed"
        rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
        assert rss < 400 * MiB, f"daemon RSS {rss >> 20} MiB"


# -- 7. hostile listings ----------------------------------------------------------------------------

@pytest.mark.slow  # 14 s; hostile keys and large directories are also held by test_mount's unsafe-keys test
def test_hostile_names_in_a_directory_source_and_100k_entries(tmp_path, mount_factory):
    src = tmp_path / "hostile"
    big = src / "big"
    big.mkdir(parents=True)
    for i in range(100_000):
        (big / f"e{i:06d}").touch()
    raw = os.fsencode(src)
    for name in (b"bad\xffutf8.bin", b"ctl\x1bname", b"x" * 255):
        with open(raw + b"/" + name, "wb") as f:
            f.write(b"data")
    deep = src / "/".join(["d"] * 60)
    deep.mkdir(parents=True)
    (deep / "leaf.txt").write_bytes(b"deep")
    write_tree(str(src), [SampleFile("ok/file.bin", 1000)])
    with mount_factory(f"file://{src}", cache_dir=tmp_path / "c") as m:
        names = os.listdir(m.mountpoint)
        assert sorted(names) == sorted(["big", "d", "ok", "x" * 255])
        listing = os.listdir(m.path("big"))
        assert len(listing) == 100_000 and len(set(listing)) == 100_000
        assert (m.mountpoint / "/".join(["d"] * 60) / "leaf.txt").read_bytes() == b"deep"
        log = m.log()
        assert "not valid UTF-8" in log and "control character" in log
        outside = {p for p in tmp_path.iterdir()} - {src, tmp_path / "c", m.mountpoint}
        assert not outside, f"created outside the cache directory: {outside}"


# -- 8. secrets ---------------------------------------------------------------------------------------

def test_secrets_never_appear_in_logs_metrics_status_or_cmdline(s3, sample_bucket, sample_files, mount_factory):
    secret = "epochfs-secret-value-7f3a9c"
    env = s3.env() | {"AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": secret + "-token"}
    m = mount_factory(f"s3://{sample_bucket}/data", "--debug", env=env)
    with m:
        pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
        for f in sample_files[:5]:
            read_all(m.path(f.key))
        with pytest.raises(OSError):
            open(m.path("no-such-file"), "rb")
        with urllib.request.urlopen(f"http://{m.status()['metrics_addr']}/metrics") as resp:
            metrics = resp.read().decode()
        status = str(m.status())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        environ_mode = Path(f"/proc/{pid}/environ").stat().st_mode
    log = m.log()
    assert "DEBUG" in log
    for where, text in (("log", log), ("metrics", metrics), ("status", status), ("cmdline", cmdline)):
        assert secret not in text, f"the secret leaked into the {where}"
    assert environ_mode & 0o077 == 0, "other users could read the daemon's environment"


# -- 9. soak ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_soak_with_faults_switching_on_and_off(s3, s3_client, fresh_bucket, mount_factory):
    """A mixed read load for several minutes (EPOCHFS_SOAK_SECONDS, default 180) while faults come and
    go: every read correct or EIO, and the daemon's memory and open files stay flat."""
    duration = float(os.environ.get("EPOCHFS_SOAK_SECONDS", "180"))
    files = sample_layout(small=150, large=3, large_mib=8, seed=33)
    upload(s3_client, fresh_bucket, "", files)
    proxy = FaultProxy(s3.port).start()
    m = mount_factory(f"s3://{fresh_bucket}", "--endpoint-url", proxy.endpoint, "--block-size", "1M",
                      "--cache-size", "24M", "--backend-timeout", "6", "--backend-attempts", "3")
    m.start()
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))

    def rss() -> int:
        return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) * 1024

    def fds() -> int:
        """Open descriptors, less the backing files kept registered for the next open of their object (a
        bounded cache of its own: one per whole object at most, checked below)."""
        p = m.status()["passthrough"] or {"kept": 0, "whole_files": 0}
        assert p["kept"] <= p["whole_files"], p
        return len(os.listdir(f"/proc/{pid}/fd")) - p["kept"]

    stop = time.monotonic() + duration
    wrong: list[str] = []
    counts = {"ok": 0, "eio": 0}

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            f = rng.choice(files)
            if not f.size:
                continue
            pos, n = rng.randrange(0, f.size), rng.randrange(1, 600 * KiB)
            try:
                with open(m.path(f.key), "rb", buffering=0) as fh:
                    data = run_with_deadline(lambda fh=fh, n=n, pos=pos: os.pread(fh.fileno(), n, pos), 60)
            except OSError as exc:
                assert exc.errno == errno.EIO, exc
                counts["eio"] += 1
                continue
            if data != f.content(pos, n):
                wrong.append(f"{f.key}@{pos}+{n}")
            counts["ok"] += 1

    kinds = ["error500", "reset", "truncate", "wrong_range", "slowdown", "stall_body"]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(reader, i) for i in range(8)]
        time.sleep(min(20.0, duration / 6))
        baseline = (rss(), fds())
        samples = []
        phase = 0
        while time.monotonic() < stop:
            proxy.set(Fault(kinds[phase % len(kinds)], rate=0.2, seed=phase, retry_after=0.1, stall=2)
                      if phase % 2 == 0 else None)
            phase += 1
            time.sleep(min(10.0, duration / 12))
            samples.append((rss(), fds()))
        for fut in futures:
            fut.result(timeout=120)
    proxy.set(None)
    m.stop()
    proxy.stop()
    assert not wrong, wrong[:5]
    assert counts["ok"] > 100
    peak_rss = max(r for r, _ in samples)
    peak_fds = max(f for _, f in samples)
    assert peak_rss < baseline[0] + 64 * MiB, f"RSS grew from {baseline[0] >> 20} to {peak_rss >> 20} MiB"
    assert peak_fds <= baseline[1] + 32, f"open files grew from {baseline[1]} to {peak_fds}"
