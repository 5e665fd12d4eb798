"""The FUSE adapter called directly, without a mount (no /dev/fuse, no S3): attributes, listings across a
snapshot switch, errno mapping, read-only answers. Real mounts are in test_mount.py."""

from __future__ import annotations

import errno
import inspect
import os
import stat

import pytest
import trio

from epochfs import kernel
from epochfs.core.errors import AccessDenied, BackendUnavailable, ObjectChanged
from epochfs.core.records import ObjectInfo
from epochfs.meta.index import NamespaceIndex
from epochfs.meta.index import build as build_namespace
from epochfs.meta.namespace import ROOT_INODE, Namespace, diff
from epochfs.vfs.fs import Operations
from epochfs.vfs.presentation import Presentation

from .helpers import FakeCache

CTX = kernel.RequestContext()


def ns(*objs: ObjectInfo) -> Namespace:
    return build_namespace(objs, mtime_ns=1)


def ops_for(namespace: Namespace, data: dict[str, bytes] | None = None, **present) -> Operations:
    return Operations(namespace, FakeCache(data or {}), attr_timeout=60, root_xattrs={b"user.x": lambda: b"v"},
                      presentation=Presentation(**present))


def run(fn, *args):
    """A handler's answer: the session calls plain handlers as it reads their request, and runs
    coroutine ones (reads, fsync) as tasks."""
    return trio.run(fn, *args) if inspect.iscoroutinefunction(fn) else fn(*args)


def lookup(ops: Operations, path: str):
    inode = ROOT_INODE
    for part in path.split("/"):
        inode = run(ops.lookup, inode, part.encode(), CTX).st_ino
    return run(ops.getattr, inode, CTX)


def test_source_modes_and_owners_are_presented_and_uniform_options_override_them():
    tree = ns(ObjectInfo("", 0, 5, "", 0o750, 10, 20), ObjectInfo("d/", 0, 6, "", 0o700, 11, 21),
              ObjectInfo("d/f", 3, 7, "e", 0o4755, 12, 22), ObjectInfo("s3-like", 3, 8, "e"))
    ops = ops_for(tree)
    root = run(ops.getattr, ROOT_INODE, CTX)
    assert (stat.S_IMODE(root.st_mode), root.st_uid, root.st_gid) == (0o750, 10, 20)
    d, f, plain = lookup(ops, "d"), lookup(ops, "d/f"), lookup(ops, "s3-like")
    assert stat.S_ISDIR(d.st_mode) and (stat.S_IMODE(d.st_mode), d.st_uid, d.st_mtime_ns) == (0o700, 11, 6)
    assert stat.S_ISREG(f.st_mode) and stat.S_IMODE(f.st_mode) == 0o755, "set-id bits are never presented"
    assert (f.st_uid, f.st_gid) == (12, 22)
    assert stat.S_IMODE(plain.st_mode) == 0o444 and plain.st_uid == os.getuid()
    uniform = ops_for(tree, file_mode=0o440, dir_mode=0o550, uid=7, gid=8)
    f = lookup(uniform, "d/f")
    assert (stat.S_IMODE(f.st_mode), f.st_uid, f.st_gid) == (0o440, 7, 8)
    assert stat.S_IMODE(lookup(uniform, "d").st_mode) == 0o550


def test_a_listing_holds_no_version_and_continues_from_any_offset_at_once(monkeypatch):
    """A listing is the directory as it is now: a refresh while it is open neither breaks it nor is held
    back by it (the handle holds no version of the tree), and the kernel's offset of any entry (a seek,
    telldir/seekdir) continues the listing from that entry with one lookup, on whichever version is
    current, each name once."""
    from epochfs.meta.entries import name_cookie

    before = ns(*(ObjectInfo(f"d/{i:03d}", 1, 0, "e") for i in range(50)))
    after = build_namespace([*(ObjectInfo(f"d/{i:03d}", 1, 0, "e") for i in range(50)),
                             ObjectInfo("d/new", 1, 0, "e")], mtime_ns=2, previous=before)
    ops = ops_for(before)
    listed: list[tuple[bytes, int]] = []

    def reply(token, name, attrs, next_id):
        listed.append((name, next_id))
        return len(listed) % 10 != 0  # the kernel's buffer fills every 10 entries

    monkeypatch.setattr(kernel, "readdir_reply", reply)
    d = run(ops.lookup, ROOT_INODE, b"d", CTX).st_ino
    fh = run(ops.opendir, d, CTX)
    assert ops._dirs[fh].inode == d  # (the node alone)
    run(ops.readdir, fh, 0, None)
    before.close()  # nothing of the listing needs the version it began on
    ops.namespace = after  # a refresh switches snapshots while the listing is open
    while True:
        had = len(listed)
        run(ops.readdir, fh, listed[-1][1], None)
        if len(listed) == had:
            break
    names = [n for n, _ in listed if n not in (b".", b"..")]
    # "." and ".." once each, last, at offsets past every name's cookie (`ls -a` shows them)
    assert [n for n, _ in listed if n in (b".", b"..")] == [b".", b".."] and listed[-2][0] == b"."
    assert sorted(names) == sorted([f"{i:03d}".encode() for i in range(50)] + [b"new"])
    assert names == sorted(names, key=lambda n: (name_cookie(n), n)) and len(set(names)) == len(names)
    for k in (0, 7, 23, 49):  # a seek to the offset of entry k lists what follows it, at once
        name, offset = listed[k]
        tail = len(listed)
        run(ops.readdir, fh, offset, None)
        assert listed[tail][0] == names[k + 1]
    run(ops.releasedir, fh)


