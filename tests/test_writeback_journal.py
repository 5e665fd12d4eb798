"""The write-back journal without a daemon: what it owes survives a reopen, and a journal someone else
wrote into (a damaged disk, a planted record) yields only records that check out; the rest is dropped,
never an exception at start-up."""

from __future__ import annotations

import json
import random
from dataclasses import asdict

from epochfs.records import ObjectInfo
from epochfs.writeback.journal import FileRecord, Journal


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
    files, uploaded, deletes = Journal(tmp_path).load()
    assert sorted(files, key=lambda r: r.id) == [record(1), record(2, closed=False)]
    assert set(uploaded) == {"ckpt/done.pt", "ckpt/step-3.pt"} and uploaded["ckpt/done.pt"].etag == '"e1"'
    assert deletes == {"ckpt/old.pt"}


def test_published_entries_and_done_deletes_leave_the_journal(tmp_path):
    j = Journal(tmp_path)
    j.put_uploaded(ObjectInfo("a", 1, 0, '"e"'))
    j.put_delete("b")
    j.put_uploaded(ObjectInfo("b", 2, 0, '"f"'))  # written again after the delete: the delete is void
    j.published({"a"}, set())
    assert j.load() == ([], {"b": ObjectInfo("b", 2, 0, '"f"')}, set())


BAD_FILE_RECORDS = [
    {}, [], "x", None, 1, {"id": "zz"},
    {**asdict(record(1)), "extra": 1},
    *({**asdict(record(1)), field: value} for field, value in [
        ("id", "../../etc/passwd"), ("id", "A" * 32), ("id", 5), ("key", ""), ("key", "k" * 5000), ("key", 7),
        ("key", "\udc80"), ("size", -1), ("size", 1 << 46), ("size", 1.5), ("size", True), ("size", "1"),
        ("mtime_ns", None), ("mtime_ns", 1 << 64), ("mode", -1), ("mode", 0o10000), ("mode", "0644"),
        ("uid", -1), ("uid", 1 << 32), ("gid", None), ("closed", 1), ("closed", "yes"), ("since", None),
        ("since", "now")]),
]
BAD_UPLOADS = [{}, [], None, {"key": "other", "size": 1, "mtime_ns": 0, "etag": '"e"'},
               {"key": "u", "size": -1, "mtime_ns": 0, "etag": '"e"'},
               {"key": "u", "size": 1, "mtime_ns": 0, "etag": ""},
               {"key": "u", "size": 1, "mtime_ns": 0, "etag": 5},
               {"key": "u", "size": 1, "mtime_ns": 0, "etag": '"e"', "mode": 0o777}]


def test_malformed_records_are_dropped_and_the_good_ones_kept(tmp_path):
    j = Journal(tmp_path)
    good = record(9)
    j.put_file(good)
    j.put_uploaded(ObjectInfo("u", 1, 0, '"e"'))
    raw = []
    for i, rec in enumerate(BAD_FILE_RECORDS):
        raw.append((b"f/" + f"{i + 100:032x}".encode(), json.dumps(rec, default=str).encode()))
    raw += [(b"u/u2", json.dumps(v).encode()) for v in BAD_UPLOADS[:1]]
    raw += [(b"u/u" + str(i).encode(), json.dumps(v).encode()) for i, v in enumerate(BAD_UPLOADS)]
    raw += [(b"f/x", b"\xff\xfe"), (b"f/y", b"{not json"), (b"zz", b"{}"), (b"x/", b"{}"), (b"x/\xff", b"{}"),
            (b"u/\xff", b"{}")]
    with j._env.begin(write=True) as txn:
        for k, v in raw:
            txn.put(k, v)
    files, uploaded, deletes = j.load()
    assert files == [good] and uploaded == {"u": ObjectInfo("u", 1, 0, '"e"')} and deletes == set()
    assert j.load() == (files, uploaded, deletes)  # dropped for good
    with j._env.begin() as txn:
        assert sum(1 for _ in txn.cursor()) == 2


def test_random_bytes_in_the_journal_never_raise(tmp_path):
    rng = random.Random(5)
    j = Journal(tmp_path)
    with j._env.begin(write=True) as txn:
        for _ in range(2000):
            prefix = rng.choice([b"f/", b"u/", b"x/", b""])
            key = prefix + bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 40)))
            value = rng.choice([bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 60))),
                                json.dumps(rng.choice(BAD_FILE_RECORDS + BAD_UPLOADS), default=str).encode()])
            txn.put(key, value)
    files, uploaded, deletes = j.load()
    assert files == [] and uploaded == {}
    assert all(isinstance(k, str) and k for k in deletes)  # a delete is only a key: any valid key is kept
