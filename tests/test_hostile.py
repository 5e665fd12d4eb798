"""Hostile and careless input against real mounts: a block-size change, another local user, symlinks in
a source or a stored snapshot, malformed control requests, a cache directory someone else prepared,
descriptor exhaustion, absurd metadata. The rule: never a wrong byte, never a dead daemon, never a leak."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from epochfs.backend.local import file_etag
from epochfs.control import protocol as p
from epochfs.control.protocol import OPERATIONS
from epochfs.core.records import ObjectInfo
from epochfs.dev.sample import SampleFile, pattern, upload, write_tree
from epochfs.meta.lmdb import LmdbMetaStore

from .conftest import requires_fuse
from .helpers import EPOCHFS, drop_all_caches, read_all, run_with_deadline, wait_idle

pytestmark = requires_fuse
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def shared_dir(request) -> Path:
    """A directory other users can traverse (pytest's own tmp dirs are private to root)."""
    base = Path(tempfile.mkdtemp(prefix="epochfs-shared-"))
    os.chmod(base, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    return base


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", "nobody", "--", *cmd], capture_output=True, text=True, timeout=30,
                          errors="replace")


# -- 1. a block-size change never serves a block cut at the old geometry --------------------------------

@pytest.mark.parametrize("first, second", [pytest.param("4M", "1M", marks=pytest.mark.slow), ("1M", "4M")])
@pytest.mark.page_cache
def test_block_size_change_on_one_cache_serves_correct_bytes(s3_client, fresh_bucket, mount_factory, first,
                                                             second):
    files = [SampleFile(f"bs/{i}.bin", size) for i, size in enumerate([9 * MiB + 3, 5 * MiB - 7, 300 * KiB + 1])]
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}", "--block-size", first, "--readahead", "0")
    with m:
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        wait_idle(m)
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", second, "--readahead", "0",
                       cache_dir=m.cache_dir, name="again") as m2:
        drop_all_caches()
        rng = random.Random(5)
        for f in files:
            with open(m2.path(f.key), "rb", buffering=0) as fh:
                for _ in range(40):  # odd sizes at seeded offsets across both geometries' boundaries
                    off, size = rng.randrange(f.size), rng.choice([1, 4095, 70_000, MiB + 17])
                    assert os.pread(fh.fileno(), size, off) == pattern(f.key, 0, off, min(size, f.size - off))
            assert read_all(m2.path(f.key)) == f.content()
        status = wait_idle(m2)
        assert not status["errors"], status["errors"]
        assert status["cache"]["demand_fetches"] > 0, "the old geometry's blocks were served for the new one"


# -- 2. a file:// source presents its permissions to other users --------------------------------------------

def test_directory_source_permissions_are_enforced_for_other_users(shared_dir, mount_factory):
    src = shared_dir / "src"
    write_tree(str(src), [SampleFile("public.bin", 5000), SampleFile("secret.bin", 6000),
                          SampleFile("private/inner.bin", 100)])
    os.chmod(src, 0o755)
    os.chmod(src / "public.bin", 0o644)
    os.chmod(src / "secret.bin", 0o600)  # root only
    os.chmod(src / "private", 0o700)
    os.chown(src / "public.bin", 1234, 4321)
    mnt = shared_dir / "mnt"
    m = mount_factory(f"file://{src}", "--allow-other", cache_dir=shared_dir / "cache", name="unused")
    m.mountpoint = mnt
    mnt.mkdir()
    with m:
        st = os.stat(mnt / "public.bin")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o644, 1234, 4321)
        assert stat.S_IMODE(os.stat(mnt / "secret.bin").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(mnt / "private").st_mode) == 0o700
        ok = as_nobody("sha256sum", str(mnt / "public.bin"))  # readable by everyone
        want = subprocess.run(["sha256sum", str(src / "public.bin")], capture_output=True, text=True).stdout
        assert ok.returncode == 0 and ok.stdout.split()[0] == want.split()[0], ok.stderr
        denied = as_nobody("cat", str(mnt / "secret.bin"))
        assert denied.returncode != 0 and "Permission denied" in denied.stderr
        denied = as_nobody("ls", str(mnt / "private"))
        assert denied.returncode != 0 and "Permission denied" in denied.stderr
        assert read_all(mnt / "secret.bin") == SampleFile("secret.bin", 6000).content()  # root still reads it
    uniform = mount_factory(f"file://{src}", "--allow-other", "--file-mode", "0444", "--dir-mode", "0555",
                            cache_dir=shared_dir / "cache", name="unused2")
    uniform.mountpoint = mnt
    with uniform:  # the uniform presentation is there when asked for
        assert stat.S_IMODE(os.stat(mnt / "secret.bin").st_mode) == 0o444
        assert as_nobody("cat", str(mnt / "secret.bin")).returncode == 0


