"""The FUSE protocol layer without a mount: requests parsed from their bytes (every opcode the adapter
answers, and fuzz loops of damaged ones), replies encoded, and the session's answer to anything it reads
(a pipe stands in for /dev/fuse). Real mounts through it are every test that mounts."""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing

from epochfs import kernel
from epochfs.core.records import ObjectInfo
from epochfs.kernel import abi
from epochfs.kernel.session import Session
from epochfs.kernel.types import FileInfo, FUSEError
from epochfs.meta.index import build as build_namespace
from epochfs.vfs.fs import Operations
from epochfs.vfs.presentation import Presentation

from .helpers import FakeCache


def request(opcode: int, body: bytes = b"", *, unique: int = 7, nodeid: int = 1) -> bytes:
    return abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, unique, nodeid, 1000, 1000, 42, 0, 0) + body


READ_IN = struct.Struct("<QQIIQII")

SAMPLES = [
    request(abi.LOOKUP, b"name\0"),
    request(abi.GETATTR, struct.pack("<IIQ", 0, 0, 0)),
    request(abi.OPEN, struct.pack("<II", os.O_RDONLY, 0), nodeid=2),
    request(abi.READ, READ_IN.pack(1, 4096, 131072, 0, 0, 0, 0), nodeid=2),
    request(abi.READDIRPLUS, READ_IN.pack(1, 0, 4096, 0, 0, 0, 0)),
    request(abi.RELEASE, struct.pack("<QIIQ", 1, 0, 0, 0), nodeid=2),
    request(abi.WRITE, READ_IN.pack(1, 10, 5, 0, 0, 0, 0) + b"hello", nodeid=2),
    request(abi.CREATE, struct.pack("<IIII", os.O_WRONLY, 0o644, 0o022, 0) + b"new\0"),
    request(abi.MKDIR, struct.pack("<II", 0o755, 0o022) + b"dir\0"),
    request(abi.RENAME2, struct.pack("<QII", 1, 0, 0) + b"old\0new\0"),
    request(abi.SETATTR, struct.pack("<IIQQQQQQIIIIIIII", abi.FATTR_SIZE | abi.FATTR_MODE, 0, 0, 3, 0, 0, 0, 0,
                                     0, 0, 0, 0o600, 0, 0, 0, 0), nodeid=2),
    request(abi.GETXATTR, struct.pack("<II", 0, 0) + b"user.x\0"),
    request(abi.LISTXATTR, struct.pack("<II", 64, 0)),
    request(abi.BATCH_FORGET, struct.pack("<II", 2, 0) + struct.pack("<QQQQ", 2, 1, 3, 1)),
    request(abi.STATFS),
    request(abi.FLUSH, struct.pack("<QIIQ", 1, 0, 0, 0), nodeid=2),
    request(abi.INTERRUPT, struct.pack("<Q", 5)),
    request(abi.UNLINK, b"gone\0"),
    request(abi.IOCTL, struct.pack("<QIIQII", 0, 0, 0x5401, 0, 0, 60), nodeid=2),  # TCGETS: isatty()
]


def test_requests_parse_to_their_arguments():
    parsed = [abi.parse(r) for r in SAMPLES]
    assert all(abi.IN_HEAD.unpack_from(r) == abi.IN_HEADER.unpack_from(r)[:3] for r in SAMPLES)
    assert parsed[0].args == abi.NameIn(b"name") and (parsed[0].uid, parsed[0].pid) == (1000, 42)
    assert parsed[3].args == abi.ReadIn(fh=1, offset=4096, size=131072) and parsed[3].nodeid == 2
    assert parsed[6].args.data == b"hello" and parsed[6].args.offset == 10
    assert parsed[7].args == abi.CreateIn(flags=os.O_WRONLY, mode=0o644, umask=0o022, name=b"new")
    assert parsed[9].args == abi.RenameIn(newdir=1, flags=0, old=b"old", new=b"new")
    assert parsed[10].args.valid == abi.FATTR_SIZE | abi.FATTR_MODE and parsed[10].args.size == 3
    assert parsed[13].args.forgets == [(2, 1), (3, 1)]
    assert parsed[11].args == abi.GetxattrIn(size=0, name=b"user.x")


