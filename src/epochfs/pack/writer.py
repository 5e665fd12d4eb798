"""``epochfs pack SOURCE DEST``: a dataset written as standard tar shards, an index and a pointer.

A run makes one new *generation* (the pointer's plus one):

1. list SOURCE and DEST; a DEST holding anything but a pack's parts is refused;
2. keep every member of the current index whose source object is unchanged (same ETag and size), unless
   ``full``; take the members of this generation's shards that a run cut short already uploaded (their
   own lists, written after each shard, say what they hold);
3. pack the rest, in path order, into new shards of about ``shard_size`` bytes: each shard is written
   to a local file (members read ``readers`` at a time), uploaded, then its member list;
4. write the index, check that no other run wrote DEST meanwhile, and write the pointer: the flip. A
   reader of DEST (a mount, ``epochfs pack`` itself) sees the previous generation until then, and the
   new one whole after it;
5. delete this generation's member lists and shards nothing refers to (a crash's leftovers); with
   ``prune``, also the shards and indexes of earlier generations the new index does not use.

A file that changes or disappears while it is read is left out with a warning (the next run packs it).
Blocking; threads inside.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import xxhash

from epochfs.backend.base import Backend
from epochfs.core.errors import BackendError, ConfigError, EpochfsError, ObjectChanged
from epochfs.core.records import ObjectInfo, unsafe_reason
from epochfs.pack import layout
from epochfs.pack.layout import Index, Member, PackInvalid
from epochfs.pack.listing import current_index, read_object

log = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 256 << 20
#: Files up to this size are read whole into memory ahead of the shard writer; larger ones are spooled
#: to a local file in chunks of this size first.
_WHOLE = 16 << 20
_LOOKAHEAD = 32  # files read ahead of each shard writer


@dataclass(frozen=True)
class PackSettings:
    shard_size: int = DEFAULT_SHARD_SIZE  # bytes of members per shard, about (a larger file gets its own)
    jobs: int = 4  # shards written at once
    readers: int = 16  # source objects read at once, across shards
    full: bool = False  # pack every file again (keep no member of the current index)
    prune: bool = False  # after the flip, delete earlier generations' parts the new index does not use
    work_dir: str | None = None  # where shards are written before upload (default: $TMPDIR)


@dataclass
class PackSummary:
    generation: int  # the generation now current (unchanged when nothing had to be written)
    files: int = 0  # members of the current index
    bytes: int = 0  # their bytes
    packed: int = 0  # files written into new shards by this run
    packed_bytes: int = 0
    kept: int = 0  # members kept where an earlier generation put them
    resumed: int = 0  # members of shards a cut-short run had uploaded
    shards: int = 0  # shards the current index uses
    new_shards: int = 0
    skipped: list[str] = field(default_factory=list)  # files that changed or vanished while read
    unsafe: int = 0  # keys that cannot be paths of a mount
    unreferenced_bytes: int = 0  # bytes of earlier shards no member uses (left: see ``prune``)
    deleted: int = 0  # parts deleted
    seconds: float = 0.0
    written: bool = True  # False: the pack was up to date


Progress = Callable[[int], None]  # called with the bytes of each member written


def pack(source: Backend, dest: Backend, settings: PackSettings, *, source_url: str = "",
         progress: Progress | None = None, planned: Callable[[int, int], None] | None = None) -> PackSummary:
    """Pack ``source`` into ``dest`` (see the module). ``planned(files, bytes)`` is told what this run
    will write before it starts; ``progress`` the bytes of each member as it is written."""
    started = time.monotonic()
    if not dest.writable:
        raise ConfigError("the destination of a pack must be an S3 prefix (s3://BUCKET/PREFIX)")
    if settings.shard_size < 1 << 20:
        raise ConfigError("--shard-size must be at least 1 MiB")
    if source.stat(layout.POINTER) is not None:
        raise ConfigError("the source is a packed dataset already; pack its original files")
    listed, dirs, unsafe = _files(source)
    parts = {o.key: o for o in dest.list_objects()}
    foreign = [k for k in parts if not layout.is_part(k)]
    if foreign:
        raise ConfigError(f"the destination holds {len(foreign)} objects that are not a pack's (such as "
                          f"{foreign[0][:200]!r}): pack into an empty prefix, or into an earlier pack")
    pointer = parts.get(layout.POINTER)
    current = _current(dest, parts, settings.full)
    generation = (current.generation if current else 0) + 1
    if generation > layout.MAX_GENERATION:
        raise ConfigError("the pack has used every generation number; pack into a new prefix")
    members: dict[str, Member] = {}
    shards: dict[str, ObjectInfo] = {}
    summary = PackSummary(generation, unsafe=unsafe)
    if current is not None and not settings.full:
        for path, m in current.members.items():
            if _unchanged(listed.get(path), m):
                members[path] = m
                shards[m.shard] = current.shards[m.shard]
        summary.kept = len(members)
    for shard, found in _resumable(dest, parts, generation):
        took = [m for m in found if m.path not in members and _unchanged(listed.get(m.path), m)]
        if took:
            shards[shard.key] = shard
            members.update((m.path, m) for m in took)
            summary.resumed += len(took)
    todo = [listed[p] for p in sorted(listed) if p not in members]
    if (current is not None and not todo and members.keys() == current.members.keys() and not summary.resumed
            and dirs == current.dirs):
        summary.written = False
        summary.generation = current.generation
        _finish_summary(summary, current, parts, started)
        return summary
    if planned is not None:
        planned(len(todo), sum(o.size for o in todo))
    first = 1 + max((n for g, n in map(_part_number, parts) if g == generation), default=-1)
    groups = list(_groups(todo, settings.shard_size))
    if first + len(groups) > layout.MAX_SHARDS:
        raise ConfigError(f"{len(groups)} new shards would pass {layout.MAX_SHARDS} in one generation: "
                          "use a larger --shard-size")
    work = tempfile.mkdtemp(prefix="epochfs-pack-", dir=settings.work_dir)
    try:
        writer = _ShardWriter(source, dest, generation, work, settings.readers, progress)
        with concurrent.futures.ThreadPoolExecutor(max(1, settings.jobs), thread_name_prefix="pack") as pool:
            futures = [pool.submit(writer.write, first + i, group) for i, group in enumerate(groups)]
            try:
                for future in concurrent.futures.as_completed(futures):
                    shard, written = future.result()
                    if written:
                        shards[shard.key] = shard
                        members.update((m.path, m) for m in written)
                        summary.packed += len(written)
                        summary.packed_bytes += sum(m.size for m in written)
                        summary.new_shards += 1
            except BaseException:
                writer.cancelled.set()
                for f in futures:
                    f.cancel()
                raise
            finally:
                writer.close()
        summary.skipped = writer.skipped
        index = Index(generation, source_url, time.time(), shards, members, dirs)
        _publish(dest, index, pointer, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("pack generation %d is current: %d files in %d shards", generation, len(members), len(shards))
    deleted = _clean(dest, parts, index, prune=settings.prune)
    summary.deleted = len(deleted)
    _finish_summary(summary, index, {k: v for k, v in parts.items() if k not in deleted}, started)
    return summary


def _files(source: Backend) -> tuple[dict[str, ObjectInfo], dict[str, ObjectInfo], int]:
    """The source's files and directory markers by key, and how many keys cannot be paths."""
    listed: dict[str, ObjectInfo] = {}
    dirs: dict[str, ObjectInfo] = {}
    unsafe = 0
    for obj in source.list_objects():
        if not obj.key or obj.key.endswith("/"):
            if not obj.key or unsafe_reason(obj.key) is None:
                dirs[obj.key] = ObjectInfo(obj.key, 0, obj.mtime_ns, "", obj.mode, obj.uid, obj.gid)
            continue
        problem = unsafe_reason(obj.key)
        if problem:
            unsafe += 1
            log.warning("not packing %r: %s", obj.key[:300], problem)
            continue
        listed[obj.key] = obj
    return listed, dirs, unsafe


