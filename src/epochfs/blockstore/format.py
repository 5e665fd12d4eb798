"""The cache's on-disk format: index entries and the checksums that bind a block's bytes to its id.

What a block is (:class:`BlockMeta`), how its bytes are checked (:func:`checksums`, :func:`verify`),
where it is in a cache directory (:func:`where`, :func:`locate`, which reads an index), and which
block files and packs a directory holds against an index (:func:`scan`, for recovery and fsck).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import blake3
import lmdb
import xxhash

from epochfs.blockstore import packs as pk

if TYPE_CHECKING:
    from epochfs.blockstore.packs import Packs
from epochfs.blockstore.keys import BLOCK_GLOB, CHUNK_SIZE, MAX_BLOCK_SIZE, block_relpath, chunk_span

_HEAD = struct.Struct("<QIIQ")  # sequence number, block length, pack (0: in its object's file), offset in it
_FILE = struct.Struct("<16sQ")  # (a block in its object's file) the object's id and size
_SUM = 8  # bytes of one xxh3-64 digest
DIGEST_SIZE = 32  # bytes of a block's BLAKE3 hash
_MAX_SEQ = 1 << 62  # an entry's sequence number (fills in order) is below this; no cache comes near it
MAX_OBJECT = 1 << 50  # an object file is never longer (1 PiB; S3 objects are at most 5 TiB)


class BlockMeta(NamedTuple):
    """An index entry: the block's length, one xxh3-64 digest per CHUNK_SIZE chunk, and where it is:
    in pack ``pack`` at ``offset``, or (``pack`` 0) at ``offset`` of its object's file (``obj``, the
    object's id, names the file; ``size`` is the object's, the file's length). ``digest``: the block's
    BLAKE3 hash where the node serves other members (b"" elsewhere): what binds an answer sent from the
    file to the block (:mod:`epochfs.peer.wire`), taken from the bytes as they were fetched."""

    length: int
    sums: bytes
    seq: int = 0
    pack: int = 0
    offset: int = 0
    obj: bytes = b""
    size: int = 0
    digest: bytes = b""

    def encode(self) -> bytes:
        head = _HEAD.pack(self.seq, self.length, self.pack, self.offset)
        file = b"" if self.pack else _FILE.pack(self.obj, self.size)
        return head + file + self.sums + self.digest

    @classmethod
    def decode(cls, raw: bytes) -> BlockMeta | None:
        """The entry, or None if ``raw`` is not one this version could have written."""
        if len(raw) < _HEAD.size:
            return None
        seq, length, pack, offset = _HEAD.unpack_from(raw)
        obj, size, at = b"", 0, _HEAD.size
        if not pack:
            if len(raw) < _HEAD.size + _FILE.size:
                return None
            obj, size = _FILE.unpack_from(raw, _HEAD.size)
            at += _FILE.size
        if not 0 < length <= MAX_BLOCK_SIZE or seq > _MAX_SEQ:
            return None
        sums, digest = bytes(raw[at:]), b""
        n = _SUM * -(-length // CHUNK_SIZE)
        if len(sums) == n + DIGEST_SIZE:
            sums, digest = sums[:n], sums[n:]
        elif len(sums) != n:
            return None
        if pack and (length >= pk.PACK_BELOW or offset % pk.ALIGN or offset + length > pk.PACK_SIZE
                     or pack > pk.MAX_PACK):
            return None
        if not pack and (offset % pk.ALIGN or offset + length > size or size > MAX_OBJECT):
            return None
        return cls(length, sums, seq, pack, offset, obj, size, digest)

    @property
    def in_file(self) -> bool:
        """In its object's file (not a pack)."""
        return not self.pack


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """A block's BLAKE3 hash (releases the GIL: any thread)."""
    return blake3.blake3(data, max_threads=1).digest()


def _seed(bid: bytes) -> int:
    """The checksum seed of a block: all of its id, folded to 64 bits."""
    return int.from_bytes(bid[:8], "little") ^ int.from_bytes(bid[8:16], "little")


def checksums(bid: bytes, data: bytes | memoryview) -> bytes:
    """One xxh3-64 digest per chunk of block ``bid``'s bytes, seeded with the block id: the bytes and
    checksums of one block never verify as another's (an index entry copied under another id, block
    files swapped together with their entries)."""
    view, seed = memoryview(data), _seed(bid)
    return b"".join(xxhash.xxh3_64_digest(view[i:i + CHUNK_SIZE], seed) for i in range(0, len(view), CHUNK_SIZE))


