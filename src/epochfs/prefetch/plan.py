"""The block plan of the epochs handed to the daemon: files in read order, expanded to blocks. Pure."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from epochfs.core.blocks import block_bounds, block_count, extent_blocks
from epochfs.core.errors import ConfigError
from epochfs.core.records import ObjectInfo, stored_extent


@dataclass(frozen=True, slots=True)
class PlanFile:
    obj: ObjectInfo
    first: int  # sequence position of its first block
    blocks: int  # how many blocks it has
    epoch: int | None  # the label the user gave the manifest
    segment: int  # which hand-over it came from (consecutive files of one manifest share it)
    stored: ObjectInfo  # the object its bytes are in: itself, or a packed member's shard
    index: int  # the block of ``stored`` its first byte is in
    base: int  # where its bytes start in ``stored`` (0 for a whole object)


#: Seconds of reading the prefetch window covers at most, by default (the scheduler's and the mount
#: option's one source).
DEFAULT_LEAD = 2.0

#: Fetches of a plan in flight at most, by default, and the most that may be asked for (each is a
#: worker thread and a backend connection while it lasts; the scheduler keeps far fewer in flight
#: where the backend answers fast).
DEFAULT_PREFETCH_CONCURRENCY = 96
MAX_PREFETCH_CONCURRENCY = 1024

#: Most blocks one plan (the epochs handed over and not yet read) may hold: about 1 GiB of daemon
#: memory, 32 TiB of reading at the default block size. A larger hand-over is refused.
MAX_PLAN_BLOCKS = 1 << 23


class PlanTooLarge(ConfigError):
    """A hand-over whose plan would exceed :data:`MAX_PLAN_BLOCKS`."""


def count_blocks(objs: Iterable[ObjectInfo], block_size: int, limit: int = MAX_PLAN_BLOCKS) -> int:
    """Blocks of ``objs`` read whole; :class:`PlanTooLarge` past ``limit`` (checked before any work)."""
    total = sum(block_count(o.size, block_size) for o in objs)
    if total > limit:
        raise PlanTooLarge(f"{total} blocks is more than one hand-over may hold ({limit}); hand over a "
                           "shorter manifest (one epoch, one rank) or use a larger --block-size")
    return total


class Plan:
    """Files in read order and the block sequence they imply. Built in a worker thread (it is pure and
    may be large); only read afterwards.

    ``blocks[p]`` is the id of the block read at sequence position ``p``; ``offsets[p]`` is the number of
    bytes read before it, so byte distances along the plan are differences of offsets; ``uses[b]`` lists
    the positions at which block ``b`` is read, in order (what the manifest eviction policy needs).
    """

    def __init__(self, files: Sequence[tuple[ObjectInfo, int | None, int]], block_size: int,
                 block_id: Callable[[ObjectInfo, int], bytes]) -> None:
        count_blocks((obj for obj, _, _ in files), block_size)
        self.block_size = block_size
        self.uses: dict[bytes, list[int]] = {}
        self.files: list[PlanFile] = []
        self.blocks: list[bytes] = []
        self.block_file: list[int] = []
        self.offsets: list[int] = [0]
        self.fetch_bytes = 0  # bytes of the distinct blocks the plan reads (a shard's block once, however
        # many of its members are read)
        self._by_key: dict[str, list[int]] = {}
        self.segment_end: dict[int, int] = {}  # segment -> index of its last file
        for obj, epoch, segment in files:
            fi = len(self.files)
            stored, base = stored_extent(obj)
            spans = list(extent_blocks(base, obj.size, stored.size, block_size))
            self.files.append(PlanFile(obj, len(self.blocks), len(spans), epoch, segment, stored,
                                       spans[0][0] if spans else 0, base))
            self.segment_end[segment] = fi
            self._by_key.setdefault(obj.key, []).append(fi)
            for i, whole, length in spans:  # (a member counts the bytes it has in each block)
                bid = block_id(stored, i)
                uses = self.uses.get(bid)
                if uses is None:
                    uses = self.uses[bid] = []
                    self.fetch_bytes += whole
                uses.append(len(self.blocks))
                self.blocks.append(bid)
                self.block_file.append(fi)
                self.offsets.append(self.offsets[-1] + length)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def total_bytes(self) -> int:
        return self.offsets[-1]

    @property
    def fetch_size(self) -> float:
        """The mean size of a block the plan fetches (of a packed member's shard: the block, not the
        member's share of it)."""
        return self.fetch_bytes / len(self.uses) if self.uses else 0.0

    def block(self, pos: int) -> tuple[ObjectInfo, int, bytes, int]:
        """(object, block index within it, block id, block size) at sequence position ``pos``: the
        object is the one the bytes are stored in (a packed member's shard)."""
        f = self.files[self.block_file[pos]]
        index = f.index + pos - f.first
        if f.stored is f.obj:
            return f.obj, index, self.blocks[pos], self.offsets[pos + 1] - self.offsets[pos]
        return f.stored, index, self.blocks[pos], block_bounds(index, f.stored.size, self.block_size)[1]

    def span(self, pos: int) -> tuple[int, int]:
        """[lo, hi): the bytes of the block at sequence position ``pos`` that its file reads (all of a
        whole object's block; a packed member's own range in its shard's block)."""
        f = self.files[self.block_file[pos]]
        start = (f.index + pos - f.first) * self.block_size
        stored_size = f.stored.size
        if f.stored is f.obj:
            return 0, min(self.block_size, stored_size - start)
        return max(f.base, start) - start, min(f.base + f.obj.size, start + self.block_size, stored_size) - start

    def locate(self, key: str, from_file: int) -> int | None:
        """Index of the first occurrence of ``key`` at or after file ``from_file``."""
        occurrences = self._by_key.get(key)
        if not occurrences:
            return None
        i = bisect_left(occurrences, from_file)
        return occurrences[i] if i < len(occurrences) else None

    def locate_in_segment(self, key: str, segment: int) -> int | None:
        """Index of the first file of ``segment`` with ``key``."""
        for i in self._by_key.get(key, ()):
            if self.files[i].segment == segment:
                return i
        return None

    def segment_start(self, segment: int) -> int:
        return next(i for i, f in enumerate(self.files) if f.segment == segment)