def test_damaged_requests_are_refused_as_malformed_never_another_error():
    rng = random.Random(11)
    for _ in range(4000):
        raw = bytearray(rng.choice(SAMPLES))
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.4 and raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            elif kind < 0.7:
                del raw[rng.randrange(len(raw) + 1):]
            else:
                raw += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        if rng.random() < 0.5 and len(raw) >= 4:  # keep the length honest, so the arguments are what is damaged
            raw[0:4] = struct.pack("<I", len(raw))
        try:
            abi.parse(bytes(raw))
        except abi.Malformed:
            pass
    for n in range(0, 200):
        with pytest.raises(abi.Malformed):
            abi.parse(bytes(n % 40))  # too short or a header that lies about its length


def test_replies_encode_the_kernel_structures():
    a = kernel.EntryAttributes(st_ino=5, st_mode=0o100444, st_nlink=1, st_size=10, st_blksize=4096, st_blocks=1,
                             st_mtime_ns=3_000_000_007, entry_timeout=1.5, attr_timeout=2)
    entry = abi.entry_out(a)
    assert len(entry) == 128
    nodeid, gen, ev, av, evn, avn = struct.unpack_from("<QQQQII", entry)
    assert (nodeid, ev, av, evn, avn) == (5, 1, 2, 500_000_000, 0)
    ino, size, blocks, at, mt, ct, atn, mtn, ctn, mode = struct.unpack_from("<QQQQQQIIII", entry, 40)
    assert (ino, size, mt, mtn, mode) == (5, 10, 3, 7, 0o100444)
    assert len(abi.attr_out(a)) == 104 and len(abi.statfs_out(kernel.StatvfsData())) == 80
    iov = abi.reply(9, b"abc", memoryview(b"de"))
    assert struct.unpack("<IiQ", iov[0]) == (21, 0, 9)
    assert struct.unpack("<IiQ", abi.error(9, errno.ENOENT)) == (16, -errno.ENOENT, 9)


def test_a_listing_reply_stops_before_the_kernels_buffer_is_full():
    a = kernel.EntryAttributes(st_ino=3, st_mode=0o100444)
    token = kernel.ReaddirToken(size=1000, plus=True)
    n = 0
    while kernel.readdir_reply(token, f"entry-{n}".encode(), a, n + 1):
        n += 1
    assert token.used <= 1000 and len(b"".join(token.parts)) == token.used and n == 1000 // 160
    ino, off, namelen, kind = struct.unpack_from("<QQII", b"".join(token.parts), 128)
    assert (ino, off, namelen, kind) == (3, 1, 7, 0o10)


class Pipe:
    """A session whose device is a pipe: what it answers can be read back."""

    def __init__(self, ops) -> None:
        self.session = Session(ops, "/", ["ro"])
        self.r, self.session.fd = os.pipe()
        os.set_blocking(self.r, False)

    def replies(self) -> list[tuple[int, int, bytes]]:
        try:
            raw = os.read(self.r, 1 << 20)
        except BlockingIOError:
            return []
        out = []
        while raw:
            length, err, unique = abi.OUT_HEADER.unpack_from(raw)
            out.append((unique, -err, raw[16:length]))
            raw = raw[length:]
        return out

    def close(self) -> None:
        os.close(self.r)
        self.session.close(unmount=False)


def adapter() -> Operations:
    tree = build_namespace([ObjectInfo("a", 5, 0, "e"), ObjectInfo("d/b", 3, 0, "e")], mtime_ns=1)
    return Operations(tree, FakeCache({"a": b"hello", "d/b": b"bye"}), attr_timeout=60,
                      root_xattrs={b"user.x": lambda: b"v"}, presentation=Presentation())


