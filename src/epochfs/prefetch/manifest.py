"""Epoch manifests: the order in which a training job will read files. Pure: no I/O but the helpers
that read and write manifest files.

Format (UTF-8): one path per line, relative to the mount root or absolute under the mount point (what
a dataset's list of samples holds), in read order; blank lines and lines starting with ``#`` are ignored. JSON Lines are accepted too: ``{"path": "a/b.jpg", "size": 1234}`` per
line (extra fields are kept but not required).

Rank partitions follow PyTorch's ``DistributedSampler(shuffle=..., drop_last=...)``: the global order
is padded by wrapping around to a multiple of the world size (with ``drop_last``, cut down to one),
then rank ``r`` takes every ``world_size``-th entry starting at ``r``. :func:`permutation` reproduces ``torch.randperm(n,
generator=torch.Generator().manual_seed(seed + epoch))`` exactly, without PyTorch, so
``shuffled(paths, seed, epoch)`` is the order ``DistributedSampler(shuffle=True, seed=seed)`` uses
after ``set_epoch(epoch)``.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from epochfs.core.errors import ConfigError

T = TypeVar("T")


class ManifestError(ConfigError):
    """A manifest (or a list of paths) that cannot be used; the message names the line. An input error:
    the command line exits with 2 for it, wherever it is found (here, or by the daemon)."""


@dataclass(frozen=True, slots=True)
class Entry:
    line: int  # 1-based line number in the manifest file
    path: str
    size: int | None = None


def parse(text: str, *, source: str = "manifest") -> list[Entry]:
    """Parse a manifest (plain or JSON Lines). Raises :class:`ManifestError` naming the bad line."""
    entries = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        size = None
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ManifestError(f"{source}:{n}: invalid JSON: {exc.msg}") from None
            path = obj.get("path") if isinstance(obj, dict) else None
            if not isinstance(path, str) or not path:
                raise ManifestError(f"{source}:{n}: a JSON line needs a \"path\" string")
            size = obj.get("size")
            if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
                raise ManifestError(f"{source}:{n}: \"size\" must be a non-negative integer")
        else:
            path = line
        if "\x00" in path:
            raise ManifestError(f"{source}:{n}: NUL in path")
        clean = path.strip("/")
        if not clean or any(part in ("", ".", "..") for part in clean.split("/")):
            raise ManifestError(f"{source}:{n}: not a clean path: {path!r}")
        entries.append(Entry(n, "/" + clean if path.startswith("/") else clean, size))
    if not entries:
        raise ManifestError(f"{source}: no paths")
    return entries


def mount_relative(mountpoint: str | os.PathLike[str], path: str) -> str:
    """``path`` (absolute under ``mountpoint``, or relative to its root) relative to the mount root; ""
    for the root itself."""
    if not os.path.isabs(path):
        rel = posixpath.normpath(path.strip("/") or ".")
        if rel == ".." or rel.startswith("../"):
            raise ManifestError(f"{path} is not under the mount root")
        return "" if rel == "." else rel
    root = os.path.abspath(mountpoint)
    rel = os.path.relpath(os.path.abspath(path), root)
    if rel.startswith(".."):
        raise ManifestError(f"{path} is not under the mount point {root}")
    return "" if rel == "." else rel


def read(path: str) -> list[Entry]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ManifestError(f"{path}: {exc.strerror}") from None
    return parse(text, source=path)


def write(path: str, paths: Iterable[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in paths:
            f.write(p + "\n")


def partition(items: Sequence[T], rank: int, world_size: int, drop_last: bool = False) -> list[T]:
    """Rank ``rank``'s share as ``DistributedSampler(drop_last=...)`` gives it: pad by wrapping to a
    multiple of ``world_size`` (or, with ``drop_last``, cut the tail down to one), then every
    ``world_size``-th item starting at ``rank``."""
    if world_size < 1:
        raise ValueError("world size must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size})")
    n = len(items)
    if n == 0:
        return []
    if drop_last:
        total = (n // world_size) * world_size
        return list(items[rank:total:world_size])
    total = math.ceil(n / world_size) * world_size
    padded = list(items)
    padding = total - n
    if padding <= n:
        padded += padded[:padding]
    else:
        padded += (padded * math.ceil(padding / n))[:padding]
    return padded[rank:total:world_size]


class _MT19937:
    """The Mersenne Twister as PyTorch's CPU generator uses it (``init_genrand`` seeding)."""

    def __init__(self, seed: int) -> None:
        mt = [0] * 624
        mt[0] = seed & 0xFFFFFFFF
        for i in range(1, 624):
            mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        self.mt = mt
        self.index = 624

    def _twist(self) -> None:
        mt = self.mt
        for i in range(624):
            y = (mt[i] & 0x80000000) | (mt[(i + 1) % 624] & 0x7FFFFFFF)
            v = mt[(i + 397) % 624] ^ (y >> 1)
            if y & 1:
                v ^= 0x9908B0DF
            mt[i] = v
        self.index = 0

    def next32(self) -> int:
        if self.index >= 624:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y

    def next64(self) -> int:
        hi = self.next32()
        lo = self.next32()
        return (hi << 32) | lo


