"""BlockStore without a mount: verification, atomic fills, capacity, recovery of a damaged index."""

import errno
import gc
import os
import time

import pytest

import epochfs.blockstore.packs as packs_mod
from epochfs.blockstore.keys import CHUNK_SIZE, block_relpath
from epochfs.blockstore.packs import PACK_BELOW
from epochfs.blockstore.store import BlockStore, CacheLocked
from epochfs.core.errors import CacheUnreadable, ConfigError
from epochfs.eviction.lru import LruPolicy

from .helpers import damage_block

MIB = 1 << 20


def bid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def make(tmp_path, capacity=1 << 30, ratio=0.0, packing=True) -> BlockStore:
    """A store; ``packing=False``: every block in a file of its own (as on a file system that cannot
    punch holes)."""
    s = BlockStore(tmp_path / "cache", capacity, ratio, LruPolicy())
    s.open()
    assert s.packing, "the test file system punches holes"
    s.packing = packing
    return s


def put(store: BlockStore, b: bytes, data: bytes) -> bool:
    if not store.reserve(b, len(data)):
        return False
    store.install(b, *store.write_temp(b, data))
    return True


def test_roundtrip_and_partial_reads(tmp_path):
    s = make(tmp_path)
    data = os.urandom(3 * CHUNK_SIZE + 123)
    put(s, bid(1), data)
    meta = s.lookup(bid(1))
    assert meta.length == len(data)
    for lo, hi in [(0, len(data)), (0, 1), (CHUNK_SIZE - 1, CHUNK_SIZE + 1), (len(data) - 5, len(data)), (70000, 70001)]:
        assert bytes(s.read(bid(1), meta, lo, hi)) == data[lo:hi]
    assert s.statistics().used_bytes == len(data)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "file"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "delete"])
def test_damaged_block_is_dropped_not_served(tmp_path, damage, packing):
    s = make(tmp_path, packing=packing)
    data = os.urandom(2 * CHUNK_SIZE)
    put(s, bid(1), data)
    put(s, bid(2), os.urandom(5000))  # a neighbour (in the same pack when packed)
    where = s.block_location(bid(1))
    assert (where[0].parent.name == "packs") == packing
    damage_block(where, damage)
    meta = s.lookup(bid(1))
    assert s.read(bid(1), meta, 0, len(data)) is None
    st = s.statistics()
    assert st.corrupt_blocks == 1 and st.used_bytes == 5000 and st.blocks == 1
    assert s.lookup(bid(1)) is None and s.block_location(bid(1)) is None
    assert packing or not where[0].exists()
    assert bytes(s.read(bid(2), s.lookup(bid(2)), 0, 5000)) == s.block_location(bid(2))[0].read_bytes()[
        s.block_location(bid(2))[1]:s.block_location(bid(2))[1] + 5000]


def test_a_deleted_pack_drops_its_blocks_not_others(tmp_path, monkeypatch):

    monkeypatch.setattr(packs_mod, "PACK_SIZE", 3 * 4096)  # three 4 KiB blocks per pack
    s = make(tmp_path)
    blocks = {n: os.urandom(4000) for n in range(6)}
    for n, data in blocks.items():
        put(s, bid(n), data)
    first = s.block_location(bid(0))[0]
    assert s.block_location(bid(3))[0] != first and len(list(s.packs_dir.iterdir())) == 2
    first.unlink()
    for n, data in blocks.items():
        got = s.read(bid(n), s.lookup(bid(n)), 0, 4000)
        assert (got is None) if n < 3 else (bytes(got) == data)
    assert s.statistics().corrupt_blocks == 3 and s.statistics().blocks == 3


