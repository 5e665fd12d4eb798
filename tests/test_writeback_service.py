"""Write-back driven directly, without a mount: the POSIX edits of :class:`WriteBack` and its background
uploads against an in-memory backend, the way the FUSE adapter calls them (S3QL's idea of testing the
file system's operations below the kernel). What the kernel adds is tested on real mounts in
``test_writeback.py``."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time

import pytest
import trio

from epochfs.backend.base import Backend, BackendStats
from epochfs.core.errors import BackendUnavailable, NoSpace, Refused
from epochfs.core.private import private_dir
from epochfs.core.records import ObjectInfo
from epochfs.meta.base import merged
from epochfs.meta.index import build as build_namespace
from epochfs.writeback.journal import Journal
from epochfs.writeback.service import WriteBack, WritebackSettings
from epochfs.writeback.tree import Overlay, Tree
from epochfs.writeback.uploads import DataFile

UID, GID = 1000, 1000


class Room:
    """The block store's side of write-back: room for pinned bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.pending, self.pinned = capacity, 0, 0

    def pin(self, nbytes: int) -> bool:
        if self.pinned + nbytes > self.capacity:
            return False
        self.pinned += nbytes
        return True

    def unpin(self, nbytes: int) -> None:
        self.pinned = max(0, self.pinned - nbytes)

    def hold(self, nbytes: int) -> None:
        self.pinned += nbytes


class Bucket(Backend):
    """Uploads and deletes kept in memory; ``fail`` makes the next uploads fail."""

    source_id = "mem://bucket/"
    writable = True

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.deleted: list[str] = []
        self.waited: dict[str, float] = {}  # key -> seconds its upload gave way
        self.fail = 0
        self._lock = threading.Lock()

    def list_objects(self):
        return iter(())

    def read_range(self, key, etag, start, length):
        return self.objects[key][0][start:start + length]

    def statistics(self):
        return BackendStats()

    def upload_file(self, path, key, *, bandwidth=None, cancelled=None, metadata=None, multipart_started=None,
                    give_way=None):
        with open(path, "rb") as f:
            data = f.read()
        started = time.monotonic()
        while give_way is not None and give_way():  # (as the S3 backend's body waits)
            time.sleep(0.005)
        self.waited[key] = time.monotonic() - started
        with self._lock:
            if self.fail:
                self.fail -= 1
                raise BackendUnavailable("the endpoint is down")
            self.objects[key] = (data, dict(metadata or {}))
        return ObjectInfo(key, len(data), 0, f'"{hashlib.md5(data).hexdigest()}"')

    def delete(self, key):
        with self._lock:
            self.objects.pop(key, None)
            self.deleted.append(key)

    def abort_multipart(self, key, upload_id):
        pass


def run_writeback(tmp_path, fn, *, capacity=1 << 30, quota=None, objects=(), keep=None):
    """Run ``fn(wb, bucket, room, published)`` against a write-back service with its workers running."""
    cache = private_dir(tmp_path / "cache")
    journal = Journal(cache)
    bucket, room, published = Bucket(), Room(capacity), []
    tree = Tree(build_namespace(list(objects)), Overlay())

    async def publish(added, removed, publication):  # as the snapshots do: a new version, the namespace rebuilt
        published.append((dict(added), set(removed)))
        current = [f.obj for f in tree.namespace.files()]
        tree.namespace = build_namespace(merged(current, added, removed), previous=tree.namespace)

    wb = WriteBack(journal, room, bucket, tree, WritebackSettings(upload_bandwidth=None, upload_concurrency=2,
                                                                  user_quota=quota),
                   demand_waiting=lambda: False, publish=publish, keep=keep)
    wb.recover()

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(wb.run)
            result = await fn(wb, bucket, room, published)
            nursery.cancel_scope.cancel()
        return result

    try:
        return trio.run(main)
    finally:
        wb.close()
        journal.close()


def root(wb: WriteBack):
    return wb.node(1)