# -- 3. no symlink is followed anywhere in a path, whatever the snapshot says ------------------------------

def test_a_stored_snapshot_naming_a_path_through_a_symlink_never_reads_outside(tmp_path, mount_factory):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "shadow"
    secret.write_bytes(b"root:$6$secret-hash:19000::::::\n")
    src = tmp_path / "src"
    write_tree(str(src), [SampleFile("ok.bin", 1000)])
    os.symlink(outside, src / "link")
    st = os.stat(secret)
    cache = tmp_path / "cache"
    # A snapshot as a shared store (or anyone who can write one) could hold it: an entry under the link.
    LmdbMetaStore(cache / "meta").save(f"file://{src}", [
        ObjectInfo("ok.bin", 1000, 0, file_etag(os.stat(src / "ok.bin"))),
        ObjectInfo("link/shadow", st.st_size, st.st_mtime_ns, file_etag(st)),
    ])
    with mount_factory(f"file://{src}", cache_dir=cache) as m:
        assert read_all(m.path("ok.bin")) == SampleFile("ok.bin", 1000).content()
        with pytest.raises(OSError) as info:
            read_all(m.path("link/shadow"))
        assert info.value.errno in (errno.ESTALE, errno.EIO)
        blocks = [p for d in ("blocks", "packs") for p in (cache / d).rglob("*") if p.is_file()]
        assert all(b"secret-hash" not in p.read_bytes() for p in blocks)


# -- 4. nothing a client sends stops the daemon ------------------------------------------------------------

def _raw_request(sock_path: str, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(sock_path)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except BrokenPipeError:  # refused before it was all read: the reply says why
            pass
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.page_cache
def test_fuzzed_control_requests_get_error_replies_and_the_mount_stays_exact(s3_client, fresh_bucket,
                                                                             mount_factory):
    files = [SampleFile(f"z/{i}.bin", 64 * KiB + 11 * i) for i in range(8)]
    upload(s3_client, fresh_bucket, "", files)
    with mount_factory(f"s3://{fresh_bucket}") as m:
        sock = os.getxattr(m.mountpoint, "user.epochfs.control").decode()
        rng = random.Random(3)
        values = [None, True, 0, -5, 1 << 70, 2.5, "", "z/0.bin", "\udc80", [], [[0]], [["x", 1]],
                  [[1, "z/0.bin"]], [[1, "missing"]], [[1, "z"]], {"a": []}, "a" * 5000]
        for i in range(500):
            kind = i % 5
            if kind == 4:  # a streamed request: a header, then chunk lines that may be anything
                head = {"op": rng.choice(["prefetch", "warmup", "resident"]), "entries": [], "follow": True}
                chunks = [rng.choice([b"[[1, \"z/0.bin\"]]\n", b"[[1, 2]]\n", b"{}\n", b"[" * 5000 + b"\n",
                                      bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 100))) + b"\n",
                                      json.dumps([[1, "z/1.bin"]] * (p.CHUNK_ENTRIES + 1)).encode() + b"\n"])
                          for _ in range(rng.randrange(0, 4))]
                payload = json.dumps(head).encode() + b"\n" + b"".join(chunks) + rng.choice([b"[]\n", b""])
            elif kind == 0:
                payload = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 300))) + b"\n"
            elif kind == 1:
                payload = rng.choice([b"[" * 50_000 + b"\n", b"{}\n", b"null\n", b'{"op": 7}\n', b"\xff\xfe\n",
                                      b'{"op": "job", "id": ' + b"9" * 5000 + b"}\n", b""])
            else:
                obj = {"op": rng.choice([*OPERATIONS, "nope"])}
                for field in rng.sample(["entries", "source", "epoch", "replace", "id", "name", "text", "x"],
                                        rng.randrange(0, 4)):
                    obj[field] = rng.choice(values)
                payload = json.dumps(obj).encode() + b"\n"
            reply = _raw_request(sock, payload)
            assert reply.endswith(b"\n") and isinstance(json.loads(reply), dict), (payload[:80], reply[:200])
        status = m.status()  # alive and answering
        assert status["pid"] > 0
        drop_all_caches()
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        assert "Traceback" not in m.log(), "an input reached an unexpected error path"