def _open_on(directory) -> list[str]:
    """What this process has open under ``directory``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_a_pack_is_written_through_one_descriptor_closed_when_the_next_pack_starts(tmp_path, monkeypatch):
    """The blocks of the current pack are written through the descriptor made with it (no open and close
    per block); once the next pack takes the writes, the old one's is closed, and close() closes the
    last. The blocks read back whole."""
    monkeypatch.setattr(packs_mod, "PACK_SIZE", 3 * 4096)
    s = make(tmp_path)
    packs_dir = s.packs_dir
    blocks = {n: os.urandom(4000) for n in range(7)}
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1])
    for n, data in blocks.items():
        assert put(s, bid(n), data)
        assert len(_open_on(packs_dir)) == 1  # the current pack's writer: the full ones' are closed
    monkeypatch.setattr(os, "open", real_open)
    assert len([p for p in opened if p.startswith(str(packs_dir))]) == 3  # one per pack: its creation
    for n, data in blocks.items():
        assert bytes(s.read(bid(n), s.lookup(bid(n)), 0, 4000)) == data
    s.close()
    assert _open_on(packs_dir) == []


def test_flipped_byte_in_an_unread_chunk_is_not_noticed_until_read(tmp_path):
    s = make(tmp_path)
    data = os.urandom(2 * CHUNK_SIZE)
    put(s, bid(1), data)
    path, offset, _ = s.block_location(bid(1))
    raw = bytearray(path.read_bytes())
    raw[offset + CHUNK_SIZE + 1] ^= 0xFF
    path.write_bytes(raw)
    meta = s.lookup(bid(1))
    assert bytes(s.read(bid(1), meta, 0, 100)) == data[:100]  # first chunk is intact and verified
    assert s.read(bid(1), meta, CHUNK_SIZE, CHUNK_SIZE + 1) is None


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "file"])
def test_swapped_blocks_are_detected(tmp_path, packing):
    s = make(tmp_path, packing=packing)
    a, b = os.urandom(1000), os.urandom(1000)
    put(s, bid(1), a)
    put(s, bid(2), b)
    damage_block(s.block_location(bid(1)), "swap", s.block_location(bid(2)))
    assert s.read(bid(1), s.lookup(bid(1)), 0, 1000) is None
    assert s.read(bid(2), s.lookup(bid(2)), 0, 1000) is None
    assert s.statistics().corrupt_blocks == 2


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def test_small_blocks_share_packs_and_evicted_ones_free_their_space(tmp_path, monkeypatch):
    """Blocks below PACK_BELOW go to pack files at aligned offsets, larger ones to files of their own;
    an evicted packed block's range is punched out, and a pack with no block left is deleted."""

    monkeypatch.setattr(packs_mod, "PACK_SIZE", 4 * 40960)  # four blocks of 40000 bytes per pack
    s = make(tmp_path, capacity=8 * 40000 + PACK_BELOW)
    big = os.urandom(PACK_BELOW)
    put(s, bid(100), big)
    assert s.block_location(bid(100)) == (s.blocks_dir / block_relpath(bid(100)), 0, PACK_BELOW)
    small = {n: os.urandom(40000) for n in range(8)}
    for n, data in small.items():
        put(s, bid(n), data)
    where = {n: s.block_location(bid(n)) for n in small}
    packs = sorted({w[0] for w in where.values()})
    assert len(packs) == 2 and all(w[1] % 4096 == 0 for w in where.values())
    assert sorted(w[1] for w in where.values() if w[0] == packs[0]) == [0, 40960, 81920, 122880]
    for n, data in small.items():
        assert bytes(s.read(bid(n), s.lookup(bid(n)), 0, 40000)) == data
    before = _allocated(packs[0])
    put(s, bid(50), os.urandom(PACK_BELOW))  # the cache is full: the oldest block (the large one) goes
    put(s, bid(51), os.urandom(40000))  # ... then small block 0, the first of the first pack
    assert s.lookup(bid(100)) is None and s.lookup(bid(0)) is None and s.lookup(bid(1)) is not None
    assert _allocated(packs[0]) <= before - 40960, "the evicted block's disk space was not freed"
    for n in (1, 2, 3):
        s._evict(bid(n))
    assert not packs[0].exists(), "a pack with no block left is deleted"
    assert packs[1].exists() and bytes(s.read(bid(7), s.lookup(bid(7)), 0, 40000)) == small[7]


def test_concurrent_packed_writes_get_their_own_ranges(tmp_path, monkeypatch):
    import random
    from concurrent.futures import ThreadPoolExecutor


    monkeypatch.setattr(packs_mod, "PACK_SIZE", 1 << 20)  # several packs, rolled over by the writers
    s = make(tmp_path)
    rng = random.Random(5)
    blocks = {bid(n): rng.randbytes(rng.randrange(1, 200_000)) for n in range(200)}
    for b, data in blocks.items():
        assert s.reserve(b, len(data))
    with ThreadPoolExecutor(8) as pool:
        written = list(pool.map(lambda item: (item[0], s.write_temp(*item)), blocks.items()))
    for b, fill in written:
        s.install(b, *fill)
    spans = sorted((w[0].name, w[1], w[1] + w[2]) for w in map(s.block_location, blocks))
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:], strict=False)), "two blocks share bytes"
    assert len({name for name, _, _ in spans}) > 1
    for b, data in blocks.items():
        assert bytes(s.read(b, s.lookup(b), 0, len(data))) == data
    s.close()
    s = make(tmp_path)  # after a restart new blocks go to a new pack: nothing is overwritten
    put(s, bid(999), b"new" * 1000)
    for b, data in blocks.items():
        assert bytes(s.read(b, s.lookup(b), 0, len(data))) == data


def test_a_file_system_that_cannot_punch_holes_gets_one_file_per_block(tmp_path, monkeypatch):

    def unsupported(*a):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(packs_mod, "punch_hole", unsupported)
    s = BlockStore(tmp_path / "cache", 1 << 30, 0.0, LruPolicy())
    s.open()
    assert not s.packing
    put(s, bid(1), b"x" * 1000)
    assert s.block_location(bid(1))[0] == s.blocks_dir / block_relpath(bid(1))
    assert bytes(s.read(bid(1), s.lookup(bid(1)), 0, 1000)) == b"x" * 1000


