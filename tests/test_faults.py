"""Backend faults injected between a real mount and the real endpoint: correct bytes within the retry
budget, EIO past it within a bounded time, nothing partial cached, recovery once the proxy heals."""

from __future__ import annotations

import errno
import os
import time

import pytest

from epochfs.dev.sample import pattern

from .conftest import requires_fuse
from .faultproxy import Fault, FaultProxy
from .helpers import drop_all_caches, run_with_deadline, wait_idle

pytestmark = requires_fuse

MiB = 1 << 20
KEY, SIZE = "obj.bin", 5 * MiB + 12345


@pytest.fixture
def proxy(s3):
    p = FaultProxy(s3.port).start()
    yield p
    p.stop()


def _mount_through(proxy, s3_client, bucket, mount_factory, timeout: int, block: str = "1M"):
    """A mount through the proxy. ``block``: 1M blocks are received by the stream engine
    (epochfs.transport.httpio), blocks under its minimum by libcurl (see epochfs.backend.s3)."""
    s3_client.put_object(Bucket=bucket, Key=KEY, Body=pattern(KEY, 0, 0, SIZE))
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, "--block-size", block,
                      "--readahead", "0", "--backend-timeout", str(timeout), "--backend-attempts", "4")
    m.start()
    return m


#: The two engines of block GETs, as block sizes (parametrize a mount fixture with indirect=True).
ENGINES = [pytest.param("1M", id="stream"), pytest.param("512K", id="curl")]


@pytest.fixture
def faulty_mount(request, s3_client, fresh_bucket, mount_factory, proxy):
    m = _mount_through(proxy, s3_client, fresh_bucket, mount_factory, 8, getattr(request, "param", "1M"))
    yield m
    m.stop()


@pytest.fixture
def short_deadline_mount(request, s3_client, fresh_bucket, mount_factory, proxy):
    """The same with a 4 s deadline, for the tests that wait for it to pass."""
    m = _mount_through(proxy, s3_client, fresh_bucket, mount_factory, 4, getattr(request, "param", "1M"))
    yield m
    m.stop()


def read_checked(m, deadline: float = 45.0) -> None:
    """Read the whole object in 70,000-byte reads, each within the deadline and each verified."""
    with open(m.path(KEY), "rb", buffering=0) as fh:
        for off in range(0, SIZE, 70_000):
            data = run_with_deadline(lambda off=off: os.pread(fh.fileno(), 70_000, off), deadline)
            assert data == pattern(KEY, 0, off, min(70_000, SIZE - off)), f"wrong bytes at {off}"


@pytest.mark.parametrize("kind", ["error500", "slowdown", "throttle429", "reset", "truncate", "wrong_range",
                                  "full_200"])
@pytest.mark.page_cache
def test_every_other_request_failing_is_retried_to_correct_bytes(faulty_mount, proxy, kind):
    proxy.set(Fault(kind, every=2, retry_after=0.2))
    read_checked(faulty_mount)
    assert proxy.injected >= 3
    status = wait_idle(faulty_mount)
    assert status["store"]["corrupt_blocks"] == 0
    proxy.set(None)
    drop_all_caches()
    read_checked(faulty_mount)  # what was cached is right


@pytest.mark.parametrize("kind", ["error500", "truncate", "wrong_range",
                                  pytest.param("stall_body", marks=pytest.mark.slow)])
def test_persistent_failure_is_eio_within_the_deadline_and_heals(faulty_mount, proxy, kind):
    proxy.set(Fault(kind, rate=1.0, stall=3.0))
    with open(faulty_mount.path(KEY), "rb", buffering=0) as fh:
        with pytest.raises(OSError) as info:
            run_with_deadline(lambda: os.pread(fh.fileno(), 1000, 2 * MiB), 40)
        assert info.value.errno == errno.EIO
    status = wait_idle(faulty_mount)
    assert status["store"]["blocks"] == 0, "a failed fetch left something in the cache"
    proxy.set(None)
    read_checked(faulty_mount)


def test_stall_before_headers_times_out_to_eio(short_deadline_mount, proxy):
    proxy.set(Fault("stall_headers", rate=1.0, stall=20.0))
    with open(short_deadline_mount.path(KEY), "rb", buffering=0) as fh:
        with pytest.raises(OSError) as info:
            run_with_deadline(lambda: os.pread(fh.fileno(), 10, 0), 15)  # timeout 4 s (+2 s guard)
        assert info.value.errno == errno.EIO
    proxy.set(None)
    read_checked(short_deadline_mount)


