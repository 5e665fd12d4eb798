"""The write-back journal: what this node owes the backend, kept across crashes.

Layout under ``<cache-dir>/writeback/``::

    data/<id>     the bytes of one file written here (0600), until it is uploaded
    journal/      LMDB, one record per thing owed:
                  f/<id>    a written file (its key, size, owner, mode, whether its writer is done)
                  U/<hash>  uploaded but not yet in a snapshot (the object, with owner and mode)
                  X/<hash>  a delete (or the old name of a rename) not yet done in the backend
                  D/<hash>  a directory made here (its owner and mode)
                  M/<hash>  a multipart upload started here and not yet completed or aborted

Records are keyed by a hash of the object key (BLAKE2b, 128 bits), never by the key itself: S3 keys run
to 1024 bytes and keys here to ``MAX_KEY_BYTES``, LMDB keys stop at 511. The key is in the record, and a record whose
key does not hash to its name is malformed. (Journals written before this layout, with ``u/<key>`` and
``x/<key>`` records, are read and rewritten at start-up.)

A file record is written when a file is created and updated when it is closed, renamed or truncated; the
data file is written by the writers and fsync'ed (with the journal) when they ask. A crash (kill -9)
loses nothing the kernel has: on restart, closed files are uploaded, files that were still open (their
writer was cut off) are dropped, uploaded entries are published, deletes are done, multipart uploads
cut off are aborted. LMDB commits are not fsync'ed one by one (a commit survives the daemon's death, not
the machine's): :meth:`Journal.sync` makes them durable, which ``fsync()`` on a written file does.

Everything read back is checked (:meth:`Journal.load`): a record that does not parse, whose fields are
out of range or whose key could not be a path of the mount (``..``, control characters, over-long
components) is dropped with a log line, never followed.

Thread safety: every method may be called from any thread (LMDB transactions are per call).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from epochfs.core.errors import EpochfsError, NoSpace
from epochfs.core.private import private_subdir
from epochfs.core.records import MAX_KEY_BYTES, MAX_OBJECT_SIZE, ObjectInfo, record_problem, unsafe_reason

log = logging.getLogger(__name__)

MAX_UPLOAD_ID = 1024
#: Longest journal record decoded (a 4 KiB key escaped in full, and the fields): its cost is bounded.
MAX_RECORD = 64 << 10


@dataclass
class FileRecord:
    id: str
    key: str
    size: int
    mtime_ns: int
    mode: int
    uid: int
    gid: int
    closed: bool  # True once the last writable handle was released (its writer is done)
    since: float  # when it was closed (pending since)
    failed: str = ""  # why a write of it failed ("" if none did): such a file is never uploaded


@dataclass(frozen=True)
class DirRecord:
    path: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int


@dataclass
class Owed:
    """Everything the journal holds."""

    files: list[FileRecord] = field(default_factory=list)
    uploaded: dict[str, ObjectInfo] = field(default_factory=dict)  # key -> object
    deletes: set[str] = field(default_factory=set)
    dirs: dict[str, DirRecord] = field(default_factory=dict)  # path -> directory
    multipart: dict[str, str] = field(default_factory=dict)  # upload id -> key


def key_hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest().encode()


def _is_int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < hi


def _is_key(value: Any) -> bool:
    """A key this mount could have written: a UTF-8 path of at most MAX_KEY_BYTES that is safe."""
    try:
        return (isinstance(value, str) and 0 < len(value.encode("utf-8")) <= MAX_KEY_BYTES
                and unsafe_reason(value) is None)
    except UnicodeEncodeError:
        return False


def _is_owner(rec: Any) -> bool:
    return _is_int(rec.mode, 0, 0o10000) and _is_int(rec.uid, 0, 2**32) and _is_int(rec.gid, 0, 2**32)


def _valid_file(rec: Any) -> FileRecord | None:
    try:
        out = FileRecord(**rec)
    except TypeError:
        return None
    ok = (isinstance(out.id, str) and len(out.id) == 32 and all(c in "0123456789abcdef" for c in out.id)
          and _is_key(out.key) and _is_int(out.size, 0, MAX_OBJECT_SIZE) and _is_int(out.mtime_ns, -2**63, 2**63)
          and _is_owner(out) and isinstance(out.closed, bool) and isinstance(out.since, (int, float))
          and not isinstance(out.since, bool) and isinstance(out.failed, str) and len(out.failed) <= 1000)
    return out if ok else None


def _valid_object(rec: Any) -> ObjectInfo | None:
    try:
        out = ObjectInfo(**rec)
    except TypeError:
        return None
    owner = (out.mode is None and out.uid is None and out.gid is None) or _is_owner(out)
    return out if record_problem(out) is None and _is_key(out.key) and owner else None


def _valid_dir(rec: Any) -> DirRecord | None:
    try:
        out = DirRecord(**rec)
    except TypeError:
        return None
    return out if _is_key(out.path) and _is_owner(out) and _is_int(out.mtime_ns, -2**63, 2**63) else None


def _object_json(obj: ObjectInfo) -> bytes:
    return json.dumps(obj._asdict()).encode()


class Journal:
    def __init__(self, cache_dir: Path) -> None:
        root = private_subdir(cache_dir, "writeback")
        self.data_dir = private_subdir(root, "data")
        path = private_subdir(root, "journal")
        self._env = lmdb.open(str(path), map_size=1 << 34, subdir=True, max_dbs=0, sync=False, metasync=False,
                              lock=True, mode=0o600)

    def close(self) -> None:
        self._env.sync(True)
        self._env.close()

    def sync(self) -> None:
        """Make every commit so far durable (worker thread: this waits for the disk)."""
        self._env.sync(True)

    def data_path(self, file_id: str) -> str:
        return f"{self.data_dir}/{file_id}"

    def open_data(self, file_id: str, flags: int, mode: int = 0o600) -> int:
        """A descriptor of a data file: never through a link planted in its place, never a special file."""
        fd = os.open(self.data_path(file_id), flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{self.data_path(file_id)} is not a regular file")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- records ---------------------------------------------------------------------------------------

    def load(self) -> Owed:
        """Everything owed. Malformed records are dropped; records of the old layout are rewritten."""
        owed, bad, legacy = Owed(), [], []
        with self._env.begin() as txn:
            for raw_key, raw in txn.cursor():
                key = bytes(raw_key)
                try:
                    if len(raw) > MAX_RECORD:  # (a key of 4 KiB escaped whole, and the fields)
                        raise ValueError("record too long")
                    value = json.loads(bytes(raw))
                    kind, name = key[:2], key[2:]
                    if kind == b"f/":
                        rec = _valid_file(value)
                        if rec is None or name != rec.id.encode():
                            raise ValueError("malformed file record")
                        owed.files.append(rec)
                    elif kind == b"U/":
                        obj = _valid_object(value)
                        if obj is None or name != key_hash(obj.key):
                            raise ValueError("malformed upload record")
                        owed.uploaded[obj.key] = obj
                    elif kind == b"X/":
                        if (not isinstance(value, dict) or set(value) != {"key"} or not _is_key(value["key"])
                                or name != key_hash(value["key"])):
                            raise ValueError("malformed delete record")
                        owed.deletes.add(value["key"])
                    elif kind == b"D/":
                        d = _valid_dir(value)
                        if d is None or name != key_hash(d.path):
                            raise ValueError("malformed directory record")
                        owed.dirs[d.path] = d
                    elif kind == b"M/":
                        if (not isinstance(value, dict) or set(value) != {"key", "upload_id"}
                                or not _is_key(value["key"]) or not isinstance(value["upload_id"], str)
                                or not 0 < len(value["upload_id"]) <= MAX_UPLOAD_ID
                                or not value["upload_id"].isascii() or not value["upload_id"].isprintable()
                                or name != key_hash(value["upload_id"])):
                            raise ValueError("malformed multipart record")
                        owed.multipart[value["upload_id"]] = value["key"]
                    elif kind == b"u/":  # the layout before hashed keys
                        obj = _valid_object(value)
                        if obj is None or obj.key.encode() != name:
                            raise ValueError("malformed upload record")
                        owed.uploaded[obj.key] = obj
                        legacy.append(key)
                    elif kind == b"x/":
                        text = name.decode()
                        if not _is_key(text):
                            raise ValueError("malformed delete record")
                        owed.deletes.add(text)
                        legacy.append(key)
                    else:
                        raise ValueError("unknown record")
                except (ValueError, TypeError, UnicodeDecodeError, AttributeError):
                    bad.append(key)
        if bad:
            log.warning("dropped %d malformed write-back journal records", len(bad))
        if bad or legacy:
            with self._env.begin(write=True) as txn:
                for key in bad + legacy:
                    txn.delete(key)
                for obj in owed.uploaded.values():
                    txn.put(b"U/" + key_hash(obj.key), _object_json(obj))
                for text in owed.deletes:
                    txn.put(b"X/" + key_hash(text), json.dumps({"key": text}).encode())
        return owed

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Any]:
        """A write transaction; a full disk is :class:`NoSpace`, any other failure :class:`EpochfsError`
        (the caller's operation fails with an errno, the daemon goes on)."""
        try:
            with self._env.begin(write=True) as txn:
                yield txn
        except (lmdb.MapFullError, lmdb.DiskError) as exc:
            raise NoSpace(f"the write-back journal: {exc}") from None
        except lmdb.Error as exc:
            raise EpochfsError(f"the write-back journal: {exc}") from None

    def put_file(self, rec: FileRecord) -> None:
        with self._writing() as txn:
            txn.put(b"f/" + rec.id.encode(), json.dumps(asdict(rec)).encode())

    def drop_file(self, file_id: str) -> None:
        with self._writing() as txn:
            txn.delete(b"f/" + file_id.encode())

    def put_uploaded(self, obj: ObjectInfo, file_id: str | None = None) -> None:
        """An upload is done: the entry to publish, and (in the same transaction) the file record gone."""
        h = key_hash(obj.key)
        with self._writing() as txn:
            txn.put(b"U/" + h, _object_json(obj))
            txn.delete(b"X/" + h)
            if file_id is not None:
                txn.delete(b"f/" + file_id.encode())

    def put_delete(self, key: str) -> None:
        h = key_hash(key)
        with self._writing() as txn:
            txn.put(b"X/" + h, json.dumps({"key": key}).encode())
            txn.delete(b"U/" + h)

    def cancel_delete(self, key: str) -> None:
        """A pending delete is void: a new file took the key."""
        with self._writing() as txn:
            txn.delete(b"X/" + key_hash(key))

    def published(self, keys: set[str], deleted: set[str]) -> None:
        """Entries now in a snapshot (uploads) or gone from it (deletes, done in the backend)."""
        with self._writing() as txn:
            for key in keys:
                txn.delete(b"U/" + key_hash(key))
            for key in deleted:
                txn.delete(b"X/" + key_hash(key))

    def put_dir(self, d: DirRecord) -> None:
        with self._writing() as txn:
            txn.put(b"D/" + key_hash(d.path), json.dumps(asdict(d)).encode())

    def drop_dir(self, path: str) -> None:
        with self._writing() as txn:
            txn.delete(b"D/" + key_hash(path))

    def put_multipart(self, upload_id: str, key: str) -> None:
        """A multipart upload of ``key`` was started: abort it if it is never completed."""
        with self._writing() as txn:
            txn.put(b"M/" + key_hash(upload_id), json.dumps({"key": key, "upload_id": upload_id}).encode())

    def drop_multipart(self, upload_id: str) -> None:
        with self._writing() as txn:
            txn.delete(b"M/" + key_hash(upload_id))

    def remove_data(self, file_id: str) -> None:
        try:
            os.unlink(self.data_path(file_id))
        except FileNotFoundError:
            pass