def test_a_failed_packed_write_indexes_nothing_and_the_next_one_works(tmp_path, monkeypatch):
    s = make(tmp_path)
    assert s.reserve(bid(1), 5000)
    real = os.pwrite

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError):
        s.write_temp(bid(1), b"a" * 5000)
    s.release(5000)
    monkeypatch.setattr(os, "pwrite", real)
    assert s.lookup(bid(1)) is None and s.pending == 0 and s.statistics().fill_errors == 1
    put(s, bid(2), b"b" * 5000)
    assert bytes(s.read(bid(2), s.lookup(bid(2)), 0, 5000)) == b"b" * 5000


def test_capacity_is_enforced_by_lru_eviction(tmp_path):
    s = make(tmp_path, capacity=10_000)
    for n in range(10):
        assert put(s, bid(n), bytes([n]) * 3000)
        assert s.statistics().used_bytes <= 10_000
    st = s.statistics()
    assert st.blocks == 3 and st.evictions == 7
    assert [s.lookup(bid(n)) is not None for n in range(10)] == [False] * 7 + [True] * 3
    assert not s.reserve(bid(99), 20_000)  # larger than the whole cache: read through


def test_reads_refresh_lru_order(tmp_path):
    s = make(tmp_path, capacity=3000)
    for n in range(3):
        put(s, bid(n), b"x" * 1000)
    s.read(bid(0), s.lookup(bid(0)), 0, 1)
    put(s, bid(3), b"y" * 1000)
    assert s.lookup(bid(0)) is not None and s.lookup(bid(1)) is None


def test_free_space_floor_stops_admission(tmp_path):
    st = os.statvfs(tmp_path)
    free_ratio = st.f_bavail / st.f_blocks
    s = make(tmp_path, ratio=min(0.999, free_ratio + 0.01))  # the floor is already crossed
    assert not put(s, bid(1), b"z" * 100)
    assert s.statistics().blocks == 0


def test_restart_keeps_blocks_and_lru_order(tmp_path):
    s = make(tmp_path, capacity=3000)
    for n in range(3):
        put(s, bid(n), bytes([n]) * 1000)
    (s.tmp_dir / "leftover").write_bytes(b"partial fill")
    s.close()
    s = make(tmp_path, capacity=3000)
    assert not any(s.tmp_dir.iterdir()), "temp files of interrupted fills are removed"
    assert s.statistics().blocks == 3 and s.statistics().used_bytes == 3000
    assert bytes(s.read(bid(2), s.lookup(bid(2)), 0, 1000)) == bytes([2]) * 1000
    put(s, bid(9), b"n" * 1000)
    assert s.lookup(bid(0)) is None, "the oldest fill is evicted first after a restart"


def test_second_owner_is_refused(tmp_path):
    s = make(tmp_path)
    with pytest.raises(CacheLocked, match="in use by pid"):
        make(tmp_path)
    s.close()
    make(tmp_path).close()


def test_garbage_index_is_rebuilt(tmp_path):
    s = make(tmp_path)
    put(s, bid(1), b"q" * 5000)
    s.close()
    for f in (tmp_path / "cache" / "index").iterdir():
        f.write_bytes(os.urandom(8192))
    s = make(tmp_path)
    assert s.statistics().blocks == 0 and s.lookup(bid(1)) is None
    assert put(s, bid(1), b"r" * 10)
    assert bytes(s.read(bid(1), s.lookup(bid(1)), 0, 10)) == b"r" * 10


@pytest.mark.parametrize("failing, around", [("pwrite", False), ("pwrite", True), ("ftruncate", False)])
def test_failed_fill_leaves_nothing_of_its_block(tmp_path, monkeypatch, failing, around):

    monkeypatch.setattr("epochfs.blockstore.writes.DIRECT_MIN", 1)
    s = make(tmp_path, packing=False)
    assert s.reserve(bid(1), 100)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        with monkeypatch.context() as m:
            m.setattr(os, failing, boom)
            s.install(bid(1), *s.write_temp(bid(1), b"a" * 100, around=around))
    s.release(100)
    assert not any(s.tmp_dir.iterdir())
    assert not any(p.stat().st_blocks for p in s.blocks_dir.rglob("*") if p.is_file()), "its bytes stayed on disk"
    assert s.statistics().fill_errors == 1 and s.pending == 0 and s.lookup(bid(1)) is None


