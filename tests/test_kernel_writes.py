"""Files the kernel writes itself (write-back mounts, passthrough by default), mounted for real against the
local S3 endpoint: a file made here is written and read by the kernel through its data file with no
request per write, and still arrives byte for byte (odd write sizes, seeded random overwrites, a size
seen while it grows); kill -9 keeps what was closed and drops what was not; a disk that fills under the
kernel's writes is ENOSPC to the writer and the file is never uploaded as it is; where the cache has no
room to lend, or with --no-passthrough, files are written through the daemon, which says so; a file
uploaded while the kernel still reads it opens right; a cached object, and a checkpoint once uploaded and
kept, are read by the kernel from the store (the restore on the node that saved it fetches nothing)."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import time

import pytest

from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import EPOCHFS
from .test_passthrough import needs_passthrough, read_until_whole
from .test_writeback import backend_read, body, daemon_pid, keys_of, sync

pytestmark = [requires_fuse, needs_passthrough]

MiB = 1 << 20


def writeback(status: dict) -> dict:
    return status["writeback"]


def test_a_file_made_here_is_written_by_the_kernel_and_arrives_byte_exact(s3_client, fresh_bucket, mount_factory):
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback")
    m.start()
    rng = random.Random(7)
    size = 20 * MiB + 4097
    model = bytearray(size)
    fd = os.open(m.path("model.pt"), os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        at = 0
        while at < size:  # odd write sizes, in order
            n = min(rng.choice([1, 4095, 65537, MiB + 3, 3 * MiB]), size - at)
            chunk = rng.randbytes(n)
            assert os.write(fd, chunk) == n
            model[at:at + n] = chunk
            at += n
        for _ in range(50):  # seeded random overwrites
            off, n = rng.randrange(size), rng.choice([1, 511, 4096, 70_001])
            chunk = rng.randbytes(min(n, size - off))
            os.pwrite(fd, chunk, off)
            model[off:off + len(chunk)] = chunk
        assert os.stat(m.path("model.pt")).st_size == size  # (its size while it is open: the data file's)
        open_now = writeback(m.status())
        assert open_now["kernel_opens"] == 1 and open_now["kernel_bytes"] == size, open_now  # seen, not sent
        with open(m.path("model.pt"), "rb") as reader:  # read while it is still open for writing
            assert reader.read() == model
        os.fsync(fd)
    finally:
        os.close(fd)
    assert m.path("model.pt").read_bytes() == model
    assert sync(m).returncode == 0
    assert body(s3_client, fresh_bucket, "ckpt/model.pt") == model
    w = writeback(m.status())
    assert w["kernel_writes"] and w["kernel_opens"] >= 2 and w["kernel_bytes"] >= size, w
    assert "the kernel writes files itself" in subprocess.run(
        [*EPOCHFS, "status", str(m.mountpoint)], capture_output=True, text=True, env=m.env).stdout


def test_kill_9_keeps_what_the_kernel_wrote_and_closed_and_drops_what_was_open(s3_client, fresh_bucket,
                                                                              mount_factory):
    source = f"s3://{fresh_bucket}/ckpt"
    proxy_free = mount_factory(source, "--writeback", "--upload-bandwidth", "1")  # (nothing uploads before the kill)
    proxy_free.start()
    closed = random.Random(1).randbytes(9 * MiB + 1)
    proxy_free.path("closed.pt").write_bytes(closed)
    half = os.open(proxy_free.path("half.pt"), os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(half, b"h" * (3 * MiB))
    time.sleep(0.2)
    assert writeback(proxy_free.status())["kernel_opens"] >= 2
    os.kill(daemon_pid(proxy_free), signal.SIGKILL)
    time.sleep(0.5)
    subprocess.run(["fusermount3", "-uz", str(proxy_free.mountpoint)], capture_output=True)
    try:
        os.close(half)
    except OSError:
        pass
    again = mount_factory(source, "--writeback", name="again")
    again.start()
    assert sync(again).returncode == 0
    assert keys_of(s3_client, fresh_bucket) == {"ckpt/closed.pt": len(closed)}
    assert body(s3_client, fresh_bucket, "ckpt/closed.pt") == closed
    assert "dropping 'half.pt'" in again.log()


def test_a_disk_filling_under_the_kernel_is_enospc_and_the_file_is_never_uploaded(s3_client, fresh_bucket,
                                                                                 mount_factory, tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160M", "tmpfs", str(disk)], check=True)
    try:
        m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--cache-size", "1G", "--free-space-ratio", "0",
                          cache_dir=disk / "cache")
        m.start()
        chunk = b"b" * (4 * MiB)
        with pytest.raises(OSError) as exc:
            with open(m.path("big.pt"), "wb") as f:
                for _ in range(100):  # 400 MiB on a 160 MiB disk: leases renewed, then no room
                    f.write(chunk)
        assert exc.value.errno == errno.ENOSPC, (exc.value, m.log()[-3000:])
        size = os.stat(m.path("big.pt")).st_size
        assert 64 * MiB < size < 160 * MiB
        assert m.path("big.pt").read_bytes() == b"b" * size  # its size is its data
        assert writeback(m.status())["kernel_opens"] >= 1
        result = sync(m, "--timeout", "20")
        assert result.returncode == 1 and "big.pt" in result.stderr and "not uploaded" in result.stderr, result
        assert keys_of(s3_client, fresh_bucket) == {}
        os.unlink(m.path("big.pt"))
        m.path("small.pt").write_bytes(b"fits")  # the room is back
        assert sync(m).returncode == 0
        assert keys_of(s3_client, fresh_bucket) == {"ckpt/small.pt": 4}
        m.stop()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.parametrize("why", ["no room to lend", "--no-passthrough"])
def test_files_are_written_through_the_daemon_where_the_kernel_may_not(s3_client, fresh_bucket, mount_factory, why):
    args = ("--cache-size", "16M") if why == "no room to lend" else ("--no-passthrough",)
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", *args)
    m.start()
    data = random.Random(2).randbytes(5 * MiB + 3)
    m.path("through.pt").write_bytes(data)
    w = writeback(m.status())
    assert w["kernel_opens"] == 0 and w["kernel_bytes"] == 0, w
    assert w["kernel_writes"] == (why == "no room to lend"), w
    assert m.path("through.pt").read_bytes() == data  # (closed, it is read by the kernel where it may)
    assert sync(m).returncode == 0
    assert body(s3_client, fresh_bucket, "ckpt/through.pt") == data
    assert writeback(m.status())["kernel_bytes"] == 0


def test_a_file_uploaded_while_the_kernel_reads_it_opens_right(s3_client, fresh_bucket, mount_factory):
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback")
    m.start()
    data = random.Random(4).randbytes(6 * MiB + 5)
    m.path("held.pt").write_bytes(data)
    with open(m.path("held.pt"), "rb") as held:  # the kernel reads its data file
        assert sync(m).returncode == 0  # uploaded meanwhile: now an object of the backend
        assert body(s3_client, fresh_bucket, "ckpt/held.pt") == data
        with open(m.path("held.pt"), "rb") as again:  # (the same inode: must not mix the kernel's two ways)
            assert again.read() == data
        assert held.read() == data
    assert m.path("held.pt").read_bytes() == data


def test_a_writeback_mount_has_the_kernel_read_cached_objects_and_a_kept_checkpoint(s3_client, fresh_bucket,
                                                                                  mount_factory):
    dataset = [SampleFile("base.pt", 9 * MiB + 77)]
    upload(s3_client, fresh_bucket, "ckpt/", dataset)
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback")
    m.start()
    read_until_whole(m, dataset)
    opens = m.status()["passthrough"]["opens"]
    assert m.path("base.pt").read_bytes() == dataset[0].content()
    assert m.status()["passthrough"]["opens"] == opens + 1  # read by the kernel from the store
    saved = random.Random(5).randbytes(12 * MiB + 1)
    m.path("step-10.pt").write_bytes(saved)
    assert sync(m).returncode == 0
    data_dir = m.cache_dir / "writeback" / "data"
    deadline = time.monotonic() + 30
    while any(data_dir.iterdir()):  # kept: the data file became the object's file in the store
        assert time.monotonic() < deadline, list(data_dir.iterdir())
        time.sleep(0.1)
    on_disk = sum(p.stat().st_blocks * 512 for p in (m.cache_dir / "blocks").rglob("*") if p.is_file())
    assert on_disk <= len(saved) + dataset[0].size + 4 * MiB, on_disk  # (no room lent to it is left taken)
    before, opens = backend_read(m), m.status()["passthrough"]["opens"]
    assert m.path("step-10.pt").read_bytes() == saved
    assert backend_read(m) == before  # the restore here fetched nothing
    assert m.status()["passthrough"]["opens"] == opens + 1, m.status()["passthrough"]


@pytest.mark.parametrize("flags", [(), ("--no-passthrough",)], ids=["kernel", "daemon"])
def test_a_file_changed_through_a_shared_mapping_arrives_with_the_change(s3_client, fresh_bucket, mount_factory,
                                                                         flags):
    import mmap

    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", *flags)
    m.start()
    rng = random.Random(9)
    model = bytearray(rng.randbytes(4 * MiB + 123))
    fd = os.open(m.path("mapped.pt"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, model)
        with mmap.mmap(fd, len(model)) as view:  # (shared, writable)
            for off in (0, 4095, 4096, MiB + 1, len(model) - 1):
                view[off] = model[off] = model[off] ^ 0xFF
            view.flush()
    finally:
        os.close(fd)
    assert m.path("mapped.pt").read_bytes() == model
    assert sync(m).returncode == 0
    assert body(s3_client, fresh_bucket, "ckpt/mapped.pt") == model


def test_the_last_checkpoints_upload_gives_way_while_the_next_is_written(s3_client, fresh_bucket, mount_factory):
    """A checkpoint closed just before the next one is written fast (through the kernel, at 100 MiB/s)
    waits to upload while the writing goes on, then uploads whole; the pause is counted in status."""
    m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback")
    m.start()
    first = random.Random(1).randbytes(64 * MiB)
    m.path("first.pt").write_bytes(first)  # (its upload starts a second after its close)
    chunk = random.Random(2).randbytes(8 * MiB)
    with open(m.path("second.pt"), "wb", buffering=0) as f:
        start = time.monotonic()
        while time.monotonic() - start < 3.0:
            f.write(chunk)
            time.sleep(0.08)
    w = writeback(m.status())
    assert w["kernel_opens"] >= 2 and w["gave_way"] >= 1 and w["gave_way_seconds"] >= 0.5, w
    assert "uploads gave way to a fast writer" in subprocess.run(
        [*EPOCHFS, "status", str(m.mountpoint)], capture_output=True, text=True, env=m.env).stdout
    assert sync(m).returncode == 0
    assert body(s3_client, fresh_bucket, "ckpt/first.pt") == first
