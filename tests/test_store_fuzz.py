"""Fuzz loops over what a crash, a failing disk or a careless hand can leave in a cache directory:
random changes to index entries (bytes, fields, entries copied under other ids), to pack and block
files (flipped, cut, extended, zeroed, deleted) and stray files, links and directories where packs and
blocks live. Then every block is read back. The rule: a read gives the block's own bytes or nothing
(the block is dropped and would be fetched again), never another block's bytes and never an
exception; the store opens, stays usable, and its accounting matches its index."""

import os
import random
import struct

import pytest

import epochfs.blockstore.packs as packs_mod
from epochfs.blockstore.format import MAX_OBJECT
from epochfs.blockstore.keys import CHUNK_SIZE, block_relpath
from epochfs.blockstore.store import WOULD_BLOCK, BlockMeta

from .test_store import bid, make, put

_HEAD = struct.Struct("<QIIQ")  # the entry layout of index format 4 (written here without validation)


def _entries(store) -> dict[bytes, bytes]:
    with store.index.env.begin() as txn:
        return {bytes(k): bytes(v) for k, v in txn.cursor() if len(k) == 16}


def _set(store, key: bytes, value: bytes | None) -> None:
    with store.index.env.begin(write=True) as txn:
        if value is None:
            txn.delete(key)
        else:
            txn.put(key, value)


def _extreme(rng: random.Random, bits: int) -> int:
    return rng.choice([0, 1, 4096, CHUNK_SIZE, packs_mod.PACK_SIZE, (1 << bits) - 1, (1 << (bits - 1)),
                       rng.randrange(1 << bits)])


def _mutate_index(rng: random.Random, store, keys: list[bytes]) -> None:
    entries = _entries(store)
    key = rng.choice(keys)
    value = entries.get(key)
    how = rng.choice(["random", "flip", "copy", "field", "new-key", "delete", "short"])
    if how == "random":
        _set(store, key, rng.randbytes(rng.randrange(0, 200)))
    elif how == "flip" and value:
        at = rng.randrange(len(value))
        _set(store, key, value[:at] + bytes([value[at] ^ (1 << rng.randrange(8))]) + value[at + 1:])
    elif how == "copy" and entries:
        _set(store, key, rng.choice(list(entries.values())))  # another block's entry under this id
    elif how == "field" and value and len(value) >= _HEAD.size:
        fields = list(_HEAD.unpack_from(value))
        which = rng.randrange(4)
        fields[which] = _extreme(rng, [64, 32, 32, 64][which])
        if which == 3:
            fields[3] -= fields[3] % 4096 * rng.randrange(2)  # aligned or not
        _set(store, key, _HEAD.pack(*fields) + value[_HEAD.size:])
    elif how == "new-key":
        source = rng.choice(list(entries.values()) or [b""])
        _set(store, rng.randbytes(16), source if rng.random() < 0.7 else rng.randbytes(rng.randrange(60)))
    elif how == "delete":
        _set(store, key, None)
    elif how == "short" and value:
        _set(store, key, value[:rng.randrange(len(value))])


def _mutate_file(rng: random.Random, path) -> None:
    size = os.path.getsize(path)
    how = rng.choice(["flip", "truncate", "extend", "zero", "delete"])
    if how == "flip" and size:
        with open(path, "r+b") as f:
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(size)
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "truncate":
        os.truncate(path, rng.randrange(size + 1))
    elif how == "extend":
        with open(path, "ab") as f:
            f.write(rng.randbytes(rng.randrange(1, 9000)))
    elif how == "zero" and size:
        at = rng.randrange(size)
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(bytes(min(size - at, rng.randrange(1, 70000))))
    elif how == "delete":
        os.unlink(path)