def test_fsck_finds_damage_and_orphans_and_repairs_them(tmp_path):
    import subprocess
    import sys

    s = make(tmp_path)
    for n in range(4):
        put(s, bid(n), bytes([n]) * 100_000)
    damage_block(s.block_location(bid(1)), "flip")
    orphan = s.blocks_dir / block_relpath(bid(77))
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"left by a crash between rename and index entry")
    s.close()
    cache = str(tmp_path / "cache")
    check = subprocess.run([sys.executable, "-m", "epochfs", "fsck", "--cache-dir", cache], capture_output=True, text=True)
    assert check.returncode == 1 and "1 damaged, 1 orphan files" in check.stdout
    assert orphan.exists()
    fix = subprocess.run([sys.executable, "-m", "epochfs", "fsck", "--cache-dir", cache, "--repair"],
                         capture_output=True, text=True)
    assert fix.returncode == 0 and "removed" in fix.stdout
    assert fix.stdout.startswith("4 blocks checked: 1 damaged and 1 orphan files") and "3 blocks" in fix.stdout, fix.stdout
    again = subprocess.run([sys.executable, "-m", "epochfs", "fsck", "--cache-dir", cache], capture_output=True, text=True)
    assert again.returncode == 0 and "3 blocks" in again.stdout and "0 damaged, 0 orphan" in again.stdout
    s = make(tmp_path)
    assert s.lookup(bid(1)) is None and bytes(s.read(bid(2), s.lookup(bid(2)), 0, 10)) == bytes([2]) * 10


def _tree(root) -> dict[str, bytes]:
    """Every path under ``root`` with its contents (the lock file and LMDB's reader table aside)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel in ("lock", "index/lock.mdb"):
            continue
        out[rel] = b"<dir>" if p.is_dir() and not p.is_symlink() else os.readlink(p).encode() if p.is_symlink() \
            else p.read_bytes()
    return out


def test_fsck_without_repair_changes_nothing_and_reports_what_a_mount_would_remove(tmp_path):
    import subprocess
    import sys

    s = make(tmp_path)
    for n in range(3):
        put(s, bid(n), bytes([n]) * 5000)
    with s.index.env.begin(write=True) as txn:
        txn.put(bid(9), b"\x01\x02garbage")  # a malformed entry
    s.close()
    (tmp_path / "cache" / "packs" / "not-a-pack").write_bytes(b"x")
    (tmp_path / "cache" / "packs" / "0badc0de").mkdir()
    (tmp_path / "cache" / "tmp" / "leftover").write_bytes(b"y")
    cache = tmp_path / "cache"
    before = _tree(cache)
    check = subprocess.run([sys.executable, "-m", "epochfs", "fsck", "--cache-dir", str(cache)], capture_output=True,
                           text=True)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "3 blocks" in check.stdout and "1 malformed index entries, 2 entries that are not cache files" \
        in check.stdout
    assert _tree(cache) == before
    fix = subprocess.run([sys.executable, "-m", "epochfs", "fsck", "--cache-dir", str(cache), "--repair"],
                         capture_output=True, text=True)
    assert fix.returncode == 0 and "removed" in fix.stdout
    again = subprocess.run([sys.executable, "-m", "epochfs", "fsck", "--cache-dir", str(cache)], capture_output=True,
                           text=True)
    assert again.returncode == 0 and "malformed" not in again.stdout and "not cache files" not in again.stdout
    assert sorted(p.name for p in (cache / "packs").iterdir()) == ["00000001"]  # the one pack of the blocks


def test_fsck_without_repair_keeps_an_index_a_mount_would_discard(tmp_path):
    import subprocess
    import sys

    import lmdb

    s = make(tmp_path)
    put(s, bid(1), b"a" * 5000)
    s.close()
    env = lmdb.open(str(tmp_path / "cache" / "index"))
    with env.begin(write=True) as txn:
        txn.put(b"\x00format", b"3")
    env.close()
    before = _tree(tmp_path / "cache")
    check = subprocess.run([sys.executable, "-m", "epochfs", "fsck", "--cache-dir", str(tmp_path / "cache")],
                           capture_output=True, text=True)
    assert check.returncode == 2 and "is of another version" in check.stderr and "nothing was changed" in check.stderr
    assert _tree(tmp_path / "cache") == before
    s = make(tmp_path)  # a mount then starts empty, as the message says
    assert s.statistics().blocks == 0


def test_a_file_system_without_nowait_reads_is_not_taken_for_damage(tmp_path, monkeypatch):
    import errno as errno_

    s = make(tmp_path)
    data = os.urandom(3 * CHUNK_SIZE)
    put(s, bid(1), data)

    def unsupported(*args, **kwargs):
        raise OSError(errno_.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "preadv", unsupported)
    meta = s.lookup(bid(1))
    assert bytes(s.read(bid(1), meta, 0, len(data), nowait=True)) == data
    assert bytes(s.read(bid(1), meta, 5, 70_000, nowait=True)) == data[5:70_000]
    assert s.statistics().corrupt_blocks == 0


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "file"])
def test_unclean_shutdown_is_reconciled_at_the_next_open(tmp_path, packing):
    """A daemon killed between a fill's rename and its index entry leaves a block file the index does not
    know (or a range of a pack no entry refers to); one whose page cache was lost leaves an entry without
    its file (or a pack cut short). All are cleaned up at start."""
    import subprocess
    import sys
    import textwrap

    crash = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = {sys.path!r}
        from tests.test_store import make, put, bid
        from pathlib import Path
        from epochfs.blockstore.keys import block_relpath
        s = make(Path({str(tmp_path)!r}), packing={packing})
        for n in range(3):
            put(s, bid(n), bytes([n]) * 70_000)
        orphan = s.blocks_dir / block_relpath(bid(9))
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"renamed, never indexed")
        path, offset, _ = s.block_location(bid(2))
        if {packing}:
            s.write_temp(bid(8), b"written, never indexed" * 10_000)  # after block 2 in the pack
            open(s.packs_dir / "7fffffff", "wb").write(b"a pack no entry refers to")
            os.truncate(path, offset + 100)  # block 2 (and the unindexed block) cut short
        else:
            path.unlink()
        os._exit(0)  # no close(): as if killed
    """)
    subprocess.run([sys.executable, "-c", crash], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    s = make(tmp_path, packing=packing)
    assert not (s.blocks_dir / block_relpath(bid(9))).exists()
    assert not (s.packs_dir / "7fffffff").exists()
    assert s.lookup(bid(2)) is None
    st = s.statistics()
    assert st.blocks == 2 and st.used_bytes == 2 * 70_000
    if packing:  # nothing of the pack is allocated but the two blocks left
        assert _allocated(s.block_location(bid(0))[0]) <= 2 * 73_728
    assert bytes(s.read(bid(1), s.lookup(bid(1)), 0, 70_000)) == bytes([1]) * 70_000
    s.close()
    assert (tmp_path / "cache" / "clean").exists()
    s = make(tmp_path)
    assert not (tmp_path / "cache" / "clean").exists()  # running: a crash from here on is unclean again
    s.close()


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EIO])
def test_a_read_error_that_is_not_damage_keeps_the_block(tmp_path, monkeypatch, code):
    s = make(tmp_path)
    data = os.urandom(2 * CHUNK_SIZE)
    put(s, bid(1), data)
    meta = s.lookup(bid(1))
    real_open = os.open

    def failing_open(path, flags, *args, **kwargs):
        if "blocks" in str(path) or "packs" in str(path):
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    for nowait in (False, True):
        with pytest.raises(CacheUnreadable):
            s.read(bid(1), meta, 0, 10, nowait=nowait)
    with pytest.raises(CacheUnreadable):
        s.finish_read(bid(1), meta, 0, 10, s.pread_range(bid(1), meta, 0, 10))
    monkeypatch.setattr(os, "open", real_open)
    assert s.lookup(bid(1)) == meta and s.statistics().corrupt_blocks == 0
    assert s.statistics().read_errors == 3
    assert bytes(s.read(bid(1), meta, 0, len(data))) == data


