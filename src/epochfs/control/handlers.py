"""What each control request does: a validated request (:mod:`.protocol`) becomes component calls.

Paths named by a request are resolved against the snapshot being served, in a worker thread (a
manifest may name millions of files), one chunk at a time for a streamed request; the hand-over's
size is checked after each chunk (:func:`epochfs.prefetch.plan.count_blocks`), so an oversized one is
refused before the rest of it is read or any work is done on the event loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio

from epochfs.control import protocol as p
from epochfs.control.caller import Caller
from epochfs.control.collected import Collected
from epochfs.control.jobs import Jobs, JobStats, JobTaken, Report
from epochfs.control.server import OWNER, Chunks, Handler
from epochfs.core.access import PathAccess, Presented
from epochfs.core.errors import ConfigError, NotPermitted
from epochfs.core.records import ObjectInfo, stored_extent
from epochfs.core.stats import read_origins
from epochfs.doctor.cost import usage_of
from epochfs.meta.namespace import Namespace
from epochfs.meta.nodes import File
from epochfs.meta.snapshots import Snapshots
from epochfs.prefetch.manifest import ManifestError
from epochfs.prefetch.plan import MAX_PLAN_BLOCKS, PlanTooLarge, count_blocks
from epochfs.prefetch.scheduler import Prefetcher
from epochfs.version import __version__
from epochfs.writeback.service import WriteBack

log = logging.getLogger(__name__)

#: Pending entries named in one ``sync`` reply (the total is always given).
MAX_PENDING_LISTED = 1000


@dataclass(frozen=True)
class MountInfo:
    """What ``epochfs status`` says about the mount itself."""

    source: str
    mountpoint: str
    cache_dir: str
    block_size: int
    eviction: str
    started: float
    metrics_addr: Callable[[], str | None]
    node: str = "localhost"  # the ``node`` label of its series
    backend_concurrency: int | None = None  # what the doctor's advice starts from
    readahead_blocks: int | None = None
    #: The options a command the doctor advises must repeat to reach the same dataset and tier (the
    #: store's URL, the files of its password and of the token: paths, never their contents).
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def resolve_some(namespace: Namespace, entries: Iterable[tuple[int, str]], source: str, *,
                 expand_dirs: bool, access: PathAccess | None = None) -> tuple[list[ObjectInfo], list[str], int]:
    """The objects ``entries`` name (directories expanded to their files if asked), what is missing (at
    most six messages, naming the manifest lines) and how many are. With ``access``, only what its
    caller may read: a name it may not read is missing, told apart from one the snapshot lacks by
    nothing, and a directory expands to the files the caller may read. Worker thread: the namespace is
    a view of one version."""
    objs: list[ObjectInfo] = []
    missing: list[str] = []
    missed = 0
    entries = list(entries)
    for (line, path), node in zip(entries, namespace.resolve_all([path for _, path in entries]), strict=True):
        if access is not None and node is not None and not access.readable(node):
            node = None
        if isinstance(node, File):
            objs.append(node.obj)
        elif node is not None and expand_dirs:
            objs.extend(f.obj for f in namespace.walk(node.inode) if access is None or access.readable(f))
        else:
            missed += 1
            if len(missing) < 6:
                what = ("a directory" if node else "not in the snapshot" if access is None
                        else "not in the snapshot or not readable by you")
                missing.append(f"{source}:{line}: {path!r} is {what}")
    return objs, missing, missed


@dataclass
class Resolved:
    """The objects a request names, and what it names that the snapshot lacks (the first few messages,
    and how many)."""

    objs: list[ObjectInfo] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    missed: int = 0
    blocks: int = 0  # the blocks of ``objs`` read whole

    def message(self) -> str:
        more = f" (and {self.missed - 5} more)" if self.missed > 5 else ""
        return "; ".join(self.missing[:5]) + more

    def check(self, skip_missing: bool) -> list[ObjectInfo]:
        """The objects; :class:`ManifestError` naming the lines of what is missing unless skipped."""
        if self.missed and not skip_missing:
            raise ManifestError(self.message())
        return self.objs


def resolve(namespace: Namespace, request: p.Entries, *, expand_dirs: bool, block_size: int,
            access: PathAccess | None = None) -> Resolved:
    """What a request's (own) entries name; :class:`~epochfs.prefetch.plan.PlanTooLarge` past the
    hand-over limit."""
    objs, missing, missed = resolve_some(namespace, request.entries, request.source, expand_dirs=expand_dirs,
                                         access=access)
    return Resolved(objs, missing, missed, count_blocks(objs, block_size))


@dataclass(frozen=True)
class UserBounds:
    """What one user who is not an operator may hold: blocks of orders not yet read, bytes of warmups
    not yet done (``--user-share`` of the hand-over limit and of the cache)."""

    order_blocks: int | None = None
    warmup_bytes: int | None = None

    @classmethod
    def share(cls, fraction: float, capacity: int) -> UserBounds:
        return cls(max(1, int(MAX_PLAN_BLOCKS * fraction)), max(1, int(capacity * fraction)))


class ControlHandlers:
    """Each request's answer for its caller (:class:`~epochfs.control.caller.Caller`; the daemon's own
    user where none is given). ``presented`` gives a node's (mode, uid, gid) as the mount presents it:
    the names a caller who is not an operator hands over are checked against it (without it, such a
    caller names nothing)."""

    def __init__(self, *, info: MountInfo, collect: Callable[[], Collected], snapshots: Snapshots,
                 prefetcher: Prefetcher, writeback: WriteBack | None = None, jobs: Jobs | None = None,
                 presented: Presented | None = None, bounds: UserBounds = UserBounds(),
                 held: Callable[[list[ObjectInfo]], Awaitable[list[bool]]] | None = None) -> None:
        self.jobs = jobs if jobs is not None else Jobs()
        self.info = info
        self.collect = collect
        self.snapshots = snapshots
        self.prefetcher = prefetcher
        self.writeback = writeback
        self.presented = presented
        self.bounds = bounds
        self.held = held  # which objects another mount of the node holds by content (cache/shared.py)

    def table(self) -> dict[type, Handler]:
        return {
            p.Status: self.status, p.Refresh: self.refresh, p.Prefetch: self.prefetch, p.Warmup: self.warmup,
            p.Resident: self.resident, p.Locate: self.locate, p.Job: self.job, p.Cancel: self.cancel, p.PublishManifest: self.publish_manifest,
            p.GetManifest: self.get_manifest, p.Sync: self.sync, Report: self.report,
        }

    def _access(self, namespace: Namespace, caller: Caller) -> PathAccess | None:
        if caller.operator:
            return None
        presented = self.presented or (lambda node: (0, 0, 0))  # (nothing presented: only root reads)
        return PathAccess(namespace.resolve, presented, caller)

    async def _objects(self, request: p.Entries, chunks: Chunks | None, *, expand_dirs: bool,
                       skip_missing: bool = False, caller: Caller = OWNER) -> Resolved:
        """What the request names that ``caller`` may read; :class:`ManifestError` for the rest unless
        skipped."""
        namespace, block_size = self.snapshots.namespace, self.info.block_size  # one snapshot for all chunks
        access = self._access(namespace, caller)
        if chunks is None:
            got = await trio.to_thread.run_sync(
                lambda: resolve(namespace, request, expand_dirs=expand_dirs, block_size=block_size, access=access))
            got.check(skip_missing)
            return got
        out = Resolved()
        blocks = 0

        def take(entries: tuple[tuple[int, str], ...]) -> None:  # (a worker thread)
            nonlocal blocks
            got, miss, n = resolve_some(namespace, entries, request.source, expand_dirs=expand_dirs, access=access)
            blocks += count_blocks(got, block_size)
            if blocks > MAX_PLAN_BLOCKS:  # refused as it grows: the rest is never read
                raise PlanTooLarge(f"more than {MAX_PLAN_BLOCKS} blocks in one hand-over; hand over a shorter "
                                   "manifest (one epoch, one rank) or use a larger --block-size")
            out.objs.extend(got)
            out.missing.extend(miss[:6 - len(out.missing)])
            out.missed += n

        await trio.to_thread.run_sync(take, request.entries)
        async for entries in chunks:
            await trio.to_thread.run_sync(take, entries)
        out.blocks = blocks
        out.check(skip_missing)
        return out

    async def report(self, request: Report, *, caller: Caller = OWNER) -> dict[str, Any]:
        try:
            self.jobs.check(request, caller.uid, caller.operator)
        except JobTaken as exc:
            raise NotPermitted(str(exc)) from None
        usage = counters = None
        if self.jobs.new_epoch(request):  # the counters where this epoch began
            c = self.collect()
            u = usage_of(c.backend.requests, c.backend.bytes_read)
            usage = (int(u.gets), int(u.lists), int(u.bytes))
            counters = epoch_counters(c)
        self.jobs.report(request, time.time(), usage, counters, uid=caller.uid)
        return {"handed_over": caller.uid in self.prefetcher.handed_by}

    async def status(self, request: p.Status, *, caller: Caller = OWNER) -> dict[str, Any]:
        c = self.collect()
        return status_of(self.info, c, marks_of(self.jobs, c.jobs), self.prefetcher.handed_by,
                         viewer=None if caller.operator else caller.uid)

    async def refresh(self, request: p.Refresh, *, caller: Caller = OWNER) -> dict[str, Any]:
        return await self.snapshots.refresh()

    async def prefetch(self, request: p.Prefetch, chunks: Chunks | None = None, *,
                       caller: Caller = OWNER) -> dict[str, Any]:
        got = await self._objects(request, chunks, expand_dirs=False, skip_missing=request.skip_missing,
                                  caller=caller)
        reply = await self.prefetcher.load(got.objs, epoch=request.epoch, replace=request.replace, rank=request.rank,
                                           uid=caller.uid, operator=caller.operator,
                                           share_blocks=self.bounds.order_blocks, blocks=got.blocks)
        if got.missed:
            log.warning("prefetch: %d of the paths %s handed over are not in the snapshot%s, handed over without "
                        "them: %s", got.missed, caller.describe(), "" if caller.operator else " or not readable",
                        got.message())
        return {**reply, "missing": got.missed, "missing_message": got.message()}

    async def warmup(self, request: p.Warmup, chunks: Chunks | None = None, *,
                     caller: Caller = OWNER) -> dict[str, Any]:
        objs = (await self._objects(request, chunks, expand_dirs=True, caller=caller)).objs
        return self.prefetcher.warmup(objs, uid=caller.uid, operator=caller.operator,
                                      share_bytes=self.bounds.warmup_bytes).as_dict()

    async def resident(self, request: p.Resident, chunks: Chunks | None = None, *,
                       caller: Caller = OWNER) -> dict[str, Any]:
        objs = (await self._objects(request, chunks, expand_dirs=True, caller=caller)).objs
        return await self.prefetcher.resident(objs)

    async def locate(self, request: p.Locate, chunks: Chunks | None = None, *,
                     caller: Caller = OWNER) -> dict[str, Any]:
        """Where each named file is stored, in order: ``locations[i]`` is ``[s, offset]`` (its bytes start
        at ``offset`` of ``stores[s]``, a packed member's shard of ``sizes[s]`` bytes) or null (a plain
        object); with ``shared``, ``shared`` lists the files (by their place in ``locations``) that another
        mount of the node holds by content (a first read copies them, fetching nothing): for an operator
        only (what other mounts hold is theirs to know; anyone else is told of none)."""
        objs = (await self._objects(request, chunks, expand_dirs=False, caller=caller)).objs
        stores: dict[str, int] = {}
        sizes: list[int] = []
        locations: list[list[int] | None] = []
        for obj in objs:
            stored, offset = stored_extent(obj)
            if stored is obj:
                locations.append(None)
                continue
            at = stores.setdefault(stored.key, len(stores))
            if at == len(sizes):
                sizes.append(stored.size)
            locations.append([at, offset])
        reply: dict[str, Any] = {"stores": list(stores), "sizes": sizes, "locations": locations}
        if request.shared:
            held = await self.held([stored_extent(obj)[0] for obj in objs]) if self.held and caller.operator else []
            reply["shared"] = [i for i, h in enumerate(held) if h]
        return reply

    async def job(self, request: p.Job, *, caller: Caller = OWNER) -> dict[str, Any]:
        job = self.prefetcher.job(request.id, uid=caller.uid, operator=caller.operator)
        if job is None:
            raise ManifestError(f"no warmup job {request.id}")
        return job.as_dict()

    async def cancel(self, request: p.Cancel, *, caller: Caller = OWNER) -> dict[str, Any]:
        job = self.prefetcher.cancel(request.id, uid=caller.uid, operator=caller.operator)
        if job is None:
            raise ManifestError(f"no warmup job {request.id}")
        return job.as_dict()

    async def publish_manifest(self, request: p.PublishManifest, *, caller: Caller = OWNER) -> dict[str, Any]:
        await self.snapshots.put_manifest(request.name, request.text)
        return {"published": request.name}

    async def get_manifest(self, request: p.GetManifest, *, caller: Caller = OWNER) -> dict[str, Any]:
        text = await self.snapshots.get_manifest(request.name)
        if text is None:
            raise ManifestError(f"no manifest named {request.name!r} in {self.snapshots.store.url}")
        return {"text": text}


    async def sync(self, request: p.Sync, *, caller: Caller = OWNER) -> dict[str, Any]:
        """Wait until what was written under the paths (all: none given) is in the backend; a caller who
        is not an operator waits only for its own files."""
        wb = self.writeback
        if wb is None:  # a read-only mount owes the backend nothing
            return {"writeback": False, "pending": [], "pending_total": 0, "pending_bytes": 0}
        # A name the caller may not reach (a directory on its way it may not search) is answered exactly
        # as one that is not there: sync tells nobody whether another user's private name exists.
        access = None if caller.operator else PathAccess(wb.tree.resolve, self.presented or (lambda node: (0, 0, 0)),
                                                         caller)
        for path in request.paths:
            if not path:
                continue
            there = wb.tree.resolve(path) is not None or bool(wb.pending([path]))
            if not there or access is not None and not access.searchable(path.rpartition("/")[0]):
                raise ConfigError(f"{path!r} is not in the mount")
        paths = list(request.paths)
        if not caller.operator:
            paths = wb.owned(caller.uid, paths)
            if not paths:
                return {"writeback": True, "pending": [], "pending_total": 0, "pending_bytes": 0, "failed_total": 0}
        left = await wb.sync(paths, request.wait)
        if not caller.operator:
            mine = set(paths)
            left = [x for x in left if x.key in mine]
        failed = [x for x in left if x.state.startswith("not uploaded")]
        left = failed + [x for x in left if x not in failed]  # what will never upload is listed first
        return {"writeback": True, "pending": [dataclasses.asdict(x) for x in left[:MAX_PENDING_LISTED]],
                "pending_total": len(left), "pending_bytes": sum(x.bytes for x in left),
                "failed_total": len(failed),
                "publish_error": wb.publish_error if any(x.state == "to publish" for x in left) else None}


def job_of(j: JobStats, handed_by: dict[int | None, float] | None = None) -> dict[str, Any]:
    """One job x rank in ``status``: its totals, the sums of its reports of the last window, and whether
    its user has handed over an order to the mount (``handed_over``; None where not known)."""
    out = {k: v for k, v in vars(j).items() if k != "recent"}
    out["handed_over"] = None if handed_by is None else j.uid in handed_by
    out["window"] = {"seconds": (j.recent[-1][0] - j.recent[0][0]) if j.recent else 0.0,
                     "reports": len(j.recent), "steps": sum(r[1] for r in j.recent),
                     "data_wait": sum(r[2] for r in j.recent), "compute": sum(r[3] for r in j.recent),
                     "saves": sum(r[4] for r in j.recent), "save_seconds": sum(r[5] for r in j.recent)}
    out["epochs"] = [dataclasses.asdict(e) for e in j.epochs]
    return out


#: The cache's counters a job's epoch marks keep (what :func:`read_origins` needs).
MARKED = ("hit_bytes", "miss_bytes", "demand_bytes", "prefetch_bytes", "peer_bytes", "replica_bytes")


def epoch_counters(c: Collected) -> dict[str, float]:
    """The counters kept where a job's epoch begins: where reads came from so far, the host's CPU time,
    the seconds the backend link carried bytes, and when."""
    out: dict[str, float] = {k: int(getattr(c.cache, k)) for k in MARKED}
    cpu = host_cpu()
    if cpu is not None:
        out["cpu_busy"], out["cpu_all"] = cpu[0], cpu[1]
    if c.backend_link is not None:
        out["backend_busy_seconds"] = c.backend_link.busy_seconds
    out["time"] = time.time()
    return out


def marks_of(jobs: Jobs, stats: tuple[JobStats, ...]) -> dict[str, list[dict[str, Any]]]:
    """Per job, the backend usage where each of its epochs began (``status``'s ``job_epochs``)."""
    out = {}
    for name in sorted({j.job for j in stats}):
        marks = jobs.marks(name)
        if marks:
            out[name] = [{"epoch": m.epoch, "time": m.time, "gets": m.usage[0], "lists": m.usage[1],
                          "bytes": m.usage[2], "counters": dict(m.counters)} for m in marks]
    return out


def host_cpu() -> list[int] | None:
    """This machine's CPU time so far, in clock ticks: [busy, all, CPUs] (``/proc/stat``; idle and
    waiting for I/O are not busy); what the doctor tells a node whose CPU is the bound by."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    return [sum(ticks) - ticks[3] - ticks[4], sum(ticks), os.cpu_count() or 1]


def memory_of(c: Collected) -> dict[str, Any] | None:
    """What the daemon holds in memory, by use, against its limit's shares (``--memory-limit``)."""
    if c.memory is None:
        return None
    k = c.cache
    return {**c.memory.as_dict(), "resident": c.resident_bytes, "throttled_seconds": k.throttled_seconds,
            "held": {"demand": k.demand_inflight_bytes, "ahead": k.ahead_bytes, "recent": k.recent_bytes,
                     "whole": k.whole_bytes, "pool": c.pool_bytes}}


def status_of(info: MountInfo, c: Collected, job_epochs: dict[str, list[dict[str, Any]]] | None = None,
              handed_by: dict[int | None, float] | None = None, viewer: int | None = None) -> dict[str, Any]:
    """The reply to ``status`` (``epochfs status --json`` prints it); ``viewer``: the uid of a caller who
    is not an operator (what is one user's alone, a guess of the learned order, is shown to that user
    only)."""
    snap = c.snapshot
    usage = usage_of(c.backend.requests, c.backend.bytes_read)  # (what the backend bills)
    return {
        "metrics_addr": info.metrics_addr(),
        "node": info.node,
        "read_seconds": c.fs.read_seconds.as_dict(),
        "errors": c.fs.errors,
        "isatty_asks": c.fs.isatty_asks,
        "io_uring_requests": c.fs.uring_requests,
        "version": __version__,
        "pid": os.getpid(),
        "uptime_seconds": time.time() - info.started,
        "now": time.time(),
        "source": info.source,
        "mountpoint": info.mountpoint,
        "cache_dir": info.cache_dir,
        "block_size": info.block_size,
        "backend_concurrency": info.backend_concurrency,
        "readahead_blocks": info.readahead_blocks,
        "options": info.options,
        "host_cpu": host_cpu(),
        "meta": {"url": snap.store, "reachable": snap.reachable, "error": snap.error, "master": snap.master,
                 "master_since": snap.master_since,
                 "latest_version": snap.latest_version},
        "snapshot": {"version": snap.version, "created": snap.created, "age_seconds": time.time() - snap.created,
                     "objects": snap.objects, "files": snap.files, "directories": snap.directories,
                     "bytes": snap.bytes, "shards": snap.shards},
        "eviction": info.eviction,
        "prefetch": vars(c.prefetch),
        "learned": c.learned.as_dict(viewer) if c.learned is not None else None,
        "memory": memory_of(c),
        "cache": vars(c.cache),
        "reads": read_origins(c.cache),
        "store": vars(c.store),
        "backend": {
            "requests": {f"{op}/{outcome}": n for (op, outcome), n in sorted(c.backend.requests.items())},
            "bytes": c.backend.bytes_read,
            "bandwidth_limit": c.backend_link.capacity.bytes_per_second if c.backend_link and c.backend_link.capacity
            else None,
            "link": c.backend_link.as_dict() if c.backend_link else None,
            "request_seconds": c.backend.request_seconds.as_dict() if c.backend.request_seconds else None,
            "first_byte_seconds": c.backend.first_byte_seconds,
            "usage": {"gets": int(usage.gets), "lists": int(usage.lists), "bytes": int(usage.bytes)},
        },
        "writeback": vars(c.writeback) if c.writeback is not None else None,
        "passthrough": vars(c.passthrough) if c.passthrough is not None else None,
        "shared": vars(c.shared) if c.shared is not None else None,
        "node_cache": vars(c.node_cache) if c.node_cache is not None else None,
        "peer": {**vars(c.peer), "members": list(c.peer.members), "down": list(c.peer.down),
                 "link": c.peer_link.as_dict() if c.peer_link else None, "load": [vars(m) for m in c.peer.load]}
        if c.peer is not None else None,
        "jobs": [job_of(j, handed_by) for j in c.jobs],
        "job_epochs": job_epochs or {},
    }