def test_the_control_files_ioctl_reaches_its_channel_with_the_kernels_caller_and_no_other_does():
    """The mount's control file (``.epochfs`` at the root, never listed) answers the channel's ioctl
    command with what the channel says, for the uid, gid and pid of the request's header; any other
    command, or that command on another file, is ENOTTY from the header alone (a process asking
    whether a file is a terminal), and the file cannot be opened for writing."""
    from epochfs.control import frames
    from epochfs.vfs.fs import CONTROL_INODE

    asked = []

    class Channel:
        name, command = frames.NAME.encode(), frames.COMMAND

        async def call(self, uid: int, gid: int, pid: int, data: bytes) -> bytes:
            asked.append((uid, gid, pid, len(data)))
            return frames.frame_out(frames.END, b"answer")

    async def main() -> None:
        ops = adapter()
        ops.control = Channel()
        ops.ioctl_commands = frozenset({frames.COMMAND})
        pipe = Pipe(ops)
        s = pipe.session
        frame = bytes(frames.frame_in(b"s" * 16, frames.RECV))
        ioctl = struct.pack("<QIIQII", 0, 0, frames.COMMAND, 0, len(frame), frames.FRAME) + frame
        async with trio.open_nursery() as nursery:
            s._nursery = nursery
            s._handle(memoryview(request(abi.LOOKUP, b".epochfs\0", unique=1)))
            s._handle(memoryview(request(abi.IOCTL, ioctl, unique=2, nodeid=CONTROL_INODE)))
            s._handle(memoryview(request(abi.IOCTL, ioctl, unique=3, nodeid=1)))  # the root is no control file
            s._handle(memoryview(request(abi.IOCTL, struct.pack("<QIIQII", 0, 0, 0x5401, 0, 0, 60), unique=4,
                                         nodeid=CONTROL_INODE)))
            s._handle(memoryview(request(abi.OPEN, struct.pack("<II", os.O_WRONLY, 0), unique=5, nodeid=CONTROL_INODE)))
            await trio.testing.wait_all_tasks_blocked()
            got = {u: (e, body) for u, e, body in pipe.replies()}
        assert got[1][0] == 0 and struct.unpack_from("<Q", got[1][1])[0] == CONTROL_INODE
        assert got[2][0] == 0 and frames.parse_out(got[2][1][abi.IOCTL_OUT.size:]) == (frames.END, b"answer")
        assert got[3] == (errno.ENOTTY, b"") and got[4] == (errno.ENOTTY, b"") and got[5][0] == errno.EPERM
        assert asked == [(1000, 1000, 42, frames.FRAME)] and s.isatty_asks == 1  # (the header's caller: request())
        assert b".epochfs" not in [name for _, name, _ in ops.tree.entries(ops.tree.node(1), 0)]  # never listed

    trio.run(main)


def test_the_session_answers_every_request_and_survives_any_input():
    """Plain handlers are answered inline, a missing one with ENOSYS, an unparsable request with EIO,
    FORGET and INTERRUPT with nothing, IOCTL (a process asking whether a file is a terminal) with ENOTTY
    from its header alone; then thousands of damaged requests against the real adapter: each
    gets at most one answer and the session keeps answering."""

    async def main() -> None:
        pipe = Pipe(adapter())
        s = pipe.session
        async with trio.open_nursery() as nursery:
            s._nursery = nursery
            s._handle(memoryview(request(abi.LOOKUP, b"a\0", unique=1)))
            s._handle(memoryview(request(abi.LOOKUP, b"zz\0", unique=2)))
            s._handle(memoryview(request(abi.SYMLINK, b"x\0y\0", unique=3)))
            s._handle(memoryview(request(abi.BMAP, b"", unique=4)))
            s._handle(memoryview(request(abi.LOOKUP, b"no-nul", unique=5)))
            s._handle(memoryview(request(abi.INTERRUPT, struct.pack("<Q", 1), unique=6)))
            s._handle(memoryview(request(abi.IOCTL, struct.pack("<QIIQII", 0, 0, 0x5401, 0, 0, 60), unique=7)))
            s._handle(memoryview(request(abi.IOCTL, b"", unique=10)))  # (its arguments are not even read)
            got = {u: (e, body) for u, e, body in pipe.replies()}
            assert got[7] == (errno.ENOTTY, b"") and got[10] == (errno.ENOTTY, b"") and s.isatty_asks == 2
            assert got[1][0] == 0 and struct.unpack_from("<Q", got[1][1])[0] > 1
            assert got[2][0] == errno.ENOENT and got[3][0] == errno.EROFS
            assert got[4][0] == errno.ENOSYS and got[5][0] == errno.EIO and 6 not in got
            inode = struct.unpack_from("<Q", got[1][1])[0]
            s._handle(memoryview(request(abi.OPEN, struct.pack("<II", os.O_RDONLY, 0), unique=8, nodeid=inode)))
            (_, e, body), = pipe.replies()
            fh, flags, _ = struct.unpack("<QII", body)
            assert e == 0 and flags & abi.FOPEN_KEEP_CACHE
            s._handle(memoryview(request(abi.READ, READ_IN.pack(fh, 1, 3, 0, 0, 0, 0), unique=9, nodeid=inode)))
            await trio.testing.wait_all_tasks_blocked()
            assert pipe.replies() == [(9, 0, b"ell")]

            rng = random.Random(5)
            samples = [r for r in SAMPLES if abi.parse(r).opcode != abi.WRITE]
            for i in range(3000):
                raw = bytearray(rng.choice(samples))
                raw[8:16] = struct.pack("<Q", 1000 + i)
                raw[16:24] = struct.pack("<Q", rng.choice([1, 2, 3, inode, 0, 2**64 - 1]))
                for _ in range(rng.randint(0, 3)):
                    at = rng.randrange(abi.IN_HEADER.size, len(raw)) if len(raw) > abi.IN_HEADER.size else 0
                    if at:
                        raw[at] = rng.randrange(256)
                s._handle(memoryview(bytes(raw)))
                if i % 50 == 0:
                    await trio.testing.wait_all_tasks_blocked()
                    answers = pipe.replies()
                    assert len({u for u, _, _ in answers}) == len(answers), "one answer per request"
            await trio.testing.wait_all_tasks_blocked()
            pipe.replies()
            s._handle(memoryview(request(abi.LOOKUP, b"a\0", unique=99)))
            assert [(u, e) for u, e, _ in pipe.replies()] == [(99, 0)]
            nursery.cancel_scope.cancel()
        pipe.close()

    trio.run(main)