def _current(dest: Backend, parts: dict[str, ObjectInfo], full: bool) -> Index | None:
    try:
        return current_index(dest)
    except PackInvalid as exc:
        if not full:
            raise PackInvalid(f"the destination's current pack is damaged ({exc}); pack it again whole with "
                              "--full") from None
        log.warning("the destination's current pack is damaged (%s): packing every file again", exc)
        generation = max((_part_number(key)[0] for key in parts), default=0)
        return Index(generation, "", 0.0, {}, {}) if generation else None


def _part_number(key: str) -> tuple[int, int]:
    return layout.shard_number(key) or layout.sidecar_number(key) or (0, -1)


def _unchanged(obj: ObjectInfo | None, m: Member) -> bool:
    return obj is not None and obj.etag == m.source_etag and obj.size == m.size


def _resumable(dest: Backend, parts: dict[str, ObjectInfo], generation: int) -> Iterator[tuple[ObjectInfo, list[Member]]]:
    """The shards of ``generation`` a cut-short run uploaded whole, with their members (a list that does
    not decode, or names a shard that is not there as uploaded, is passed over: its shard is packed
    again)."""
    for key, info in sorted(parts.items()):
        number = layout.sidecar_number(key)
        if number is None or number[0] != generation:
            continue
        try:
            shard, found = layout.decode_sidecar(read_object(dest, info, layout.MAX_INDEX_BYTES), key)
        except (PackInvalid, BackendError) as exc:
            log.warning("not resuming from %s: %s", key, exc)
            continue
        there = parts.get(shard.key)
        if there is None or there.etag != shard.etag or there.size != shard.size:
            log.warning("not resuming from %s: its shard is not there as it was uploaded", key)
            continue
        log.info("resuming: %s holds %d members", shard.key, len(found))
        yield shard, found