# -- 5. a cache directory someone else prepared is refused, ours is private ---------------------------------

def test_planted_symlinks_and_foreign_ownership_in_the_cache_dir_are_refused(shared_dir, s3, sample_bucket,
                                                                              mount_factory):
    target = shared_dir / "root-only-target"
    target.write_bytes(b"precious\n")
    os.chmod(target, 0o600)

    def attempt(prepare, expect: str) -> None:
        cache = shared_dir / f"cache-{expect.split()[0]}-{random.randrange(1 << 30)}"
        prepare(cache)
        m = mount_factory(f"s3://{sample_bucket}/data", cache_dir=cache, name=f"m{random.randrange(1 << 30)}")
        r = m.start(expect_ok=False)
        assert r.returncode == 2 and expect in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert target.read_bytes() == b"precious\n", "a planted link was followed"
        assert not os.path.ismount(m.mountpoint)

    def foreign(cache: Path) -> None:
        cache.mkdir(mode=0o700)
        os.chown(cache, 65534, 65534)

    def writable(cache: Path) -> None:
        cache.mkdir()
        os.chmod(cache, 0o777)

    def link(name: str):
        def prepare(cache: Path) -> None:
            cache.mkdir(mode=0o700)
            os.symlink(target, cache / name)
        return prepare

    def foreign_blocks(cache: Path) -> None:
        cache.mkdir(mode=0o700)
        (cache / "blocks").mkdir()
        os.chown(cache / "blocks", 65534, 65534)

    attempt(foreign, "belongs to uid 65534")
    attempt(writable, "writable by other users")
    attempt(link("lock"), "symbolic link")
    attempt(link("epochfs.log"), "symbolic link")
    attempt(foreign_blocks, "belongs to uid 65534")

    cache = shared_dir / "ours"
    cache.mkdir(mode=0o755)
    (cache / "blocks").mkdir(mode=0o755)  # made by hand, readable by all: made private at start-up
    with mount_factory(f"s3://{sample_bucket}/data", cache_dir=cache, name="ours") as m:
        for p in list(m.mountpoint.rglob("*"))[:20]:
            if p.is_file():
                read_all(p)
        wait_idle(m)
        for p in [cache, *cache.rglob("*")]:
            mode = stat.S_IMODE(os.lstat(p).st_mode)
            assert mode & 0o077 == 0, f"{p} is mode {mode:04o}"


# -- 6. running out of descriptors never deletes a healthy block --------------------------------------------

@pytest.mark.page_cache
def test_descriptor_exhaustion_never_deletes_cached_blocks(s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"fd/{i}.bin", 200 * KiB + i) for i in range(20)]
    upload(s3_client, fresh_bucket, "", files)
    with mount_factory(f"s3://{fresh_bucket}") as m:
        for f in files:
            read_all(m.path(f.key))
        before = wait_idle(m)["store"]["blocks"]
        pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
        host, port = m.status()["metrics_addr"].rsplit(":", 1)
        subprocess.run(["prlimit", f"--pid={pid}", "--nofile=48:"], check=True)
        clients = []
        try:
            for _ in range(300):  # local clients try to eat the daemon's descriptors
                try:
                    clients.append(socket.create_connection((host, int(port)), timeout=2))
                except OSError:
                    break
            drop_all_caches()
            for f in files:  # correct bytes or an error; never a deletion
                try:
                    assert run_with_deadline(lambda f=f: read_all(m.path(f.key)), 30) == f.content()
                except OSError as exc:
                    assert exc.errno == errno.EIO
        finally:
            for c in clients:
                c.close()
            subprocess.run(["prlimit", f"--pid={pid}", "--nofile=4096:"], check=True)
        status = wait_idle(m)
        assert status["store"]["corrupt_blocks"] == 0 and status["store"]["blocks"] == before
        drop_all_caches()
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        assert status["cache"]["demand_fetches"] == m.status()["cache"]["demand_fetches"]


# -- 7. absurd metadata is refused at the boundary, the loop stays responsive -------------------------------

