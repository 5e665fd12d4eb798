"""The background half of write-back: upload and delete workers, and the publisher.

Files closed and settled are uploaded under their final key (whole, multipart and parallel for large
files, capped by ``--upload-bandwidth``, started only while no demand read waits for the backend); a
file changed, renamed or removed while it uploads has its upload cancelled, or, if the upload finished
first, the stale object deleted. A failed upload or delete is retried with backoff. Uploaded objects and
deletes are published to the metadata store every ``PUBLISH_INTERVAL`` seconds. What is owed, and when
it changes, is :class:`~epochfs.writeback.owed.Owed`'s; the uploads and deletes themselves run in
worker threads and touch no state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from epochfs.backend.base import Backend
from epochfs.core.errors import BackendError, EpochfsError, KeyRefused
from epochfs.core.records import ObjectInfo
from epochfs.writeback.giveway import GiveWay
from epochfs.writeback.journal import Journal
from epochfs.writeback.owed import Owed, Pending
from epochfs.writeback.tree import LocalFile, Overlay, Stored, Tree

log = logging.getLogger(__name__)

#: ``publish(added, removed, publication)``: ``publication`` names the batch, the same on every try of it,
#: so that a store that already holds it (the answer was lost, not the write) does not take it twice.
Publish = Callable[[dict[str, ObjectInfo], set[str], str], Awaitable[None]]
Fail = Callable[[LocalFile, str], None]  # a file that can never be uploaded as it is
Read = Callable[[int, int], "bytes | None"]  # ``read(start, length)``, blocking; None once gone


class Keep(Protocol):
    """Where an uploaded file's bytes go so that reading it back here fetches nothing (the block cache)."""

    def offer(self, obj: ObjectInfo, read: Read) -> None:
        """The bytes of ``obj`` are here (``read`` gives them) until :meth:`withdraw`: read them, not the
        backend."""

    async def adopt(self, obj: ObjectInfo, read: Read, path: str | None = None) -> int:
        """Keep them as cached blocks of ``obj``'s version (``path``: the data file, which the cache may
        take as it is); the bytes kept."""

    def withdraw(self, obj: ObjectInfo) -> None:
        """The bytes are going."""