def test_a_written_file_is_uploaded_whole_published_and_unpinned(tmp_path):
    expected = b"".join(bytes([off % 251]) * min(70_001, 300_000 - off) for off in range(0, 300_000, 70_001))

    async def fn(wb, bucket, room, published):
        fh, _ = wb.create(root(wb), b"ckpt.pt", 0o640, UID, GID)
        for off in range(0, 300_000, 70_001):  # odd sizes
            wb.write(fh, off, bytes([off % 251]) * min(70_001, 300_000 - off))
        during = room.pinned, wb.room()
        wb.flush(fh)
        wb.release(fh)
        left = await wb.sync([], 10)
        return during, left, wb.tree.resolve("ckpt.pt"), room.pinned, wb.statistics(), bucket.objects, published

    during, left, node, pinned, stats, objects, published = run_writeback(tmp_path, fn)
    assert during == (300_000, (1 << 30) - 300_000)  # pinned while owed: never evicted
    assert left == [] and objects["ckpt.pt"][0] == expected
    assert node.obj.mode == 0o640 and node.obj.uid == UID  # published: an object of the snapshot, owner kept
    assert pinned == 0 and stats.pending_files == 0 and stats.uploaded_files == 1 and stats.uploaded_bytes == 300_000
    assert published and published[-1][0]["ckpt.pt"].size == 300_000


class SlowKeeper:
    """The block cache's side of keeping uploaded bytes, which adopts them only when told to."""

    def __init__(self) -> None:
        self.offered: dict[str, tuple[ObjectInfo, object]] = {}
        self.adopted: dict[str, bytes | None] = {}
        self.withdrawn: list[str] = []
        self.adopt_now, self.gone = trio.Event(), trio.Event()

    def offer(self, obj, read):
        self.offered[obj.key] = (obj, read)

    async def adopt(self, obj, read, path=None):
        await self.adopt_now.wait()
        self.adopted[obj.key] = read(0, obj.size)
        return obj.size

    def withdraw(self, obj):
        self.withdrawn.append(obj.key)
        self.gone.set()


def test_an_uploaded_files_bytes_are_offered_to_the_cache_by_the_time_sync_returns_until_kept(tmp_path):
    """A restore right after ``sync`` on the node that saved the file reads its own bytes, not the backend,
    even while they are still being copied into the cache (under load that takes a while); once kept, the
    offer is withdrawn and the data file goes."""
    data = os.urandom(300_001)
    keeper = SlowKeeper()

    async def fn(wb, bucket, room, published):
        fh, _ = wb.create(root(wb), b"ckpt.pt", 0o644, UID, GID)
        wb.write(fh, 0, data)
        wb.release(fh)
        assert await wb.sync([], 10) == []
        obj, read = keeper.offered["ckpt.pt"]
        at_sync = read(65_537, 70_001), list(keeper.withdrawn), os.listdir(wb.journal.data_dir)
        keeper.adopt_now.set()
        with trio.fail_after(10):
            await keeper.gone.wait()
        return obj, at_sync, read(0, 10), os.listdir(wb.journal.data_dir)

    obj, (offered, withdrawn, files), after, files_after = run_writeback(tmp_path, fn, keep=keeper)
    assert obj.size == len(data) and obj.etag == f'"{hashlib.md5(data).hexdigest()}"'  # the uploaded version's
    assert offered == data[65_537:65_537 + 70_001] and withdrawn == [] and len(files) == 1
    assert keeper.adopted == {"ckpt.pt": data}
    assert after is None and files_after == []  # withdrawn, closed, removed: a late reader gets nothing


def test_a_data_file_closed_while_a_read_is_in_progress_is_closed_by_that_read(tmp_path, monkeypatch):
    """The cache's reads of an offered file run in worker threads; the close (on the event loop) neither
    waits for them nor closes the descriptor under them."""
    path = tmp_path / "data"
    path.write_bytes(b"abcdef")
    fd = os.open(path, os.O_RDONLY)
    data = DataFile(fd)
    inside, go_on = threading.Event(), threading.Event()
    real = os.pread

    def slow_pread(f, n, off):
        inside.set()
        go_on.wait(10)
        return real(f, n, off)

    monkeypatch.setattr(os, "pread", slow_pread)
    got = []
    reader = threading.Thread(target=lambda: got.append(data.read(1, 3)))
    reader.start()
    assert inside.wait(10)
    data.close()  # (returns at once)
    still_open = os.fstat(fd).st_size
    go_on.set()
    reader.join(10)
    assert got == [b"bcd"] and still_open == 6
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the read that ended last
    assert data.read(0, 1) is None


