"""Packed datasets: ``epochfs pack`` (shards, index, pointer; incremental, resumable, never half-visible)
and mounts of a packed root (the original tree, each file a range of its shard through the block cache)."""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import random
import signal
import subprocess
import tarfile
import time

import pytest
import xxhash

from epochfs.backend import BackendSettings, open_backend
from epochfs.backend.base import Backend
from epochfs.core.errors import ConfigError
from epochfs.core.records import (
    MEMBER_TAG,
    ObjectInfo,
    Source,
    member_etag,
    member_location,
    record_problem,
    stored_extent,
)
from epochfs.dev.sample import SampleFile, upload
from epochfs.pack import layout
from epochfs.pack.layout import Index, Member, PackInvalid
from epochfs.pack.listing import current_index, dataset_listing
from epochfs.pack.writer import PackSettings, pack

from .conftest import requires_fuse
from .helpers import EPOCHFS, MemoryBackend, errno_of

KIB = 1024


@pytest.fixture
def s3_env(s3, monkeypatch):
    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)


def backend(s3, bucket: str, prefix: str) -> Backend:
    return open_backend(BackendSettings(Source.parse(f"s3://{bucket}/{prefix}"), endpoint_url=s3.endpoint))


def dataset(n: int = 120, seed: int = 3, big: int = 0) -> list[SampleFile]:
    rng = random.Random(seed)
    files = [SampleFile(f"c{i % 4}/img{i:04d}.jpg", rng.choice([0, 1, 511, 512, 513, rng.randint(1, 300 * KIB)]))
             for i in range(n)]
    files += [SampleFile(f"big/{'long-name-' * 12}{i}.bin", (5 << 20) + 70_001 * i) for i in range(big)]
    return files


def run_pack(s3, bucket: str, src: str = "raw/", dst: str = "packed/", **kw) -> object:
    source, dest = backend(s3, bucket, src), backend(s3, bucket, dst)
    try:
        return pack(source, dest, PackSettings(**{"shard_size": 1 << 20, "jobs": 3, "readers": 6, **kw}),
                    source_url=f"s3://{bucket}/{src}")
    finally:
        source.close()
        dest.close()


# -- member locations ------------------------------------------------------------------------------------

def test_a_member_locates_its_bytes_in_its_shard_and_a_bad_location_is_refused():
    shard = ObjectInfo("shards/000001-00000.tar", 10_000, 0, '"abc:-2"')
    member = ObjectInfo("x/y:z.jpg", 100, 5, member_etag(shard, 9_900, "00000000deadbeef"))
    assert record_problem(member) is None
    assert stored_extent(member) == (shard, 9_900)
    assert member_location(member) == (shard, 9_900, 0xDEADBEEF)
    assert "earlier epochfs" in record_problem(member._replace(etag=f"tar:9900:10000:{len(shard.etag)}:{shard.etag}x"))
    plain = ObjectInfo("a", 1, 0, '"e"')
    assert stored_extent(plain) == (plain, 0) and member_location(plain) is None
    assert "outside a shard" in record_problem(member._replace(size=101))
    rng = random.Random(5)
    for _ in range(3000):  # whatever the ETag, a record is refused or its location is inside the shard
        etag = member.etag
        cut = rng.randrange(len(etag))
        etag = rng.choice([etag[:cut], etag[:cut] + rng.choice("0:9-x\x00é") + etag[cut + 1:],
                           MEMBER_TAG + "".join(rng.choice("0123:a") for _ in range(rng.randrange(40)))])
        obj = member._replace(etag=etag)
        if record_problem(obj) is None and etag.startswith(MEMBER_TAG):
            stored, offset = stored_extent(obj)
            assert 0 <= offset and offset + obj.size <= stored.size


class _Listed(MemoryBackend):
    def list_objects(self):
        return iter([ObjectInfo("a.bin", 1, 0, "tar:0:1:1:xother"), ObjectInfo("b.bin", 1, 0, '"ok"')])


def test_a_plain_listing_never_yields_a_member_location():
    assert [o.key for o in dataset_listing(_Listed())] == ["b.bin"]


# -- the index -------------------------------------------------------------------------------------------

def _index() -> Index:
    shards = {layout.shard_key(1, 0): ObjectInfo(layout.shard_key(1, 0), 4096, 0, '"s0"'),
              layout.shard_key(2, 3): ObjectInfo(layout.shard_key(2, 3), 2048, 0, '"s1"')}
    members = {"a/b.jpg": Member("a/b.jpg", layout.shard_key(1, 0), 512, 100, 7, "0" * 16, '"e1"'),
               "c.jpg": Member("c.jpg", layout.shard_key(2, 3), 1024, 1024, -5, "0123456789abcdef", '"e2"')}
    return Index(2, "s3://b/raw/", 1.5, shards, members)


def _rows(raw: bytes) -> list:
    return [json.loads(line) for line in gzip.decompress(raw).splitlines()]


def _pack_rows(rows: list) -> bytes:
    return gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())