def _plant(rng: random.Random, store) -> None:
    """Something that is not ours where packs or block files live."""
    where = rng.choice([store.packs_dir, store.blocks_dir / "ab", store.blocks_dir])
    where.mkdir(exist_ok=True)
    name = rng.choice(["fffffffe", "ffffffff", "0x10", "00000001", "zz", "1" * 32, "ab" + "0" * 30,
                       f"{rng.randrange(1, 20):08x}", "00", f"{rng.randrange(256):02x}"])
    path = where / name
    if os.path.lexists(path):
        return
    kind = rng.choice(["file", "dir", "link"])
    if kind == "file":
        path.write_bytes(rng.randbytes(rng.randrange(5000)))
    elif kind == "dir":
        path.mkdir()
        (path / "inner").write_bytes(b"x")
    else:
        os.symlink(store.cache_dir / "lock", path)


def _check_reads(rng: random.Random, store, blocks: dict[bytes, bytes]) -> None:
    """Every block the index has reads as its own bytes or is dropped; ids never filled read nothing."""
    for key in list(_entries(store)):
        meta = store.lookup(key)
        if meta is None:
            continue
        data = blocks.get(key)
        if data is None or meta.length != len(data):  # what the cache service does with a wrong length
            store.drop_corrupt(key, meta, "not the length this block has")
            continue
        for _ in range(3):
            lo = rng.randrange(len(data))
            hi = rng.randrange(lo + 1, len(data) + 1)
            got = store.read(key, meta, lo, hi, nowait=rng.random() < 0.5)
            if got is WOULD_BLOCK:
                got = store.finish_read(key, meta, lo, hi, store.pread_range(key, meta, lo, hi))
            if got is None:
                break  # dropped as damaged
            assert bytes(got) == data[lo:hi], f"wrong bytes for block {key.hex()} [{lo}, {hi})"
            meta = store.lookup(key)
            if meta is None:
                break


def _shut(store, clean: bool) -> None:
    """Close the store cleanly, or as a killed daemon leaves it (index synced, no clean marker)."""
    if not clean:
        store.packs.close_fds()
        store.index.close(sync=True)
    store.close()


def _check_accounting(store) -> None:
    metas = [BlockMeta.decode(v) for v in _entries(store).values()]
    assert None not in metas
    st = store.statistics()
    assert st.blocks == len(metas) and st.used_bytes == sum(m.length for m in metas)


@pytest.mark.parametrize("seed", range(150))
def test_a_cache_directory_changed_at_random_never_gives_wrong_bytes(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(packs_mod, "PACK_SIZE", packs_mod.PACK_BELOW)  # several packs
    packing = rng.random() < 0.75
    capacity = 4 << 20
    s = make(tmp_path, capacity=capacity, packing=packing)
    blocks: dict[bytes, bytes] = {}
    for n in range(rng.randrange(4, 16)):
        data = rng.randbytes(rng.choice([1, 100, 4096, CHUNK_SIZE, CHUNK_SIZE + 1, rng.randrange(1, 200_000)]))
        if put(s, bid(n), data):
            blocks[bid(n)] = data
    _shut(s, clean=rng.random() < 0.5)  # a clean stop: the next open trusts the index; else reconciled
    keys = list(blocks) + [rng.randbytes(16)]
    s = make(tmp_path, capacity=capacity, packing=packing)  # (to reach the index; reopened below)
    for _ in range(rng.randrange(1, 5)):
        what = rng.random()
        if what < 0.5:
            _mutate_index(rng, s, keys)
        elif what < 0.85:
            files = [p for p in [*s.packs_dir.iterdir(), *s.blocks_dir.glob("*/*")] if p.is_file()]
            if files:
                _mutate_file(rng, rng.choice(files))
        else:
            _plant(rng, s)
    _shut(s, clean=rng.random() < 0.5)

    s = make(tmp_path, capacity=capacity, packing=packing)
    _check_accounting(s)
    _check_reads(rng, s, blocks)
    _check_accounting(s)

    # fsck drops what the partial reads did not touch; all that is left then reads back whole.
    report = s.fsck(repair=True)
    assert report["unreadable"] == 0
    for key in _entries(s):
        got = s.read(key, s.lookup(key), 0, len(blocks[key]))
        assert got is not None and bytes(got) == blocks[key]
    # New fills evict the rest and work.
    for n in range(100, 100 + 24):
        data = rng.randbytes(rng.randrange(1, 300_000))
        if put(s, bid(n), data):
            blocks[bid(n)] = data
            got = s.read(bid(n), s.lookup(bid(n)), 0, len(data))
            assert got is not None and bytes(got) == data
    assert s.statistics().used_bytes <= capacity
    _check_accounting(s)
    _check_reads(rng, s, blocks)
    s.close()
    s = make(tmp_path, capacity=capacity, packing=packing)
    _check_accounting(s)
    _check_reads(rng, s, blocks)
    assert not any(p.is_symlink() or p.is_dir() for p in s.packs_dir.iterdir())
    s.close()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "file"])