def test_init_takes_only_what_both_sides_have_and_refuses_an_old_kernel():
    pipe = Pipe(adapter())
    s = pipe.session
    offered = abi.ASYNC_READ | abi.DO_READDIRPLUS | abi.MAX_PAGES | abi.NO_OPEN_SUPPORT | (1 << 31)
    s._handle(memoryview(request(abi.INIT, struct.pack("<IIII", 7, 44, 1 << 20, offered), unique=1)))
    (u, e, body), = pipe.replies()
    major, minor, readahead, flags = struct.unpack_from("<IIII", body)
    assert (e, major, minor, readahead) == (0, 7, abi.MINOR, 1 << 20)
    assert flags == abi.ASYNC_READ | abi.DO_READDIRPLUS | abi.MAX_PAGES and s.negotiated & abi.NO_OPEN_SUPPORT
    s._handle(memoryview(request(abi.INIT, struct.pack("<IIII", 7, 20, 0, offered), unique=2)))
    assert [(u, e) for u, e, _ in pipe.replies()] == [(2, errno.EPROTO)]
    pipe.close()


def test_unknown_mount_options_are_refused_with_their_name():
    with pytest.raises(kernel.MountError, match="'frobnicate'"):
        Session(adapter(), "/", ["ro", "frobnicate"])
    s = Session(adapter(), "/", ["ro", "nosuid", "allow_other", "fsname=s3://b/p\\,q", "subtype=epochfs"])
    o = s.options
    assert o.flags == 1 | 2 and o.data == ("allow_other",) and o.source == "s3://b/p,q" and o.fstype == "fuse.epochfs"


NOBODY_MOUNT = r'''
import errno, os, stat, sys
sys.path.insert(0, sys.argv[2])
import trio
from epochfs import kernel

class Ops:
    def lookup(self, parent, name, ctx):
        if parent == 1 and name == b"hello":
            return self.getattr(2, ctx)
        raise kernel.FUSEError(errno.ENOENT)
    def getattr(self, inode, ctx):
        mode = stat.S_IFDIR | 0o755 if inode == 1 else stat.S_IFREG | 0o444
        return kernel.EntryAttributes(st_ino=inode, st_mode=mode, st_nlink=1, st_size=0 if inode == 1 else 5)
    def open(self, inode, flags, ctx):
        return kernel.FileInfo(fh=inode)
    async def read(self, fh, off, size, inode=0, pid=0, reader=None):
        return b"world"[off:off + size]
    def release(self, fh):
        pass

session = kernel.Session(Ops(), sys.argv[1], {"ro", "fsname=a,b", "subtype=t", "default_permissions"})
session.mount()
async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        data = await trio.to_thread.run_sync(lambda: open(os.path.join(sys.argv[1], "hello")).read())
        mounts = [line.split()[:3] for line in open("/proc/self/mounts") if sys.argv[1] in line]
        print(data, mounts)
        session.terminate()
trio.run(main)
session.close()
print([line for line in open("/proc/self/mounts") if sys.argv[1] in line])
'''