def test_the_object_holds_exactly_what_was_written_and_who_may_read_it(tmp_path):
    data = os.urandom(123_457)

    async def fn(wb, bucket, room, published):
        fh, _ = wb.create(root(wb), b"a.bin", 0o600, UID, GID)
        wb.write(fh, 0, data[:50_000])
        wb.write(fh, 50_000, data[50_000:])
        wb.release(fh)
        await wb.sync([], 10)
        return bucket.objects["a.bin"], published

    (body, meta), published = run_writeback(tmp_path, fn)
    assert body == data
    assert meta == {"epochfs-mode": "0600", "epochfs-uid": str(UID), "epochfs-gid": str(GID)}  # private stays so
    assert published and "a.bin" in published[-1][0]


def test_a_file_with_a_second_writable_handle_is_not_uploaded_until_the_last_release(tmp_path):
    """A writer that forked (or dup'ed) shares the description: the first release is not the end."""
    async def fn(wb, bucket, room, published):
        fh, f = wb.create(root(wb), b"forked.pt", 0o644, UID, GID)
        second = wb.open(f, os.O_WRONLY)
        wb.write(fh, 0, b"x" * 1000)
        wb.flush(fh)
        wb.release(fh)
        left = await wb.sync([], 1.5)
        seen = dict(bucket.objects)
        wb.write(second, 1000, b"y" * 1000)
        wb.release(second)
        await wb.sync([], 10)
        return left, seen, bucket.objects

    left, seen, objects = run_writeback(tmp_path, fn)
    assert [p.state for p in left] == ["open for writing"] and seen == {}
    assert objects["forked.pt"][0] == b"x" * 1000 + b"y" * 1000


def test_a_full_quota_fails_the_file_and_it_is_never_uploaded(tmp_path):
    async def fn(wb, bucket, room, published):
        fh, f = wb.create(root(wb), b"big.pt", 0o644, UID, GID)
        wb.write(fh, 0, b"a" * 4000)
        with pytest.raises(Refused) as refused:
            wb.write(fh, 4000, b"b" * 4000)
        wb.release(fh)
        left = await wb.sync([], 2)
        fh2, _ = wb.create(root(wb), b"other.pt", 0o644, UID + 1, GID)  # another owner has a quota of its own
        wb.write(fh2, 0, b"c" * 4000)
        wb.release(fh2)
        await wb.sync(["other.pt"], 10)
        return refused.value, left, bucket.objects, room.pinned

    error, left, objects, pinned = run_writeback(tmp_path, fn, quota=5000)
    assert error.code == errno.EDQUOT
    assert [(p.key, p.state) for p in left] == [("big.pt", "not uploaded: its owner's write-back quota is full")]
    assert set(objects) == {"other.pt"} and pinned == 4000  # the failed file keeps its bytes here


def test_no_room_in_the_cache_is_enospc(tmp_path):
    async def fn(wb, bucket, room, published):
        fh, _ = wb.create(root(wb), b"huge.pt", 0o644, UID, GID)
        with pytest.raises(NoSpace):
            wb.write(fh, 0, b"z" * 20_000)
        wb.release(fh)
        return room.pinned, wb.pending()

    pinned, pending = run_writeback(tmp_path, fn, capacity=10_000)
    assert pinned == 0 and pending[0].state.startswith("not uploaded: the cache had no room")


def test_a_file_renamed_before_its_upload_is_uploaded_under_its_new_name_only(tmp_path):
    async def fn(wb, bucket, room, published):
        fh, _ = wb.create(root(wb), b"ckpt.tmp", 0o644, UID, GID)
        wb.write(fh, 0, b"weights")
        wb.release(fh)
        wb.rename(root(wb), b"ckpt.tmp", root(wb), b"ckpt.pt", 0)
        await wb.sync([], 10)
        return bucket.objects, wb.tree.resolve("ckpt.tmp")

    objects, old = run_writeback(tmp_path, fn)
    assert set(objects) == {"ckpt.pt"} and objects["ckpt.pt"][0] == b"weights" and old is None


