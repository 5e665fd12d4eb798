"""One capacity for the node's mounts: the split (pure, and a fuzz loop of its promises), the records'
decoding of garbage, and two mounts for real against the local S3 endpoint: a scan of one dataset does
not evict another mount's working set that fits its share, and a mount holding more than its share
gives back down to it when another fills."""

from __future__ import annotations

import random
import time

import pytest

from epochfs.cache.nodeshare import Member, allocate
from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import kill_daemon

MIB = 1 << 20


def member(used: int, size: int = 100, filling: bool = False, weight: int = 1) -> Member:
    return Member(1, 1, b"b" * 16, used, size, weight, filling, 0.0)


def test_a_mount_that_fills_gets_its_share_from_one_that_holds_more():
    parts = allocate({b"a": member(80), b"b": member(0, filling=True)})
    assert parts == {b"a": 50, b"b": 50}


def test_room_nobody_asks_for_is_open_to_any():
    assert allocate({b"a": member(80), b"b": member(0)}) == {b"a": 100, b"b": 20}
    assert allocate({b"a": member(30), b"b": member(10)}) == {b"a": 90, b"b": 70}


def test_a_working_set_within_its_share_is_kept_while_another_fills():
    parts = allocate({b"job": member(20), b"scan": member(80, filling=True), b"idle": member(0)})
    assert parts == {b"job": 20, b"scan": 80, b"idle": 0}


def test_the_node_is_the_largest_size_given_and_no_part_passes_its_own():
    parts = allocate({b"a": member(0, size=40, filling=True), b"b": member(0, size=100, filling=True)})
    assert parts == {b"a": 40, b"b": 60}


def test_weights_split_by_weight():
    parts = allocate({b"a": member(0, filling=True, weight=3), b"b": member(0, filling=True, weight=1)})
    assert parts == {b"a": 75, b"b": 25}


def test_the_split_keeps_its_promises_on_random_nodes():
    rng = random.Random(80)
    for _ in range(5000):
        members = {bytes([i]): member(rng.randrange(0, 200), rng.choice([50, 100, 150]), rng.random() < 0.5,
                                      rng.randrange(1, 4)) for i in range(rng.randrange(1, 6))}
        parts = allocate(members)
        node = max(m.size for m in members.values())
        weights = sum(m.weight for m in members.values())
        assert set(parts) == set(members)
        for k, m in members.items():
            assert 0 <= parts[k] <= m.size
            ask = min(m.size, m.size if m.filling else m.used)
            fair = node * m.weight // weights
            assert parts[k] >= min(ask, fair) - 1, (members, parts)  # (never less than its ask or its share)
        asked = {k: min(m.size, m.size if m.filling else m.used) for k, m in members.items()}
        granted = {k: min(parts[k], asked[k]) for k in members}
        assert sum(granted.values()) <= node + len(members)  # (what is asked for is never over-promised)


def test_records_decode_garbage_to_nothing():
    rng = random.Random(7)
    good = member(5).encode()
    assert Member.decode(good) == member(5)
    for _ in range(20_000):
        raw = bytes(rng.randrange(256) for _ in range(rng.choice([0, 10, len(good), len(good) + 1])))
        m = Member.decode(raw)
        assert m is None or (0 < m.pid and 0 < m.weight <= 1000)


