"""The write-back journal without a daemon: what it owes survives a reopen, and a journal someone else
wrote into (a damaged disk, a planted record) yields only records that check out; the rest is dropped,
never an exception at start-up."""

from __future__ import annotations

import json
import random
from dataclasses import asdict

import pytest

from epochfs.core.records import PATH_MAX, ObjectInfo, unsafe_reason
from epochfs.writeback.journal import DirRecord, FileRecord, Journal, key_hash


def record(i: int, **changes) -> FileRecord:
    rec = FileRecord(id=f"{i:032x}", key=f"ckpt/step-{i}.pt", size=100 * i, mtime_ns=10**18, mode=0o644,
                     uid=1000, gid=1000, closed=True, since=12.5)
    return FileRecord(**{**asdict(rec), **changes})


def test_what_is_owed_survives_a_reopen(tmp_path):
    j = Journal(tmp_path)
    j.put_file(record(1))
    j.put_file(record(2, closed=False))
    j.put_uploaded(ObjectInfo("ckpt/done.pt", 7, 10**18, '"e1"'))
    j.put_delete("ckpt/old.pt")
    j.put_file(record(3))
    j.put_uploaded(ObjectInfo("ckpt/step-3.pt", 300, 10**18, '"e3"'), record(3).id)  # the record goes with it
    j.close()
    owed = Journal(tmp_path).load()
    files, uploaded, deletes = owed.files, owed.uploaded, owed.deletes
    assert sorted(files, key=lambda r: r.id) == [record(1), record(2, closed=False)]
    assert set(uploaded) == {"ckpt/done.pt", "ckpt/step-3.pt"} and uploaded["ckpt/done.pt"].etag == '"e1"'
    assert deletes == {"ckpt/old.pt"}


def test_published_entries_and_done_deletes_leave_the_journal(tmp_path):
    j = Journal(tmp_path)
    j.put_uploaded(ObjectInfo("a", 1, 0, '"e"'))
    j.put_delete("b")
    j.put_uploaded(ObjectInfo("b", 2, 0, '"f"'))  # written again after the delete: the delete is void
    j.published({"a"}, set())
    owed = j.load()
    assert (owed.files, owed.uploaded, owed.deletes) == ([], {"b": ObjectInfo("b", 2, 0, '"f"')}, set())


BAD_FILE_RECORDS = [
    {}, [], "x", None, 1, {"id": "zz"},
    {**asdict(record(1)), "extra": 1},
    *({**asdict(record(1)), field: value} for field, value in [
        ("id", "../../etc/passwd"), ("id", "A" * 32), ("id", 5), ("key", ""), ("key", "k" * 5000), ("key", 7),
        ("key", "\udc80"), ("key", "../etc/shadow"), ("key", "a/../../b"), ("key", "a\nb"), ("key", "/abs"),
        ("key", "a//b"), ("key", "x" * 256), ("failed", 5), ("failed", None), ("since", True), ("size", -1), ("size", 1 << 46), ("size", 1.5), ("size", True), ("size", "1"),
        ("mtime_ns", None), ("mtime_ns", 1 << 64), ("mode", -1), ("mode", 0o10000), ("mode", "0644"),
        ("uid", -1), ("uid", 1 << 32), ("gid", None), ("closed", 1), ("closed", "yes"), ("since", None),
        ("since", "now")]),
]
BAD_UPLOADS = [{}, [], None, {"key": "other", "size": 1, "mtime_ns": 0, "etag": '"e"'},
               {"key": "u", "size": -1, "mtime_ns": 0, "etag": '"e"'},
               {"key": "u", "size": 1, "mtime_ns": 0, "etag": ""},
               {"key": "u", "size": 1, "mtime_ns": 0, "etag": 5},
               {"key": "u", "size": 1, "mtime_ns": 0, "etag": '"e"', "mode": 0o777},  # mode without owner
               {"key": "u", "size": 1, "mtime_ns": 0, "etag": '"e"', "mode": 0o10000, "uid": 0, "gid": 0},
               {"key": "../u", "size": 1, "mtime_ns": 0, "etag": '"e"'}]


