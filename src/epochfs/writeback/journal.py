"""The write-back journal: what this node owes the backend, kept across crashes.

Layout under ``<cache-dir>/writeback/``::

    data/<id>     the bytes of one file written here (0600), until it is uploaded
    journal/      LMDB: f/<id> a written file, u/<key> uploaded but not yet in a snapshot,
                  x/<key> a delete (or the old name of a rename) not yet done in the backend

A record is written when a file is created and updated when it is closed, renamed or truncated; the
data file is written by the writers and fsync'ed (with the journal) when they ask. A crash (kill -9)
loses nothing the kernel has: on restart, closed files are uploaded, files that were still open (their
writer was cut off) are dropped, uploaded entries are published, deletes are done. LMDB commits are not
fsync'ed one by one (a commit survives the daemon's death, not the machine's): :meth:`Journal.sync`
makes them durable, which ``fsync()`` on a written file does.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lmdb

from epochfs.private import private_subdir
from epochfs.records import MAX_KEY_BYTES, MAX_OBJECT_SIZE, ObjectInfo

log = logging.getLogger(__name__)


@dataclass
class FileRecord:
    id: str
    key: str
    size: int
    mtime_ns: int
    mode: int
    uid: int
    gid: int
    closed: bool  # False while a writer has it open
    since: float  # when it was closed (pending since)


def _is_int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < hi


def _is_key(value: Any) -> bool:
    try:
        return isinstance(value, str) and 0 < len(value.encode("utf-8")) <= MAX_KEY_BYTES
    except UnicodeEncodeError:
        return False


def _valid(rec: Any) -> FileRecord | None:
    try:
        out = FileRecord(**rec)
    except TypeError:
        return None
    ok = (isinstance(out.id, str) and len(out.id) == 32 and all(c in "0123456789abcdef" for c in out.id)
          and _is_key(out.key) and _is_int(out.size, 0, MAX_OBJECT_SIZE) and _is_int(out.mtime_ns, -2**63, 2**63)
          and _is_int(out.mode, 0, 0o10000) and _is_int(out.uid, 0, 2**32) and _is_int(out.gid, 0, 2**32)
          and isinstance(out.closed, bool) and isinstance(out.since, (int, float)))
    return out if ok else None


def _valid_object(key: str, rec: Any) -> ObjectInfo | None:
    try:
        out = ObjectInfo(**rec)
    except TypeError:
        return None
    ok = (out.key == key and _is_key(out.key) and _is_int(out.size, 0, MAX_OBJECT_SIZE)
          and _is_int(out.mtime_ns, -2**63, 2**63) and isinstance(out.etag, str) and 0 < len(out.etag) <= 1024
          and out.mode is None and out.uid is None and out.gid is None)
    return out if ok else None


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

    # -- records ---------------------------------------------------------------------------------------

    def load(self) -> tuple[list[FileRecord], dict[str, ObjectInfo], set[str]]:
        """Everything owed: written files, uploaded entries, deletes. Malformed records are dropped."""
        files, uploaded, deletes, bad = [], {}, set(), []
        with self._env.begin() as txn:
            for raw_key, raw in txn.cursor():
                key = bytes(raw_key)
                try:
                    value = json.loads(bytes(raw))
                    if key.startswith(b"f/"):
                        rec = _valid(value)
                        if rec is None:
                            raise ValueError("malformed file record")
                        files.append(rec)
                    elif key.startswith(b"u/"):
                        obj = _valid_object(key[2:].decode(), value)
                        if obj is None:
                            raise ValueError("malformed upload record")
                        uploaded[obj.key] = obj
                    elif key.startswith(b"x/"):
                        if not _is_key(key[2:].decode()):
                            raise ValueError("malformed delete record")
                        deletes.add(key[2:].decode())
                    else:
                        raise ValueError("unknown record")
                except (ValueError, TypeError, UnicodeDecodeError):
                    bad.append(key)
        if bad:
            log.warning("dropped %d malformed write-back journal records", len(bad))
            with self._env.begin(write=True) as txn:
                for key in bad:
                    txn.delete(key)
        return files, uploaded, deletes

    def put_file(self, rec: FileRecord) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(b"f/" + rec.id.encode(), json.dumps(asdict(rec)).encode())

    def drop_file(self, file_id: str) -> None:
        with self._env.begin(write=True) as txn:
            txn.delete(b"f/" + file_id.encode())

    def put_uploaded(self, obj: ObjectInfo, file_id: str | None = None) -> None:
        """An upload is done: the entry to publish, and (in the same transaction) the file record gone."""
        with self._env.begin(write=True) as txn:
            txn.put(b"u/" + obj.key.encode(), json.dumps({
                "key": obj.key, "size": obj.size, "mtime_ns": obj.mtime_ns, "etag": obj.etag}).encode())
            txn.delete(b"x/" + obj.key.encode())
            if file_id is not None:
                txn.delete(b"f/" + file_id.encode())

    def put_delete(self, key: str) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(b"x/" + key.encode(), b"{}")
            txn.delete(b"u/" + key.encode())

    def cancel_delete(self, key: str) -> None:
        """A pending delete is void: a new file took the key."""
        with self._env.begin(write=True) as txn:
            txn.delete(b"x/" + key.encode())

    def published(self, keys: set[str], deleted: set[str]) -> None:
        """Entries now in a snapshot (uploads) or gone from it (deletes, done in the backend)."""
        with self._env.begin(write=True) as txn:
            for key in keys:
                txn.delete(b"u/" + key.encode())
            for key in deleted:
                txn.delete(b"x/" + key.encode())

    def remove_data(self, file_id: str) -> None:
        try:
            os.unlink(self.data_path(file_id))
        except FileNotFoundError:
            pass