def test_a_user_other_than_root_mounts_through_fusermount3():
    """Without root the session mounts through fusermount3 (the descriptor passed back over a socket),
    and unmounts through it. /dev/fuse is opened for the user, so it must be open to them (0666, the
    usual mode) for the time of the test."""
    if os.geteuid() != 0 or not shutil.which("fusermount3") or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root (to become nobody), fusermount3 and /usr/bin/python3")
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="epochfs-user-") as tmp:  # (pytest's are root's only)
        os.chmod(tmp, 0o755)
        _mount_as_nobody(Path(tmp))


def _mount_as_nobody(tmp_path: Path) -> None:
    """The session's package and trio's copied where nobody can read them, and run as nobody."""
    site = tmp_path / "site"
    site.mkdir()
    packages = Path(trio.__file__).parents[1]
    for name in ("trio", "attr", "attrs", "sortedcontainers", "idna", "outcome", "sniffio"):
        if (packages / name).exists():
            shutil.copytree(packages / name, site / name)
    shutil.copytree(Path(kernel.__file__).parents[1], site / "epochfs", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "mnt").mkdir()
    shutil.chown(tmp_path / "mnt", "nobody")
    script = tmp_path / "mount.py"
    script.write_text(NOBODY_MOUNT)
    subprocess.run(["chmod", "-R", "a+rX", str(tmp_path)], check=True)
    mode = os.stat("/dev/fuse").st_mode
    os.chmod("/dev/fuse", 0o666)
    try:
        r = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", str(script), str(tmp_path / "mnt"),
                            str(site)], capture_output=True, text=True, timeout=60)
    finally:
        os.chmod("/dev/fuse", stat.S_IMODE(mode))
    assert r.returncode == 0, r.stderr
    first, after = r.stdout.splitlines()
    assert first.startswith("world ") and "'a,b'" in first and "'fuse.t'" in first
    assert after == "[]"


def test_a_handler_that_answers_nonsense_is_answered_eio_and_the_session_goes_on():
    class Nonsense:
        def lookup(self, parent, name, ctx):
            return "not attributes"

        def getattr(self, inode, ctx):
            raise KeyError("a bug")

        def read_now(self, fh, off, size, inode=0, pid=0, reader=None):
            return 12345

        async def read(self, fh, off, size, inode=0, pid=0, reader=None):
            return b""

        def statfs(self, ctx):
            return kernel.StatvfsData(f_blocks=1)

    pipe = Pipe(Nonsense())
    s = pipe.session
    s._handle(memoryview(request(abi.LOOKUP, b"a\0", unique=1)))
    s._handle(memoryview(request(abi.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=2)))
    s._handle(memoryview(request(abi.READ, READ_IN.pack(0, 0, 10, 0, 0, 0, 0), unique=3)))
    s._handle(memoryview(request(abi.STATFS, unique=4)))
    assert [(u, e) for u, e, _ in pipe.replies()] == [(1, errno.EIO), (2, errno.EIO), (3, errno.EIO), (4, 0)]
    pipe.close()


#: The minors of the kernels the session must speak: 7.31 (Linux 5.4: Ubuntu 20.04), 7.33 (5.11), 7.34
#: (5.14-5.15: RHEL 9, Ubuntu 22.04), 7.36 (5.17: flags2), 7.37 (6.1: Debian 12), 7.38 (6.2: the
#: extension header), 7.39 (6.6-6.8: Ubuntu 24.04) and 7.44 (6.18: this machine).
KERNEL_MINORS = [31, 33, 34, 35, 36, 37, 38, 39, 44]
#: Reply sizes (header included) as a kernel of every one of those minors reads them.
REPLY_SIZES = {abi.LOOKUP: 16 + 128, abi.GETATTR: 16 + 104, abi.OPEN: 16 + 16, abi.STATFS: 16 + 80,
               abi.INIT: 16 + 64}


def fake_init(minor: int, flags: int, *, unique: int = 1) -> bytes:
    """The INIT a kernel of 7.``minor`` sends, offering ``flags``: 16 bytes of arguments before 7.36, then
    64 with ``flags2``."""
    body = struct.pack("<IIII", 7, minor, 1 << 20, flags & 0xFFFFFFFF)
    if minor >= 36:
        body += struct.pack("<I", flags >> 32) + b"\0" * 44
    return request(abi.INIT, body, unique=unique)


