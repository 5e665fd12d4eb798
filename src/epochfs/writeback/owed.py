"""What this node owes the backend, and the events that say when that changes (trio thread).

Files written here and not yet uploaded (their bytes pinned in the block store, counted per owner
against ``--writeback-user-quota``), uploads not yet published, deletes not yet done or published,
multipart uploads to abort, and the backoff of what failed. The POSIX edits
(:class:`~epochfs.writeback.service.WriteBack`) and the background work
(:class:`~epochfs.writeback.uploads.Uploads`) share it; the block store is reached only through the
:class:`Room` it lends.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import trio

from epochfs.core.errors import EpochfsError, NoSpace, Refused
from epochfs.core.records import ObjectInfo
from epochfs.core.text import human
from epochfs.writeback.tree import LocalFile


@dataclass
class WritebackStats:
    pending_files: int
    pending_bytes: int
    oldest_pending_seconds: float
    uploading: int
    uploaded_files: int
    uploaded_bytes: int
    upload_errors: int
    deletes_pending: int
    unpublished: int
    kernel_writes: bool = False  # the kernel writes files made here itself (:mod:`epochfs.writeback.kernel`)
    kernel_opens: int = 0  # opens of them it was given the data file for
    kernel_bytes: int = 0  # bytes it wrote into them
    kernel_off: str = ""  # why it does not, where it could have
    gave_way: int = 0  # bursts of writing the uploads paused for (:mod:`epochfs.writeback.giveway`)
    gave_way_seconds: float = 0.0  # how long they paused, in all


@dataclass(frozen=True, order=True)
class Pending:
    key: str
    bytes: int
    state: str  # open for writing, waiting, uploading, retrying, to delete, to publish (or "not uploaded: WHY")


#: What each state of a pending file waits for, in words (what ``epochfs sync`` says).
PENDING_WHY = {
    "open for writing": "it uploads once every process that has it open for writing closes it",
    "waiting": "closed, queued for an upload slot (it starts a second after its close)",
    "uploading": "being uploaded",
    "retrying": "an upload of it failed; tried again",
    "to delete": "its removal is being sent to the backend",
    "to publish": "uploaded; the namespace that lists it is being published",
}


def state_kind(state: str) -> str:
    """The kind of a pending file's state (what :data:`PENDING_WHY` is keyed by): the state without
    what it carries (a failed write's reason, a retried upload's last error)."""
    return "not uploaded" if state.startswith("not uploaded") else state.split(" (")[0]


def pending_summary(pending: list[dict[str, object]], total: int) -> str:
    """Why ``total`` files are pending, from a sync answer's first ones: a count per state, each with
    what it waits for and the first file in it (``3 open for writing: it uploads once ... (ckpt/a.pt)``)."""
    by_state: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    for item in pending:
        state = str(item.get("state", ""))
        kind = state_kind(state)
        by_state.setdefault(kind, []).append(str(item["key"]))
        if kind == "retrying" and " (" in state:
            errors.setdefault(kind, state.split(" (", 1)[1].rstrip(")"))
    parts = []
    for state, keys in by_state.items():
        why = PENDING_WHY.get(state, "a write of it failed: it will not upload as it is")
        if state in errors:
            why += f"; the last try: {errors[state]}"
        parts.append(f"{len(keys)} {state} ({why}; {keys[0]}{', ...' if len(keys) > 1 else ''})")
    more = f"; {total - len(pending)} more not listed" if total > len(pending) else ""
    return "; ".join(parts) + more


class Room(Protocol):
    """What the block store lends write-back: room for bytes that may not be evicted until uploaded."""

    capacity: int
    pending: int
    pinned: int

    def pin(self, nbytes: int) -> bool: ...  # room made by evicting cached blocks; False if none

    def unpin(self, nbytes: int) -> None: ...

    def hold(self, nbytes: int) -> None: ...  # pinned even past the capacity (admitted before a restart)


class Owed:
    SETTLE = 1.0  # seconds a closed file waits before its upload starts: a rename usually follows

    def __init__(self, room: Room, *, user_quota: int | None = None) -> None:
        self.room_of = room
        self.user_quota = user_quota
        self.files: dict[str, LocalFile] = {}  # id -> file, every file not yet uploaded
        self.uploaded: dict[str, ObjectInfo] = {}  # key -> object, not yet published
        self.deletes: dict[str, float] = {}  # key -> not before (monotonic): to delete in the backend
        self.deleting: set[str] = set()  # deletes in flight: no upload of those keys starts meanwhile
        self.deleted: set[str] = set()  # deleted in the backend, not yet published
        self.retry: dict[str, float] = {}  # file id -> backoff of its failed upload
        self.last_error: dict[str, str] = {}  # file id -> why its last upload failed (sync and status say it)
        self.not_before: dict[str, float] = {}  # file id -> when to try its upload again (monotonic)
        self.cancels: dict[str, threading.Event] = {}
        self.aborts: dict[str, str] = {}  # multipart upload id -> key: to abort in the backend
        self.wake = trio.Event()  # replaced on each kick: a waiter takes it before looking for work
        self.changed = trio.Event()
        self.publish_now = trio.Event()
        self.uploaded_files = self.uploaded_bytes = self.errors = 0
        self._by_uid: Counter[int] = Counter()  # uid -> bytes of its files not yet uploaded

    # -- events ------------------------------------------------------------------------------------------

    def touch(self) -> None:
        """Something owed changed (``sync`` waiters look again)."""
        self.changed.set()
        self.changed = trio.Event()

    def kick(self) -> None:
        """Wake the upload and delete workers: there may be work."""
        self.wake.set()
        self.wake = trio.Event()

    def cancel_upload(self, f: LocalFile) -> None:
        cancel = self.cancels.get(f.id)
        if cancel is not None:
            cancel.set()

    # -- the bytes owed ------------------------------------------------------------------------------------

    def reserve(self, f: LocalFile, size: int) -> tuple[str, EpochfsError] | None:
        """Pin ``size`` more bytes for ``f`` (its owner's quota, then the cache); else why not, and the
        error its writer gets."""
        if self.user_quota is not None and self._by_uid[f.uid] + size > self.user_quota:
            return "its owner's write-back quota is full", Refused(
                f"{f.path}: user {f.uid} holds {human(self._by_uid[f.uid])} not yet uploaded "
                f"(--writeback-user-quota {human(self.user_quota)})", errno.EDQUOT)
        if not self.room_of.pin(size):
            return "the cache had no room for it", NoSpace(
                f"{f.path}: the cache holds {human(self.room_of.pinned)} not yet uploaded and has no room for "
                "more; they drain as they upload")
        self.owe(f.uid, size)
        return None

    def unreserve(self, uid: int, size: int) -> None:
        if size:
            self.room_of.unpin(size)
            self.owe(uid, -size)

    def take(self, uid: int, size: int) -> None:
        """Bytes already written (by the kernel, past what was lent): pinned where the cache can make room,
        past the capacity where it cannot."""
        if not self.room_of.pin(size):
            self.room_of.hold(size)
        self.owe(uid, size)

    def hold(self, uid: int, size: int) -> None:
        """Bytes of a file owed since before a restart: pinned even past the capacity."""
        self.room_of.hold(size)
        self.owe(uid, size)

    def owe(self, uid: int, size: int) -> None:
        """``uid``'s files not yet uploaded grew (or, negative, shrank) by ``size`` bytes."""
        self._by_uid[uid] += size
        if self._by_uid[uid] <= 0:
            del self._by_uid[uid]

    def room(self) -> int:
        """Bytes that may still be written before writers get ENOSPC."""
        st = self.room_of
        return max(0, st.capacity - st.pinned - st.pending)

    # -- what is next, and what is left ------------------------------------------------------------------

    def ready(self) -> tuple[LocalFile | None, float]:
        """The next file to upload (oldest first), or how long until one may be."""
        now, best, wait = time.monotonic(), None, 3600.0
        for f in self.files.values():
            if f.writers or f.uploading or f.failed or f.path in self.deleting:
                continue
            at = max(f.since + self.SETTLE, self.not_before.get(f.id, 0.0))
            if at <= now:
                if best is None or f.since < best.since:
                    best = f
            else:
                wait = min(wait, at - now)
        return best, wait

    def pending(self, prefixes: Iterable[str] = ()) -> list[Pending]:
        """What is not yet in the backend (under ``prefixes``, if given), by key."""
        wanted = [p.strip("/") for p in prefixes]

        def under(key: str) -> bool:
            return not wanted or any(w == "" or key == w or key.startswith(w + "/") for w in wanted)

        def state(f: LocalFile) -> str:
            if f.failed:
                return f"not uploaded: {f.failed}"
            if f.writers:
                return "open for writing"  # (PENDING_WHY says why each state waits)
            if f.uploading:
                return "uploading"
            if f.id in self.last_error:
                return f"retrying ({self.last_error[f.id][:200]})"  # (PENDING_WHY: by the words before " (")
            return "retrying" if f.id in self.retry else "waiting"

        out = [Pending(f.path, f.size, state(f)) for f in self.files.values() if under(f.path)]
        out += [Pending(k, 0, "to delete") for k in self.deletes if under(k)]
        out += [Pending(k, 0, "to publish") for k in (*self.uploaded, *self.deleted) if under(k)]
        return sorted(out)

    def statistics(self) -> WritebackStats:
        now = time.monotonic()
        closed = [f for f in self.files.values() if not f.writers]
        return WritebackStats(
            pending_files=len(self.files),
            pending_bytes=sum(f.size for f in self.files.values()),
            oldest_pending_seconds=max((now - f.since for f in closed), default=0.0),
            uploading=sum(f.uploading for f in self.files.values()),
            uploaded_files=self.uploaded_files,
            uploaded_bytes=self.uploaded_bytes,
            upload_errors=self.errors,
            deletes_pending=len(self.deletes),
            unpublished=len(self.uploaded) + len(self.deleted),
        )
