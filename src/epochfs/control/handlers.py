"""What each control request does: a validated request (:mod:`.protocol`) becomes component calls.

Paths named by a request are resolved against the snapshot being served, in a worker thread (a
manifest may name millions of files), and the hand-over's size is checked there before any work on
the event loop (:func:`epochfs.prefetch.plan.count_blocks`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from epochfs import __version__
from epochfs.control import protocol as p
from epochfs.control.server import Handler
from epochfs.errors import ConfigError
from epochfs.meta.namespace import File, Namespace
from epochfs.meta.snapshots import Snapshots
from epochfs.metrics import Collected
from epochfs.prefetch.manifest import ManifestError
from epochfs.prefetch.plan import count_blocks
from epochfs.prefetch.scheduler import Prefetcher
from epochfs.records import ObjectInfo
from epochfs.writeback.service import WriteBack

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


def resolve(namespace: Namespace, request: p.Entries, *, expand_dirs: bool, block_size: int) -> list[ObjectInfo]:
    """The objects a request's entries name (directories expanded to their files if asked); errors name
    the manifest lines. Runs in a worker thread: the namespace is immutable."""
    objs: list[ObjectInfo] = []
    missing = []
    for line, path in request.entries:
        node = namespace.resolve(path)
        if isinstance(node, File):
            objs.append(node.obj)
        elif node is not None and expand_dirs:
            prefix = node.path + "/" if node.path else ""
            objs.extend(f.obj for f in namespace.files() if f.path.startswith(prefix))
        else:
            missing.append(f"{request.source}:{line}: {path!r} is {'a directory' if node else 'not in the snapshot'}")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ManifestError("; ".join(missing[:5]) + more)
    count_blocks(objs, block_size)
    return objs


class ControlHandlers:
    def __init__(self, *, info: MountInfo, collect: Callable[[], Collected], snapshots: Snapshots,
                 prefetcher: Prefetcher, writeback: WriteBack | None = None) -> None:
        self.info = info
        self.collect = collect
        self.snapshots = snapshots
        self.prefetcher = prefetcher
        self.writeback = writeback

    def table(self) -> dict[type, Handler]:
        return {
            p.Status: self.status, p.Refresh: self.refresh, p.Prefetch: self.prefetch, p.Warmup: self.warmup,
            p.Resident: self.resident, p.Job: self.job, p.Cancel: self.cancel, p.PublishManifest: self.publish_manifest,
            p.GetManifest: self.get_manifest, p.Sync: self.sync,
        }

    async def _objects(self, request: p.Entries, *, expand_dirs: bool) -> list[ObjectInfo]:
        return await trio.to_thread.run_sync(
            lambda: resolve(self.snapshots.namespace, request, expand_dirs=expand_dirs,
                            block_size=self.info.block_size))

    async def status(self, request: p.Status) -> dict[str, Any]:
        return status_of(self.info, self.collect())

    async def refresh(self, request: p.Refresh) -> dict[str, Any]:
        return await self.snapshots.refresh()

    async def prefetch(self, request: p.Prefetch) -> dict[str, Any]:
        objs = await self._objects(request, expand_dirs=False)
        return await self.prefetcher.load(objs, epoch=request.epoch, replace=request.replace, rank=request.rank)

    async def warmup(self, request: p.Warmup) -> dict[str, Any]:
        objs = await self._objects(request, expand_dirs=True)
        return self.prefetcher.warmup(objs).as_dict()

    async def resident(self, request: p.Resident) -> dict[str, Any]:
        objs = await self._objects(request, expand_dirs=True)
        return await self.prefetcher.resident(objs)

    async def job(self, request: p.Job) -> dict[str, Any]:
        job = self.prefetcher.job(request.id)
        if job is None:
            raise ManifestError(f"no warmup job {request.id}")
        return job.as_dict()

    async def cancel(self, request: p.Cancel) -> dict[str, Any]:
        job = self.prefetcher.cancel(request.id)
        if job is None:
            raise ManifestError(f"no warmup job {request.id}")
        return job.as_dict()

    async def publish_manifest(self, request: p.PublishManifest) -> dict[str, Any]:
        await self.snapshots.put_manifest(request.name, request.text)
        return {"published": request.name}

    async def get_manifest(self, request: p.GetManifest) -> dict[str, Any]:
        text = await self.snapshots.get_manifest(request.name)
        if text is None:
            raise ManifestError(f"no manifest named {request.name!r} in {self.snapshots.store.url}")
        return {"text": text}


    async def sync(self, request: p.Sync) -> dict[str, Any]:
        wb = self.writeback
        if wb is None:  # a read-only mount owes the backend nothing
            return {"writeback": False, "pending": [], "pending_total": 0, "pending_bytes": 0}
        for path in request.paths:
            if path and wb.tree.resolve(path) is None and not wb.pending([path]):
                raise ConfigError(f"{path!r} is not in the mount")
        left = await wb.sync(list(request.paths), request.wait)
        failed = [x for x in left if x.state.startswith("not uploaded")]
        left = failed + [x for x in left if x not in failed]  # what will never upload is listed first
        return {"writeback": True, "pending": [dataclasses.asdict(x) for x in left[:MAX_PENDING_LISTED]],
                "pending_total": len(left), "pending_bytes": sum(x.bytes for x in left),
                "failed_total": len(failed)}


def status_of(info: MountInfo, c: Collected) -> dict[str, Any]:
    """The reply to ``status`` (``epochfs status --json`` prints it)."""
    snap = c.snapshot
    return {
        "metrics_addr": info.metrics_addr(),
        "read_seconds": c.fs.read_seconds.as_dict(),
        "errors": c.fs.errors,
        "version": __version__,
        "pid": os.getpid(),
        "uptime_seconds": time.time() - info.started,
        "source": info.source,
        "mountpoint": info.mountpoint,
        "cache_dir": info.cache_dir,
        "block_size": info.block_size,
        "meta": {"url": snap.store, "reachable": snap.reachable, "error": snap.error,
                 "latest_version": snap.latest_version},
        "snapshot": {"version": snap.version, "created": snap.created, "age_seconds": time.time() - snap.created,
                     "objects": snap.objects, "files": snap.files, "directories": snap.directories,
                     "bytes": snap.bytes},
        "eviction": info.eviction,
        "prefetch": vars(c.prefetch),
        "cache": vars(c.cache),
        "store": vars(c.store),
        "backend": {
            "requests": {f"{op}/{outcome}": n for (op, outcome), n in sorted(c.backend.requests.items())},
            "bytes": c.backend.bytes_read,
        },
        "writeback": vars(c.writeback) if c.writeback is not None else None,
        "peer": {**vars(c.peer), "members": list(c.peer.members), "down": list(c.peer.down)}
        if c.peer is not None else None,
    }