def permutation(n: int, seed: int) -> list[int]:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()`` on the CPU."""
    if seed < 0:
        seed += 1 << 64
    gen = _MT19937(seed)
    perm = list(range(n))
    draw = gen.next32 if n < 0xFFFFFFFF // 20 else gen.next64
    for i in range(n - 1):
        z = draw() % (n - i)
        perm[i], perm[i + z] = perm[i + z], perm[i]
    return perm


def shuffled(items: Sequence[T], seed: int, epoch: int) -> list[T]:
    """``items`` in the order ``DistributedSampler(shuffle=True, seed=seed)`` reads them in ``epoch``
    (with one replica)."""
    return [items[i] for i in permutation(len(items), seed + epoch)]


def epoch_order(items: Sequence[T], *, seed: int | None, epoch: int | None = None, rank: int = 0,
                world_size: int = 1, drop_last: bool = False) -> list[T]:
    """What rank ``rank`` reads in ``epoch``: ``items`` (the dataset in index order) shuffled as
    ``DistributedSampler(shuffle=True, seed=seed)`` does if a seed is given, then partitioned. The one
    definition of an epoch's order (the command line and the Python helpers use it)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ManifestError(f"rank {rank} is not in [0, world size {world_size})")
    if seed is not None:
        if epoch is None:
            raise ManifestError("a shuffle (seed) needs the epoch number")
        items = shuffled(items, seed, epoch)
    return partition(items, rank, world_size, drop_last)


def local_order(groups: Sequence[Hashable], *, seed: int, epoch: int, window: int = 4, rank: int = 0,
                world_size: int = 1, drop_last: bool = False) -> list[int]:
    """Sample indices in an order random enough for training and local for storage: ``groups[i]`` is
    where sample ``i`` is stored (its shard, for a packed dataset). The groups are drawn in a random permutation; the samples of each run of
    ``window`` consecutive groups are shuffled together (the idea of Mosaic Streaming's block shuffles).
    Deterministic by ``(seed, epoch)``; every sample once per epoch, partitioned as
    ``DistributedSampler`` does (padded by wrapping to a multiple of ``world_size``, or cut with
    ``drop_last``) except that each rank takes a contiguous share, so that it reads whole groups. With
    one sample per group this is a plain random permutation."""
    if window < 1:
        raise ManifestError("the shuffle window must be at least one group")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ManifestError(f"rank {rank} is not in [0, world size {world_size})")
    rng = random.Random(f"epochfs-local:{seed}:{epoch}")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    drawn = list(members.values())
    rng.shuffle(drawn)
    order: list[int] = []
    for start in range(0, len(drawn), window):
        run = [i for group in drawn[start:start + window] for i in group]
        rng.shuffle(run)
        order += run
    n = len(order)
    if n == 0:
        return []
    total = (n // world_size) * world_size if drop_last else math.ceil(n / world_size) * world_size
    while len(order) < total:
        order += order[:total - len(order)]
    per = total // world_size
    return order[rank * per:(rank + 1) * per]