def test_an_absurd_prefetch_is_refused_and_the_mount_stays_responsive(tmp_path, s3, s3_client, fresh_bucket,
                                                                      mount_factory):
    s3_client.put_object(Bucket=fresh_bucket, Key="small.bin", Body=b"x" * 1000)
    cache = tmp_path / "cache"
    source = f"s3://{fresh_bucket}/"
    LmdbMetaStore(cache / "meta").save(source, [
        ObjectInfo("small.bin", 1000, 0, s3_client.head_object(Bucket=fresh_bucket, Key="small.bin")["ETag"]),
        ObjectInfo("huge.bin", 1 << 46, 0, '"not-really-there"'),  # 64 TiB: 16 M blocks of 4 MiB
    ])
    manifest = tmp_path / "m.txt"
    manifest.write_text("huge.bin\nsmall.bin\n")
    with mount_factory(f"s3://{fresh_bucket}", cache_dir=cache) as m:
        started = time.monotonic()
        r = subprocess.run([*EPOCHFS, "prefetch", str(m.mountpoint), "--manifest", str(manifest)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "blocks is more than one hand-over may hold" in r.stderr, r.stderr
        r = subprocess.run([*EPOCHFS, "warmup", str(m.mountpoint), str(m.path("huge.bin"))], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "blocks is more than" in r.stderr, r.stderr
        assert time.monotonic() - started < 20
        run_with_deadline(lambda: os.stat(m.path("small.bin")), 2)
        assert m.path("small.bin").read_bytes() == b"x" * 1000
        # streamed: the oversized object comes first, a long tail after it is never read
        manifest.write_text("huge.bin\n" + "small.bin\n" * (3 * p.CHUNK_ENTRIES))
        r = subprocess.run([*EPOCHFS, "prefetch", str(m.mountpoint), "--manifest", str(manifest)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "blocks" in r.stderr and "hand-over" in r.stderr, r.stderr
        run_with_deadline(lambda: os.stat(m.path("small.bin")), 2)


def test_a_long_manifest_is_streamed_and_the_mount_answers_meanwhile(tmp_path, s3, s3_client, fresh_bucket,
                                                                     mount_factory):
    """More entries than one line may hold (a line is bounded before it is parsed): the command streams
    them, the daemon takes them one chunk at a time, and lookups on the mount go on meanwhile."""
    etag = s3_client.put_object(Bucket=fresh_bucket, Key="f/0", Body=b"y" * 100)["ETag"]
    n = 3 * p.CHUNK_ENTRIES // 2  # streamed in two chunks
    cache = tmp_path / "cache"
    source = f"s3://{fresh_bucket}/"
    LmdbMetaStore(cache / "meta").save(source, [ObjectInfo(f"f/{i}", 100, 0, etag) for i in range(n)])
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"f/{i}\n" for i in range(n - 1, -1, -1)))
    with mount_factory(f"s3://{fresh_bucket}", cache_dir=cache) as m:
        worst, stop = [0.0], [False]

        def probe() -> None:
            while not stop[0]:
                t = time.monotonic()
                os.stat(m.path(f"f/{random.randrange(n)}"))
                worst[0] = max(worst[0], time.monotonic() - t)
                time.sleep(0.01)

        th = threading.Thread(target=probe, daemon=True)
        th.start()
        r = subprocess.run([*EPOCHFS, "prefetch", str(m.mountpoint), "--manifest", str(manifest)],
                           capture_output=True, text=True, timeout=120)
        stop[0] = True
        th.join(10)
        assert r.returncode == 0 and f"{n} files" in r.stdout, r.stderr
        assert worst[0] < 1.0, worst[0]
        assert m.path("f/0").read_bytes() == b"y" * 100


def test_idle_connections_cannot_block_the_metrics_scrapes(s3_client, fresh_bucket, mount_factory):
    """Any local user can connect to the metrics port; connections that send nothing give up their slot
    to a scraper that asks."""
    s3_client.put_object(Bucket=fresh_bucket, Key="a.bin", Body=b"a")
    with mount_factory(f"s3://{fresh_bucket}") as m:
        host, port = m.status()["metrics_addr"].rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(64)]
        try:
            ok = 0
            for _ in range(30):
                with socket.create_connection((host, int(port)), timeout=5) as s:
                    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    reply = b""
                    while chunk := s.recv(65536):
                        reply += chunk
                ok += reply.startswith(b"HTTP/1.1 200") and b"epochfs_cache_hits_total" in reply
                idle.append(socket.create_connection((host, int(port)), timeout=5))  # and more keep coming
            assert ok == 30
        finally:
            for s in idle:
                s.close()


GETDENTS = r'''
import ctypes, os, random, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
buf = ctypes.create_string_buffer(4096)
def getdents():
    n = libc.syscall(217, fd, buf, 4096)  # getdents64
    if n < 0:
        raise OSError(ctypes.get_errno(), "getdents64")
    return n
getdents()  # the handle is open and has read a little
print("open", flush=True)
rng = random.Random(int(sys.argv[2]))
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:  # seek anywhere and read on, as long as it is told
    os.lseek(fd, rng.randrange(1 << 62), os.SEEK_SET)
    getdents()
time.sleep(float(sys.argv[4]))
'''


def test_a_directory_held_open_or_seeked_by_another_user_holds_nothing_back(shared_dir, mount_factory):
    """Another user holds a listing of a large directory open (reading on from random offsets) while the
    source changes and the mount refreshes again and again: every refresh succeeds, the namespace index
    does not grow by a copy per refresh (nothing the handle holds pins a version), and the listing and
    lookups of everyone else go on."""
    src = shared_dir / "src"
    big = src / "big"
    big.mkdir(parents=True)
    for i in range(5000):
        (big / f"{i:05d}.bin").write_bytes(b"")
    os.chmod(src, 0o755)
    os.chmod(big, 0o755)
    m = mount_factory(f"file://{src}", "--allow-other", name="unused")
    m.mountpoint = shared_dir / "mnt"
    m.mountpoint.mkdir()
    with m:
        script = shared_dir / "getdents.py"
        script.write_text(GETDENTS)
        script.chmod(0o644)
        holders = [subprocess.Popen(["runuser", "-u", "nobody", "--", "python3", str(script), str(m.mountpoint / "big"),
                                     str(seed), str(seconds), "60"], stdout=subprocess.PIPE, text=True)
                   for seed, seconds in ((1, 0), (2, 20))]
        try:
            for h in holders:
                assert h.stdout.readline() == "open\n"
            index = m.cache_dir / "namespace" / "data.mdb"
            sizes = []
            for i in range(12):
                (src / f"new{i}.bin").write_bytes(b"x")
                r = subprocess.run([*EPOCHFS, "refresh", str(m.mountpoint)], capture_output=True, text=True,
                                   timeout=60)
                assert r.returncode == 0, r.stderr
                sizes.append(index.stat().st_size)
                assert (m.mountpoint / f"new{i}.bin").read_bytes() == b"x"
            assert sizes[-1] <= 2 * sizes[1], sizes  # (a pinned version grew it by a copy per refresh)
            assert len(os.listdir(m.mountpoint / "big")) == 5000
            assert all(h.poll() is None for h in holders)  # their listings still open, never an error
        finally:
            for h in holders:
                h.kill()
                h.wait()


def test_clients_that_ask_and_never_read_cannot_block_the_metrics_scrapes(s3_client, fresh_bucket, mount_factory):
    """Sixteen connections ask for a metrics page of well over 30 KiB (256 job ranks) and never read it:
    every scrape still gets its page, each taking the slot of a client that stopped reading."""
    from epochfs.control import request

    def stalled_client() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # (before connecting: a small window)
        s.settimeout(5)
        s.connect((host, int(port)))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        return s

    s3_client.put_object(Bucket=fresh_bucket, Key="a.bin", Body=b"a")
    with mount_factory(f"s3://{fresh_bucket}") as m:
        for rank in range(256):
            request(m.mountpoint, "report", job="resnet50-long-job-name", rank=rank, steps=5, data_wait=1.0,
                    compute=2.0, gpu_utilization=50.0)
        host, port = m.status()["metrics_addr"].rsplit(":", 1)
        stalled = []
        try:
            for _ in range(16):
                stalled.append(stalled_client())
            time.sleep(0.5)
            sizes = []
            for _ in range(25):
                with socket.create_connection((host, int(port)), timeout=5) as s:
                    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    reply = b""
                    while chunk := s.recv(65536):
                        reply += chunk
                assert reply.startswith(b"HTTP/1.1 200") and b"epochfs_job_steps_total" in reply
                sizes.append(len(reply))
                stalled.append(stalled_client())  # and the stalled ones keep coming
            assert min(sizes) > 30 << 10
        finally:
            for s in stalled:
                s.close()