def test_a_readdir_costs_the_entries_it_answers_wherever_it_starts(monkeypatch):
    """In a directory of 20,000 names, a listing started at any offset (a seek far into it, an offset
    no entry has, the very end) decodes only the entries it answers, never the ones before."""
    from epochfs.meta.namespace import Namespace

    big = ns(*(ObjectInfo(f"d/{i:06d}", 1, 0, "e") for i in range(20_000)))
    ops = ops_for(big)
    d = run(ops.lookup, ROOT_INODE, b"d", CTX).st_ino
    fh = run(ops.opendir, d, CTX)
    cookies = [c for c, _, _ in big.entries_after(d, 0)]
    decoded = []
    real = Namespace._found
    monkeypatch.setattr(Namespace, "_found", lambda self, raw: decoded.append(1) or real(self, raw))
    answered: list[bytes] = []

    def reply(token, name, attrs, next_id):
        answered.append(name)
        return len(answered) % 16 != 0

    monkeypatch.setattr(kernel, "readdir_reply", reply)
    for offset in (cookies[19_000], cookies[5] + 1, cookies[-1], (1 << 62) - 1, 12345):
        decoded.clear()
        answered.clear()
        run(ops.readdir, fh, offset, None)
        assert len(decoded) <= len(answered) + 1, (offset, len(decoded))
    run(ops.releasedir, fh)


def test_reads_and_errors_through_the_one_errno_table():
    tree = ns(ObjectInfo("a", 5, 0, "e"))
    ops = ops_for(tree, {"a": b"hello"})
    inode = run(ops.lookup, ROOT_INODE, b"a", CTX).st_ino
    fi = run(ops.open, inode, os.O_RDONLY, CTX)
    assert run(ops.read, fi.fh, 1, 3) == b"ell"
    for exc, code in [(ObjectChanged("x"), errno.ESTALE), (AccessDenied("x"), errno.EACCES),
                      (BackendUnavailable("x"), errno.EIO), (RuntimeError("bug"), errno.EIO)]:
        ops.cache.error = exc
        with pytest.raises(kernel.FUSEError) as info:
            run(ops.read, fi.fh, 0, 5)
        assert info.value.errno == code
    assert ops.statistics().errors == {"ESTALE": 1, "EACCES": 1, "EIO": 1, "internal": 1}
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_APPEND):
        with pytest.raises(kernel.FUSEError) as info:
            run(ops.open, inode, flags, CTX)
        assert info.value.errno == errno.EROFS
    with pytest.raises(kernel.FUSEError) as info:
        run(ops.lookup, ROOT_INODE, b"missing", CTX)
    assert info.value.errno == errno.ENOENT
    assert run(ops.getxattr, ROOT_INODE, b"user.x", CTX) == b"v"
    with pytest.raises(kernel.FUSEError):
        run(ops.getxattr, inode, b"user.x", CTX)


def test_a_read_only_mount_declines_flush_so_the_kernel_stops_sending_it():
    """close() on a read-only mount has nothing to do: ENOSYS once, and the kernel sends no FLUSH for
    the rest of the mount (one request less per file read). Not counted as an error."""
    tree = ns(ObjectInfo("a", 5, 0, "e"))
    ops = ops_for(tree, {"a": b"hello"})
    fi = run(ops.open, run(ops.lookup, ROOT_INODE, b"a", CTX).st_ino, os.O_RDONLY, CTX)
    with pytest.raises(kernel.FUSEError) as info:
        run(ops.flush, fi.fh)
    assert info.value.errno == errno.ENOSYS
    assert ops.statistics().errors == {}
    run(ops.release, fi.fh)


