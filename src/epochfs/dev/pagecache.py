"""The machine's page cache, dropped by whoever measures cold reads: the test suite's page-cache tests,
the benchmarks, and the demo. One lock, a file every one of them holds while it depends on the caches
(or drops them), so that one never drops the caches another is measuring: a test of hot reads beside a
benchmark's drop would read cold, a benchmark's warm pass beside a test's drop would read the disk."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The lock (shared by every checkout on the machine: the page cache is the machine's).
LOCK = Path(tempfile.gettempdir()) / "epochfs-tests-page-cache.lock"
#: Set (to the holder's pid) in the environment of what a holder of the lock runs: a benchmark a test
#: runs drops the caches under its parent's lock instead of waiting for it (forever: the parent waits too).
HELD_ENV = "EPOCHFS_PAGE_CACHE_HELD"


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold the page-cache lock (blocks while another holds it)."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def drop(*, locked: bool = False) -> None:
    """Write back what is dirty and drop the page cache, dentries and inodes (needs root). Takes the
    lock for the drop unless the caller holds it already (``locked``)."""
    if locked or os.environ.get(HELD_ENV):
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    with held():
        drop(locked=True)
