"""The backend contract.

A backend lists a dataset and reads byte ranges of one *version* of an object. Its methods are
blocking and thread-safe: the async layers call them through ``trio.to_thread.run_sync`` under a shared
capacity limiter.

Backends own their retries. A temporary failure (throttling, 5xx, a reset connection, a body cut short)
is retried with exponential backoff and jitter inside the call, bounded by an overall deadline; the
caller only ever sees a permanent domain error from :mod:`epochfs.core.errors`:

- :class:`~epochfs.core.errors.ObjectChanged` when the object no longer has the snapshot's ETag (or is
  gone) — the reader gets ESTALE and never a mix of versions;
- :class:`~epochfs.core.errors.BackendUnavailable` when retries or the deadline ran out — EIO;
- :class:`~epochfs.core.errors.AccessDenied` — EACCES.

``read_range`` returns exactly ``length`` bytes of the version named by ``etag`` or raises.
"""

from __future__ import annotations

import abc
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from epochfs.backend import attrs
from epochfs.core.errors import BackendUnavailable
from epochfs.core.records import MAX_MTIME_NS, MIN_MTIME_NS, ObjectInfo, Source, record_problem
from epochfs.core.stats import Histogram, HistogramSnapshot
from epochfs.links.meter import TransferMeter

log = logging.getLogger(__name__)

T = TypeVar("T")

def listing_problem(obj: ObjectInfo) -> str | None:
    """Why a listed object cannot be kept and served (None if it can): :func:`records.record_problem`
    of it, its mtime clamped first (see :func:`servable`)."""
    return record_problem(_clamped(obj))


def _clamped(obj: ObjectInfo) -> ObjectInfo:
    if isinstance(obj.mtime_ns, int) and not MIN_MTIME_NS <= obj.mtime_ns <= MAX_MTIME_NS:
        return obj._replace(mtime_ns=min(max(obj.mtime_ns, MIN_MTIME_NS), MAX_MTIME_NS))
    return obj


def servable(objects: Iterable[ObjectInfo]) -> Iterator[ObjectInfo]:
    """The objects of a listing within the bounds every store and reader relies on; the others are
    skipped with one warning each. An mtime beyond what 64 bits of nanoseconds hold is clamped to it."""
    for obj in objects:
        obj = _clamped(obj)
        problem = record_problem(obj)
        if problem:
            log.warning("skipping listed object %r: %s", str(obj.key)[:300], problem)
            continue
        yield obj


#: The defaults of a backend's settings (the one source: the mount options take them from here).
DEFAULT_TIMEOUT, DEFAULT_ATTEMPTS, DEFAULT_CONCURRENCY = 30.0, 5, 16


@dataclass(frozen=True)
class BackendSettings:
    """What a backend needs to know, and nothing of the mount around it."""

    source: Source
    endpoint_url: str | None = None  # an S3-compatible endpoint (path-style addressing)
    region: str | None = None
    timeout: float = DEFAULT_TIMEOUT  # deadline of one block fetch, retries and body included
    attempts: int = DEFAULT_ATTEMPTS  # attempts per request
    concurrency: int = DEFAULT_CONCURRENCY  # parallel requests the caller will make (sizes the connection pool)
    profile: str | None = None  # a profile of the AWS configuration (default: the standard chain)


@dataclass(frozen=True)
class BackendStats:
    """Cumulative counters since the backend was opened."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (op, outcome) -> count
    bytes_read: int = 0
    request_seconds: HistogramSnapshot | None = None
    first_byte_seconds: float | None = None  # how long a data request waits for its first byte (recent mean)


class StatsRecorder:
    """Thread-safe counters a backend updates from its worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._bytes = 0
        self.latency = Histogram()
        self.transfers = TransferMeter()  # when the bodies of data requests moved: the link's rate
        self.first_byte: float | None = None  # EWMA of the wait for a data request's first byte

    def record(self, op: str, outcome: str, nbytes: int = 0, seconds: float | None = None,
               moving: tuple[float, float] | None = None) -> None:
        """One request; ``moving``: when its body's first and last byte arrived (monotonic seconds)."""
        with self._lock:
            self._requests[(op, outcome)] += 1
            self._bytes += nbytes
        if seconds is not None:
            self.latency.observe(seconds)
        if moving is not None:
            self.transfers.record(moving[0], moving[1], nbytes)
            if seconds is not None:  # (the request began ``seconds`` before its last byte)
                wait = max(0.0, moving[0] - (moving[1] - seconds))
                with self._lock:
                    self.first_byte = wait if self.first_byte is None else 0.9 * self.first_byte + 0.1 * wait

    def snapshot(self) -> BackendStats:
        with self._lock:
            return BackendStats(requests=dict(self._requests), bytes_read=self._bytes,
                                request_seconds=self.latency.snapshot(), first_byte_seconds=self.first_byte)


