"""Test helpers: real mounts in a subprocess (with a wait for readiness and a lazy unmount), and the fakes
and references the tests without a mount share."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from epochfs.backend.base import Backend, BackendStats
from epochfs.control import request
from epochfs.dev import pagecache
from epochfs.dev.sample import drop_file_pages, pattern

EPOCHFS = [sys.executable, "-m", "epochfs"]


class Mount:
    def __init__(self, source: str, mountpoint: Path, cache_dir: Path, env: dict[str, str], *args: str):
        self.source = source
        self.mountpoint = Path(mountpoint)
        self.cache_dir = Path(cache_dir)
        self.env = env
        self.args = list(args)
        self.mountpoint.mkdir(parents=True, exist_ok=True)

    def start(self, *extra: str, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
        own = [] if "--metrics-targets" in (*self.args, *extra) else ["--metrics-targets", "off"]  # not in /run
        cmd = [*EPOCHFS, "mount", self.source, str(self.mountpoint), "--cache-dir", str(self.cache_dir),
               *own, *self.args, *extra]
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        if expect_ok:
            assert result.returncode == 0, f"mount failed: {result.stderr}\n{self.log()}"
        return result

    def __enter__(self) -> Mount:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if os.path.ismount(self.mountpoint):
            result = subprocess.run([*EPOCHFS, "umount", str(self.mountpoint)], capture_output=True,
                                    text=True, timeout=60)
            if result.returncode != 0:
                subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], capture_output=True)

    def status(self) -> dict[str, Any]:
        return request(self.mountpoint, "status")

    def log(self) -> str:
        path = self.cache_dir / "epochfs.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def path(self, key: str) -> Path:
        return self.mountpoint / key


def kill_daemon(m: Mount, timeout: float = 30) -> None:
    """kill -9 of ``m``'s daemon, returning once its process is gone (its mount left dead)."""
    import signal

    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"daemon {pid} still alive {timeout:g}s after kill -9"
        time.sleep(0.05)


