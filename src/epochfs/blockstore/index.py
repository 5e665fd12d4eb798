"""The cache index: LMDB under ``<cache-dir>/index/``, block id -> :class:`~epochfs.blockstore.format.BlockMeta`.

One entry per cached block; per object file that is whole and checked, its fingerprint (``\\x01`` and
the object's id: what the file was when it was last known right, see :mod:`epochfs.blockstore.objects`);
a format mark (``\\x00format``) so an index of another layout is recognised and discarded rather than
misread, and the boot the index was last opened in (``\\x00boot``). Commits are not fsync'ed one by
one (the index survives
the daemon's death, not the machine's; the store reconciles after an unclean shutdown); :meth:`close`
syncs. Owned by :class:`epochfs.blockstore.store.BlockStore` on the trio thread.
"""

from __future__ import annotations

from pathlib import Path

import lmdb

from epochfs.blockstore.format import BlockMeta

FORMAT = b"5"  # 5: a file per object; 4: checksums bound to the block id; 3: small blocks in packs; 2: a file per block
_FORMAT_KEY = b"\x00format"
_BOOT_KEY = b"\x00boot"
PRINT = b"\x01"  # the prefix of an object file's fingerprint


class OtherFormat(lmdb.InvalidError):
    """The index was written by a version of epochfs with another layout."""


class Index:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.env: lmdb.Environment | None = None
        self.boot = b""  # the boot the index was last opened in (b"": not known)

    def open(self, *, readonly: bool) -> tuple[list[tuple[int, bytes, BlockMeta]], list[bytes]]:
        """Open it and read every entry: the good ones as (sequence, id, entry) in fill order, and the
        keys of malformed ones (fingerprints are read by :meth:`prints`). Raises :class:`lmdb.Error`
        (:class:`OtherFormat` for another layout)."""
        self.env = lmdb.open(
            str(self.directory), map_size=1 << 36, subdir=True, max_dbs=0, sync=False, metasync=False,
            readahead=False, lock=True, mode=0o600, readonly=readonly,
        )
        loaded: list[tuple[int, bytes, BlockMeta]] = []
        bad: list[bytes] = []
        with self.env.begin() as txn:
            fmt = txn.get(_FORMAT_KEY)
            if fmt is not None and fmt != FORMAT:
                raise OtherFormat(f"it has format {fmt.decode(errors='replace')}, this version uses "
                                  f"{FORMAT.decode()}")
            self.boot = bytes(txn.get(_BOOT_KEY) or b"")
            for key, raw in txn.cursor():
                if key in (_FORMAT_KEY, _BOOT_KEY) or (key[:1] == PRINT and len(key) == 17):
                    continue
                meta = BlockMeta.decode(raw)
                if len(key) != 16 or meta is None:
                    bad.append(bytes(key))
                else:
                    loaded.append((meta.seq, bytes(key), meta))
        loaded.sort()
        return loaded, bad

    def mark(self, drop: list[bytes], boot: bytes = b"") -> None:
        """Write the format mark and this boot's id, and delete the entries ``drop`` (the malformed ones)."""
        assert self.env is not None
        with self.env.begin(write=True) as txn:
            txn.put(_FORMAT_KEY, FORMAT)
            if boot:
                txn.put(_BOOT_KEY, boot)
            for key in drop:
                txn.delete(key)

    def prints(self) -> dict[bytes, bytes]:
        """Every object file's fingerprint: object id -> its encoding."""
        assert self.env is not None
        with self.env.begin() as txn:
            cursor = txn.cursor()
            found: dict[bytes, bytes] = {}
            if cursor.set_range(PRINT):
                for key, raw in cursor:
                    if key[:1] != PRINT:
                        break
                    if len(key) == 17:
                        found[bytes(key[1:])] = bytes(raw)
            return found

    def set_print(self, oid: bytes, raw: bytes | None) -> None:
        """Keep (or, with None, forget) an object file's fingerprint."""
        assert self.env is not None
        with self.env.begin(write=True) as txn:
            if raw is None:
                txn.delete(PRINT + oid)
            else:
                txn.put(PRINT + oid, raw)

    def clear_prints(self) -> None:
        """Forget every fingerprint (their files are checked again before the kernel reads them)."""
        assert self.env is not None
        oids = list(self.prints())
        with self.env.begin(write=True) as txn:
            for oid in oids:
                txn.delete(PRINT + oid)

    def get(self, bid: bytes) -> BlockMeta | None:
        assert self.env is not None
        with self.env.begin(buffers=True) as txn:
            raw = txn.get(bid)
            return BlockMeta.decode(bytes(raw)) if raw is not None else None

    def put(self, bid: bytes, meta: BlockMeta) -> None:
        assert self.env is not None
        with self.env.begin(write=True) as txn:
            txn.put(bid, meta.encode())

    def pop(self, bid: bytes) -> tuple[bool, BlockMeta | None]:
        """Remove an entry: whether there was one, and what it said (None if malformed)."""
        assert self.env is not None
        with self.env.begin(write=True) as txn:
            raw = txn.pop(bid)
        return raw is not None, BlockMeta.decode(bytes(raw)) if raw is not None else None

    def entries(self) -> list[tuple[bytes, BlockMeta | None]]:
        """Every block entry (None where malformed)."""
        assert self.env is not None
        with self.env.begin() as txn:
            return [(bytes(k), BlockMeta.decode(bytes(v))) for k, v in txn.cursor() if len(k) == 16]

    @property
    def is_open(self) -> bool:
        return self.env is not None

    def close(self, *, sync: bool) -> None:
        if self.env is not None:
            if sync:
                self.env.sync(True)
            self.env.close()
            self.env = None