def test_access_denied_is_eacces_at_once_not_retried(faulty_mount, proxy):
    proxy.set(Fault("denied403", rate=1.0))
    with open(faulty_mount.path(KEY), "rb", buffering=0) as fh:
        with pytest.raises(OSError) as info:
            run_with_deadline(lambda: os.pread(fh.fileno(), 10, 0), 5)
        assert info.value.errno == errno.EACCES
    denied_reads = faulty_mount.status()["errors"]["EACCES"]  # the kernel may retry a failed page once
    assert proxy.injected == denied_reads, "a denied request was retried"
    proxy.set(None)
    read_checked(faulty_mount)


def test_retry_after_is_honoured(faulty_mount, proxy):
    proxy.set(Fault("slowdown", at={1}, retry_after=1.5))
    with open(faulty_mount.path(KEY), "rb", buffering=0) as fh:
        assert os.pread(fh.fileno(), 100, 0) == pattern(KEY, 0, 0, 100)
    injected = proxy.events("slowdown")
    assert len(injected) == 1
    following = [t for t, method, _p, what in proxy.log if method == "GET" and t > injected[0]]
    assert following and following[0] - injected[0] >= 1.4


@pytest.mark.parametrize("faulty_mount", ENGINES, indirect=True)
@pytest.mark.page_cache
def test_ten_percent_faults_of_every_kind_never_give_wrong_bytes(faulty_mount, proxy):
    for seed, kind in enumerate(["error500", "reset", "truncate", "wrong_range", "full_200", "slowdown"]):
        proxy.set(Fault(kind, rate=0.1, seed=seed, retry_after=0.1))
        drop_all_caches()
        read_checked(faulty_mount)


@pytest.mark.parametrize("short_deadline_mount", ENGINES, indirect=True)
@pytest.mark.parametrize("kind", ["drip_body", pytest.param("drip_headers", marks=pytest.mark.slow)])
def test_a_dripping_endpoint_is_eio_within_the_deadline_and_unmount_does_not_wait(short_deadline_mount, proxy,
                                                                                 kind):
    """--backend-timeout bounds the whole request: one byte every 1.5 s never resets it."""
    m = short_deadline_mount
    proxy.set(Fault(kind, rate=1.0, stall=1.5))
    with open(m.path(KEY), "rb", buffering=0) as fh:
        with pytest.raises(OSError) as info:
            run_with_deadline(lambda: os.pread(fh.fileno(), 1000, 3 * MiB), 15)  # timeout 4 s (+2 s guard)
        assert info.value.errno == errno.EIO
    assert proxy.injected >= 1
    proxy.set(None)
    read_checked(m)  # the link heals: correct bytes
    started = time.monotonic()
    m.stop()
    elapsed = time.monotonic() - started
    assert elapsed < 15, f"unmount waited {elapsed:.0f}s for a dripping request"


def test_a_buffered_read_of_a_small_file_waits_for_one_deadline_not_one_per_kernel_retry(
        s3_client, fresh_bucket, mount_factory, proxy):
    """A buffered read (Python's open().read(), the way most code reads) of a file under a block, behind a
    dripping endpoint: the kernel reads ahead, then asks again at once for the pages the failed
    readahead left. That second fetch (errors are never cached: it asks the endpoint again) has a
    short deadline of its own, so the read ends within --backend-timeout and that budget (8 + 2.5 s
    here), not two full deadlines (16 s, measured before); once the endpoint heals, a read succeeds."""
    key, size = "small.bin", 600 * 1024 + 7
    s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 0, 0, size))
    m = mount_factory(f"s3://{fresh_bucket}", "--endpoint-url", proxy.endpoint, "--readahead", "0",
                      "--backend-timeout", "8", "--backend-attempts", "4")
    m.start()
    try:
        for how in ("buffered", "unbuffered"):
            proxy.set(Fault("drip_body", rate=1.0, stall=1.5))

            def read(how=how) -> bytes:
                with open(m.path(key), "rb", **({} if how == "buffered" else {"buffering": 0})) as f:
                    return f.read()

            with pytest.raises(OSError) as info:
                run_with_deadline(read, 13)  # (8 s, then at most 2.5 s for the kernel's retry; 16 s before)
            assert info.value.errno == errno.EIO
            assert proxy.injected <= 2, (how, proxy.injected)  # the fetch, and at most the retry's
            proxy.set(None)
        assert open(m.path(key), "rb").read() == pattern(key, 0, 0, size)  # healed: at once
    finally:
        m.stop()


