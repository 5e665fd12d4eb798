"""Recovery of a cache directory: after an unclean shutdown, and on demand (``epochfs fsck``).

A killed daemon can leave block files the index does not know (a crash between a fill's rename and its
index entry, or index writes lost with the page cache), entries whose file is missing or short, and
pack ranges written but never indexed. :func:`reconcile` settles them before anything is served;
:func:`fsck` verifies every block in full and reports (or repairs) what it finds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from epochfs.blockstore.format import BlockMeta, missing, scan, verify
from epochfs.blockstore.index import Index
from epochfs.blockstore.packs import Packs, discard

log = logging.getLogger(__name__)


class Store(Protocol):
    """What recovery needs of the block store it settles."""

    blocks_dir: Path
    packs: Packs
    index: Index
    used: int
    malformed: int
    strays: set[str]

    @property
    def inspecting(self) -> bool: ...

    def stray(self, path: str) -> None: ...

    def remove(self, bid: bytes, length: int) -> None: ...

    def drop_corrupt(self, bid: bytes, meta: BlockMeta, why: str) -> None: ...

    def pread_range(self, bid: bytes, meta: BlockMeta, lo: int, hi: int) -> bytes | OSError: ...


def reconcile(store: Store, known: dict[bytes, BlockMeta]) -> None:
    """After an unclean shutdown: drop index entries whose block file is missing or of the wrong
    length (or whose pack is missing or too short), delete block files the index does not know (a
    crash between a fill's rename and its index entry, or index writes lost with the page cache)
    and free the ranges of packs no entry refers to. Runs before anything is served."""
    on_disk, orphans = scan(store.blocks_dir, store.packs, known, store.stray)
    for path, _ in orphans:
        discard(str(path))
    if orphans:
        log.warning("removed %d block files (%d bytes) the cache index did not know, left by an "
                    "unclean shutdown", len(orphans), sum(size for _, size in orphans))
    lost = [bid for bid, meta in known.items() if on_disk.get(bid) != meta.length]
    for bid in lost:
        store.remove(bid, known[bid].length)
    if lost:
        log.warning("dropped %d cache index entries whose block file was missing or short", len(lost))
    gone = set(lost)
    used: dict[int, list[tuple[int, int]]] = {}  # the ranges of packs the index refers to
    for bid, meta in known.items():
        if meta.pack and bid not in gone:
            used.setdefault(meta.pack, []).append((meta.offset, meta.length))
    store.packs.free_unreferenced(used)


def fsck(store: Store, repair: bool) -> dict[str, int]:
    """Verify every indexed block in full and look for block files the index does not know
    (left by a crash between a fill's rename and its index entry). With ``repair``, drop damaged
    blocks and delete orphans (not on a store opened to inspect). Run only while no daemon owns the
    directory (the lock ensures it)."""
    assert store.index.is_open and not (repair and store.inspecting)
    entries = store.index.entries()
    known = {bid: meta for bid, meta in entries if meta is not None}  # (malformed ones are counted)
    damaged = unreadable = 0
    for bid, meta in known.items():
        data = store.pread_range(bid, meta, 0, meta.length)
        if isinstance(data, OSError) and not missing(data):
            unreadable += 1  # not evidence of damage: reported, never deleted
            log.warning("block %s: cannot read it: %s", bid.hex(), data)
            continue
        why = verify(bid, meta, 0, meta.length, data)
        if why:
            damaged += 1
            log.warning("block %s: %s", bid.hex(), why)
            if repair:
                store.drop_corrupt(bid, meta, why)
    _, orphans = scan(store.blocks_dir, store.packs, known, store.stray)
    if repair:
        for path, _ in orphans:
            discard(str(path))
    # ("blocks" and "used_bytes": what the directory holds now, after a repair's removals; "checked": before)
    return {"checked": len(known), "blocks": len(known) - (damaged if repair else 0), "damaged": damaged, "unreadable": unreadable, "orphans": len(orphans),
            "orphan_bytes": sum(size for _, size in orphans), "used_bytes": store.used,
            "malformed": store.malformed, "strays": len(store.strays)}