def test_cache_files_and_directories_are_private_and_planted_links_refused(tmp_path):
    s = make(tmp_path)
    put(s, bid(7), b"x" * 100)
    s.close()
    for p in [tmp_path / "cache", *(tmp_path / "cache").rglob("*")]:
        assert os.lstat(p).st_mode & 0o077 == 0, p
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "cache" / "lock").unlink()
    os.symlink(target, tmp_path / "cache" / "lock")
    with pytest.raises(ConfigError, match="symbolic link"):
        make(tmp_path)
    assert target.read_bytes() == b"keep"


def test_malformed_index_entries_are_dropped_with_their_files(tmp_path):
    s = make(tmp_path)
    put(s, bid(1), b"a" * 5000)
    put(s, bid(2), b"b" * 5000)
    with s.index.env.begin(write=True) as txn:
        txn.put(bid(2), b"\x01\x02garbage")  # an entry that does not decode
    s.close()
    s = make(tmp_path)
    assert s.lookup(bid(2)) is None and s.lookup(bid(1)) is not None
    assert not (tmp_path / "cache" / "blocks" / block_relpath(bid(2))).exists()
    assert s.statistics().blocks == 1 and s.statistics().used_bytes == 5000


def _in_page_cache(path) -> bool:
    """Whether any page of a file is in memory: fincore(1) (util-linux) asks mincore(2), which reads
    nothing (a probing read could itself bring a page in)."""
    import subprocess

    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                         text=True, check=True).stdout
    return int(out.strip() or 0) > 0


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 100 * 1024 + 3, 5 << 20])
def test_blocks_written_around_the_page_cache_read_back_exactly(tmp_path, monkeypatch, size):

    monkeypatch.setattr("epochfs.blockstore.writes.DIRECT_MIN", 1)  # every size, to find alignment bugs
    s = make(tmp_path, packing=False)
    data = os.urandom(size)
    assert s.reserve(bid(1), size)
    written, meta = s.write_temp(bid(1), data, around=True)
    path = s.object_path(bid(1))
    assert os.path.getsize(path) == size
    # O_DIRECT: no page-cache copy was made (an unaligned length is an object's last block, written
    # through the page cache so the file is never longer than the object)
    assert _in_page_cache(path) == bool(size % 4096)
    s.install(bid(1), written, meta)
    assert bytes(s.read(bid(1), s.lookup(bid(1)), 0, size)) == data
    assert bytes(s.read(bid(1), s.lookup(bid(1)), size // 3, size)) == data[size // 3:]


def test_buffered_writes_stay_in_the_page_cache(tmp_path):
    """Blocks for a later reader, and small blocks (a direct write costs them more), go through the page
    cache; large blocks for a reader at hand around it."""
    from epochfs.blockstore.writes import DIRECT_MIN

    s = make(tmp_path, packing=False)
    s.write_temp(bid(1), b"x" * DIRECT_MIN)
    s.write_temp(bid(2), b"x" * (DIRECT_MIN - 4096), around=True)
    s.write_temp(bid(3), b"x" * DIRECT_MIN, around=True)
    assert _in_page_cache(s.object_path(bid(1)))
    assert _in_page_cache(s.object_path(bid(2)))
    assert not _in_page_cache(s.object_path(bid(3)))


@pytest.mark.parametrize("where", ["open", "write"])
def test_a_file_system_without_direct_writes_falls_back_to_the_page_cache(tmp_path, monkeypatch, where):
    """tmpfs and some network file systems refuse O_DIRECT at open, others at the first unaligned write:
    the block is written anyway, and later blocks do not try again."""
    import epochfs.blockstore.store as store_mod

    s = make(tmp_path, packing=False)
    tries = []
    real_open = os.open

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT:
            tries.append(path)
            if where == "open":
                raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    real_pwrite = os.pwrite

    def no_direct_pwrite(fd, data, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(store_mod.os, "open", no_direct_open)
    if where == "write":
        monkeypatch.setattr(store_mod.os, "pwrite", no_direct_pwrite)
    monkeypatch.setattr("epochfs.blockstore.writes.DIRECT_MIN", 1)
    for n in (1, 2):
        data = os.urandom(8192 * (2 + n))  # (aligned: an unaligned last block is never written directly)
        assert s.reserve(bid(n), len(data))
        s.install(bid(n), *s.write_temp(bid(n), data, around=True))
        assert bytes(s.read(bid(n), s.lookup(bid(n)), 0, len(data))) == data
    assert len(tries) == 1


def test_an_index_of_another_version_is_discarded_with_its_blocks(tmp_path, caplog):
    import lmdb

    s = make(tmp_path, packing=False)
    put(s, bid(1), b"a" * 5000)
    s.close()
    env = lmdb.open(str(tmp_path / "cache" / "index"))
    with env.begin(write=True) as txn:
        txn.put(b"\x00format", b"4")  # a file per block
    env.close()
    s = make(tmp_path)
    assert s.statistics().blocks == 0 and s.lookup(bid(1)) is None
    assert not (s.blocks_dir / block_relpath(bid(1))).exists()
    assert "is of another version (it has format 4, this version uses 5)" in caplog.text
    assert put(s, bid(1), b"b" * 10) and bytes(s.read(bid(1), s.lookup(bid(1)), 0, 10)) == b"b" * 10


@pytest.mark.page_cache
@pytest.mark.parametrize("packing", [True, False])
def test_a_read_that_would_wait_for_the_disk_is_handed_back_without_starting_it(tmp_path, packing):
    """``read(nowait=True)`` answers from the page cache, or says WOULD_BLOCK for a worker thread to
    read: it never starts the disk read on the event loop (cachestat, where the kernel has it)."""
    from epochfs.blockstore import pagecache
    from epochfs.blockstore.store import WOULD_BLOCK

    store = make(tmp_path, packing=packing)
    data = os.urandom(100 << 10)
    assert put(store, bid(1), data)
    meta = store.lookup(bid(1))
    path, offset, length = store.block_location(bid(1))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if not pagecache.available():
            pytest.skip("this kernel has no cachestat")
        assert pagecache.resident(fd, offset, length) is False
        assert store.read(bid(1), meta, 0, len(data), nowait=True) is WOULD_BLOCK
        assert pagecache.resident(fd, offset, length) is False, "the disk read was started on the loop"
        raw = store.pread_range(bid(1), meta, 0, len(data))  # (a worker thread's part)
        assert bytes(store.finish_read(bid(1), meta, 0, len(data), raw)) == data
        pages, cached, evicted = pagecache.counts(fd, offset, length)
        assert cached + evicted >= pages, "the worker's read did not leave the block in memory"
        answer = store.read(bid(1), meta, 5, 70_000, nowait=True)
        if answer is WOULD_BLOCK:  # (only where the kernel took pages back since: a host short of memory)
            assert pagecache.counts(fd, offset, length)[2] > 0
        else:
            assert bytes(answer) == data[5:70_000]
    finally:
        os.close(fd)


def test_block_files_read_keep_their_descriptors_until_the_block_goes(tmp_path):
    """The trio thread's reads keep a block file open (no open per read), at most a bounded number, and
    a block removed closes its descriptor: no deleted file is held open (its space is freed)."""
    from epochfs.blockstore import store as store_mod

    s = make(tmp_path, packing=False)
    blocks = {bid(i): os.urandom(PACK_BELOW + i) for i in range(store_mod._BLOCK_FDS + 5)}
    for b, data in blocks.items():
        assert put(s, b, data)

    def open_block_files():
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if str(tmp_path) in target and "/blocks/" in target:
                out.add(target)
        return out

    for b, data in blocks.items():
        meta = s.lookup(b)
        for lo in (0, 1000, len(data) - 10):
            assert bytes(s.read(b, meta, lo, lo + 10)) == data[lo:lo + 10]
    held = open_block_files()
    assert len(held) == store_mod._BLOCK_FDS, "one descriptor per recent block file, at most the limit"
    last = list(blocks)[-1]
    s.remove(last, len(blocks[last]))
    assert not [t for t in open_block_files() if "(deleted)" in t]
    assert len(open_block_files()) == store_mod._BLOCK_FDS - 1
    s.close()
    assert not open_block_files()


def test_a_block_advised_ahead_is_opened_once_on_the_trio_thread_and_the_advice_lands(tmp_path, monkeypatch):
    """Advising a block file (a reader comes next) opens it off the calling thread (the open waits for
    the disk after the caches were dropped, as the advice does): the calling thread opens it once, for
    its reads, and the advised pages are in memory; a block whose file the calling thread holds open
    is advised through that descriptor, with no open at all."""
    import threading

    from epochfs.blockstore import pagecache

    s = make(tmp_path, packing=False)
    data = os.urandom(PACK_BELOW + 3 * 4096)
    assert put(s, bid(1), data)
    path, _, _ = s.block_location(bid(1))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (as after drop_caches: the reads go to disk)
        opened = []
        real_open = os.open
        caller = threading.current_thread()

        def counting_open(name, *args, **kwargs):
            if os.fspath(name) == str(path):
                opened.append(threading.current_thread() is caller)
            return real_open(name, *args, **kwargs)

        monkeypatch.setattr(os, "open", counting_open)
        meta = s.lookup(bid(1))
        s.advise(bid(1), meta)
        s.adviser.drain()
        assert opened == [False]  # (the adviser's own open)
        if pagecache.available():  # (the advice starts the reads; they land a moment later)
            deadline = time.monotonic() + 10
            while not pagecache.resident(fd, 0, len(data)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pagecache.resident(fd, 0, len(data))
        for lo in (0, 4096, len(data) - 10):
            assert bytes(s.read(bid(1), meta, lo, lo + 10)) == data[lo:lo + 10]
        s.advise(bid(1), meta)  # (held open now: advised through it)
        s.adviser.drain()
        monkeypatch.undo()
        assert opened == [False, True]
    finally:
        os.close(fd)
    s.remove(bid(1), len(data))
    s.advise(bid(1), meta)  # (gone: nothing to advise, nothing raised)


def test_advice_is_made_off_the_calling_thread_lands_and_leaks_no_descriptor(tmp_path):
    """The adviser's thread makes the advice (the pages of a dropped file come back into memory), on a
    duplicate it closes, so the caller's descriptor may go at once; past its bound, advice is dropped,
    counted, and still nothing leaks."""
    from epochfs.blockstore import pagecache

    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 << 20))
    gc.collect()  # (what earlier tests left for the collector closes now, not while this one counts)
    before = len(os.listdir("/proc/self/fd"))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    adviser = pagecache.Adviser()
    adviser.advise(fd, 0, 8 << 20)
    os.close(fd)  # (the caller's own: the advice holds a duplicate)
    adviser.drain()
    fd = os.open(path, os.O_RDONLY)
    try:
        if pagecache.available():
            deadline = time.monotonic() + 10
            while not pagecache.resident(fd, 0, 8 << 20) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pagecache.resident(fd, 0, 8 << 20)
        for _ in range(10 * pagecache.Adviser.BOUND):
            adviser.advise(fd, 0, 4096)
        adviser.drain()
    finally:
        os.close(fd)
    assert len(os.listdir("/proc/self/fd")) == before


def test_advice_past_the_adviser_bound_is_dropped_counted_and_reported(tmp_path):
    """Advice the adviser's queue has no room for is let go (its duplicate descriptor closed), counted,
    and the count reaches the store's statistics and the metrics."""
    import queue

    from epochfs.daemon.metrics import METRICS

    s = make(tmp_path)
    full: queue.Queue = queue.Queue(1)
    full.put(("/nonexistent", 0, 0))
    s.adviser._queue, s.adviser._pid = full, os.getpid()  # (its thread never started: the queue stays full)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    with open(path, "rb") as f:
        for _ in range(3):
            s.adviser.advise(f.fileno(), 0, 8192)
        s.adviser.advise_path(str(path), 0, 8192)
    assert len(os.listdir("/proc/self/fd")) == before  # (the file closed, and no duplicate left open)
    assert s.statistics().advice_dropped == 4
    assert "cache_advice_dropped" in METRICS
    s.close()


def test_a_file_taken_whole_is_the_objects_file_no_byte_copied_and_refused_where_it_could_mislead(tmp_path):
    """take_file renames an uploaded write-back file into place as its object's file (the same inode);
    each block indexed after its checksums are taken from the file reads back right, and a flipped byte
    is still caught; a file another name links, one of another size, or an object the store has a file
    of already are not taken; what is not kept of a taken file is freed, the file removed if nothing was."""
    from epochfs.blockstore.objects import Place

    s = make(tmp_path)
    block, size = 1 << 20, 3 * (1 << 20) + 4097
    data = os.urandom(size)
    src = tmp_path / "data-file"
    src.write_bytes(data)
    ino = os.stat(src).st_ino
    oid = bid(100)
    linked = tmp_path / "other-name"
    os.link(src, linked)
    assert s.take_file(oid, str(src), size) is None  # (another name could change it behind the store)
    linked.unlink()
    assert s.take_file(oid, str(src), size + 1) is None
    written = s.take_file(oid, str(src), size)
    assert written is not None and not src.exists() and os.stat(s.object_path(oid)).st_ino == ino
    for i, start in enumerate(range(0, size, block)):
        b, length = bid(100 + i), min(block, size - start)
        assert s.reserve(b, length)
        s.install(b, written, s.checked_block(b, written, Place(oid, start, size), length))
    for i, start in enumerate(range(0, size, block)):
        b = bid(100 + i)
        assert bytes(s.read(b, s.lookup(b), 0, s.lookup(b).length)) == data[start:start + block]
    assert s.objects.get(oid).whole
    again = tmp_path / "again"
    again.write_bytes(data)
    assert s.take_file(oid, str(again), size) is None  # (the store has this object's file)
    with open(s.object_path(oid), "r+b") as f:  # a byte flipped after the checksums were taken
        f.seek(5)
        f.write(bytes([data[5] ^ 1]))
    with pytest.raises(Exception):  # noqa: B017 - the store's damaged-block error
        bytes(s.read(bid(100), s.lookup(bid(100)), 0, 16))

    part = tmp_path / "part"  # a file kept in part: the rest freed; one kept not at all: removed
    part.write_bytes(data)
    written = s.take_file(bid(200), str(part), size)
    assert s.reserve(bid(200), block)
    s.install(bid(200), written, s.checked_block(bid(200), written, Place(bid(200), 0, size), block))
    s.untake(bid(200), block, size)
    assert os.stat(s.object_path(bid(200))).st_blocks * 512 <= block + (64 << 10)
    none = tmp_path / "none"
    none.write_bytes(data)
    assert s.take_file(bid(300), str(none), size) is not None
    s.untake(bid(300), 0, size)
    assert not os.path.exists(s.object_path(bid(300)))


@pytest.mark.parametrize("how", ["linked", "being-linked"])
def test_a_file_another_store_links_is_never_punched_its_blocks_leave_whole(tmp_path, how):
    """An object file another store of the node holds a link to (or is taking one to: a shared lock on
    it) loses a block: this store drops all of the object's blocks and its own name of the file; not a
    byte of the file is punched, so the other store's name keeps every byte."""
    import fcntl

    from epochfs.blockstore.objects import Place

    s = make(tmp_path, packing=False)
    data = os.urandom(3 * MIB + 5)
    oid, step = bid(10), MIB
    for i in range(4):  # (an object of 4 blocks in one file)
        b = oid if i == 0 else bid(10 + i)
        part = data[i * step:(i + 1) * step]
        s.install(b, *s.write_temp(b, part, place=Place(oid, i * step, len(data))))
    path = s.block_location(oid)[0]
    other = tmp_path / "other-store-name"
    held = None
    if how == "linked":
        os.link(path, other)
    else:
        held = os.open(path, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_SH)
    s.remove(bid(12), MIB)  # (evicted, or found damaged)
    assert all(s.lookup(b) is None for b in (oid, bid(11), bid(12), bid(13))), "its blocks all left"
    assert not path.exists() and s.statistics().used_bytes == 0
    if how == "linked":
        assert other.read_bytes() == data and _allocated(other) >= len(data) - 4096  # (no hole punched)
    else:
        assert os.pread(held, len(data) + 1, 0) == data
        os.close(held)
    put(s, bid(20), b"y" * 70_000)  # (the store goes on)
    assert bytes(s.read(bid(20), s.lookup(bid(20)), 0, 70_000)) == b"y" * 70_000
    s.close()


def test_a_file_this_store_alone_holds_is_punched_as_before(tmp_path):
    from epochfs.blockstore.objects import Place

    s = make(tmp_path, packing=False)
    data = os.urandom(2 * MIB)
    s.install(bid(30), *s.write_temp(bid(30), data[:MIB], place=Place(bid(30), 0, len(data))))
    s.install(bid(31), *s.write_temp(bid(31), data[MIB:], place=Place(bid(30), MIB, len(data))))
    path = s.block_location(bid(30))[0]
    s.remove(bid(31), MIB)
    assert s.lookup(bid(30)) is not None and path.exists() and _allocated(path) <= MIB + 4096
    assert bytes(s.read(bid(30), s.lookup(bid(30)), 0, MIB)) == data[:MIB]
    s.close()