@requires_fuse
def test_a_scan_takes_at_most_what_the_other_mount_leaves(s3_client, fresh_bucket, mount_factory, tmp_path):
    """Two mounts split one 24 MiB node cache: the job's 8 MiB working set (within its 12 MiB share) stays
    cached, whole, through a 48 MiB scan on the other mount; every byte right, and the job's second pass
    fetches nothing. Then the scan mount, holding 16 MiB, is cut back to its share once the job fills."""
    work = [SampleFile(f"w/{i}.bin", MIB - 100 * i) for i in range(8)]
    scan = [SampleFile(f"s/{i}.bin", MIB + 3 * i) for i in range(48)]
    more = [SampleFile(f"m/{i}.bin", MIB - 7 * i) for i in range(16)]
    again = [SampleFile(f"a/{i}.bin", MIB - 5 * i) for i in range(16)]
    upload(s3_client, fresh_bucket, "job/", work + more + again)
    upload(s3_client, fresh_bucket, "scan/", scan)
    args = ("--share-dir", str(tmp_path / "shared"), "--cache-size", "24M", "--block-size", "1M", "--readahead", "0")
    job = mount_factory(f"s3://{fresh_bucket}/job", *args, cache_dir=tmp_path / "c1", name="job")
    other = mount_factory(f"s3://{fresh_bucket}/scan", *args, cache_dir=tmp_path / "c2", name="scan")
    with job, other:
        for f in work:
            assert job.path(f.key).read_bytes() == f.content()
        time.sleep(2.5)  # (its record published: it holds 8 MiB and fills no more)
        fetched = job.status()["backend"]["bytes"]
        for f in scan:
            assert other.path(f.key).read_bytes() == f.content()
        deadline = time.monotonic() + 15  # (the scan's mount holds to its part at its next turn)
        while other.status()["store"]["used_bytes"] > 24 * MIB - sum(f.size for f in work) + MIB:
            assert time.monotonic() < deadline, (other.status()["store"], other.status()["node_cache"])
            time.sleep(0.3)
        s_job, s_scan = job.status(), other.status()
        assert s_job["store"]["evictions"] == 0 and s_job["store"]["used_bytes"] >= sum(f.size for f in work)
        node = s_scan["node_cache"]
        assert node["members"] == 2 and node["node_bytes"] == 24 * MIB, node
        for f in work:  # (the second pass: all from its cache)
            assert job.path(f.key).read_bytes() == f.content()
        assert job.status()["backend"]["bytes"] == fetched
        for f in more:  # (the job fills past what it holds: the scan mount gives back down to its 12 MiB share)
            assert job.path(f.key).read_bytes() == f.content()
        deadline = time.monotonic() + 15
        while other.status()["store"]["used_bytes"] > 12 * MIB + MIB:
            assert time.monotonic() < deadline, (other.status()["store"], other.status()["node_cache"])
            time.sleep(0.3)
        for f in again:  # (more of the job's files: it fills, and holds its share)
            assert job.path(f.key).read_bytes() == f.content()
        assert job.status()["node_cache"]["part_bytes"] >= 12 * MIB, job.status()["node_cache"]
        assert job.status()["store"]["used_bytes"] >= 11 * MIB, (job.status()["store"], job.status()["node_cache"])
        for f in scan[-8:]:
            assert other.path(f.key).read_bytes() == f.content()


@pytest.mark.parametrize("killed", [False, True])
@requires_fuse
def test_a_mount_that_stops_or_dies_leaves_its_share(s3_client, fresh_bucket, mount_factory, tmp_path, killed):
    """Its record goes (at its stop, or at the next mount's read once its process is gone): the other
    mount may hold the whole node again."""
    files = [SampleFile(f"f/{i}.bin", MIB - 11 * i) for i in range(20)]
    upload(s3_client, fresh_bucket, "a/", files)
    upload(s3_client, fresh_bucket, "b/", files)
    args = ("--share-dir", str(tmp_path / "shared"), "--cache-size", "16M", "--block-size", "1M", "--readahead", "0")
    a = mount_factory(f"s3://{fresh_bucket}/a", *args, cache_dir=tmp_path / "c1", name="a")
    b = mount_factory(f"s3://{fresh_bucket}/b", *args, cache_dir=tmp_path / "c2", name="b")
    with a:
        b.start()
        time.sleep(2.5)
        assert a.status()["node_cache"]["members"] == 2
        if killed:
            kill_daemon(b)
        else:
            b.stop()
        deadline = time.monotonic() + 15
        while a.status()["node_cache"]["members"] != 1:
            assert time.monotonic() < deadline, a.status()["node_cache"]
            time.sleep(0.3)
        for f in files[:15]:
            assert a.path(f.key).read_bytes() == f.content()
        time.sleep(1.5)
        assert a.status()["store"]["used_bytes"] >= 14 * MIB, a.status()["store"]
    b.stop()


