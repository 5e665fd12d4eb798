"""The block plan of the epochs handed to the daemon: files in read order, expanded to blocks. Pure."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epochfs.backend.base import ObjectInfo
from epochfs.cache.keys import block_count


@dataclass(frozen=True, slots=True)
class PlanFile:
    obj: ObjectInfo
    first: int  # sequence position of its block 0
    epoch: int | None  # the label the user gave the manifest
    segment: int  # which hand-over it came from (consecutive files of one manifest share it)


class Plan:
    """Files in read order and the block sequence they imply.

    ``blocks[p]`` is the id of the block read at sequence position ``p``; ``offsets[p]`` is the number of
    bytes read before it, so byte distances along the plan are differences of offsets.
    """

    def __init__(self, files: Sequence[tuple[ObjectInfo, int | None, int]], block_size: int,
                 block_id: Callable[[ObjectInfo, int], bytes]) -> None:
        self.block_size = block_size
        self.files: list[PlanFile] = []
        self.blocks: list[bytes] = []
        self.block_file: list[int] = []
        self.offsets: list[int] = [0]
        self._by_key: dict[str, list[int]] = {}
        self.segment_end: dict[int, int] = {}  # segment -> index of its last file
        for obj, epoch, segment in files:
            fi = len(self.files)
            self.files.append(PlanFile(obj, len(self.blocks), epoch, segment))
            self.segment_end[segment] = fi
            self._by_key.setdefault(obj.key, []).append(fi)
            for i in range(block_count(obj.size, block_size)):
                self.blocks.append(block_id(obj, i))
                self.block_file.append(fi)
                self.offsets.append(self.offsets[-1] + min(block_size, obj.size - i * block_size))

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def total_bytes(self) -> int:
        return self.offsets[-1]

    def block(self, pos: int) -> tuple[ObjectInfo, int, bytes, int]:
        """(object, block index within it, block id, block size) at sequence position ``pos``."""
        f = self.files[self.block_file[pos]]
        return f.obj, pos - f.first, self.blocks[pos], self.offsets[pos + 1] - self.offsets[pos]

    def locate(self, key: str, from_file: int) -> int | None:
        """Index of the first occurrence of ``key`` at or after file ``from_file``."""
        occurrences = self._by_key.get(key)
        if not occurrences:
            return None
        i = bisect_left(occurrences, from_file)
        return occurrences[i] if i < len(occurrences) else None

    def tail(self, from_file: int) -> list[tuple[ObjectInfo, int | None, int]]:
        return [(f.obj, f.epoch, f.segment) for f in self.files[from_file:]]

    def segment_start(self, segment: int) -> int:
        return next(i for i, f in enumerate(self.files) if f.segment == segment)