def test_a_failed_upload_is_retried_and_nothing_is_lost(tmp_path):
    async def fn(wb, bucket, room, published):
        bucket.fail = 1
        fh, _ = wb.create(root(wb), b"retry.pt", 0o644, UID, GID)
        wb.write(fh, 0, b"r" * 5000)
        wb.release(fh)
        with trio.move_on_after(0.5):
            await wb.sync([], 0.5)
        first = [p.state for p in wb.pending()]
        await wb.sync([], 10)
        return first, bucket.objects, wb.statistics()

    first, objects, stats = run_writeback(tmp_path, fn)
    assert first in (["retrying (the endpoint is down)"], ["uploading"])  # (the state says why it waits)
    assert objects["retry.pt"][0] == b"r" * 5000 and stats.upload_errors == 1


def test_removing_an_object_deletes_it_in_the_backend_and_publishes_the_delete(tmp_path):
    old = ObjectInfo("old/ckpt.pt", 10, 0, '"e"')

    async def fn(wb, bucket, room, published):
        wb.unlink(wb.tree.resolve("old"), b"ckpt.pt")
        assert wb.tree.resolve("old/ckpt.pt") is None  # gone for this mount at once
        await wb.sync([], 10)
        return bucket.deleted, published

    deleted, published = run_writeback(tmp_path, fn, objects=[old])
    assert deleted == ["old/ckpt.pt"] and any("old/ckpt.pt" in removed for _, removed in published)


def test_what_the_journal_owes_is_taken_up_after_a_restart(tmp_path):
    async def write(wb, bucket, room, published):  # then the service stops before any upload starts
        fh, _ = wb.create(root(wb), b"closed.pt", 0o644, UID, GID)
        wb.write(fh, 0, b"c" * 3000)
        wb.release(fh)
        fh2, _ = wb.create(root(wb), b"open.pt", 0o644, UID, GID)  # its writer is cut off by the stop
        wb.write(fh2, 0, b"o" * 3000)
        return dict(bucket.objects)

    assert run_writeback(tmp_path, write) == {}

    async def after(wb, bucket, room, published):
        pinned = room.pinned
        await wb.sync([], 10)
        return pinned, bucket.objects, wb.tree.resolve("open.pt")

    pinned, objects, dropped = run_writeback(tmp_path, after)
    assert pinned == 3000 and set(objects) == {"closed.pt"} and objects["closed.pt"][0] == b"c" * 3000
    assert dropped is None  # never uploaded half-written


def test_an_upload_gives_way_to_a_fast_writer_for_a_bounded_time(tmp_path, monkeypatch):
    """A file closed before another is written fast (the next checkpoint) waits to upload while the
    writing goes on, at most giveway.MOST seconds: then it is uploaded beside the writer, which is
    still writing. A job waiting in sync is not made to wait (the other tests: no writer, no wait)."""
    from epochfs.writeback import giveway

    monkeypatch.setattr(giveway, "RATE", 1 << 20)  # (1 MiB/s a burst: the test writes 3 MiB/s)
    monkeypatch.setattr(giveway, "MOST", 0.8)

    async def fn(wb, bucket, room, published):
        fh, _ = wb.create(root(wb), b"first.pt", 0o644, UID, GID)
        wb.write(fh, 0, b"1" * 100_000)
        wb.release(fh)
        fh, _ = wb.create(root(wb), b"second.pt", 0o644, UID, GID)
        start, off, uploaded_while_writing = time.monotonic(), 0, None
        while time.monotonic() - start < 3.5:  # the first one's upload starts a second after its close
            wb.write(fh, off, b"2" * 65536)
            off += 65536
            if uploaded_while_writing is None and "first.pt" in bucket.objects:
                uploaded_while_writing = time.monotonic() - start
            await trio.sleep(0.02)
        wb.release(fh)
        left = await wb.sync([], 10)
        return uploaded_while_writing, left, wb.statistics(), bucket

    uploaded_at, left, stats, bucket = run_writeback(tmp_path, fn)
    assert left == [] and bucket.objects["first.pt"][0] == b"1" * 100_000
    assert 0.7 <= bucket.waited["first.pt"] <= 2.0, bucket.waited  # gave way, for MOST seconds
    assert uploaded_at is not None, "the writer held the upload back for as long as it wrote"
    assert stats.gave_way == 1 and stats.gave_way_seconds >= 0.7
    assert bucket.waited["second.pt"] < 0.1  # (uploaded in sync, with no writer: no waiting)