def test_an_entry_copied_under_another_block_id_does_not_verify(tmp_path, packing):
    """Two blocks of the same length: the index entry (and for block files, the file) of one put under
    the other's id. Its checksums are bound to its own id, so the other id reads nothing."""
    s = make(tmp_path, packing=packing)
    a, b = os.urandom(5000), os.urandom(5000)
    put(s, bid(1), a)
    put(s, bid(2), b)
    _set(s, bid(2), _entries(s)[bid(1)])
    if not packing:
        os.replace(s.blocks_dir / block_relpath(bid(1)), s.blocks_dir / block_relpath(bid(2)))
    assert s.read(bid(2), s.lookup(bid(2)), 0, 5000) is None
    assert s.statistics().corrupt_blocks == 1


def test_a_block_file_replaced_by_a_link_or_a_directory_is_damage_not_a_lasting_error(tmp_path):
    s = make(tmp_path, packing=False)
    for n in (1, 2):
        put(s, bid(n), bytes([n]) * 5000)
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes([1]) * 5000)
    path = s.blocks_dir / block_relpath(bid(1))
    path.unlink()
    os.symlink(target, path)
    other = s.blocks_dir / block_relpath(bid(2))
    other.unlink()
    other.mkdir()
    for n in (1, 2):
        assert s.read(bid(n), s.lookup(bid(n)), 0, 5000) is None
    assert s.statistics().corrupt_blocks == 2 and s.statistics().read_errors == 0
    assert not os.path.lexists(path) and not os.path.lexists(other) and target.exists()