def test_the_index_round_trips_and_damage_is_refused_whole():
    index = _index()
    assert layout.decode_index(layout.encode_index(index), 2) == index
    assert layout.decode_pointer(layout.encode_pointer(index)) == (2, layout.index_key(2))
    head, s0, s1, m0, m1 = _rows(layout.encode_index(index))
    assert head["members"] == 2 and head["shards"] == 2 and head["dirs"] == 0
    damaged = [
        [{**head, "generation": 3}, s0, s1, m0, m1],
        [{**head, "members": 3}, s0, s1, m0, m1, m0],  # twice
        [{**head, "members": 3}, s0, s1, m0, m1],  # fewer rows than the header says
        [head, s0, s1, m0, m1, m1],  # more
        [{**head, "members": 1}, s0, s1, ["a", s0[0], 4000, 200, 0, "0" * 16, "e", None, None, None]],  # past the shard
        [{**head, "members": 1}, s0, s1, ["a", "shards/000009-00000.tar", 512, 1, 0, "0" * 16, "e", None, None, None]],
        [head, ["shards/000003-00000.tar", 1, "e"], s1, m0, m1],  # a later generation's shard
        [head, ["../x.tar", 1, "e"], s1, m0, m1],
        [{**head, "members": 1}, s0, s1, ["a/", s0[0], 512, 1, 0, "0" * 16, "e", None, None, None]],
        [{**head, "members": 1}, s0, s1, ["a", s0[0], 512, True, 0, "0" * 16, "e", None, None, None]],
        # a member inside the tar's first header, and two members whose bytes overlap
        [{**head, "members": 1}, s0, s1, ["a", s0[0], 0, 100, 0, "0" * 16, "e", None, None, None]],
        [{**head, "members": 3}, s0, s1, m0, m1, ["z", m0[1], m0[2] + 99, 10, 0, "0" * 16, "e", None, None, None]],
        [{**head, "format": 1}, s0, s1, m0, m1],
    ]
    for rows in damaged:
        with pytest.raises(PackInvalid):
            layout.decode_index(_pack_rows(rows), 2)
    with pytest.raises(PackInvalid, match="--full"):  # an index of the earlier format: one JSON document
        layout.decode_index(gzip.compress(json.dumps({"format": 1, "generation": 2}).encode()), 2)
    with pytest.raises(PackInvalid, match="--full"):
        layout.decode_pointer(json.dumps({"format": 1, "generation": 2}).encode())