class TemporaryFailure(Exception):
    """Raised inside a backend for a failure worth retrying; never escapes the backend."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def retry(
    fn: Callable[[], T],
    *,
    what: str,
    deadline: float,
    attempts: int,
    base_delay: float = 0.05,
    max_delay: float = 2.0,
) -> T:
    """Call ``fn`` until it returns, retrying :class:`TemporaryFailure` with full-jitter backoff.

    Stops after ``attempts`` calls or once ``deadline`` (a ``time.monotonic()`` value) would be passed,
    and then raises :class:`BackendUnavailable`. A ``retry_after`` hint from the server is honoured as
    the minimum wait.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except TemporaryFailure as exc:
            delay = random.uniform(0, min(max_delay, base_delay * 2 ** (attempt - 1)))
            if exc.retry_after is not None:
                delay = max(delay, exc.retry_after)
            if attempt == attempts or time.monotonic() + delay >= deadline:
                raise BackendUnavailable(f"{what}: {exc} (gave up after {attempt} attempts)") from None
            log.debug("%s: %s; retrying in %.2fs", what, exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


class Backend(abc.ABC):
    """Lists a dataset and reads ranges of pinned object versions. Blocking, thread-safe."""

    #: Identifies the dataset in cache keys, so two sources can share one cache directory.
    source_id: str

    @abc.abstractmethod
    def list_objects(self) -> Iterator[ObjectInfo]:
        """Every object under the source root, keys relative to it, in any order."""

    @abc.abstractmethod
    def read_range(self, key: str, etag: str, start: int, length: int) -> bytes | bytearray:
        """Exactly ``length`` bytes at ``start`` of the version ``etag`` of ``key`` (never written to
        after it is returned)."""

    def stat(self, key: str) -> ObjectInfo | None:
        """The object ``key`` as it is now, or None if there is none (a pack's pointer, index and shard
        lists are read by name: :mod:`epochfs.pack`). A backend that cannot look an object up by name
        returns None: it serves plain datasets only."""
        return None

    def check_access(self) -> None:  # noqa: B027 - optional: a source that cannot refuse has nothing to check
        """Ask the source once whether it serves this mount (the credentials, the bucket, the endpoint),
        before a stored snapshot is served: :class:`~epochfs.core.errors.AccessDenied` or
        :class:`~epochfs.core.errors.ConfigError` say what is wrong for good, :class:`BackendUnavailable`
        that it does not answer now."""

    @abc.abstractmethod
    def statistics(self) -> BackendStats:
        """Cumulative request and byte counters."""

    def content_scope(self) -> bytes | None:
        """Where this backend's ETags name their objects' bytes (an S3 single-part ETag is their MD5): the
        scope in which mounts of the node may share objects by content (:mod:`epochfs.cache.shared`),
        which must tell apart every place and identity that may read other objects; None where versions
        do not name content."""
        return None

    def transfers(self) -> TransferMeter | None:
        """When the bodies of data requests moved and how large they were (what measures the link's
        rate: :mod:`epochfs.links`); None where the backend does not record them."""
        return None

    def link_peer(self) -> tuple[str, int] | None:
        """The host and port this node receives the backend's bytes from over the network (the link
        whose capacity the utilisation is of), or None (local, or not known)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # -- writing (write-back mounts; optional) -------------------------------------------------------------

    writable = False  #: whether the methods below are implemented

    def upload_file(self, path: str, key: str, *, bandwidth: float | None = None,
                    cancelled: threading.Event | None = None, metadata: dict[str, str] | None = None,
                    multipart_started: Callable[[str], None] | None = None,
                    give_way: Callable[[], bool] | None = None) -> ObjectInfo:
        """Put the file at ``path`` under ``key``, atomically (the object appears whole or not at all),
        with ``metadata`` (user metadata of the object), and return the new object. Raises
        :class:`~epochfs.core.errors.BackendError`; ``cancelled`` stops it (nothing is left behind).
        ``multipart_started`` is called (from another thread) with the id of each multipart upload this
        starts, so that one cut off by a crash can be aborted later (:meth:`abort_multipart`). While
        ``give_way()`` (asked from the upload's threads) is true, the body's bytes wait."""
        raise NotImplementedError

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload of ``key`` (done if it was completed or aborted already)."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Delete ``key`` (done if it is already gone)."""
        raise NotImplementedError

    def key_problem(self, key: str) -> tuple[str, int] | None:
        """Why a writer may not make ``key`` (a file, or a directory as ``path/``) here, with the errno
        it gets; None if it may. Checked when the name is made, so no write is accepted that could
        never be uploaded."""
        return None

    def attribute_records(self) -> attrs.Records:
        """The owners and modes the backend keeps for objects it holds (:mod:`epochfs.backend.attrs`);
        none where it keeps no records (a directory's own are in its listing)."""
        return attrs.Records()

    def put_attributes(self, key: str, mode: int, uid: int, gid: int) -> str | None:
        """Record ``key``'s owner and mode where every later listing finds them (before the object
        is written); the record's name, or None where the backend keeps no records."""
        return None

    def drop_attributes(self, key: str, keep: str | None = None) -> None:  # noqa: B027 - optional hook
        """Remove ``key``'s attribute records except ``keep`` (after its object is replaced or deleted)."""

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Copy ``src`` to ``dst`` within the backend and return the new object."""
        raise NotImplementedError