def _groups(todo: list[ObjectInfo], shard_size: int) -> Iterator[list[ObjectInfo]]:
    group: list[ObjectInfo] = []
    size = 0
    for obj in todo:
        if group and size + obj.size > shard_size:
            yield group
            group, size = [], 0
        group.append(obj)
        size += obj.size
    if group:
        yield group


class _ShardWriter:
    """Writes shards in worker threads, their members read ahead through one shared pool."""

    def __init__(self, source: Backend, dest: Backend, generation: int, work: str, readers: int,
                 progress: Progress | None) -> None:
        self.source, self.dest, self.generation, self.work = source, dest, generation, work
        self.progress = progress
        self.reads = concurrent.futures.ThreadPoolExecutor(max(1, readers), thread_name_prefix="pack-read")
        self.cancelled = threading.Event()
        self.skipped: list[str] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        self.reads.shutdown(wait=True, cancel_futures=True)

    def write(self, number: int, group: list[ObjectInfo]) -> tuple[ObjectInfo, list[Member]]:
        key = layout.shard_key(self.generation, number)
        path = os.path.join(self.work, f"{number:05d}.tar")
        written: list[Member] = []
        ahead: deque[tuple[ObjectInfo, concurrent.futures.Future[bytes | str]]] = deque()
        todo = iter(group)
        with open(path, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            while True:
                while len(ahead) < _LOOKAHEAD and (obj := next(todo, None)) is not None:
                    ahead.append((obj, self.reads.submit(self._read, obj)))
                if not ahead:
                    break
                if self.cancelled.is_set():
                    raise EpochfsError("cancelled")
                obj, future = ahead.popleft()
                member = self._add(tar, obj, future.result())
                if member is not None:
                    written.append(member)
        if not written:
            return ObjectInfo(key, 0, 0, ""), []
        shard = self.dest.upload_file(path, key)
        if shard.size != os.path.getsize(path):
            raise BackendError(f"{key}: uploaded {os.path.getsize(path)} bytes, the store holds {shard.size}")
        written = [dataclasses.replace(m, shard=key) for m in written]
        side = path + ".json"
        with open(side, "wb") as f:
            f.write(layout.encode_sidecar(shard, written))
        self.dest.upload_file(side, layout.sidecar_key(self.generation, number))
        os.unlink(path)
        os.unlink(side)
        return shard, written

    def _read(self, obj: ObjectInfo) -> bytes | str:
        """The object's bytes, the path of a local copy (a large one), or "" if it changed meanwhile."""
        try:
            if obj.size <= _WHOLE:
                return bytes(self.source.read_range(obj.key, obj.etag, 0, obj.size))
            fd, spool = tempfile.mkstemp(dir=self.work, suffix=".part")
            with os.fdopen(fd, "wb") as f:
                for start in range(0, obj.size, _WHOLE):
                    if self.cancelled.is_set():
                        raise EpochfsError("cancelled")
                    f.write(self.source.read_range(obj.key, obj.etag, start, min(_WHOLE, obj.size - start)))
            return spool
        except ObjectChanged as exc:
            log.warning("not packing %s this time: %s (the next run packs it)", obj.key[:300], exc)
            with self._lock:
                self.skipped.append(obj.key)
            return ""

    def _add(self, tar: tarfile.TarFile, obj: ObjectInfo, data: bytes | str) -> Member | None:
        if isinstance(data, str) and not data:
            return None
        info = tarfile.TarInfo(obj.key)
        info.size = obj.size
        info.mtime = obj.mtime_ns / 1e9
        info.mode = obj.mode if obj.mode is not None else 0o644
        info.uid, info.gid = obj.uid or 0, obj.gid or 0
        digest = xxhash.xxh64()
        with contextlib.ExitStack() as stack:
            if isinstance(data, bytes):
                digest.update(data)
                fileobj: io.BufferedIOBase = io.BytesIO(data)
            else:
                fileobj = stack.enter_context(open(data, "rb"))
                for chunk in iter(lambda: fileobj.read(1 << 20), b""):
                    digest.update(chunk)
                fileobj.seek(0)
                stack.callback(os.unlink, data)
            tar.addfile(info, fileobj)
        offset = tar.offset - -(-obj.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        if self.progress is not None:
            self.progress(obj.size)
        return Member(obj.key, "", offset, obj.size, obj.mtime_ns, digest.hexdigest(), obj.etag, obj.mode, obj.uid,
                      obj.gid)


def _publish(dest: Backend, index: Index, pointer: ObjectInfo | None, work: str) -> None:
    """Write the index, check that no other run wrote the destination meanwhile, and flip the pointer."""
    path = os.path.join(work, "index.json.gz")
    with open(path, "wb") as f:
        f.write(layout.encode_index(index))
    dest.upload_file(path, layout.index_key(index.generation))
    now = dest.stat(layout.POINTER)
    if (now is None) != (pointer is None) or (now is not None and pointer is not None and now.etag != pointer.etag):
        raise EpochfsError("another pack run wrote the destination's pointer meanwhile; nothing was flipped "
                           "(run again, one run at a time per destination)")
    for key, shard in index.shards.items():
        if (layout.shard_number(key) or (0, 0))[0] != index.generation:
            continue
        there = dest.stat(key)
        if there is None or there.etag != shard.etag:
            raise EpochfsError(f"{key} was overwritten by another pack run meanwhile; nothing was flipped "
                               "(run again, one run at a time per destination)")
    with open(path, "wb") as f:
        f.write(layout.encode_pointer(index))
    dest.upload_file(path, layout.POINTER)


def _clean(dest: Backend, parts: dict[str, ObjectInfo], index: Index, *, prune: bool) -> set[str]:
    """Delete what the flip made useless: this generation's member lists and unused shards (and, with
    ``prune``, earlier generations' parts the index does not use); the keys deleted. Best effort: a
    failure is a warning."""
    keep = {layout.POINTER, layout.index_key(index.generation), *index.shards}
    doomed = [k for k in parts if k not in keep and (_part_number(k)[0] == index.generation
                                                     or prune and _part_number(k)[0] < index.generation)]
    doomed += [key for key in (layout.sidecar_key(g, n) for g, n in filter(None, map(layout.shard_number, index.shards))
                               if g == index.generation) if key not in parts]
    deleted = set()
    for key in doomed:
        try:
            dest.delete(key)
            deleted.add(key)
        except EpochfsError as exc:
            log.warning("could not delete %s (harmless; the next run tries again): %s", key, exc)
    return deleted


def _finish_summary(summary: PackSummary, index: Index, parts: dict[str, ObjectInfo], started: float) -> None:
    summary.files = len(index.members)
    summary.bytes = index.total_bytes
    summary.shards = len(index.shards)
    used = set(index.shards)
    summary.unreferenced_bytes = sum(o.size for k, o in parts.items() if layout.shard_number(k) and k not in used)
    summary.seconds = time.monotonic() - started