@requires_fuse
def test_objects_linked_from_another_mount_are_charged_once(s3_client, fresh_bucket, mount_factory, tmp_path):
    """v1's mount holds 20 MiB of a 24 MiB node; v2's mount links the same 20 MiB (on disk once): it is
    not charged for them, so it takes them all without fetching a byte and v1 evicts nothing; what v2
    then fetches of its own is charged to it."""
    files = [SampleFile(f"f/{i}.bin", 5 * MIB - 1000 * i) for i in range(4)]
    own = [SampleFile(f"own/{i}.bin", MIB + i) for i in range(3)]
    upload(s3_client, fresh_bucket, "v1/", files)
    upload(s3_client, fresh_bucket, "v2/", files + own)
    args = ("--share-dir", str(tmp_path / "shared"), "--cache-size", "24M", "--readahead", "0")
    m1 = mount_factory(f"s3://{fresh_bucket}/v1", *args, cache_dir=tmp_path / "c1", name="v1")
    m2 = mount_factory(f"s3://{fresh_bucket}/v2", *args, cache_dir=tmp_path / "c2", name="v2")
    with m1, m2:
        for f in files:
            assert m1.path(f.key).read_bytes() == f.content()
        time.sleep(2.5)  # (offered, and its record published)
        for f in files:
            assert m2.path(f.key).read_bytes() == f.content()
        s2 = m2.status()
        assert s2["backend"]["bytes"] == 0 and s2["shared"]["linked"] == len(files), (s2["backend"], s2["shared"])
        for f in own:
            assert m2.path(f.key).read_bytes() == f.content()
        time.sleep(2.5)
        assert m1.status()["store"]["evictions"] == 0, m1.status()["store"]
        for f in files + own:
            assert m2.path(f.key).read_bytes() == f.content()


@requires_fuse
def test_what_a_job_writes_is_never_refused_for_the_split(s3_client, fresh_bucket, mount_factory, tmp_path):
    """A --writeback mount whose part of the node is small (the other mount holds 20 MiB of 24) writes a
    10 MiB checkpoint: nothing refused (bound by its own --cache-size only), every byte in the backend."""
    import subprocess

    from .helpers import EPOCHFS

    files = [SampleFile(f"f/{i}.bin", 5 * MIB - 1000 * i) for i in range(4)]
    upload(s3_client, fresh_bucket, "data/", files)
    s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/.keep", Body=b"")
    args = ("--share-dir", str(tmp_path / "shared"), "--cache-size", "24M", "--readahead", "0")
    m1 = mount_factory(f"s3://{fresh_bucket}/data", *args, cache_dir=tmp_path / "c1", name="data")
    m2 = mount_factory(f"s3://{fresh_bucket}/ckpt", *args, "--writeback", cache_dir=tmp_path / "c2", name="ckpt")
    with m1, m2:
        for f in files:
            assert m1.path(f.key).read_bytes() == f.content()
        time.sleep(2.5)
        assert m2.status()["node_cache"]["part_bytes"] <= 5 * MIB, m2.status()["node_cache"]
        data = random.Random(5).randbytes(10 * MIB + 3)
        with open(m2.path("step-1.pt"), "wb") as fh:
            fh.write(data)
        out = subprocess.run([*EPOCHFS, "sync", str(m2.mountpoint)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert s3_client.get_object(Bucket=fresh_bucket, Key="ckpt/step-1.pt")["Body"].read() == data
        assert m2.path("step-1.pt").read_bytes() == data