@pytest.mark.parametrize("minor", KERNEL_MINORS)
def test_the_session_speaks_each_kernels_minor_and_uses_only_what_it_offers(minor):
    """A fake kernel of each minor: INIT answered with min(ours, its) and only flags it offered (every
    flag the daemon wants that it has, nothing it lacks), replies of the sizes that kernel reads, the
    in-header's padding before 7.38 never read as an extension length, and zero-message opens only
    where the kernel offers them."""
    offered = 0
    for flag, since in abi.FLAG_MINOR.items():
        if since <= minor:
            offered |= flag
    pipe = Pipe(adapter())
    s = pipe.session
    s._handle(memoryview(fake_init(minor, offered)))
    (u, e, body), = pipe.replies()
    assert e == 0 and len(body) + 16 == REPLY_SIZES[abi.INIT]
    major, got_minor, _, flags = struct.unpack_from("<IIII", body)
    max_pages, flags2 = struct.unpack_from("<H", body, 28)[0], struct.unpack_from("<I", body, 32)[0]
    assert (major, got_minor, s.minor) == (7, min(minor, abi.MINOR), min(minor, abi.MINOR))
    assert flags & ~offered == 0 and flags2 == 0
    from epochfs.kernel.session import WANT
    assert flags == WANT & offered & 0xFFFFFFFF  # every wanted flag the kernel has
    assert max_pages == (256 if flags & abi.MAX_PAGES else 0)
    # the header's padding, which becomes total_extlen at 7.38: a kernel before that may leave it anything
    raw = bytearray(request(abi.LOOKUP, b"a\0", unique=2))
    struct.pack_into("<H", raw, 36, 3 if minor < 38 else 0)
    s._handle(memoryview(bytes(raw)))
    (u, e, body), = pipe.replies()
    assert (u, e, len(body) + 16) == (2, 0, REPLY_SIZES[abi.LOOKUP])
    inode = struct.unpack_from("<Q", body)[0]
    for unique, opcode, arg in ((3, abi.GETATTR, struct.pack("<IIQ", 0, 0, 0)), (4, abi.STATFS, b"")):
        s._handle(memoryview(request(opcode, arg, unique=unique, nodeid=inode if opcode == abi.GETATTR else 1)))
        (u, e, body), = pipe.replies()
        assert (u, e, len(body) + 16) == (unique, 0, REPLY_SIZES[opcode])
    pipe.close()
    # zero-message opens: ENOSYS to OPEN only for a kernel that offers NO_OPEN_SUPPORT (all of these do)
    for offers in (offered, offered & ~abi.NO_OPEN_SUPPORT):
        ops = adapter()
        ops.zero_open = True
        pipe = Pipe(ops)
        ops.session = pipe.session
        pipe.session._handle(memoryview(fake_init(minor, offers)))
        pipe.replies()
        pipe.session._handle(memoryview(request(abi.OPEN, struct.pack("<II", os.O_RDONLY, 0), unique=5,
                                                nodeid=inode)))
        (u, e, body), = pipe.replies()
        if offers & abi.NO_OPEN_SUPPORT:
            assert e == errno.ENOSYS
        else:
            assert e == 0 and len(body) + 16 == REPLY_SIZES[abi.OPEN]
        pipe.close()


@pytest.mark.parametrize("minor", KERNEL_MINORS)
def test_passthrough_is_asked_for_only_where_the_kernel_offers_it_and_never_with_a_writeback_cache(minor):
    """A kernel of 7.40 or later that offers FUSE_PASSTHROUGH gets it asked for (flags2 bit 5, with
    FUSE_INIT_EXT), 7.40 spoken and a stack depth of 1, in the 64-byte reply; an earlier one, one that
    does not offer it, or a mount with a write-back cache: nothing of it. An open answered with a backing
    id carries FOPEN_PASSTHROUGH and the id, in the same 16 bytes."""
    offered = 0
    for flag, since in abi.FLAG_MINOR.items():
        if since <= minor:
            offered |= flag
    for offers, writeback in ((offered, False), (offered & ~abi.PASSTHROUGH, False), (offered, True)):
        ops = adapter()
        ops.want_passthrough = True
        ops.enable_writeback_cache = writeback
        pipe = Pipe(ops)
        s = pipe.session
        s._handle(memoryview(fake_init(minor, offers)))
        (u, e, body), = pipe.replies()
        assert e == 0 and len(body) + 16 == REPLY_SIZES[abi.INIT]
        _, got_minor, _, flags = struct.unpack_from("<IIII", body)
        flags2, depth = struct.unpack_from("<II", body, 32)
        if minor >= 40 and offers & abi.PASSTHROUGH and not writeback:
            assert flags & abi.INIT_EXT and flags2 == abi.PASSTHROUGH >> 32 and depth == 1
            assert got_minor == s.minor == 40 and s.can(abi.PASSTHROUGH)
        else:
            assert flags2 & (abi.PASSTHROUGH >> 32) == 0 and depth == 0 and not s.can(abi.PASSTHROUGH)
            assert got_minor == min(minor, abi.MINOR)
        pipe.close()
    info = FileInfo(fh=7, keep_cache=True, backing_id=3)
    raw = abi.open_out(info.fh, info.flags(), info.backing_id)
    assert len(raw) == 16 and struct.unpack("<QIi", raw) == (7, abi.FOPEN_PASSTHROUGH, 3)
    assert struct.unpack("<QIi", abi.open_out(7, FileInfo(fh=7).flags())) == (7, abi.FOPEN_KEEP_CACHE, 0)