_NOT_A_FILE = {errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR}  # where a block should be


def missing(exc: OSError) -> bool:
    """Whether a failed open or read says the block's file is not there (or is not a plain file: a
    link, a directory), which is damage; any other error (EMFILE, EIO, ENOMEM) says nothing of it."""
    return exc.errno in _NOT_A_FILE


def verify(bid: bytes, meta: BlockMeta, lo: int, hi: int, data: bytes | bytearray | OSError) -> str:
    """What is wrong with ``data`` read for [lo, hi) of block ``bid`` described by ``meta``, or ""
    (pure: any thread)."""
    start, end = chunk_span(lo, hi, meta.length)
    if isinstance(data, OSError):
        return f"its file is missing or not a file ({data.strerror or data})"
    if len(data) != end - start:
        return f"short read: {len(data)} of {end - start} bytes"
    view, seed = memoryview(data), _seed(bid)
    first = start // CHUNK_SIZE
    for n, off in enumerate(range(0, len(view), CHUNK_SIZE)):
        expected = meta.sums[(first + n) * _SUM:(first + n + 1) * _SUM]
        if xxhash.xxh3_64_digest(view[off:off + CHUNK_SIZE], seed) != expected:
            return f"checksum mismatch in chunk {first + n}"
    return ""


def locate(cache_dir: Path, bid: bytes) -> tuple[Path, int, int] | None:
    """Where block ``bid`` is in the cache directory ``cache_dir`` (file, offset, length), read from its
    index without taking the directory's lock (LMDB readers may share it with the running daemon);
    None if it is not cached. For inspection and tests."""
    cache_dir = Path(cache_dir)
    env = lmdb.open(str(cache_dir / "index"), subdir=True, readonly=True, lock=True, max_dbs=0)
    try:
        with env.begin() as txn:
            raw = txn.get(bid)
    finally:
        env.close()
    return where(cache_dir, bid, BlockMeta.decode(raw) if raw is not None else None)


def where(cache_dir: Path, bid: bytes, meta: BlockMeta | None) -> tuple[Path, int, int] | None:
    if meta is None:
        return None
    if meta.pack:
        return cache_dir / "packs" / pk.pack_name(meta.pack), meta.offset, meta.length
    return cache_dir / "blocks" / block_relpath(meta.obj), meta.offset, meta.length


def scan(blocks_dir: Path, packs: Packs, known: dict[bytes, BlockMeta], stray: Callable[[str], None]
         ) -> tuple[dict[bytes, int], list[tuple[Path, int]]]:
    """Walk the object files and packs: the lengths present of the blocks in ``known`` (a block counts
    as present if its object's file, or its pack, is long enough to hold it), and (path, size) of
    object files and packs that hold no block of ``known``."""
    sizes: dict[bytes, int] = {}
    orphans: list[tuple[Path, int]] = []
    pack_sizes: dict[int, int] = {}
    for pack in packs.on_disk(stray):
        try:
            pack_sizes[pack] = os.stat(packs.path(pack)).st_size
        except OSError:
            continue
    referenced: set[int] = set()
    for bid, meta in known.items():
        if meta.pack:
            referenced.add(meta.pack)
            if pack_sizes.get(meta.pack, -1) >= meta.offset + meta.length:
                sizes[bid] = meta.length
    for pack, size in pack_sizes.items():
        if pack not in referenced:
            orphans.append((Path(packs.path(pack)), size))
    files: dict[bytes, list[tuple[bytes, BlockMeta]]] = {}  # object id -> its blocks
    for bid, meta in known.items():
        if not meta.pack:
            files.setdefault(meta.obj, []).append((bid, meta))
    for path in blocks_dir.glob(BLOCK_GLOB):
        try:
            oid = bytes.fromhex(path.name)
        except ValueError:
            oid = b""
        try:
            st = path.lstat()
            size = st.st_size if stat.S_ISREG(st.st_mode) else -1
        except OSError:
            size = -1
        held = files.get(oid)
        if not held:
            orphans.append((path, max(0, size)))
            continue
        for bid, meta in held:
            if size == meta.size:
                sizes[bid] = meta.length
    return sizes, orphans