def as_user(user: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    """``cmd`` run as another local user (``runuser``)."""
    return subprocess.run(["runuser", "-u", user, "--", *cmd], capture_output=True, text=True, timeout=60,
                          errors="replace")


@contextlib.contextmanager
def passable(m: Mount):
    """``m`` mounted under a directory the node's other users may pass (a test's tmp_path is root's alone),
    unmounted and removed after."""
    import shutil

    base = Path(tempfile.mkdtemp(prefix="epochfs-shared-"))
    os.chmod(base, 0o755)
    m.mountpoint = base / "mnt"
    m.mountpoint.mkdir()
    try:
        with m:
            yield m
    finally:
        m.stop()
        shutil.rmtree(base, ignore_errors=True)


def epochfs_as(user: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``epochfs ARGS`` run as another local user, who may not enter the checkout's virtualenv: the
    system's Python with the checkout's sources and the virtualenv's packages on its path."""
    root = Path(__file__).resolve().parents[1]
    path = f"PYTHONPATH={root / 'src'}:{root / '.venv' / 'lib' / 'python3.11' / 'site-packages'}"
    return subprocess.run(["runuser", "-u", user, "--", "env", path, "HOME=/tmp", "/usr/bin/python3", "-m", "epochfs",
                           *args], capture_output=True, text=True, timeout=timeout, errors="replace")


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` as a file only its owner may read (umask 077 while it is created)."""
    old = os.umask(0o077)
    try:
        path.write_bytes(data)
    finally:
        os.umask(old)


def read_all(path: Path, read_size: int = 1 << 20) -> bytes:
    with open(path, "rb", buffering=0) as f:
        chunks = []
        while chunk := f.read(read_size):
            chunks.append(chunk)
    return b"".join(chunks)


def run_with_deadline(fn, seconds: float):  # type: ignore[no-untyped-def]
    """Run ``fn`` in a thread; fail if it does not return within ``seconds`` (a read must never hang)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise AssertionError(f"operation did not finish within {seconds}s")
    if "error" in box:
        raise box["error"]
    box["elapsed"] = time.monotonic() - started
    return box.get("value")


def errno_of(exc: BaseException) -> int | None:
    return exc.errno if isinstance(exc, OSError) else None


__all__ = ["Mount", "read_all", "drop_file_pages", "run_with_deadline", "errno_of", "errno"]


#: Taken exclusively for each test marked ``page_cache``, by every process of the suite (and any other
#: suite of this machine): such a test drops the kernel's caches, or counts what they spare the daemon,
#: so no two run at once while the rest of the suite runs beside them (``-n``).
#: (the benchmarks and the demo drop the caches holding it too: epochfs.dev.pagecache)
PAGE_CACHE_LOCK = pagecache.LOCK
_page_cache_held = threading.Event()


@contextlib.contextmanager
def page_cache_to_myself() -> Iterator[None]:
    """No other test marked ``page_cache`` (in any process) runs until the block ends: none drops the
    caches this test counts on (see ``PAGE_CACHE_LOCK``)."""
    with open(PAGE_CACHE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _page_cache_held.set()
        os.environ[pagecache.HELD_ENV] = str(os.getpid())  # (what this test runs drops under this hold)
        try:
            yield
        finally:
            os.environ.pop(pagecache.HELD_ENV, None)
            _page_cache_held.clear()
            fcntl.flock(lock, fcntl.LOCK_UN)


def drop_all_caches() -> None:
    """Drop the kernel page cache so that the next reads reach the daemon (needs root). Only a test marked
    ``page_cache`` may: the caches are the whole machine's, and the tests beside it count on theirs."""
    if not _page_cache_held.is_set():
        raise RuntimeError("drop_all_caches() in a test not marked page_cache (it would disturb the tests "
                           "running beside it)")
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def wait_idle(mount: Mount, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until the daemon has no fetch or fill in flight; return its status."""
    deadline = time.monotonic() + timeout
    while True:
        status = mount.status()
        if status["cache"]["inflight"] == 0:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon still busy after {timeout}s: {status['cache']}")
        time.sleep(0.05)


class FakeStream:
    def __init__(self, cache: FakeCache, obj: Any) -> None:
        self.cache, self.obj = cache, obj

    def read_now(self, offset: int, size: int) -> bytes | None:
        return None  # (always the waiting path: read)

    async def read(self, offset: int, size: int) -> bytes:
        if self.cache.error is not None:
            raise self.cache.error
        return self.cache.data[self.obj.key][offset:offset + size]

    def close(self) -> None:
        pass


class FakeCache:
    """Stands in for BlockCache under fs.Operations: bytes from a dict, or the error set in ``error``."""

    def __init__(self, data: dict[str, bytes]) -> None:
        self.data = data
        self.error: BaseException | None = None

    def open_stream(self, obj: Any, inode: int = 0, reader: Any = None) -> FakeStream:
        return FakeStream(self, obj)


BS = 64 << 10  # the block size of the tests that run the cache without a mount


class MemoryBackend(Backend):
    source_id = "mem://test/"

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.calls: Counter[tuple[str, int]] = Counter()
        self.fail: Exception | None = None
        self._lock = threading.Lock()

    def list_objects(self):
        return iter(())

    def read_range(self, key, etag, start, length):
        with self._lock:
            self.calls[(key, start)] += 1
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return pattern(key, 0, start, length)

    def statistics(self):
        return BackendStats()


def offline_min_misses(seq: list[bytes], capacity: int) -> int:
    """Belady's MIN with bypass for unit-size blocks, by brute force: on a miss with a full cache, drop
    whichever of (the resident blocks and the new one) is next used farthest in the future."""
    def next_use(b: bytes, after: int) -> int:
        for j in range(after + 1, len(seq)):
            if seq[j] == b:
                return j
        return len(seq) + 1

    cache: set[bytes] = set()
    misses = 0
    for i, b in enumerate(seq):
        if b in cache:
            continue
        misses += 1
        if len(cache) < capacity:
            cache.add(b)
            continue
        far = max(cache | {b}, key=lambda x: next_use(x, i))
        if far != b:
            cache.remove(far)
            cache.add(b)
    return misses


def damage_block(where: tuple[Path, int, int], how: str, other: tuple[Path, int, int] | None = None) -> None:
    """Damage a cached block in place, wherever it is (``where``: file, offset, length as
    :func:`epochfs.blockstore.format.locate` gives): ``flip`` a bit in its middle; ``truncate`` it after 100
    bytes; ``empty`` it; ``delete`` it; ``swap`` its bytes with the block at ``other``. A block in a
    file of its own is truncated, emptied or deleted as a file; one in a pack file (shared with other
    blocks) has that range zeroed instead, as a hole punched by another program would read."""
    path, offset, length = where
    packed = path.parent.name == "packs"
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(offset + length // 2)
            byte = f.read(1)[0]
            f.seek(offset + length // 2)
            f.write(bytes([byte ^ 0x10]))
    elif how in ("truncate", "empty", "delete"):
        keep = 100 if how == "truncate" else 0
        if packed:
            with open(path, "r+b") as f:
                f.seek(offset + keep)
                f.write(bytes(length - keep))
        elif how == "delete":
            path.unlink()
        else:
            os.truncate(path, keep)
    elif how == "swap":
        assert other is not None
        if packed:
            opath, ooff, olen = other
            with open(path, "r+b") as f, open(opath, "r+b") as g:
                n = min(length, olen)
                f.seek(offset)
                mine = f.read(n)
                g.seek(ooff)
                theirs = g.read(n)
                f.seek(offset)
                f.write(theirs)
                g.seek(ooff)
                g.write(mine)
        else:
            tmp = path.with_suffix(".swap")
            os.rename(path, tmp)
            os.rename(other[0], path)
            os.rename(tmp, other[0])
    else:
        raise ValueError(how)


def namespaces_work() -> bool:
    """Whether network namespaces can be made here (root and ``ip``): the cluster boxes need them."""
    import random

    name = f"efctest{random.randrange(1 << 30)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made