def test_decoding_random_index_entries_never_raises_and_keeps_the_bounds():
    """Whatever bytes an index entry holds, decoding gives None or an entry within the bounds every
    reader relies on (a length a block can have, checksums for each chunk, a range inside a pack)."""
    rng = random.Random(7)
    goods = [BlockMeta(100_000, bytes(8 * 2), 5, 3, 8192).encode(),  # packed
             BlockMeta(3 << 20, bytes(8 * 48), 9, 0, 8 << 20, bytes(range(16)), 40 << 20).encode()]  # in its object's file
    for n in range(20_000):
        if n % 2:
            raw = bytearray(rng.choice(goods))
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            raw = bytes(raw[:rng.randrange(len(raw) + 1)]) if rng.random() < 0.2 else bytes(raw)
        else:
            raw = rng.randbytes(rng.randrange(0, 80))
        meta = BlockMeta.decode(raw)
        if meta is None:
            continue
        assert 0 < meta.length <= 64 << 20 and len(meta.sums) == 8 * -(-meta.length // CHUNK_SIZE)
        if meta.pack:
            assert meta.length < packs_mod.PACK_BELOW and meta.offset % 4096 == 0
            assert meta.offset + meta.length <= packs_mod.PACK_SIZE and meta.pack <= packs_mod.MAX_PACK
        else:
            assert meta.offset % 4096 == 0 and meta.offset + meta.length <= meta.size <= MAX_OBJECT
            assert len(meta.obj) == 16
        assert BlockMeta.decode(meta.encode()) == meta


def _fill_object(s, oid: bytes, data: bytes, first: int, step: int) -> None:
    from epochfs.blockstore.objects import Place

    for i, off in enumerate(range(0, len(data), step)):
        b, chunk = bid(first + i), data[off:off + step]
        if s.lookup(b) is not None:
            continue
        assert s.reserve(b, len(chunk))
        try:
            s.install(b, *s.write_temp(b, chunk, place=Place(oid, off, len(data))))
        except OSError:
            s.release(len(chunk))


def _lent_bytes(s, oid: bytes) -> bytes | None:
    fd = s.backing_fd(oid)
    if fd is None:
        return None
    try:
        return os.pread(fd, os.fstat(fd).st_size + 1, 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_object_files_changed_under_the_store_are_lent_to_the_kernel_only_with_every_byte_theirs(tmp_path, seed):
    """Whole object files (what the kernel reads itself) changed in every way the file system allows:
    flipped, cut, extended, replaced, made a link, deleted, holes punched, their mode changed; after
    each change the store hands out a descriptor for the kernel only of a file whose bytes are all the
    object's, the scrub's hash drops what is damaged, refilling makes it whole again, nothing raises."""
    import shutil

    rng = random.Random(seed)
    s = make(tmp_path, packing=False)
    step = 256 << 10
    objects: dict[bytes, tuple[bytes, int]] = {}
    for n in range(10):
        data = rng.randbytes(rng.randrange(1, 3 * step + 5000))
        oid = bid((1 << 100) + n)
        objects[oid] = (data, n * 100)
        _fill_object(s, oid, data, n * 100, step)
        assert _lent_bytes(s, oid) == data
    for _ in range(120):
        oid = rng.choice(list(objects))
        data, first = objects[oid]
        path = s.blocks_dir / oid.hex()[:2] / oid.hex()
        how = rng.choice(["flip", "cut", "extend", "replace", "link", "delete", "punch", "chmod", "none"])
        if path.is_symlink() and how not in ("delete", "none"):
            how = "none"  # (never written through: the link's target is not the cache's)
        try:
            if how == "flip" and path.stat().st_size:
                with open(path, "r+b") as fh:
                    at = rng.randrange(path.stat().st_size)
                    fh.seek(at)
                    byte = fh.read(1)
                    fh.seek(at)
                    fh.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
            elif how == "cut":
                os.truncate(path, rng.randrange(path.stat().st_size + 1))
            elif how == "extend":
                with open(path, "ab") as fh:
                    fh.write(b"x" * rng.randrange(1, 5000))
            elif how == "replace":
                other = path.with_name("other")
                shutil.copyfile(path, other)
                os.replace(other, path)
            elif how == "link":
                decoy = tmp_path / "decoy"
                decoy.write_bytes(data)  # (the object's own bytes, elsewhere: still never lent)
                os.unlink(path)
                os.symlink(decoy, path)
            elif how == "delete":
                os.unlink(path)
            elif how == "punch" and path.stat().st_size:
                fd = os.open(path, os.O_WRONLY)
                try:
                    packs_mod.punch_hole(fd, 0, min(4096, path.stat().st_size))
                finally:
                    os.close(fd)
            elif how == "chmod":
                os.chmod(path, 0o644)
        except OSError:
            pass
        got = _lent_bytes(s, oid)
        assert got is None or got == data, how
        for other in rng.sample(list(objects), 3):  # the scrub's hash, and reads through the store
            plan = s.check_plan(other)
            if plan:
                fp, bad = s.check_object(other, plan, 0)
                s.checked(other, plan, fp, bad)
            got = _lent_bytes(s, other)
            assert got is None or got == objects[other][0]
        if rng.random() < 0.3:
            if path.is_symlink():
                path.unlink()
            _fill_object(s, oid, data, first, step)
    for oid, (data, first) in objects.items():  # every object refilled and hashed: lent again, right
        path = s.blocks_dir / oid.hex()[:2] / oid.hex()
        if path.is_symlink():
            path.unlink()
        for _ in range(3):
            plan = s.check_plan(oid)
            if plan:
                fp, bad = s.check_object(oid, plan, 0)
                s.checked(oid, plan, fp, bad)
            _fill_object(s, oid, data, first, step)
        assert _lent_bytes(s, oid) == data, "refilled and hashed, yet not lent"
    s.close()
