"""Checkpoint write-back through real mounts against the real local S3 endpoint: byte-exact objects for
every size and write pattern, the rename patterns, crash safety (kill -9, remount, sync), the endpoint
going away, upload faults, a cache full of pending data, concurrent writers, and reads going on during a
large upload."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from epochfs.dev.sample import pattern
from epochfs.dev.servers import LocalRedis

from .conftest import requires_fuse
from .faultproxy import Fault, FaultProxy
from .helpers import EPOCHFS, Mount, drop_file_pages, read_all

pytestmark = requires_fuse

MiB = 1 << 20


def keys_of(s3_client, bucket: str, prefix: str = "") -> dict[str, int]:
    """The objects under ``prefix`` and their sizes: the data, without epochfs's attribute records
    (``.epochfs/``) unless ``prefix`` asks for them."""
    out: dict[str, int] = {}
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])
                    if "/.epochfs/" not in "/" + o["Key"] or ".epochfs/" in prefix})
    return out


def body(s3_client, bucket: str, key: str) -> bytes:
    return s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()


def sync(mount: Mount, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EPOCHFS, "sync", str(mount.mountpoint), *args], capture_output=True, text=True,
                          timeout=timeout, env=mount.env)


def daemon_pid(mount: Mount) -> int:
    return int(os.getxattr(mount.mountpoint, "user.epochfs.pid"))


def write_scattered(path: Path, data: bytes, seed: int) -> None:
    """Write ``data`` in odd-sized pieces in a seeded random order (the file grows with holes first)."""
    rng = random.Random(seed)
    pieces, off = [], 0
    while off < len(data):
        n = rng.choice([1, 7, 4095, 4097, 65537, 131071, 1 << 20])
        pieces.append((off, min(n, len(data) - off)))
        off += n
    rng.shuffle(pieces)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off, n in pieces:
            assert os.pwrite(fd, data[off:off + n], off) == n
    finally:
        os.close(fd)


@pytest.fixture
def wb_mount(fresh_bucket, mount_factory):
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--block-size", "1M")
    m.start()
    yield m
    m.stop()


def test_without_writeback_the_mount_stays_read_only(s3_client, fresh_bucket, mount_factory):
    s3_client.put_object(Bucket=fresh_bucket, Key="a.bin", Body=b"abc")
    with mount_factory(f"s3://{fresh_bucket}") as m:
        for attempt in (lambda: open(m.path("new.bin"), "wb"), lambda: open(m.path("a.bin"), "r+b"),
                        lambda: os.mkdir(m.path("d")), lambda: os.unlink(m.path("a.bin")),
                        lambda: os.link(m.path("a.bin"), m.path("b.bin")), lambda: os.symlink("a.bin", m.path("c"))):
            with pytest.raises(OSError) as exc:
                attempt()
            assert exc.value.errno == errno.EROFS
        result = sync(m)
        assert result.returncode == 0 and "nothing to sync" in result.stderr


@pytest.mark.parametrize("size", [0, 1, 4095, MiB + 1, 3 * MiB - 7])
def test_files_of_every_size_arrive_byte_exact(wb_mount, s3_client, fresh_bucket, size):
    data = random.Random(size).randbytes(size)
    write_scattered(wb_mount.path("f.bin"), data, seed=size)
    assert read_all(wb_mount.path("f.bin"), 70_001) == data  # at local speed, before the upload
    done = sync(wb_mount)
    assert done.returncode == 0 and "every file written is in the backend" in done.stderr, done.stderr
    assert keys_of(s3_client, fresh_bucket) == {"ckpt/f.bin": size}
    assert body(s3_client, fresh_bucket, "ckpt/f.bin") == data
    assert read_all(wb_mount.path("f.bin"), 65_537) == data  # now read through the cache


def test_a_file_over_the_multipart_threshold_arrives_whole(wb_mount, s3_client, fresh_bucket):
    size = 70 * MiB + 12_345  # over 64 MiB: uploaded in parallel parts
    data = random.Random(1).randbytes(size)
    write_scattered(wb_mount.path("big.pt"), data, seed=2)
    assert sync(wb_mount, timeout=300).returncode == 0
    head = s3_client.head_object(Bucket=fresh_bucket, Key="ckpt/big.pt")
    assert head["ContentLength"] == size and "-" in head["ETag"]  # a multipart ETag
    assert body(s3_client, fresh_bucket, "ckpt/big.pt") == data
    rng = random.Random(3)
    with open(wb_mount.path("big.pt"), "rb", buffering=0) as f:
        for _ in range(50):
            off, n = rng.randrange(size), rng.choice([1, 4097, 1 << 20, 3 << 20])
            assert os.pread(f.fileno(), n, off) == data[off:off + n]


def test_temp_then_rename_and_rename_over_an_existing_object(wb_mount, s3_client, fresh_bucket):
    s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/latest.pt", Body=b"old checkpoint")
    subprocess.run([*EPOCHFS, "refresh", str(wb_mount.mountpoint)], check=True, capture_output=True,
                   env=wb_mount.env)
    assert wb_mount.path("latest.pt").read_bytes() == b"old checkpoint"
    os.makedirs(wb_mount.path("step-100"))
    data = random.Random(5).randbytes(2 * MiB + 3)
    for name in ("model.pt", "optim.pt"):
        tmp = wb_mount.path(f"step-100/.{name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, wb_mount.path(f"step-100/{name}"))
    new = wb_mount.path(".latest.tmp")
    new.write_bytes(b"new checkpoint")
    os.replace(new, wb_mount.path("latest.pt"))
    assert wb_mount.path("latest.pt").read_bytes() == b"new checkpoint"
    assert sorted(os.listdir(wb_mount.mountpoint)) == ["latest.pt", "step-100"]
    assert sorted(os.listdir(wb_mount.path("step-100"))) == ["model.pt", "optim.pt"]
    assert sync(wb_mount).returncode == 0
    assert keys_of(s3_client, fresh_bucket) == {"ckpt/latest.pt": 14, "ckpt/step-100/model.pt": len(data),
                                                "ckpt/step-100/optim.pt": len(data)}  # no temp name left
    assert body(s3_client, fresh_bucket, "ckpt/latest.pt") == b"new checkpoint"
    assert body(s3_client, fresh_bucket, "ckpt/step-100/optim.pt") == data


def test_unlink_mkdir_rmdir_and_what_the_mount_refuses(wb_mount, s3_client, fresh_bucket):
    s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/old/a.pt", Body=b"a")
    s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/keep.pt", Body=b"k")
    subprocess.run([*EPOCHFS, "refresh", str(wb_mount.mountpoint)], check=True, capture_output=True,
                   env=wb_mount.env)
    m = wb_mount
    with pytest.raises(OSError) as exc:  # an object is replaced (O_TRUNC), never modified in place
        open(m.path("keep.pt"), "r+b")
    assert exc.value.errno == errno.EOPNOTSUPP
    with pytest.raises(OSError) as exc:  # renaming an object already in the backend: mv copies instead
        os.rename(m.path("keep.pt"), m.path("moved.pt"))
    assert exc.value.errno == errno.EXDEV
    with pytest.raises(OSError) as exc:
        os.rmdir(m.path("old"))
    assert exc.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as exc:
        os.mkdir(m.path("old"))
    assert exc.value.errno == errno.EEXIST
    for attempt, expected in ((lambda: os.link(m.path("keep.pt"), m.path("hard.pt")), errno.EPERM),
                              (lambda: os.symlink("keep.pt", m.path("sym.pt")), errno.EPERM),
                              (lambda: os.mkfifo(m.path("fifo")), errno.EPERM)):
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == expected
    os.unlink(m.path("old/a.pt"))
    os.rmdir(m.path("old"))
    os.mkdir(m.path("new"))
    os.mkdir(m.path("new/deeper"))
    os.rmdir(m.path("new/deeper"))
    assert sorted(os.listdir(m.mountpoint)) == ["keep.pt", "new"]
    assert sync(m).returncode == 0
    assert keys_of(s3_client, fresh_bucket) == {"ckpt/keep.pt": 1}
    assert sorted(os.listdir(m.mountpoint)) == ["keep.pt", "new"]


def test_kill_9_after_close_loses_nothing_closed_and_uploads_nothing_half_written(
        s3_client, fresh_bucket, mount_factory, tmp_path):
    source = f"s3://{fresh_bucket}/ckpt"
    slow = mount_factory(source, "--writeback", "--upload-bandwidth", "512K", name="mnt")
    slow.start()
    closed = {f"c{i}.pt": random.Random(i).randbytes(3 * MiB + i) for i in range(2)}
    for name, data in closed.items():
        slow.path(name).write_bytes(data)
    writer = open(slow.path("half.pt"), "wb")  # still open when the daemon dies
    writer.write(b"x" * 100_000)
    writer.flush()
    time.sleep(2.0)  # past the settle time: the uploads are running, throttled
    assert slow.status()["writeback"]["uploading"] >= 1
    os.kill(daemon_pid(slow), signal.SIGKILL)
    time.sleep(0.5)
    subprocess.run(["fusermount3", "-uz", str(slow.mountpoint)], capture_output=True)
    assert len(keys_of(s3_client, fresh_bucket)) < len(closed)  # killed before the uploads finished
    again = mount_factory(source, "--writeback", name="mnt")
    again.start()
    assert sync(again).returncode == 0
    assert keys_of(s3_client, fresh_bucket) == {f"ckpt/{k}": len(v) for k, v in closed.items()}
    for name, data in closed.items():
        assert body(s3_client, fresh_bucket, f"ckpt/{name}") == data
        assert again.path(name).read_bytes() == data
    assert not again.path("half.pt").exists()
    assert "dropping 'half.pt'" in again.log()
    try:
        writer.close()
    except OSError:
        pass


@pytest.mark.slow  # 21 s; upload retries are also held by the failing-requests test
def test_the_endpoint_stopped_during_uploads_then_restarted(private_s3, mount_factory, tmp_path):
    client = private_s3.client()
    client.create_bucket(Bucket="ckpts")
    proxy = FaultProxy(private_s3.port).start()
    try:
        m = mount_factory("s3://ckpts/run", "--writeback", "--endpoint-url", proxy.endpoint,
                          "--backend-attempts", "2")
        m.start()
        data = random.Random(9).randbytes(5 * MiB)
        private_s3.stop()
        m.path("during.pt").write_bytes(data)  # the write itself needs no backend
        result = sync(m, "--timeout", "4")
        assert result.returncode == 1
        assert "during.pt" in result.stderr and "1 still pending" in result.stderr
        assert m.status()["writeback"]["pending_bytes"] == len(data)
        private_s3.start()
        proxy.upstream_port = private_s3.port
        assert sync(m, timeout=180).returncode == 0
        assert body(private_s3.client(), "ckpts", "run/during.pt") == data
        assert m.status()["writeback"]["upload_errors"] >= 1
    finally:
        proxy.stop()


def test_upload_requests_failing_are_retried_to_a_whole_object(s3, s3_client, fresh_bucket, mount_factory):
    proxy = FaultProxy(s3.port).start()
    try:
        m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--endpoint-url", proxy.endpoint,
                          "--backend-attempts", "2")
        m.start()
        # First every other upload request fails (the client's retries absorb it), then all of them do for
        # a while (the write-back's own backoff), then they heal.
        proxy.set(Fault("error500", every=2, methods=("PUT", "POST"), ranged_only=False))
        files = {f"f{i}.pt": random.Random(i).randbytes(MiB + 17 * i) for i in range(3)}
        for name, data in files.items():
            m.path(name).write_bytes(data)
        assert sync(m, timeout=120).returncode == 0
        proxy.set(Fault("reset", rate=1.0, methods=("PUT", "POST"), ranged_only=False))
        m.path("later.pt").write_bytes(b"later" * 1000)
        timed_out = sync(m, "--timeout", "3")
        assert timed_out.returncode == 1
        # The listing says why the upload waits: the backend's own answer, not only "retrying".
        (line,) = [ln for ln in timed_out.stderr.splitlines() if ln.startswith("  later.pt")]
        assert "retrying (" in line and "Connection was closed" in line, timed_out.stderr
        assert "the last try: " in timed_out.stderr.splitlines()[0], timed_out.stderr
        proxy.set(None)
        assert sync(m, timeout=120).returncode == 0
        files["later.pt"] = b"later" * 1000
        for name, data in files.items():
            assert body(s3_client, fresh_bucket, f"ckpt/{name}") == data
        assert keys_of(s3_client, fresh_bucket) == {f"ckpt/{k}": len(v) for k, v in files.items()}
    finally:
        proxy.stop()


def test_pending_data_filling_the_cache_is_enospc_and_reads_go_on(s3, s3_client, fresh_bucket, mount_factory):
    s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/data.bin", Body=pattern("d", 0, 0, 3 * MiB))
    proxy = FaultProxy(s3.port).start()
    try:
        m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--endpoint-url", proxy.endpoint,
                          "--cache-size", "8M", "--block-size", "1M", "--backend-attempts", "1")
        m.start()
        proxy.set(Fault("error500", rate=1.0, methods=("PUT", "POST"), ranged_only=False))  # nothing drains
        first = random.Random(1).randbytes(5 * MiB)
        m.path("first.pt").write_bytes(first)
        with pytest.raises(OSError) as exc:
            m.path("second.pt").write_bytes(random.Random(2).randbytes(5 * MiB))
        assert exc.value.errno == errno.ENOSPC
        assert read_all(m.path("data.bin")) == pattern("d", 0, 0, 3 * MiB)  # reads go on
        assert m.path("first.pt").read_bytes() == first  # what was written is kept
        proxy.set(None)
        assert sync(m, str(m.path("first.pt")), timeout=120).returncode == 0
        assert body(s3_client, fresh_bucket, "ckpt/first.pt") == first
        m.path("third.pt").write_bytes(b"room again")  # the upload gave the room back
    finally:
        proxy.stop()


def test_sync_says_why_a_file_is_still_pending(wb_mount, s3_client, fresh_bucket):
    """A checkpoint still open for writing cannot be durable: `epochfs sync` with a deadline names it and
    says it uploads once it is closed; closed, the same sync succeeds."""
    writer = open(wb_mount.path("ckpt-open.pt"), "wb")  # noqa: SIM115 - kept open across the sync
    try:
        writer.write(b"x" * 4096)
        writer.flush()
        result = sync(wb_mount, "--timeout", "2")
        assert result.returncode == 1, result.stderr
        assert "ckpt-open.pt" in result.stderr and "open for writing" in result.stderr
        assert "uploads once every process that has it open for writing closes it" in result.stderr, result.stderr
    finally:
        writer.close()
    assert sync(wb_mount, "--timeout", "60").returncode == 0


def test_concurrent_writers(wb_mount, s3_client, fresh_bucket):
    files = {f"rank{r}/shard.pt": random.Random(r).randbytes(MiB + 999 * r) for r in range(6)}
    for name in files:
        os.makedirs(wb_mount.path(name).parent, exist_ok=True)
    errors: list[BaseException] = []

    def write(name: str, data: bytes) -> None:
        try:
            fd = os.open(wb_mount.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for off in range(0, len(data), 77_777):
                    os.pwrite(fd, data[off:off + 77_777], off)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=write, args=item) for item in files.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sync(wb_mount).returncode == 0
    for name, data in files.items():
        assert body(s3_client, fresh_bucket, f"ckpt/{name}") == data


def test_reads_of_other_files_go_on_while_a_large_upload_runs(s3_client, fresh_bucket, mount_factory):
    for i in range(20):
        s3_client.put_object(Bucket=fresh_bucket, Key=f"ckpt/data/{i}.bin", Body=pattern(str(i), 0, 0, 300_000))
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--upload-bandwidth", "4M")
    m.start()
    big = random.Random(4).randbytes(24 * MiB)
    m.path("big.pt").write_bytes(big)
    time.sleep(1.5)
    assert m.status()["writeback"]["uploading"] == 1
    for i in range(20):
        assert read_all(m.path(f"data/{i}.bin"), 65_536) == pattern(str(i), 0, 0, 300_000)
    assert m.status()["writeback"]["pending_bytes"] > 0  # the upload was still running meanwhile
    assert sync(m, timeout=120).returncode == 0
    assert body(s3_client, fresh_bucket, "ckpt/big.pt") == big


def test_status_and_metrics_show_the_backlog(s3, fresh_bucket, mount_factory):
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--upload-bandwidth", "1M")
    m.start()
    m.path("slow.pt").write_bytes(b"s" * (4 * MiB))
    time.sleep(1.2)
    text = subprocess.run([*EPOCHFS, "status", str(m.mountpoint)], capture_output=True, text=True,
                          check=True).stdout
    assert "write-back 1 files (4.0 MiB) not yet in the backend" in text
    import urllib.request

    addr, node = m.status()["metrics_addr"], m.status()["node"]
    labels = f'mountpoint="{m.mountpoint}",node="{node}"'
    metrics = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    assert f'epochfs_writeback_pending_bytes{{{labels}}} 4.194304e+06' in metrics
    assert "epochfs_writeback_uploaded_bytes_total" in metrics
    assert "epochfs_writeback_oldest_pending_seconds" in metrics
    assert sync(m, timeout=120).returncode == 0
    metrics = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    assert f'epochfs_writeback_uploaded_bytes_total{{{labels}}} 4.194304e+06' in metrics
    assert f'epochfs_writeback_pending_bytes{{{labels}}} 0.0' in metrics


def backend_read(m: Mount) -> int:
    cache = m.status()["cache"]
    return cache["demand_bytes"] + cache["prefetch_bytes"]


def test_a_checkpoint_is_restored_on_the_node_that_saved_it_without_the_backend(s3_client, fresh_bucket,
                                                                                 mount_factory):
    """The bytes a node wrote and uploaded become its cached blocks of the uploaded version: reading the
    checkpoint back after the page cache is dropped, and after the daemon restarts (a resumed job), fetches
    (almost) nothing from the backend, and every byte is the uploaded one."""
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--block-size", "1M")
    m.start()
    shards = {f"step-9/rank{r}.distcp": random.Random(r).randbytes(6 * MiB + 1234 * r) for r in range(3)}
    os.mkdir(m.path("step-9"))
    for name, data in shards.items():
        write_scattered(m.path(name), data, seed=len(data))
    assert sync(m).returncode == 0
    total = sum(len(d) for d in shards.values())
    assert keys_of(s3_client, fresh_bucket, "ckpt/step-9/") == {f"ckpt/{n}": len(d) for n, d in shards.items()}
    for name in shards:
        drop_file_pages(m.path(name))
    before = backend_read(m)
    for name, data in shards.items():
        assert read_all(m.path(name), 65_537) == data
    assert backend_read(m) - before <= 0.02 * total
    m.stop()
    m.start()  # the job restarts: a fresh daemon on the same cache
    for name, data in shards.items():
        assert read_all(m.path(name), 1 << 20) == data
    assert backend_read(m) <= 0.02 * total
    assert not os.listdir(m.cache_dir / "writeback" / "data"), "uploaded data files stay behind"


def test_a_checkpoint_larger_than_the_cache_is_restored_byte_exact(s3_client, fresh_bucket, mount_factory):
    """What the cache's bound cannot keep is fetched when read: the restore is whole either way."""
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--block-size", "1M", "--cache-size", "24M")
    m.start()
    data = random.Random(5).randbytes(20 * MiB + 3)
    m.path("big.pt").write_bytes(data)
    assert sync(m).returncode == 0
    m.path("second.pt").write_bytes(data[::-1])
    assert sync(m).returncode == 0
    for name, want in (("big.pt", data), ("second.pt", data[::-1])):
        drop_file_pages(m.path(name))
        assert read_all(m.path(name), 131_071) == want
    assert body(s3_client, fresh_bucket, "ckpt/big.pt") == data