def test_malformed_records_are_dropped_and_the_good_ones_kept(tmp_path):
    j = Journal(tmp_path)
    good = record(9)
    j.put_file(good)
    j.put_uploaded(ObjectInfo("kept", 1, 0, '"e"'))
    raw = []
    for i, rec in enumerate(BAD_FILE_RECORDS):
        raw.append((b"f/" + f"{i + 100:032x}".encode(), json.dumps(rec, default=str).encode()))
    raw.append((b"f/" + f"{7:032x}".encode(), json.dumps(asdict(record(8))).encode()))  # under another id
    raw += [(b"U/" + key_hash(str(v.get("key")) if isinstance(v, dict) else "u"), json.dumps(v).encode())
            for v in BAD_UPLOADS]
    raw.append((b"U/" + key_hash("other"), json.dumps({"key": "u2", "size": 1, "mtime_ns": 0, "etag": '"e"'}).encode()))
    raw += [(b"X/" + key_hash("a"), json.dumps({"key": "b"}).encode()),  # a key that is not its hash
            (b"X/" + key_hash("../x"), json.dumps({"key": "../x"}).encode()),
            (b"X/" + key_hash("c"), json.dumps({"key": "c", "more": 1}).encode()),
            (b"D/" + key_hash("d"), json.dumps({"path": "d", "mode": 0o20000, "uid": 0, "gid": 0, "mtime_ns": 0}).encode()),
            (b"D/" + key_hash("e"), json.dumps({"path": "e\n", "mode": 0o755, "uid": 0, "gid": 0, "mtime_ns": 0}).encode()),
            (b"M/" + key_hash("id1"), json.dumps({"key": "k", "upload_id": "id2"}).encode()),
            (b"M/" + key_hash("id\n"), json.dumps({"key": "k", "upload_id": "id\n"}).encode())]
    raw += [(b"f/x", b"\xff\xfe"), (b"f/y", b"{not json"), (b"zz", b"{}"), (b"x/", b"{}"), (b"x/\xff", b"{}"),
            (b"u/\xff", b"{}"), (b"x/../../etc", b"{}"),
            (b"X/" + key_hash("bomb"), b'{"key": "bomb", "x": [' + b"[]," * (1 << 20) + b"[]]}")]  # not decoded
    with j._env.begin(write=True) as txn:
        for k, v in raw:
            txn.put(k, v)
    owed = j.load()
    assert owed.files == [good] and owed.uploaded == {"kept": ObjectInfo("kept", 1, 0, '"e"')}
    assert owed.deletes == set() and owed.dirs == {} and owed.multipart == {}
    assert j.load() == owed  # dropped for good
    with j._env.begin() as txn:
        assert sum(1 for _ in txn.cursor()) == 2


