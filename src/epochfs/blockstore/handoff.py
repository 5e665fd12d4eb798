"""The hand-over of a block fill's result from the worker thread that wrote it to the trio thread that
waits for it: exactly once, and undone by the worker if nobody takes it."""

from __future__ import annotations

import threading

from epochfs.blockstore.format import BlockMeta


class Handoff:
    """What a fill's worker thread wrote, passed to the trio thread exactly once: taken by the fill if
    it still waits, or, if the fill gave up (its deadline passed, or the service stopped), left to the
    worker thread, which then has the write undone."""

    __slots__ = ("_lock", "_result", "_closed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._result: tuple[str, BlockMeta] | OSError | None = None
        self._closed = False

    def give(self, result: tuple[str, BlockMeta] | OSError) -> bool:
        """(Worker thread) hand the result over; False if the fill no longer takes it."""
        with self._lock:
            if self._closed:
                return False
            self._result = result
            return True

    def take(self) -> tuple[str, BlockMeta] | OSError | None:
        """(Trio thread) the result if the worker has given it (None if not yet); from now on it gives
        nothing."""
        with self._lock:
            self._closed = True
            return self._result