def test_decoding_an_index_costs_what_its_rows_are_worth_never_what_they_expand_to():
    """A decompression bomb (the 0.76 MiB of gzip that once cost the daemon 1.5 GiB), lines that
    decode into millions of objects, and a row longer than any real one are refused early, with the
    memory they take bounded by a few times what was read."""
    import tracemalloc

    head = {"format": 2, "generation": 1, "source": "s", "created": 0.0, "shards": 0, "dirs": 0, "members": 0}
    bombs = {
        "expands": gzip.compress(json.dumps(head).encode() + b"\n" + b"\n" * (400 << 20), compresslevel=9),
        "nested": gzip.compress(json.dumps(head).encode() + b"\n" + b"[" + b"[]," * (100 << 20) + b"[]]",
                                compresslevel=9),
        "long line": gzip.compress(b'["' + b"a" * (1 << 20) + b'"]\n'),
        "cut": layout.encode_index(_index())[:-20],
        "trailing": layout.encode_index(_index()) + b"junk",
    }
    assert len(bombs["expands"]) < 1 << 20
    for name, raw in bombs.items():
        tracemalloc.start()
        try:
            with pytest.raises(PackInvalid):
                layout.decode_index(raw, 1 if name != "cut" and name != "trailing" else 2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, (name, peak)


def test_a_fuzzed_index_is_refused_or_valid_never_a_crash():
    rng = random.Random(11)
    text = gzip.decompress(layout.encode_index(_index())).decode()
    for i in range(600):
        if i % 2:
            raw = bytearray(layout.encode_index(_index()))
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            raw = bytes(raw)
        else:
            chars = list(text)
            for _ in range(rng.randint(1, 3)):
                chars[rng.randrange(len(chars))] = rng.choice('0123456789",:[]{}-.ex/\n')
            raw = gzip.compress("".join(chars).encode())
        try:
            index = layout.decode_index(raw, 2)
        except PackInvalid:
            continue
        layout.check_extents(index.members.values())
        for obj in index.objects():
            assert record_problem(obj) is None


# -- packing ---------------------------------------------------------------------------------------------

def _tree(client, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            out[o["Key"][len(prefix):]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def test_pack_writes_standard_tar_shards_an_index_and_the_pointer(s3, s3_client, fresh_bucket, s3_env):
    files = dataset(big=1)
    upload(s3_client, fresh_bucket, "raw/", files)
    summary = run_pack(s3, fresh_bucket)
    assert summary.packed == len(files) and summary.kept == summary.resumed == 0 and summary.generation == 1
    parts = _tree(s3_client, fresh_bucket, "packed/")
    assert all(layout.is_part(k) for k in parts)
    assert not [k for k in parts if layout.sidecar_number(k)]  # member lists are gone once the pointer is flipped
    shards = sorted(k for k in parts if layout.shard_number(k))
    assert len(shards) == summary.shards > 3
    index = layout.decode_index(parts[layout.index_key(1)], 1)
    seen = {}
    for key in shards:  # every shard is a tar that `tar` and WebDataset read; the index says where each member is
        with tarfile.open(fileobj=io.BytesIO(parts[key])) as tar:
            for info in tar:
                data = tar.extractfile(info).read()
                seen[info.name] = data
                m = index.members[info.name]
                assert (m.shard, m.offset, m.size) == (key, info.offset_data, len(data))
                assert m.xxh64 == xxhash.xxh64(data).hexdigest()
    assert seen == {f.key: f.content() for f in files}
    with tarfile.open(fileobj=io.BytesIO(parts[index.members[files[-1].key].shard])) as tar:
        assert [i.name for i in tar] == [files[-1].key]  # a file over the shard size has a shard of its own


def test_pack_is_incremental_and_an_up_to_date_pack_writes_nothing(s3, s3_client, fresh_bucket, s3_env):
    files = dataset(n=60)
    upload(s3_client, fresh_bucket, "raw/", files)
    run_pack(s3, fresh_bucket)
    again = run_pack(s3, fresh_bucket)
    assert not again.written and again.generation == 1
    changed = SampleFile(files[5].key, 70_000, version=1)
    new = SampleFile("c9/new.jpg", 3333)
    upload(s3_client, fresh_bucket, "raw/", [changed, new])
    s3_client.delete_object(Bucket=fresh_bucket, Key="raw/" + files[6].key)
    summary = run_pack(s3, fresh_bucket)
    assert (summary.generation, summary.packed, summary.kept) == (2, 2, len(files) - 2)
    dest = backend(s3, fresh_bucket, "packed/")
    index = current_index(dest)
    assert index.generation == 2 and files[6].key not in index.members
    first = layout.decode_index(_tree(s3_client, fresh_bucket, "packed/index/")["000001.jsonl.gz"], 1)
    assert index.members[files[7].key] == first.members[files[7].key]  # unchanged files stay where they are
    assert layout.shard_number(index.members[changed.key].shard)[0] == 2
    want = {f.key: f.content() for f in files if f.key not in (files[6].key, changed.key)}
    want |= {changed.key: changed.content(), new.key: new.content()}
    got = {}
    for m in index.members.values():
        got[m.path] = bytes(dest.read_range(m.shard, index.shards[m.shard].etag, m.offset, m.size))
    assert got == want
    full = run_pack(s3, fresh_bucket, full=True, prune=True)
    assert full.kept == 0 and full.packed == len(want) and full.unreferenced_bytes == 0
    assert {layout.shard_number(k)[0] for k in _tree(s3_client, fresh_bucket, "packed/") if layout.shard_number(k)} == {3}


class _Failing(Backend):
    """A source that fails (as a crash would stop it) after ``after`` reads."""

    def __init__(self, inner: Backend, after: int) -> None:
        self.inner, self.after, self.source_id = inner, after, inner.source_id
        self.reads = 0

    def list_objects(self):
        return self.inner.list_objects()

    def stat(self, key):
        return self.inner.stat(key)

    def read_range(self, key, etag, start, length):
        self.reads += 1
        if self.reads > self.after:
            raise KeyboardInterrupt
        return self.inner.read_range(key, etag, start, length)

    def statistics(self):
        return self.inner.statistics()


def test_a_pack_cut_short_is_never_visible_and_the_next_run_resumes(s3, s3_client, fresh_bucket, s3_env):
    files = [SampleFile(f"d{i % 3}/{i:03d}", 100 * KIB + 7 * i) for i in range(80)]
    upload(s3_client, fresh_bucket, "raw/", files[:40])
    run_pack(s3, fresh_bucket)
    upload(s3_client, fresh_bucket, "raw/", files[40:])
    dest = backend(s3, fresh_bucket, "packed/")
    with pytest.raises(KeyboardInterrupt):
        pack(_Failing(backend(s3, fresh_bucket, "raw/"), after=25), dest,
             PackSettings(shard_size=1 << 20, jobs=1, readers=1), source_url="x")
    assert current_index(dest).generation == 1  # the previous pack stays current, whole
    assert len(current_index(dest).members) == 40
    left = [k for k in _tree(s3_client, fresh_bucket, "packed/") if layout.sidecar_number(k)]
    assert left  # some shards of generation 2 were uploaded whole before the cut
    summary = run_pack(s3, fresh_bucket)
    assert summary.generation == 2 and summary.resumed > 0 and summary.kept == 40
    assert summary.resumed + summary.packed == 40
    index = current_index(dest)
    assert {p: bytes(dest.read_range(m.shard, index.shards[m.shard].etag, m.offset, m.size))
            for p, m in index.members.items()} == {f.key: f.content() for f in files}


def test_pack_refuses_what_it_must_not_write_into(s3, s3_client, fresh_bucket, s3_env):
    upload(s3_client, fresh_bucket, "raw/", dataset(n=5))
    upload(s3_client, fresh_bucket, "other/", [SampleFile("mine.txt", 10)])
    with pytest.raises(ConfigError, match="not a pack's"):
        run_pack(s3, fresh_bucket, dst="other/")
    run_pack(s3, fresh_bucket)
    with pytest.raises(ConfigError, match="packed dataset already"):
        run_pack(s3, fresh_bucket, src="packed/", dst="again/")
    s3_client.put_object(Bucket=fresh_bucket, Key="packed/" + layout.POINTER, Body=b"{not json")
    with pytest.raises(PackInvalid, match="--full"):
        run_pack(s3, fresh_bucket)
    assert run_pack(s3, fresh_bucket, full=True).generation == 2  # the way out of a damaged pack
    env = s3.env()
    for args, message in ((["s3://x/raw", "file:///tmp/x"], "DEST must be a place that can be written"),
                          ([f"s3://{fresh_bucket}/raw", f"s3://{fresh_bucket}/raw/sub"], "overlap")):
        r = subprocess.run([*EPOCHFS, "pack", *args, "--endpoint-url", s3.endpoint], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_the_cli_packs_with_a_summary_and_resumes_after_kill_9(s3, s3_client, fresh_bucket, tmp_path, s3_env):
    files = [SampleFile(f"d/{i:03d}.bin", 100 * KIB) for i in range(300)]
    upload(s3_client, fresh_bucket, "raw/", files)
    base = [*EPOCHFS, "pack", f"s3://{fresh_bucket}/raw", f"s3://{fresh_bucket}/packed", "--endpoint-url",
            s3.endpoint, "--shard-size", "1M", "--work-dir", str(tmp_path)]
    proc = subprocess.Popen([*base, "--jobs", "1", "--readers", "1"], env=s3.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        listed = s3_client.list_objects_v2(Bucket=fresh_bucket, Prefix="packed/index/000001/").get("Contents", [])
        if len(listed) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the pack finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = subprocess.run([*base, "--jobs", "4", "--readers", "8"], env=s3.env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    resumed = int(r.stdout.split("resumed ")[1].split()[0])
    assert resumed >= 2 * 10, r.stdout
    assert "generation 1 of" in r.stdout and "300 files" in r.stdout
    assert len(current_index(backend(s3, fresh_bucket, "packed/")).members) == 300


# -- mounts of a packed dataset -------------------------------------------------------------------------

@requires_fuse
def test_a_mount_of_a_packed_root_serves_the_original_tree(s3, s3_client, fresh_bucket, s3_env, mount_factory):
    files = dataset(n=150, seed=21, big=2)
    upload(s3_client, fresh_bucket, "raw/", files)
    run_pack(s3, fresh_bucket)
    index = current_index(backend(s3, fresh_bucket, "packed/"))
    blocks = sum(-(-s.size // (1 << 20)) for s in index.shards.values())
    gets = s3.request_count(fresh_bucket)
    with mount_factory(f"s3://{fresh_bucket}/packed/", "--block-size", "1M") as m:
        root = m.mountpoint
        assert sorted(os.listdir(root)) == ["big", "c0", "c1", "c2", "c3"]  # no shard, index or pointer
        rng = random.Random(4)
        for f in files:
            path = root / f.key
            st = path.stat()
            assert st.st_size == f.size
            with open(path, "rb", buffering=0) as fh:
                assert fh.read() == f.content(), f.key
                for _ in range(3):  # seeded random offsets and odd sizes across block boundaries
                    off, n = rng.randrange(f.size + 1), rng.choice([1, 4095, 70_000, 1 << 20])
                    assert os.pread(fh.fileno(), n, off) == f.content(off, n)
        st = m.status()
        fetched = s3.request_count(fresh_bucket) - gets
        # each block of each shard crossed the link once (and the listing, pointer and index were read)
        assert fetched <= blocks + 4 < len(files) / 3, (fetched, blocks)
        cache = st["cache"]
        assert cache["demand_bytes"] + cache["prefetch_bytes"] <= sum(s.size for s in index.shards.values())
        assert cache["hit_bytes"] > 0  # members read from blocks fetched for their neighbours


@requires_fuse
def test_a_packed_mount_keeps_the_guarantees_of_plain_objects(s3, s3_client, fresh_bucket, s3_env, mount_factory):
    files = dataset(n=40, seed=2, big=1)  # (the big file has a shard of its own: two shards at least)
    upload(s3_client, fresh_bucket, "raw/", files)
    run_pack(s3, fresh_bucket)
    m = mount_factory(f"s3://{fresh_bucket}/packed/", "--block-size", "256K")
    r = m.start("--writeback", expect_ok=False)
    assert r.returncode != 0 and "packed dataset" in r.stderr + m.log()
    m.start()
    index = current_index(backend(s3, fresh_bucket, "packed/"))
    victim = next(f for f in files if f.size > 1000)
    shard = index.members[victim.key].shard
    # the shard is overwritten behind the pack's back: its members' reads fail ESTALE, never other bytes
    s3_client.put_object(Bucket=fresh_bucket, Key="packed/" + shard, Body=b"\0" * index.shards[shard].size)
    with pytest.raises(OSError) as raised:
        (m.mountpoint / victim.key).read_bytes()
    assert errno_of(raised.value) == errno.ESTALE
    other = next(f for f in files if index.members[f.key].shard != shard and f.size)
    assert (m.mountpoint / other.key).read_bytes() == other.content()
    m.stop()


@requires_fuse
def test_a_damaged_pack_is_refused_with_a_clear_error(s3, s3_client, fresh_bucket, s3_env, mount_factory):
    upload(s3_client, fresh_bucket, "raw/", dataset(n=10))
    run_pack(s3, fresh_bucket)
    m = mount_factory(f"s3://{fresh_bucket}/packed/")
    m.start()
    good = sorted(os.listdir(m.mountpoint))
    s3_client.put_object(Bucket=fresh_bucket, Key="packed/" + layout.index_key(1), Body=b"\x1f\x8bjunk")
    r = subprocess.run([*EPOCHFS, "refresh", str(m.mountpoint)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "index" in r.stderr, r.stderr
    assert sorted(os.listdir(m.mountpoint)) == good  # the mount keeps serving what it had
    m.stop()
    fresh = mount_factory(f"s3://{fresh_bucket}/packed/", cache_dir=m.cache_dir.parent / "cache2", name="m2")
    r = fresh.start(expect_ok=False)
    assert r.returncode != 0 and "does not decompress" in r.stderr + fresh.log()


@requires_fuse
def test_a_manifest_prefetches_a_packed_dataset_by_its_shards_blocks(s3, s3_client, fresh_bucket, s3_env,
                                                                    mount_factory):
    files = [SampleFile(f"s/{i:04d}.jpg", 60 * KIB + i) for i in range(200)]
    upload(s3_client, fresh_bucket, "raw/", files)
    run_pack(s3, fresh_bucket, shard_size=4 << 20)
    order = list(files)
    random.Random(1).shuffle(order)
    with mount_factory(f"s3://{fresh_bucket}/packed/", "--block-size", "1M") as m:
        from epochfs import Client

        job = Client(m.mountpoint).warmup([str(m.mountpoint / "s")])
        assert job["done_bytes"] == job["total_bytes"] == sum(f.size for f in files) and not job["errors"]
        gets = s3.request_count(fresh_bucket)
        for f in order:
            assert (m.mountpoint / f.key).read_bytes() == f.content()
        assert s3.request_count(fresh_bucket) == gets  # warmed by shard blocks: every read a hit
    total = sum(f.size for f in files)
    with mount_factory(f"s3://{fresh_bucket}/packed/", "--block-size", "1M", cache_dir=m.cache_dir.parent / "c2",
                       name="m2") as m2:
        gets = s3.request_count(fresh_bucket)
        Client(m2.mountpoint).hand_over([f.key for f in order], epoch=0)
        for f in order:
            assert (m2.mountpoint / f.key).read_bytes() == f.content()
        fetched = s3.request_count(fresh_bucket) - gets
        assert fetched <= total // (1 << 20) + 6, fetched  # about one GET per shard block, not per file


# -- every byte of a member checked against its own checksum -----------------------------------------------

def test_a_member_whose_location_is_wrong_is_eio_never_other_bytes(tmp_path):
    """Fuzz: members whose recorded location is off (by one, into a header, cut short, lengthened,
    another file's range), read with random offsets and sizes through read_now and read, inside one
    block and across blocks: every answer is the file's exact bytes or DamagedMember, before any byte
    of a wrong range reaches a reader; a right member is checked once and remembered."""
    from epochfs.cache.members import DamagedMember
    from epochfs.dev.sample import pattern

    from .helpers import BS
    from .test_cache_service import run_with_cache

    shard = ObjectInfo("shards/000001-00000.tar", 3 * BS + 999, 0, '"s"')
    rng = random.Random(17)
    cases = []
    for _ in range(300):
        offset = rng.randrange(512, shard.size - 2)
        size = rng.choice([1, 2, 511, 4096, 70_000, BS, BS + 7, rng.randrange(1, shard.size - offset)])
        size = max(1, min(size, shard.size - offset))
        truth = xxhash.xxh64(pattern(shard.key, 0, offset, size)).hexdigest()
        wrong = rng.choice([(offset, size), (offset + 1, size), (offset - 1, size), (offset - 512, size),
                            (offset, 1), (offset, size - 1), (offset, size + 1), (rng.randrange(512, shard.size - 1), size)])
        woff, wsize = wrong
        woff = max(0, min(woff, shard.size - 1))
        wsize = max(1, min(wsize, shard.size - woff))
        cases.append((ObjectInfo(f"m{len(cases)}", wsize, 0, member_etag(shard, woff, truth)), offset, size))

    async def fn(cache):
        outcomes = {"exact": 0, "refused": 0}
        for member, offset, size in cases:
            stream = cache.open_stream(member)
            right = (member.size, stored_extent(member)[1]) == (size, offset)
            try:
                for _ in range(3):
                    off = rng.randrange(member.size)
                    n = rng.choice([1, 4095, 70_000, BS + 3])
                    got = stream.read_now(off, n)
                    if got is None:
                        got = await stream.read(off, n)
                    assert right, f"{member.etag}: bytes served from a wrong range"
                    assert bytes(got) == pattern(shard.key, 0, offset + off, min(n, member.size - off))
                outcomes["exact"] += 1
                assert member.etag in cache.verified
            except DamagedMember:
                assert not right
                outcomes["refused"] += 1
            finally:
                stream.close()
        return outcomes

    outcomes, cache = run_with_cache(tmp_path, MemoryBackend(), fn)
    assert outcomes["exact"] > 20 and outcomes["refused"] > 150, outcomes
    assert cache.verified.damaged >= outcomes["refused"] and cache.whole_held == 0


@requires_fuse
def test_a_mount_refuses_the_members_a_wrong_index_misplaces(s3, s3_client, fresh_bucket, s3_env, mount_factory):
    """An index rewritten with a member off by one, one pointing at the next file's tar header (that
    file left out of the index), and one cut to a byte: EIO for those, the exact bytes for the rest."""
    files = [SampleFile(f"d/{i:02d}.bin", 3000 + 1000 * i) for i in range(8)]
    upload(s3_client, fresh_bucket, "raw/", files)
    run_pack(s3, fresh_bucket)
    dest = backend(s3, fresh_bucket, "packed/")
    index = current_index(dest)
    members = dict(index.members)
    m1, m3, m4, m6 = (members[f"d/0{i}.bin"] for i in (1, 3, 4, 6))
    members[m1.path] = Member(m1.path, m1.shard, m1.offset + 1, m1.size, m1.mtime_ns, m1.xxh64, m1.source_etag)
    del members[m4.path]  # its header is now free for another member to point at
    members[m3.path] = Member(m3.path, m3.shard, m4.offset - 512, m3.size, m3.mtime_ns, m3.xxh64, m3.source_etag)
    members[m6.path] = Member(m6.path, m6.shard, m6.offset, 1, m6.mtime_ns, m6.xxh64, m6.source_etag)
    s3_client.put_object(Bucket=fresh_bucket, Key="packed/" + layout.index_key(1),
                         Body=layout.encode_index(Index(1, index.source, index.created, index.shards, members, index.dirs)))
    with mount_factory(f"s3://{fresh_bucket}/packed/") as m:
        for f in files:
            path = m.mountpoint / f.key
            if f.key == m4.path:
                assert not path.exists()
            elif f.key in (m1.path, m3.path, m6.path):
                with pytest.raises(OSError) as raised:
                    path.read_bytes()
                assert errno_of(raised.value) == errno.EIO, f.key
            else:
                assert path.read_bytes() == f.content()
        assert "do not match the file's checksum" in m.log()


# -- the locality order ----------------------------------------------------------------------------------

def test_the_local_order_is_exact_deterministic_and_reads_a_few_shards_at_a_time():
    from epochfs.prefetch.manifest import local_order

    groups = [f"shard{i // 50}" for i in range(1000)]  # 20 shards of 50 samples
    one = local_order(groups, seed=1, epoch=0, window=4)
    assert sorted(one) == list(range(1000))
    assert one == local_order(groups, seed=1, epoch=0, window=4)
    assert one != local_order(groups, seed=1, epoch=1, window=4) != local_order(groups, seed=2, epoch=0, window=4)
    for start in range(0, 1000, 200):  # each run of 200 samples comes from 4 shards
        assert len({groups[i] for i in one[start:start + 200]}) == 4
    assert len({groups[i] for i in one[:50]}) > 1  # shuffled across the window, not shard after shard
    # the ranks' shares: DistributedSampler's sizes and padding, each a contiguous run of the order
    for world, drop in ((3, False), (3, True), (7, False)):
        shares = [local_order(groups, seed=1, epoch=0, window=4, rank=r, world_size=world, drop_last=drop)
                  for r in range(world)]
        assert len({len(s) for s in shares}) == 1
        flat = [i for s in shares for i in s]
        if drop:
            assert len(flat) == 999 and len(set(flat)) == 999
        else:
            assert len(flat) == -(-1000 // world) * world and set(flat) == set(range(1000))
        for share in shares:  # a rank reads the windows its run covers, not every shard
            assert len({groups[i] for i in share}) <= 4 * (len(share) // 200 + 2) < 20
    plain = local_order(list(range(100)), seed=0, epoch=0)
    assert sorted(plain) == list(range(100)) and plain != list(range(100))
    with pytest.raises(Exception, match="window"):
        local_order(groups, seed=0, epoch=0, window=0)


@requires_fuse
def test_the_daemon_says_where_members_are_and_the_sampler_hands_over_a_local_order(s3, s3_client, fresh_bucket,
                                                                                  s3_env, mount_factory, tmp_path):
    files = [SampleFile(f"s/{i:04d}.jpg", 30 * KIB + i) for i in range(120)]
    upload(s3_client, fresh_bucket, "raw/", files)
    run_pack(s3, fresh_bucket)
    index = current_index(backend(s3, fresh_bucket, "packed/"))
    from epochfs import Client

    with mount_factory(f"s3://{fresh_bucket}/packed/") as m:
        where = Client(m.mountpoint).locate([m.mountpoint / f.key for f in files])
        assert where == [(index.members[f.key].shard, index.members[f.key].offset,
                          index.shards[index.members[f.key].shard].size) for f in files]
        manifest = tmp_path / "epoch.txt"
        manifest.write_text("".join(f.key + "\n" for f in files))
        r = subprocess.run([*EPOCHFS, "plan", "--manifest", str(manifest), "--cache-size", "1G", "--block-size", "1M",
                            "--mount", str(m.mountpoint), "--json"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        # the prediction is the shards' blocks the members touch, each once (not one object per file)
        blocks = {(loc.store, (loc.offset + i) >> 20) for loc, f in zip(where, files, strict=True)
                  for i in (0, f.size - 1)}
        assert json.loads(r.stdout)["policies"]["lru"]["backend_bytes"] == sum(
            min(1 << 20, index.shards[key].size - (b << 20)) for key, b in blocks)
        torch = pytest.importorskip("torch")
        from epochfs.torch import local_sampler

        sampler = local_sampler([str(m.mountpoint / f.key) for f in files], m.mountpoint, seed=3, window=2,
                                background=False)
        sampler.set_epoch(0)
        order = list(sampler)
        assert sorted(order) == list(range(len(files))) and len(sampler) == len(files)
        plan = m.status()["prefetch"]  # the order reached the daemon (background=False: handed over at set_epoch)
        assert (plan["files"], plan["epoch"]) == (len(files), 0)
        loader = torch.utils.data.DataLoader(list(range(len(files))), sampler=sampler, batch_size=10)
        assert sorted(int(i) for batch in loader for i in batch) == list(range(len(files)))


# -- the peer tier ---------------------------------------------------------------------------------------

def test_peers_are_answered_for_the_shards_of_packed_members_and_nothing_else():
    import trio

    from epochfs.core.blocks import block_bounds, block_id
    from epochfs.meta.index import NamespaceIndex
    from epochfs.peer import wire
    from epochfs.peer.tier import PeerAnswers

    bs = 1 << 20
    shard = ObjectInfo("shards/000001-00000.tar", (2 << 20) + 5000, 0, '"s1"')
    members = [ObjectInfo(f"m/{i}", 1000, 0, member_etag(shard, 512 + 1536 * i, "0" * 16)) for i in range(5)]
    plain = ObjectInfo("plain.bin", 10, 0, '"p"')

    class Cache:
        def block_id(self, obj, index):
            return block_id("src", obj.key, obj.etag, index, block_size=bs)

        def block_length(self, obj, index):
            return block_bounds(index, obj.size, bs)[1]

        async def read_for_peer(self, obj, index, warm):
            return f"{obj.key}#{index}".encode()

    index = NamespaceIndex.temporary()
    view = index.build([*members, plain], source="x", version=1, created=1.0)
    answers = PeerAnswers(Cache(), lambda: view)

    def ask(obj, i):
        req = wire.BlockRequest(Cache().block_id(obj, i), obj.key, obj.etag, i, Cache().block_length(obj, i))
        return trio.run(answers.serve, req)

    assert ask(shard, 2) == f"{shard.key}#2".encode()  # the shard its members are stored in
    assert ask(plain, 0) == b"plain.bin#0"
    for other in (shard._replace(etag='"old"'), ObjectInfo("shards/000009-00000.tar", bs, 0, '"s1"'),
                  ObjectInfo("index/000001.jsonl.gz", 100, 0, '"i"')):
        with pytest.raises(wire.Rejected) as refused:
            ask(other, 0)
        assert refused.value.status == 404
    second = ObjectInfo("shards/000002-00000.tar", bs, 0, '"s2"')
    view2, _ = index.apply({"n/x": ObjectInfo("n/x", 10, 0, member_etag(second, 512, "0" * 16))}, set(), version=2, created=2.0)
    answers.namespace = lambda: view2
    assert ask(second, 0) == f"{second.key}#0".encode() and ask(shard, 0)  # a change set adds its shards
    view.close()
    view2.close()


def test_a_fuzzed_shard_list_is_refused_or_valid_never_a_crash():
    shard = ObjectInfo(layout.shard_key(2, 7), 9000, 0, '"s"')
    members = [Member(f"a/{i}", shard.key, 512 * (2 * i + 1), 100 + i, i, f"{i:016x}", f'"e{i}"') for i in range(5)]
    raw = layout.encode_sidecar(shard, members)
    key = layout.sidecar_key(2, 7)
    assert layout.decode_sidecar(raw, key) == (shard, members)
    with pytest.raises(PackInvalid, match="another shard"):
        layout.decode_sidecar(raw, layout.sidecar_key(2, 8))
    rng = random.Random(9)
    for _ in range(800):
        damaged = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = ord(rng.choice('0123456789",:[]{}-.ex/\\'))
        try:
            got, found = layout.decode_sidecar(bytes(damaged), key)
        except PackInvalid:
            continue
        assert all(m.offset + m.size <= got.size and m.shard == got.key for m in found)


@requires_fuse
def test_a_packed_dataset_published_to_redis_is_served_by_nodes_that_never_list(s3, s3_client, fresh_bucket, s3_env,
                                                                                mount_factory, tmp_path):
    from epochfs.dev.servers import LocalRedis

    files = dataset(n=30, seed=5)
    upload(s3_client, fresh_bucket, "raw/", files)
    run_pack(s3, fresh_bucket)
    redis = LocalRedis(tmp_path / "redis").start()
    try:
        r = subprocess.run([*EPOCHFS, "import", f"s3://{fresh_bucket}/packed", "--meta", redis.url, "--endpoint-url",
                            s3.endpoint], env=s3.env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and f"{len(files)} objects" in r.stdout, r.stderr
        with mount_factory(f"s3://{fresh_bucket}/packed/", "--meta", redis.url) as m:
            for f in files:
                assert (m.mountpoint / f.key).read_bytes() == f.content()
            assert "listing" not in m.log()  # a node of a shared store loads what was published
    finally:
        redis.stop()


def test_the_prefetch_plan_of_members_reads_their_shards_blocks():
    from epochfs.core.blocks import block_id
    from epochfs.prefetch.plan import Plan

    bs = 1 << 20
    shard = ObjectInfo("shards/000001-00000.tar", (3 << 20) + 100, 0, '"s"')
    # three members: inside block 0, across blocks 0-1, and the shard's short last block
    members = [ObjectInfo("a", 1000, 0, member_etag(shard, 512, "0" * 16)),
               ObjectInfo("b", 4096, 0, member_etag(shard, bs - 1024, "0" * 16)),
               ObjectInfo("c", 100, 0, member_etag(shard, 3 << 20, "0" * 16))]
    plain = ObjectInfo("p", bs + 1, 0, '"p"')

    def bid(obj, i):
        return block_id("src", obj.key, obj.etag, i, block_size=bs)

    plan = Plan([(m, 0, 0) for m in [*members, plain]], bs, bid)
    assert plan.blocks == [bid(shard, 0), bid(shard, 0), bid(shard, 1), bid(shard, 3), bid(plain, 0), bid(plain, 1)]
    assert [plan.block(p)[:2] for p in range(4)] == [(shard, 0), (shard, 0), (shard, 1), (shard, 3)]
    assert [plan.block(p)[3] for p in range(6)] == [bs, bs, bs, 100, bs, 1]  # what a fetch of it costs
    assert plan.total_bytes == 1000 + 4096 + 100 + bs + 1  # what the reader reads
    assert plan.fetch_bytes == bs + bs + 100 + bs + 1  # each distinct block once
    assert plan.uses[bid(shard, 0)] == [0, 1]
    # what each position reads of its block (what is read into memory ahead of the reader)
    assert [plan.span(p) for p in range(6)] == [(512, 1512), (bs - 1024, bs), (0, 3072), (0, 100), (0, bs), (0, 1)]


@requires_fuse
def test_a_pack_of_a_directory_keeps_its_permissions_for_other_users(s3, fresh_bucket, s3_env, mount_factory):
    import shutil
    import stat
    import tempfile
    from pathlib import Path

    from epochfs.dev.sample import write_tree

    from .test_hostile import as_nobody

    base = Path(tempfile.mkdtemp(prefix="epochfs-shared-"))
    try:
        os.chmod(base, 0o755)
        src = base / "src"
        write_tree(str(src), [SampleFile("public.bin", 5000), SampleFile("secret.bin", 6000),
                              SampleFile("private/inner.bin", 100)])
        os.chmod(src, 0o755)
        os.chmod(src / "public.bin", 0o644)
        os.chmod(src / "secret.bin", 0o600)
        os.chmod(src / "private", 0o700)
        os.chown(src / "public.bin", 1234, 4321)
        local = open_backend(BackendSettings(Source.parse(f"file://{src}")))
        pack(local, backend(s3, fresh_bucket, "packed/"), PackSettings(shard_size=1 << 20), source_url=f"file://{src}")
        m = mount_factory(f"s3://{fresh_bucket}/packed/", "--allow-other", name="unused")
        m.mountpoint = base / "mnt"
        m.mountpoint.mkdir()
        with m:
            mnt = m.mountpoint
            st = os.stat(mnt / "public.bin")
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o644, 1234, 4321)
            assert stat.S_IMODE(os.stat(mnt / "secret.bin").st_mode) == 0o600
            assert stat.S_IMODE(os.stat(mnt / "private").st_mode) == 0o700
            assert as_nobody("cat", str(mnt / "public.bin")).returncode == 0
            denied = as_nobody("cat", str(mnt / "secret.bin"))
            assert denied.returncode != 0 and "Permission denied" in denied.stderr
            denied = as_nobody("ls", str(mnt / "private"))
            assert denied.returncode != 0 and "Permission denied" in denied.stderr
            assert (mnt / "secret.bin").read_bytes() == SampleFile("secret.bin", 6000).content()
    finally:
        shutil.rmtree(base, ignore_errors=True)
