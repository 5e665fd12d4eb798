"""One capacity for the node's mounts (:class:`NodeShare`): the mounts that share a share directory split one
cache size between them, fairly.

Each such mount keeps its own store (its files, its index, its eviction policy), and publishes a record
of itself in ``<share dir>/members`` (LMDB) every :attr:`NodeShare.EVERY` seconds: what its store holds,
the size it was given (``--cache-size``), its weight, and whether it is *filling* (it evicted or refused
a block for want of room in the last :attr:`NodeShare.HOLD` seconds). The node's capacity is the largest size a live mount
was given. From the same records every mount computes the same split (:func:`allocate`):

- each mount asks for its size while it is filling, else for what it holds;
- the node's capacity is shared by weighted max-min fairness: a mount that asks for less than its share
  gets what it asks, the rest is split between the others by weight;
- room nobody asks for is left to whoever fills first.

A mount then holds at most its part (its store evicts down to it, its own policy choosing what). So a
scan of one dataset takes at most what the others leave it: a job whose working set fits its fair share
(the capacity over the number of mounts, by weight) keeps it however large the scan. A record whose
process is gone (its pid dead, or another process under that pid, or another boot) is dropped by the
next mount that reads it; a mount that stops cleanly drops its own.
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lmdb
import trio

from epochfs.blockstore.store import BlockStore
from epochfs.blockstore.writes import boot_id
from epochfs.core.private import private_subdir

log = logging.getLogger(__name__)

_RECORD = struct.Struct("<IQ16sQQIBd")  # pid, its start time, boot, used, size, weight, filling, at


class Member(NamedTuple):
    """What a mount of the node publishes of itself."""

    pid: int
    started: int  # the process's start time (clock ticks since boot, /proc/PID/stat)
    boot: bytes
    used: int
    size: int  # its --cache-size
    weight: int
    filling: bool
    at: float

    def encode(self) -> bytes:
        return _RECORD.pack(self.pid, self.started, self.boot[:16].ljust(16, b"\0"), self.used, self.size,
                            self.weight, self.filling, self.at)

    @classmethod
    def decode(cls, raw: bytes) -> Member | None:
        if len(raw) != _RECORD.size:
            return None
        pid, started, boot, used, size, weight, filling, at = _RECORD.unpack(raw)
        if not 0 < pid < 1 << 22 or not 0 < weight <= 1000 or size > 1 << 60 or used > 1 << 60:
            return None
        return cls(pid, started, boot, used, size, weight, bool(filling), at)


def allocate(members: dict[bytes, Member]) -> dict[bytes, int]:
    """Each member's part of the node's capacity (the largest size given to one): weighted max-min
    fairness over what each asks (its size while filling, else what it holds), then the room nobody
    asks for open to any (so a part may exceed a share until another mount asks). Pure."""
    if not members:
        return {}
    node = max(m.size for m in members.values())
    asks = {k: min(m.size, m.size if m.filling else m.used) for k, m in members.items()}
    parts: dict[bytes, int] = {}
    active, left = set(members), node
    while active:
        weights = sum(members[k].weight for k in active)
        level = left / weights
        below = [k for k in active if asks[k] <= level * members[k].weight]
        if not below:  # (contended: the rest split by weight, nothing spare)
            return {**parts, **{k: int(level * members[k].weight) for k in active}}
        for k in below:
            parts[k] = asks[k]
            left -= asks[k]
            active.discard(k)
    spare = max(0, node - sum(parts.values()))  # (every ask met: what is left is anyone's to fill)
    return {k: min(members[k].size, parts[k] + spare) for k in members}


def _alone_now(paths: list[tuple[bytes, str]]) -> list[bytes]:
    """(a worker thread) The objects whose file has one name now (or none: gone)."""
    out = []
    for oid, path in paths:
        try:
            if os.stat(path, follow_symlinks=False).st_nlink == 1:
                out.append(oid)
        except OSError:
            out.append(oid)
    return out


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class NodeStats:
    members: int  # live mounts sharing the node's capacity
    node_bytes: int  # the node's capacity: the largest --cache-size of a live mount
    part_bytes: int  # what this mount may hold now (besides what it holds linked from another mount)
    linked_bytes: int = 0  # what it holds linked from another mount's store (charged to that one)


class NodeShare:
    EVERY = 1.0  # seconds between records
    HOLD = 10.0  # seconds a mount that had to evict or refuse for want of room still counts as filling

    def __init__(self, directory: Path, store: BlockStore, weight: int = 1) -> None:
        self.directory = directory
        self.store = store
        self.weight = weight
        self.id = secrets.token_bytes(16)
        self._env: lmdb.Environment | None = None
        self._pid, self._boot = os.getpid(), boot_id()[:16].ljust(16, b"\0")
        self._startedat = _started(self._pid) or 0
        self._seen = (0, 0)  # (evictions, refusals) at the last record
        self._filling_until = 0.0
        self._ring = 0  # where the next look at the linked objects starts
        self._stats = NodeStats(1, store.capacity, store.capacity)

    def open(self) -> None:
        """Open the members' records (raises ConfigError where the directory is not private, lmdb.Error)."""
        where = private_subdir(self.directory, "members")
        self._env = lmdb.open(str(where), map_size=64 << 20, subdir=True, max_dbs=0, sync=False, metasync=False,
                              readahead=False, lock=True, mode=0o600)

    def close(self) -> None:
        if self._env is not None:
            try:
                with self._env.begin(write=True) as txn:
                    txn.delete(self.id)
            except lmdb.Error:
                pass
            self._env.close()
            self._env = None

    async def run(self) -> None:
        while True:
            await self.turn()
            await trio.sleep(self.EVERY)

    async def turn(self) -> None:
        """Publish this mount's record, read the others', and hold this mount's store to its part."""
        st = self.store.statistics()
        await self._settle_links()
        linked = self.store.linked_bytes
        seen, now = (st.evictions, st.not_admitted), time.monotonic()
        if seen != self._seen:
            self._seen, self._filling_until = seen, now + self.HOLD
        held = st.used_bytes + st.pinned_bytes - linked  # (written data not yet uploaded counts too)
        me = Member(self._pid, self._startedat, self._boot, max(0, held), self.store.capacity,
                    self.weight, now < self._filling_until, time.time())
        try:
            members = await trio.to_thread.run_sync(self._exchange, me)
        except lmdb.Error as exc:
            log.warning("the node's mounts' records in %s cannot be read (%s): this mount holds its own "
                        "--cache-size meanwhile", self.directory, exc)
            self.store.limit = None
            return
        part = allocate(members)[self.id]
        self.store.limit = part if part < self.store.capacity else None
        self.store.shrink()
        self._stats = NodeStats(len(members), max(m.size for m in members.values()), part, linked)

    LINKS_CHECKED = 256  # linked objects looked at a turn: which no other store holds any more

    async def _settle_links(self) -> None:
        """Objects this store took by a link whose other names are gone are its own now: charged again."""
        store = self.store
        if not store.linked:
            return
        ring = list(store.linked)
        start = self._ring % len(ring)
        some = (ring[start:] + ring[:start])[:self.LINKS_CHECKED]
        self._ring = start + len(some)
        paths = [(oid, store.object_path(oid)) for oid in some]
        alone = await trio.to_thread.run_sync(_alone_now, paths)
        for oid in alone:
            store.alone_now(oid)

    def _exchange(self, me: Member) -> dict[bytes, Member]:
        assert self._env is not None
        live: dict[bytes, Member] = {}
        with self._env.begin(write=True) as txn:
            txn.put(self.id, me.encode())
            gone = []
            for key, raw in txn.cursor():
                m = Member.decode(bytes(raw))
                if m is None or len(key) != 16 or (bytes(key) != self.id and not self._alive(m)):
                    gone.append(bytes(key))
                else:
                    live[bytes(key)] = m
            for key in gone:
                txn.delete(key)
        return live

    def _alive(self, m: Member) -> bool:
        return m.boot == self._boot and _started(m.pid) == m.started

    def statistics(self) -> NodeStats:
        return self._stats