@pytest.mark.parametrize("length", [1, 200, 255, 509, 510, 511, 512, 1024, 2000, PATH_MAX])
def test_keys_of_any_length_s3_allows_are_journaled(tmp_path, length):
    """S3 keys run to 1024 bytes and paths on the mount to PATH_MAX; LMDB keys stop at 511."""
    parts, left = [], length
    while left > 0:  # components of at most 200 bytes (two-byte characters, one ASCII), joined by '/'
        n = min(200, left)
        parts.append("x" + "é" * ((n - 1) // 2) + "y" * ((n - 1) % 2))
        left -= n + 1
    key = "/".join(parts)
    assert abs(len(key.encode()) - length) <= 1 and len(key.encode()) <= PATH_MAX
    other, folder = key[:-1] + "Q", key[:-1] + "D"
    j = Journal(tmp_path)
    j.put_file(record(1, key=key))
    j.put_uploaded(ObjectInfo(key, 5, 0, '"e"', 0o600, 1000, 1000), None)
    j.put_delete(other)
    j.put_dir(DirRecord(folder, 0o1777, 1000, 1000, 5))
    j.put_multipart("upload-1", key)
    j.close()
    owed = Journal(tmp_path).load()
    assert owed.files == [record(1, key=key)]
    assert owed.uploaded[key].mode == 0o600 and owed.uploaded[key].uid == 1000
    assert owed.deletes == {other} and owed.dirs[folder].mode == 0o1777
    assert owed.multipart == {"upload-1": key}


def test_a_journal_of_the_earlier_layout_is_read_and_rewritten(tmp_path):
    j = Journal(tmp_path)
    with j._env.begin(write=True) as txn:
        txn.put(b"u/ckpt/a.pt", json.dumps({"key": "ckpt/a.pt", "size": 3, "mtime_ns": 0, "etag": '"e"'}).encode())
        txn.put(b"x/ckpt/b.pt", b"{}")
    owed = j.load()
    assert owed.uploaded == {"ckpt/a.pt": ObjectInfo("ckpt/a.pt", 3, 0, '"e"')} and owed.deletes == {"ckpt/b.pt"}
    with j._env.begin() as txn:
        assert sorted(bytes(k)[:2] for k, _ in txn.cursor()) == [b"U/", b"X/"]
    assert j.load() == owed


def test_random_bytes_in_the_journal_never_raise(tmp_path):
    rng = random.Random(5)
    j = Journal(tmp_path)
    with j._env.begin(write=True) as txn:
        for _ in range(2000):
            prefix = rng.choice([b"f/", b"u/", b"x/", b"U/", b"X/", b"D/", b"M/", b""])
            key = prefix + bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 40)))
            value = rng.choice([bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 60))),
                                json.dumps(rng.choice(BAD_FILE_RECORDS + BAD_UPLOADS), default=str).encode()])
            txn.put(key, value)
    owed = j.load()
    assert owed.files == [] and owed.uploaded == {} and owed.dirs == {} and owed.multipart == {}
    assert all(isinstance(k, str) and k for k in owed.deletes)  # a legacy delete is only a key: a valid one is kept


def test_random_keys_of_s3s_whole_range_come_back_exactly_or_are_refused(tmp_path):
    """Keys of 1 to 1024 bytes of any characters S3 takes: a key the mount could have written comes back
    exactly from every kind of record; anything else is dropped at load, never an exception."""
    rng = random.Random(11)
    safe_pieces = ["a", "Z", "0", "-", "_", ".", " ", "/", "é", "日", "\U0001f600", "%", "?", "#", "\\", "~"]
    hostile = ["//", "/../", "\u0085", "\u2028", "\n", "\t", "\x7f", "\x00", "/./", "x" * 300]
    keys = set()
    while len(keys) < 400:
        pieces = [rng.choice(safe_pieces) for _ in range(rng.randrange(1, 400))]
        if rng.random() < 0.4:
            pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(hostile))
        key = "".join(pieces)
        while len(key.encode()) > 1024:
            key = key[:-1]
        if key:
            keys.add(key)
    j = Journal(tmp_path)
    for i, key in enumerate(sorted(keys)):
        j.put_file(record(i, key=key))
        j.put_uploaded(ObjectInfo(key, i, 0, '"e"', 0o640, i, i))
        j.put_delete(key + "x")
        j.put_dir(DirRecord(key, 0o750, i, i, 0))
        j.put_multipart(f"id-{i}", key)
    j.close()
    owed = Journal(tmp_path).load()
    safe = {k for k in keys if unsafe_reason(k) is None}
    assert 100 < len(safe) < len(keys) - 100  # both kinds were tried
    assert {r.key for r in owed.files} == safe and set(owed.uploaded) == safe and set(owed.dirs) == safe
    assert set(owed.multipart.values()) == safe
    assert owed.deletes == {k + "x" for k in keys if unsafe_reason(k + "x") is None}
    for r in owed.files:
        assert owed.uploaded[r.key].size == int(r.id, 16) and owed.uploaded[r.key].mode == 0o640