def test_another_node_finds_the_checkpoint_through_the_shared_store(s3_client, fresh_bucket, mount_factory,
                                                                     tmp_path):
    redis_server = LocalRedis(tmp_path / "redis").start()
    try:
        source = f"s3://{fresh_bucket}/ckpt"
        s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/config.json", Body=b"{}")
        writer = mount_factory(source, "--writeback", "--meta", redis_server.url, name="a", cache_dir=tmp_path / "ca")
        reader = mount_factory(source, "--meta", redis_server.url, "--meta-poll", "0.5", name="b",
                               cache_dir=tmp_path / "cb")
        subprocess.run([*EPOCHFS, "import", source, "--meta", redis_server.url, "--endpoint-url",
                        writer.args[writer.args.index("--endpoint-url") + 1]], check=True, capture_output=True,
                       env=writer.env)
        writer.start()
        reader.start()
        data = random.Random(7).randbytes(MiB + 5)
        os.mkdir(writer.path("step-1"))
        writer.path("step-1/model.pt").write_bytes(data)
        assert sync(writer).returncode == 0
        deadline = time.monotonic() + 20
        while not reader.path("step-1/model.pt").exists():
            assert time.monotonic() < deadline, "the other node never saw the checkpoint"
            time.sleep(0.2)
        assert reader.path("step-1/model.pt").read_bytes() == data
        assert sorted(os.listdir(reader.mountpoint)) == ["config.json", "step-1"]
        # A node mounting later (a restarted job) finds it without listing or importing.
        late = mount_factory(source, "--meta", redis_server.url, name="c", cache_dir=tmp_path / "cc")
        late.start()
        assert late.path("step-1/model.pt").read_bytes() == data
    finally:
        redis_server.stop()


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_random_operations_match_a_model(wb_mount, s3_client, fresh_bucket, mount_factory, tmp_path, seed):
    """A seeded run of creates, replacements, renames, deletes and directory changes (some of them on
    files already uploaded), each checked against a dict, then the backend and a fresh mount of the
    published snapshot against the same dict."""
    rng = random.Random(seed)
    m = wb_mount
    files: dict[str, bytes] = {}
    dirs: set[str] = set()
    names = ["a.pt", "b.pt", "c.bin", "d/x.pt", "d/y.pt", "d/e/z.pt", "f/w.pt"]

    def parent_ok(path: str) -> bool:
        parent = path.rpartition("/")[0]
        return not parent or parent in dirs or any(k.startswith(parent + "/") for k in files)

    def visible_dirs() -> set[str]:
        implied = {k.rsplit("/", i)[0] for k in files for i in range(1, k.count("/") + 1)}
        return dirs | implied

    history: list[str] = []
    for step in range(150):
        op = rng.choice(["write", "write", "rename", "unlink", "mkdir", "rmdir", "read", "list", "pause"])
        path = rng.choice(names)
        history.append(f"{step} {op} {path}")
        if op == "write" and parent_ok(path) and path not in visible_dirs():
            data = rng.randbytes(rng.choice([0, 1, 4097, 70_001, MiB + 3]))
            write_scattered(m.path(path), data, seed=step)
            files[path] = data
            history.append(f"  wrote {len(data)}")
        elif op == "rename" and path in files:
            dst = rng.choice(names)
            if dst == path or not parent_ok(dst) or dst in visible_dirs():
                continue
            try:
                os.rename(m.path(path), m.path(dst))
                history.append(f"  renamed to {dst} (replacing: {dst in files})")
            except OSError as exc:  # already uploaded: S3 has no rename, so mv copies
                assert exc.errno == errno.EXDEV, exc
                m.path(dst).write_bytes(m.path(path).read_bytes())
                os.unlink(m.path(path))
                history.append(f"  copied to {dst} (replacing: {dst in files}) and unlinked")
            files[dst] = files.pop(path)
        elif op == "unlink" and path in files:
            os.unlink(m.path(path))
            del files[path]
            history.append("  unlinked")
        elif op in ("mkdir", "rmdir"):
            d = rng.choice(["d", "d/e", "f", "g"])
            if op == "mkdir" and d not in visible_dirs() and d not in files and parent_ok(d):
                os.mkdir(m.path(d))
                dirs.add(d)
                history.append(f"  mkdir {d}")
            elif op == "rmdir" and d in visible_dirs():
                empty = not any(k.startswith(d + "/") for k in files) and not any(
                    x.startswith(d + "/") for x in dirs)
                try:
                    os.rmdir(m.path(d))
                    assert empty, (d, history[-30:])
                    dirs.discard(d)
                    history.append(f"  rmdir {d}")
                except OSError as exc:
                    assert not empty and exc.errno == errno.ENOTEMPTY, (d, exc)
        elif op == "read" and path in files:
            assert read_all(m.path(path), 65_537) == files[path], path
        elif op == "list":
            seen = {str(p.relative_to(m.mountpoint)) for p in m.mountpoint.rglob("*") if p.is_file()}
            assert seen == set(files), history[-30:]
        elif op == "pause":
            time.sleep(1.2)  # uploads start: later renames and deletes meet uploaded objects
    assert sync(m, timeout=180).returncode == 0
    assert keys_of(s3_client, fresh_bucket) == {f"ckpt/{k}": len(v) for k, v in files.items()}
    for key, data in files.items():
        assert body(s3_client, fresh_bucket, f"ckpt/{key}") == data, key
    fresh = mount_factory(f"s3://{fresh_bucket}/ckpt", name="fresh", cache_dir=tmp_path / "fresh-cache")
    fresh.start()
    for key, data in files.items():
        assert read_all(fresh.path(key), 70_001) == data, key


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_sync_against_an_unreachable_store_waits_names_it_and_publishes_when_it_returns(s3_client, fresh_bucket,
                                                                                         mount_factory, tmp_path):
    """The shared store goes away under ``sync``: the publisher backs off instead of being asked again
    at the client's pace (no hot loop: a few log lines, little CPU), ``sync --timeout`` ends with an
    error naming the store, and once it is back the upload is published (a fresh node finds it)."""
    redis_server = LocalRedis(tmp_path / "redis").start()
    try:
        source = f"s3://{fresh_bucket}/ckpt"
        s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/config.json", Body=b"{}")
        m = mount_factory(source, "--writeback", "--meta", redis_server.url, name="a", cache_dir=tmp_path / "ca")
        subprocess.run([*EPOCHFS, "import", source, "--meta", redis_server.url, "--endpoint-url",
                        m.args[m.args.index("--endpoint-url") + 1]], check=True, capture_output=True, env=m.env)
        m.start()
        data = random.Random(3).randbytes(MiB + 11)
        redis_server.client().save()  # (kept on disk: the store comes back with what it held)
        redis_server.stop()
        m.path("during.pt").write_bytes(data)
        pid = daemon_pid(m)
        cpu, started = _cpu_seconds(pid), time.monotonic()
        r = sync(m, "--timeout", "8", timeout=60)
        took, used = time.monotonic() - started, _cpu_seconds(pid) - cpu
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"metadata store redis://127.0.0.1:{redis_server.port}" in r.stderr, r.stderr
        assert took < 30, took  # (its timeout, and a round of the daemon's)
        assert used < 0.4 * took, (used, took)  # waiting, not asking the store in a loop
        assert m.log().count("could not publish") <= 2, m.log()[-3000:]
        redis_server.start()
        assert sync(m, "--timeout", "90", timeout=150).returncode == 0
        assert "the metadata store answers again" in m.log()
        late = mount_factory(source, "--meta", redis_server.url, name="late", cache_dir=tmp_path / "cl")
        late.start()
        assert late.path("during.pt").read_bytes() == data
    finally:
        redis_server.stop()