class DataFile:
    """An uploaded file's data file, open for reading until :meth:`close` (reads after it get None). The
    descriptor is closed by whichever comes last, the close or the last read in progress: never under a
    reader (nor its number reused for one), and a close never waits for a read."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._reading = 0
        self._closed = False

    def read(self, start: int, length: int) -> bytes | None:
        with self._lock:
            if self._closed:
                return None
            self._reading += 1
        try:
            return os.pread(self._fd, length, start)
        except OSError:
            return None
        finally:
            with self._lock:
                self._reading -= 1
                last = self._closed and not self._reading
            if last:
                os.close(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = not self._reading
        if last:
            os.close(self._fd)


class Uploads:
    PUBLISH_INTERVAL = 2.0
    RETRY_MIN, RETRY_MAX = 1.0, 60.0  # backoff of a failed upload or delete

    def __init__(self, owed: Owed, journal: Journal, backend: Backend, tree: Tree, overlay: Overlay, *,
                 bandwidth: float | None, concurrency: int, demand_waiting: Callable[[], bool],
                 publish: Publish, fail: Fail | None = None, keep: Keep | None = None,
                 give_way: GiveWay | None = None) -> None:
        self.owed = owed
        self.journal = journal
        self.backend = backend
        self.tree = tree
        self.overlay = overlay
        self.bandwidth = bandwidth
        self.concurrency = max(1, concurrency)
        self.demand_waiting = demand_waiting
        self.publish = publish
        self._batch: tuple[str, dict[str, ObjectInfo], set[str]] | None = None  # (name, added, removed) to retry
        # A store that refuses publications: the error, how many tries in a row failed, when the next is due.
        self.publish_error: str | None = None
        self._publish_failed = 0
        self._publish_at = 0.0
        self.fail = fail
        self.keep = keep
        self.give_way = give_way  # (while a file is written fast, the uploads' bytes wait: giveway.py)
        self._recorded: set[tuple[str, int, int, int]] = set()  # directories' attribute records written
        self._uploads_running = 0  # upload threads still running (abandoned ones included)
        self._uploads_done = threading.Condition()
        self._nursery: trio.Nursery | None = None  # (while running: where uploaded files are kept in the cache)
        self._keeping = trio.Semaphore(1)  # one file's bytes copied into the cache at a time

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(self.concurrency):
                nursery.start_soon(self._upload_worker)
            nursery.start_soon(self._delete_worker)
            nursery.start_soon(self._publisher)
            task_status.started()

    async def _upload_worker(self) -> None:
        while True:
            wake = self.owed.wake
            f, wait = self.owed.ready()
            if f is None or self.demand_waiting():  # demand reads go first on the backend link
                with trio.move_on_after(wait if f is None else 0.01):
                    await wake.wait()
                continue
            await self._upload(f)

    async def _upload(self, f: LocalFile) -> None:
        f.uploading = True
        generation, key, size = f.generation, f.path, f.size
        cancel = self.owed.cancels[f.id] = threading.Event()
        started: list[str] = []  # multipart upload ids this upload created
        attributes = {"epochfs-mode": f"{f.mode:04o}", "epochfs-uid": str(f.uid), "epochfs-gid": str(f.gid)}

        def multipart_started(upload_id: str) -> None:  # (an s3transfer thread)
            started.append(upload_id)
            self.journal.put_multipart(upload_id, key)

        dirs = self._directories(key)
        mode, uid, gid = f.mode, f.uid, f.gid
        give_way = self.give_way.now if self.give_way is not None else None

        def upload() -> ObjectInfo:
            try:
                # Owners and modes first (of the directories made here, then the file): a listing that
                # sees the object sees its record, so it is never presented more open than written.
                for d in dirs:
                    self.backend.put_attributes(*d)
                record = self.backend.put_attributes(key, mode, uid, gid)
                fd = self.journal.open_data(f.id, os.O_RDONLY)  # this very file, whatever is at its name later
                try:
                    obj = self.backend.upload_file(f"/proc/self/fd/{fd}", key, bandwidth=self.bandwidth,
                                                   cancelled=cancel, metadata=attributes,
                                                   multipart_started=multipart_started, give_way=give_way)
                finally:
                    os.close(fd)
                self._recorded.update(dirs)
                try:
                    self.backend.drop_attributes(key, keep=record)  # an earlier version's, if other
                except BackendError as exc:  # (left: the strictest of a key's records wins)
                    log.warning("could not remove earlier attribute records of %s: %s", key, exc)
                return obj
            finally:
                with self._uploads_done:
                    self._uploads_running -= 1
                    self._uploads_done.notify_all()

        with self._uploads_done:
            self._uploads_running += 1
        try:
            try:
                obj = await trio.to_thread.run_sync(upload, abandon_on_cancel=True)
            except BaseException:
                for upload_id in started:  # s3transfer aborts what it cancels; make sure of it
                    self.owed.aborts[upload_id] = key
                raise
            for upload_id in started:
                self.journal.drop_multipart(upload_id)
        except KeyRefused as exc:
            self.owed.errors += 1
            if self.fail is not None:
                self.fail(f, str(exc))
            else:
                log.warning("%s", exc)
            return
        except BackendError as exc:
            if not cancel.is_set():
                self.owed.errors += 1
                backoff = min(self.RETRY_MAX, max(self.RETRY_MIN, 2 * self.owed.retry.get(f.id, 0.5)))
                self.owed.retry[f.id] = backoff
                self.owed.not_before[f.id] = time.monotonic() + backoff
                self.owed.last_error[f.id] = str(exc)
                log.warning("upload of %s failed (%s); retrying in %.0f s", key, exc, backoff)
            return
        except OSError as exc:  # the data file itself: gone or replaced by something else
            self.owed.errors += 1
            log.warning("upload of %s failed: %s; retrying", key, exc)
            self.owed.not_before[f.id] = time.monotonic() + self.RETRY_MAX
            self.owed.last_error[f.id] = f"its local copy: {exc}"
            return
        except Exception:
            self.owed.errors += 1
            log.exception("upload of %s failed", key)
            self.owed.not_before[f.id] = time.monotonic() + self.RETRY_MAX
            self.owed.last_error[f.id] = "an internal error (the daemon's log has it)"
            return
        finally:
            f.uploading = False
            self.owed.cancels.pop(f.id, None)
            if self.owed.aborts:
                self.owed.kick()
        self.owed.retry.pop(f.id, None)
        self.owed.last_error.pop(f.id, None)
        self.owed.not_before.pop(f.id, None)
        current = self.owed.files.get(f.id) is f and f.generation == generation and f.path == key
        if not current:
            # Renamed, removed or written again while it uploaded: the object under the old key is stale
            # unless the file (or another one) still owns that key; the file itself is uploaded again.
            holder = self.tree.resolve(key)
            if holder is None or holder.is_dir:
                self.journal.put_delete(key)
                self.owed.deletes[key] = 0.0
            self.owed.kick()
            return
        obj = obj._replace(mode=f.mode, uid=f.uid, gid=f.gid)  # who may read it stays who could before
        self.journal.put_uploaded(obj, f.id)
        self.owed.files.pop(f.id, None)
        self.owed.unreserve(f.uid, size)
        stored = Stored(f.inode, key, obj)  # the same inode: the kernel's view of it stays valid
        self.overlay.put(stored)
        self.owed.uploaded[key] = obj
        self.owed.deleted.discard(key)  # a delete done before this upload is superseded by it
        self.owed.uploaded_files += 1
        self.owed.uploaded_bytes += size
        self.owed.publish_now.set()
        self.owed.touch()
        log.info("uploaded %s (%d bytes)", key, size)
        data = self._offer(f.id, obj)  # (no checkpoint since the upload was recorded: nobody saw it before)
        if self._nursery is not None:  # (beside the uploads: the next file's upload does not wait for it)
            self._nursery.start_soon(self._keep_and_remove, f.id, obj, data)
        else:
            await self._keep_and_remove(f.id, obj, data)

    def _offer(self, file_id: str, obj: ObjectInfo) -> DataFile | None:
        """The uploaded file's bytes offered to the cache from the moment its upload is published (no
        thread hop in between: ``sync`` returning means a read here finds them), or None."""
        if self.keep is None:
            return None
        try:
            data = DataFile(self.journal.open_data(file_id, os.O_RDONLY))  # (it is written no more)
        except OSError as exc:
            log.warning("%s uploaded, its bytes not kept in the cache: %s", obj.key, exc)
            return None
        self.keep.offer(obj, data.read)
        return data

    async def _keep_and_remove(self, file_id: str, obj: ObjectInfo, data: DataFile | None) -> None:
        """The uploaded file's bytes become cached blocks of its new version (a restore on this node then
        reads them, not the backend; until they are, it reads the data file), then its data file goes. A
        file recovery finds no record of is removed at the next start, should the daemon stop in
        between."""
        try:
            async with self._keeping:
                if self.keep is not None and data is not None:
                    kept = await self.keep.adopt(obj, data.read, self.journal.data_path(file_id))
                    if kept < obj.size:
                        log.info("kept %d of %s's %d bytes in the cache (the rest is fetched if read)", kept,
                                 obj.key, obj.size)
        finally:
            if self.keep is not None and data is not None:
                self.keep.withdraw(obj)
                data.close()
            self.journal.remove_data(file_id)

    def _directories(self, key: str) -> list[tuple[str, int, int, int]]:
        """The attribute records owed for the directories made here above ``key`` (each once)."""
        out = []
        parent = key.rpartition("/")[0]
        while parent:
            node = self.tree.resolve(parent)
            made = node.record() if node is not None and node.made_here and node.is_dir else None
            if made is not None and made.mode is not None and made.uid is not None and made.gid is not None:
                record = (parent + "/", made.mode, made.uid, made.gid)
                if record not in self._recorded:
                    out.append(record)
            parent = parent.rpartition("/")[0]
        return out

    async def _abort_unfinished(self) -> None:
        """Abort the multipart uploads nobody will complete (cut off by a crash, failed, cancelled)."""
        for upload_id, key in list(self.owed.aborts.items()):
            try:
                await trio.to_thread.run_sync(self.backend.abort_multipart, key, upload_id, abandon_on_cancel=True)
            except BackendError as exc:
                log.warning("abort of an unfinished upload of %s failed (%s); retrying", key, exc)
                continue
            self.owed.aborts.pop(upload_id, None)
            self.journal.drop_multipart(upload_id)
            log.info("aborted an unfinished multipart upload of %s", key)

    async def _delete_worker(self) -> None:
        while True:
            wake = self.owed.wake
            if self.owed.aborts:
                await self._abort_unfinished()
            now = time.monotonic()
            due = [k for k, at in self.owed.deletes.items() if at <= now]
            if not due:
                later = min((at - now for at in self.owed.deletes.values()), default=3600.0)
                if self.owed.aborts:
                    later = min(later, self.RETRY_MAX / 4)
                with trio.move_on_after(later):
                    await wake.wait()
                continue
            for key in due:
                if key not in self.owed.deletes:
                    continue  # void meanwhile: a new file took the key
                self.owed.deleting.add(key)
                try:
                    await trio.to_thread.run_sync(self._delete, key, abandon_on_cancel=True)
                except BackendError as exc:
                    self.owed.errors += 1
                    if key in self.owed.deletes:
                        self.owed.deletes[key] = time.monotonic() + self.RETRY_MAX / 4
                    log.warning("delete of %s failed (%s); retrying", key, exc)
                    continue
                finally:
                    self.owed.deleting.discard(key)
                    self.owed.kick()
                if key in self.owed.deletes:
                    del self.owed.deletes[key]
                    self.owed.deleted.add(key)
                    self.owed.publish_now.set()
                    self.owed.touch()

    def _delete(self, key: str) -> None:
        """The object, then its attribute records (they are never less strict than an object there)."""
        self.backend.delete(key)
        try:
            self.backend.drop_attributes(key)
        except BackendError as exc:  # (left: harmless without its object, and strict with a new one)
            log.warning("could not remove the attribute records of %s: %s", key, exc)

    async def _publisher(self) -> None:
        while True:
            await self.owed.publish_now.wait()
            await trio.sleep(max(self.PUBLISH_INTERVAL, self._publish_at - time.monotonic()))
            self.owed.publish_now = trio.Event()
            await self.publish_pending()

    async def publish_pending(self) -> None:
        """Publish uploads and deletes to the metadata store; keep them for the next try if it fails. A
        batch that failed is tried again as it was, under its name, before anything newer joins one."""
        if self._batch is None:
            added, removed = dict(self.owed.uploaded), set(self.owed.deleted)
            if not added and not removed:
                return
            self._batch = (uuid.uuid4().hex, added, removed)
        publication, added, removed = self._batch
        if self.publish_error is not None and time.monotonic() < self._publish_at:
            return  # (a store that refused the last try is asked again at the backoff's pace, whoever asks)
        try:
            await self.publish(added, removed, publication)
        except EpochfsError as exc:
            self._publish_refused(str(exc), len(added), len(removed))
            self.owed.publish_now.set()
            return
        if self.publish_error is not None:
            log.warning("published %d uploads and %d deletes: the metadata store answers again (after %d failed "
                        "tries)", len(added), len(removed), self._publish_failed)
            self.publish_error, self._publish_failed = None, 0
        self._batch = None
        self.journal.published(set(added), removed)
        for key, obj in added.items():
            if self.owed.uploaded.get(key) is obj:
                del self.owed.uploaded[key]
                entry = self.overlay.entries.get(key)
                if entry is not None and entry.in_backend and entry.obj is obj:  # (an overlay entry: Stored)
                    self.overlay.remove(key)
                    self.overlay.by_inode[entry.inode] = entry  # open handles and the kernel may still name it
        for key in removed:
            self.owed.deleted.discard(key)
            if self.tree.namespace.resolve(key) is None:
                self.overlay.hidden.discard(key)
        if self.owed.uploaded or self.owed.deleted:
            self.owed.publish_now.set()  # (what came after the batch)
        self.owed.touch()

    async def sync(self, prefixes: list[str], seconds: float) -> list[Pending]:
        """Wait until nothing under ``prefixes`` is owed to the backend (and what was uploaded is
        published), at most ``seconds``; what is still pending. Files closed but settling are uploaded
        at once, and failed ones retried at once (once per request: a caller waiting in rounds retries
        at the pace of its rounds, not faster). A store that refuses publications is asked again at the
        publisher's backoff, not at the caller's pace (:attr:`publish_error` says why, meanwhile)."""
        for f in self.owed.files.values():
            self.owed.not_before.pop(f.id, None)
        if self.give_way is not None:
            self.give_way.syncing += 1  # (the caller waits for the uploads: they do not give way meanwhile)
        try:
            return await self._sync(prefixes, seconds)
        finally:
            if self.give_way is not None:
                self.give_way.syncing -= 1

    async def _sync(self, prefixes: list[str], seconds: float) -> list[Pending]:
        with trio.move_on_after(seconds):
            while any(p.state != "to publish" and not p.state.startswith("not uploaded")
                      for p in self.owed.pending(prefixes)):
                changed = self.owed.changed
                for f in self.owed.files.values():
                    f.since = min(f.since, time.monotonic() - self.owed.SETTLE)
                self.owed.kick()
                await changed.wait()
            for _ in range(2):  # (a batch tried before, then what came after it)
                if self.owed.uploaded or self.owed.deleted:
                    await self.publish_pending()
            while self.publish_error is not None and any(p.state == "to publish" for p in self.owed.pending(prefixes)):
                await trio.sleep(max(0.0, self._publish_at - time.monotonic()))  # (the deadline ends it)
                await self.publish_pending()
        return self.owed.pending(prefixes)

    def _publish_refused(self, why: str, added: int, removed: int) -> None:
        """A publication failed: the next try waits (doubling from ``RETRY_MIN`` to ``RETRY_MAX``), and
        the log says so once per change of state (the first failure, a new reason), with the count."""
        self._publish_failed += 1
        backoff = min(self.RETRY_MAX, self.RETRY_MIN * 2 ** min(self._publish_failed - 1, 16))
        self._publish_at = time.monotonic() + backoff
        if why != self.publish_error:
            log.warning("could not publish %d uploads and %d deletes (%s); trying again with backoff (up to %gs), "
                        "nothing is lost (%d failed tries so far)", added, removed, why, self.RETRY_MAX,
                        self._publish_failed)
        self.publish_error = why

    def close(self, wait: float = 5.0) -> None:
        """Stop: every upload is cancelled (the journal keeps what is owed; a multipart upload cut off is
        aborted at the next start), and waited for at most ``wait`` seconds."""
        for cancel in list(self.owed.cancels.values()):
            cancel.set()
        deadline = time.monotonic() + wait
        with self._uploads_done:
            while self._uploads_running and time.monotonic() < deadline:
                self._uploads_done.wait(max(0.01, deadline - time.monotonic()))
            if self._uploads_running:
                log.warning("%d uploads still running at shutdown; they resume at the next start",
                            self._uploads_running)