def test_every_request_is_one_row_with_a_typed_handler():
    """Each row of the table names a method of the operations interface that takes the arguments the
    row passes, a coroutine exactly where the request may wait; its arguments have a typed row of their
    own; the interface answers ENOSYS by default; and the adapter's methods keep the interface's
    signatures."""
    import inspect

    from epochfs.kernel.operations import Operations
    from epochfs.kernel.translate import ROWS
    from epochfs.vfs.fs import Operations as Adapter

    for opcode, row in ROWS.items():
        assert opcode in abi.PARSERS, f"opcode {opcode} has no arguments row"
        method = getattr(Operations, row.handler)
        params = list(inspect.signature(method).parameters.values())[1:]
        required = [p for p in params if p.default is inspect.Parameter.empty]
        assert len(required) <= row.arity <= len(params), (row.handler, row.arity, params)
        assert inspect.iscoroutinefunction(method) == row.waits, row.handler
        mine = getattr(Adapter, row.handler)
        assert len(inspect.signature(mine).parameters) == len(params) + 1, row.handler
        assert inspect.iscoroutinefunction(mine) == row.waits, row.handler
    with pytest.raises(FUSEError) as raised:
        Operations().lookup(1, b"x", None)
    assert raised.value.errno == errno.ENOSYS
    pipe = Pipe(Operations())  # a file system that answers nothing: every request ENOSYS, no failure
    pipe.session._handle(memoryview(fake_init(44, 0)))
    pipe.replies()
    pipe.session._handle(memoryview(request(abi.LOOKUP, b"a\0", unique=2)))
    pipe.session._handle(memoryview(request(abi.FLUSH, struct.pack("<QIIQ", 1, 0, 0, 0), unique=3)))
    assert [(u, e) for u, e, _ in pipe.replies()] == [(2, errno.ENOSYS), (3, errno.ENOSYS)]
    pipe.close()


@pytest.mark.parametrize("limit, pages", [("256\n", 256), ("512\n", 512), ("65535\n", 512), ("100\n", 256),
                                          ("garbage", 256), (None, 256)])
def test_requests_are_as_large_as_the_kernel_allows_up_to_a_2_mib_folio(tmp_path, monkeypatch, limit, pages):
    """The INIT reply's max_pages and max_write (and the read buffer behind them) follow the node's
    ``fs.fuse.max_pages_limit``, up to 512 pages: the largest folio a kernel that gives FUSE files large
    folios would size from them (min(max_write, max_read) pages, max_pages; docs/kernel-paths.md)."""
    from epochfs.kernel import session as sess

    path = tmp_path / "max_pages_limit"
    if limit is not None:
        path.write_text(limit)
    monkeypatch.setattr(sess, "MAX_PAGES_LIMIT", str(path))
    pipe = Pipe(adapter())
    s = pipe.session
    assert (s.max_pages, s.max_write) == (pages, pages * 4096)
    s._handle(memoryview(fake_init(abi.MINOR, abi.MAX_PAGES | abi.BIG_WRITES)))
    (u, e, body), = pipe.replies()
    assert e == 0
    max_write, max_pages = struct.unpack_from("<I", body, 20)[0], struct.unpack_from("<H", body, 28)[0]
    assert (max_write, max_pages) == (pages * 4096, pages)