def test_a_read_spanning_many_blocks_waits_for_one_deadline_not_one_per_block(s3_client, fresh_bucket,
                                                                                 mount_factory, proxy):
    """One bound per read, whatever the blocks behind it (--backend-timeout 8: 10 s), 256 KiB blocks and
    no readahead of the daemon's: a READ of 1 MiB from a link that is slow but works (4 s a block) has
    its four blocks fetched together (4 s, where one after the other took 16 s); a buffered read of a
    3 MiB file from an endpoint that drips past the deadline fails within the bound and the kernel
    retry's budget (10 + 2.5 s; 25 s was measured); healed, every byte is right."""
    size = 3 * MiB
    for key in ("spans.bin", "slow.bin"):
        s3_client.put_object(Bucket=fresh_bucket, Key=key, Body=pattern(key, 0, 0, size))
    m = mount_factory(f"s3://{fresh_bucket}", "--endpoint-url", proxy.endpoint, "--block-size", "256K",
                      "--backend-timeout", "8", "--backend-attempts", "4", "--readahead", "0")
    m.start()
    try:
        proxy.set(Fault("slow_body", rate=1.0, stall=4.0))
        started = time.monotonic()
        with open(m.path("slow.bin"), "rb", buffering=0) as f:
            got = run_with_deadline(lambda: os.pread(f.fileno(), MiB, MiB), 45)
        took = time.monotonic() - started
        assert got == pattern("slow.bin", 0, MiB, MiB) and took < 9, took
        for how in ("buffered", "unbuffered"):  # (unbuffered: one READ of 1 MiB, four blocks)
            proxy.set(Fault("drip_body", rate=1.0, stall=1.5))

            def read(how=how) -> bytes:
                if how == "buffered":
                    with open(m.path("spans.bin"), "rb") as f:
                        return f.read()
                with open(m.path("spans.bin"), "rb", buffering=0) as f:
                    return os.pread(f.fileno(), MiB, MiB)

            started = time.monotonic()
            with pytest.raises(OSError) as info:
                run_with_deadline(read, 45)
            assert info.value.errno == errno.EIO
            assert time.monotonic() - started < 15, (how, time.monotonic() - started)
            proxy.set(None)
            time.sleep(2)  # (the failed fetches' short retry window passes)
        assert open(m.path("spans.bin"), "rb").read() == pattern("spans.bin", 0, 0, size)
    finally:
        m.stop()


@pytest.mark.parametrize("kind, code", [("no_etag", errno.EIO), ("other_etag", errno.ESTALE)])
def test_an_answer_without_the_asked_for_etag_is_never_served_or_cached(faulty_mount, proxy, kind, code):
    proxy.set(Fault(kind, rate=1.0))
    with open(faulty_mount.path(KEY), "rb", buffering=0) as fh:
        with pytest.raises(OSError) as info:
            run_with_deadline(lambda: os.pread(fh.fileno(), 1000, MiB), 40)
        assert info.value.errno == code
    status = wait_idle(faulty_mount)
    assert status["store"]["blocks"] == 0, "an unverifiable answer was cached"
    proxy.set(None)
    read_checked(faulty_mount)


def test_a_wrong_region_is_corrected_from_the_answer_not_eio(faulty_mount, proxy):
    """A bucket in another region than --region (or the configured default): S3 answers 301 with the
    bucket's region; the daemon signs for that region from then on and the read succeeds."""
    proxy.set(Fault("region", rate=1.0, region="eu-north-1"))
    read_checked(faulty_mount)
    # only requests already on their way when the first answer came were signed for the wrong region
    assert 1 <= proxy.redirects <= 16 and proxy.matching > proxy.redirects
    assert "bucket " in faulty_mount.log() and "is in region eu-north-1" in faulty_mount.log()
