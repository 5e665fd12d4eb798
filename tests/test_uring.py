"""FUSE over io_uring (``--io-uring``), mounted for real: the kernel's requests come through the ring's
entries (the status counts them) and every byte is right (odd sizes at seeded random offsets, small
files read whole, a listing, a file written where the mount is writable); without the kernel's leave
(``enable_uring`` off) the mount serves through ``/dev/fuse`` and says why; an unmount ends the ring's
loop. The kernel's switch is global: the tests set it for their mount and put it back."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from epochfs.dev.sample import SampleFile, upload
from epochfs.kernel import uring

from .conftest import requires_fuse
from .helpers import EPOCHFS

pytestmark = [requires_fuse, pytest.mark.mounts]

MIB = 1 << 20
FILES = [SampleFile(f"ds/large-{i}.bin", 5 * MIB + 4097 * (i + 3), version=i) for i in range(2)] + [
    SampleFile(f"ds/small/{i:03d}.bin", 1000 + 37 * i) for i in range(40)]

needs_uring = pytest.mark.skipif(
    not os.path.exists(uring.ENABLE) or os.geteuid() != 0,
    reason="FUSE over io_uring: a kernel built with it (6.14+), and root to let servers use it")


@contextlib.contextmanager
def kernel_switch(on: bool) -> Iterator[None]:
    before = open(uring.ENABLE).read().strip()
    with open(uring.ENABLE, "w") as f:
        f.write("Y" if on else "N")
    try:
        yield
    finally:
        with open(uring.ENABLE, "w") as f:
            f.write(before)


@pytest.fixture
def dataset(s3_client, fresh_bucket):
    upload(s3_client, fresh_bucket, "", FILES)
    return f"s3://{fresh_bucket}/ds"


def read_odd(path: Path, f: SampleFile, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "rb", buffering=0) as fh:
        for _ in range(30):
            off = rng.randrange(0, f.size)
            size = rng.choice([1, 4095, 4097, 65537, MIB, 3 * MIB + 7])
            fh.seek(off)
            assert fh.read(size) == f.content(off, min(size, f.size - off)), (f.key, off, size)
    assert path.read_bytes() == f.content()


@needs_uring
def test_requests_come_through_the_ring_and_every_byte_is_right(dataset, mount_factory):
    with kernel_switch(True):
        m = mount_factory(dataset, "--io-uring", "--cache-size", "64M")
        m.start()
        for i, f in enumerate(FILES[:2]):
            read_odd(m.mountpoint / f.key.removeprefix("ds/"), f, seed=i)
        assert sorted(os.listdir(m.mountpoint / "small")) == sorted(Path(f.key).name for f in FILES[2:])
        for f in FILES[2:]:
            assert (m.mountpoint / f.key.removeprefix("ds/")).read_bytes() == f.content()
        status = m.status()
        taken = status["io_uring_requests"]
        text = subprocess.run([*EPOCHFS, "status", str(m.mountpoint)], capture_output=True, text=True, timeout=60)
        assert "requests through the ring (--io-uring)" in text.stdout, text.stdout
        assert taken is not None and taken > 50, taken  # (lookups, reads, the listing: not through /dev/fuse)
        plain = mount_factory(dataset, "--cache-size", "64M", name="plain", cache_dir=m.cache_dir.parent / "plain-cache")
        plain.start()
        from epochfs.kernel.session import PAGE, request_pages
        ring = uring.memory_needed(request_pages() * PAGE)  # (set aside by --memory-limit before its split)
        assert status["memory"]["baseline"] - plain.status()["memory"]["baseline"] > 0.75 * ring
        plain.stop()
        m.stop()
        assert not os.path.ismount(m.mountpoint)
        assert "requests through io_uring: 2 queues" in m.log() or "requests through io_uring" in m.log()


@needs_uring
def test_writes_go_through_the_ring_too(s3_client, fresh_bucket, mount_factory):
    with kernel_switch(True):
        m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--io-uring", "--writeback")
        m.start()
        data = random.Random(7).randbytes(3 * MIB + 11)
        (m.mountpoint / "w.bin").write_bytes(data)
        assert (m.mountpoint / "w.bin").read_bytes() == data
        assert m.status()["io_uring_requests"] > 0
        subprocess.run([*EPOCHFS, "sync", str(m.mountpoint)], check=True, capture_output=True, timeout=120)
        m.stop()
    assert s3_client.get_object(Bucket=fresh_bucket, Key="ckpt/w.bin")["Body"].read() == data


@needs_uring
def test_without_the_kernels_leave_the_mount_serves_through_dev_fuse_and_says_why(dataset, mount_factory):
    with kernel_switch(False):
        m = mount_factory(dataset, "--io-uring")
        m.start()
        f = FILES[0]
        read_odd(m.mountpoint / f.key.removeprefix("ds/"), f, seed=3)
        assert m.status()["io_uring_requests"] is None
        m.stop()
    assert "does not offer FUSE over io_uring" in m.log()


def test_the_queue_count_is_the_kernels_possible_cpus(tmp_path):
    p = tmp_path / "possible"
    for text, n in (("0-1\n", 2), ("0\n", 1), ("0-3,8-11\n", 12), ("0,2\n", 3)):
        p.write_text(text)
        assert uring.possible_cpus(str(p)) == n
    assert uring.possible_cpus(str(tmp_path / "absent")) == (os.cpu_count() or 1)


def test_a_ring_entry_of_any_bytes_is_handed_over_whole_or_answered_eio_and_never_raises():
    """A fuzz loop over what the kernel leaves in an entry's buffers: lengths and payload sizes of any
    value. The request handed on is exactly the in-header, the operation's header and the payload (as
    ``/dev/fuse`` gives it); one whose sizes do not add up is answered EIO; every entry is committed."""
    import struct as st

    handed: list[bytes] = []
    with open(os.devnull, "rb") as null:
        ch = uring.Channel(null.fileno(), 64 << 10, lambda view: (handed.append(bytes(view)),
                                                                  ch.answer([uring.OUT_HEADER.pack(16, 0, st.unpack_from("<Q", view, 8)[0])])),
                           depth=2, queues=2)
        try:
            rng = random.Random(11)
            for i in range(3000):
                e = ch.entries[i % len(ch.entries)]
                head = bytearray(rng.randbytes(uring.HEADERS_SIZE))
                op_len = rng.choice([0, 16, 40, 128, 129, rng.randrange(0, 1 << 16)])
                payload = rng.choice([0, 1, 4096, 64 << 10, (64 << 10) + 1, rng.randrange(0, 1 << 32)])
                length = rng.choice([40 + op_len + payload, rng.randrange(0, 1 << 32)]) & 0xFFFFFFFF
                st.pack_into("<I", head, 0, length)
                st.pack_into("<Q", head, 8, i + 1)  # unique
                uring.ENT_IN_OUT.pack_into(head, uring.HEADER_IN_OUT + uring.HEADER_OP, 0, i + 1, payload & 0xFFFFFFFF, 0)
                e.headers[:uring.HEADERS_SIZE] = bytes(head)
                before = len(handed)
                ch._request(e)
                assert not ch.owns(i + 1)  # answered either way: the entry goes back to the kernel
                ok = 0 <= length - 40 - payload <= 128 and payload <= 64 << 10
                if ok:
                    got = handed[-1]
                    assert len(handed) == before + 1 and len(got) == length
                    assert got[:40] == bytes(head[:40])
                    assert got[40:length - payload] == bytes(head[128:128 + length - 40 - payload])
                    assert got[length - payload:] == e.payload[:payload]
                else:
                    assert len(handed) == before
                    assert st.unpack_from("<i", e.headers, 4)[0] == -5  # EIO in the out header
                ch.ring.completions()  # (the commits' answers from a device that is not FUSE's)
        finally:
            ch.close()


def test_a_handler_that_raises_still_gets_its_request_answered_eio():
    """The last guard: whatever ``handle`` does, the entry's request is answered (EIO) and committed:
    a request left unanswered would hold its caller for ever."""
    import struct as st

    def boom(view: memoryview) -> None:
        raise RuntimeError("a bug")

    with open(os.devnull, "rb") as null:
        ch = uring.Channel(null.fileno(), 64 << 10, boom, depth=1, queues=1)
        try:
            e = ch.entries[0]
            head = bytearray(uring.HEADERS_SIZE)
            st.pack_into("<IIQ", head, 0, 40, 3, 77)  # a GETATTR of 40 bytes, unique 77
            uring.ENT_IN_OUT.pack_into(head, uring.HEADER_IN_OUT + uring.HEADER_OP, 0, 77, 0, 0)
            e.headers[:uring.HEADERS_SIZE] = bytes(head)
            ch.ring.completions = lambda: [(0, 0)]  # type: ignore[method-assign]  # (the kernel's: a request)
            assert ch._take()
            assert not ch.owns(77)
            assert st.unpack_from("<IiQ", e.headers, 0) == (16, -5, 77)
            assert e.last == uring.CMD_COMMIT_AND_FETCH and e.commit_id == 77
        finally:
            ch.close()


def test_the_rings_buffers_are_set_aside_from_the_memory_limit(tmp_path):
    """A page of headers and a payload buffer per entry, 8 entries per queue: what ``--memory-limit``
    counts as held before it splits the rest (16 MiB and 32 KiB here at 1 MiB requests on 2 CPUs)."""
    from epochfs.core import memory

    assert uring.memory_needed(1 << 20, queues=2) == 2 * 8 * (4096 + (1 << 20))
    plain = memory.split(256 << 20, 80 << 20, 4 << 20, 16)
    ringed = memory.split(256 << 20, (80 << 20) + uring.memory_needed(1 << 20, queues=2), 4 << 20, 16)
    assert ringed.ahead + ringed.recent + ringed.whole + ringed.pool < plain.ahead + plain.recent + plain.whole + plain.pool


def test_an_answer_of_the_wrong_kind_keeps_its_entry_so_eio_can_answer_it():
    """A handler's answer that cannot be copied (not bytes) leaves the request owned by the channel, so
    the session's fallback answers it EIO through the same entry: never a request left unanswered."""
    import struct as st

    with open(os.devnull, "rb") as null:
        ch = uring.Channel(null.fileno(), 64 << 10, lambda view: None, depth=1, queues=1)
        try:
            e = ch.entries[0]
            head = bytearray(uring.HEADERS_SIZE)
            st.pack_into("<IIQ", head, 0, 40, 3, 91)
            uring.ENT_IN_OUT.pack_into(head, uring.HEADER_IN_OUT + uring.HEADER_OP, 0, 91, 0, 0)
            e.headers[:uring.HEADERS_SIZE] = bytes(head)
            ch._request(e)
            assert ch.owns(91)
            with pytest.raises(TypeError):
                ch.answer([uring.OUT_HEADER.pack(16 + 8, 0, 91), 12345])  # type: ignore[list-item]
            assert ch.owns(91)
            ch.answer([uring.OUT_HEADER.pack(16, -5, 91)])
            assert not ch.owns(91) and st.unpack_from("<IiQ", e.headers, 0) == (16, -5, 91)
        finally:
            ch.close()