def test_zero_message_opens_read_each_inode_as_one_version_and_keep_old_ones_while_held():
    """A read-only mount answers OPEN with ENOSYS (the kernel then opens files without asking) and reads
    with no handle by inode. Its index gives a changed file a new inode number, and the adapter keeps
    the old number readable (the old version) until the kernel forgets it: a file held open across a
    refresh keeps reading what it opened, a new lookup reads the new version. Write-back mounts keep
    their handles."""
    index = NamespaceIndex.temporary()
    index.renumber_changed = True
    old, new = ObjectInfo("a", 5, 0, "e1"), ObjectInfo("a", 5, 1, "e2")
    before = index.build([old, ObjectInfo("b", 1, 0, "e")], source="", version=1, created=0.0, mtime_ns=1)
    versions = {"e1": b"AAAAA", "e2": b"BBBBB", "e": b"x"}

    class Versions(FakeCache):
        def open_stream(self, obj, inode=0, reader=None):
            opened.append(obj)
            stream = super().open_stream(obj, inode)
            stream.read = lambda off, size: _answer(versions[obj.etag][off:off + size])
            return stream

    opened: list[ObjectInfo] = []
    ops = Operations(before, Versions({}), attr_timeout=60, root_xattrs={}, zero_open=True)
    held = run(ops.lookup, ROOT_INODE, b"a", CTX).st_ino
    with pytest.raises(kernel.FUSEError) as info:
        run(ops.open, held, os.O_RDONLY, CTX)
    assert info.value.errno == errno.ENOSYS and ops.statistics().errors == {}

    def read(inode: int, off: int, pid: int) -> bytes:
        return trio.run(ops.read, 0, off, 2, inode, pid)

    assert read(held, 0, 100) == b"AA" and opened == [old]
    after = index.build([new, ObjectInfo("b", 1, 0, "e")], source="", version=2, created=0.0, mtime_ns=2,
                        previous=before)
    ops.switch(after, diff(before, after)[1])
    fresh = run(ops.lookup, ROOT_INODE, b"a", CTX).st_ino
    assert fresh != held and run(ops.lookup, ROOT_INODE, b"b", CTX).st_ino == before.resolve("b").inode
    assert read(held, 2, 100) == b"AA" and read(held, 0, 200) == b"AA"  # held open: the version it opened
    assert run(ops.getattr, held, CTX).st_mtime_ns == 0
    assert read(fresh, 2, 100) == b"BB" and opened[-1] == new
    ops.forget([(held, 1)])  # the kernel let go of it
    with pytest.raises(kernel.FUSEError) as info:
        read(held, 0, 300)
    assert info.value.errno == errno.ENOENT
    for pid in range(1000, 1000 + ops.BOUND + 10):
        read(fresh, 0, pid)
    assert len(ops._bound) == ops.BOUND  # bounded
    writable = Operations(before, FakeCache({}), attr_timeout=60, root_xattrs={}, zero_open=True,
                          writeback=object())  # type: ignore[arg-type]
    assert not writable.zero_open


async def _answer(data: bytes) -> bytes:
    return data


def test_expected_answers_are_answered_and_counted_nowhere_failures_are_counted():
    """An errno the kernel expects (no such attribute, a directory opened as a file, a file listed as a
    directory, FLUSH on a read-only mount) is answered as such and is not an error in the metrics; a
    backend failure is counted by its errno."""
    ops = ops_for(ns(ObjectInfo("d/a", 3, 0, "e")), {"d/a": b"abc"})
    d = run(ops.lookup, ROOT_INODE, b"d", CTX).st_ino
    a = run(ops.lookup, d, b"a", CTX).st_ino
    for call, code in ((lambda: ops.getxattr(ROOT_INODE, b"user.nope", CTX), kernel.ENOATTR),
                       (lambda: ops.open(d, os.O_RDONLY, CTX), errno.EISDIR),
                       (lambda: ops.opendir(a, CTX), errno.ENOTDIR),
                       (lambda: ops.flush(1), errno.ENOSYS)):
        with pytest.raises(kernel.FUSEError) as raised:
            call()
        assert raised.value.errno == code
    assert ops.statistics().errors == {}
    ops.cache.error = AccessDenied("no")  # (FakeCache: every read fails so)
    fh = run(ops.open, a, os.O_RDONLY, CTX).fh
    with pytest.raises(kernel.FUSEError) as raised:
        run(ops.read, fh, 0, 3)
    assert raised.value.errno == errno.EACCES and ops.statistics().errors == {"EACCES": 1}
