"""Composition root: builds every service of a mount, runs them in one trio nursery, tears them down.

Order of start-up: clear a dead FUSE mount left by a crashed daemon; open the backend; lock and open
the block store; load the namespace snapshot (or list the source); mount; start the cache service and
the control channel; answer the first request through the mount; then report ready. Tear-down runs in
reverse on SIGINT/SIGTERM or an external unmount (``epochfs umount``, ``fusermount3 -u``).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

from epochfs import __version__
from epochfs.backend import Backend, open_backend
from epochfs.cache.policy import make_policy
from epochfs.cache.service import BlockCache
from epochfs.cache.store import BlockStore
from epochfs.config import Config
from epochfs.control import CONTROL_XATTR, PID_XATTR, ControlServer, socket_path
from epochfs.errors import BackendUnavailable, ConfigError, EpochfsError
from epochfs.fs import Operations
from epochfs.meta import MetaStore, Snapshot, open_meta
from epochfs.meta.lmdb import LmdbMetaStore
from epochfs.meta.namespace import File, Namespace, diff
from epochfs.metrics import MetricsServer, Sample, parse_addr
from epochfs.prefetch.manifest import ManifestError
from epochfs.prefetch.scheduler import Prefetcher

log = logging.getLogger(__name__)

Ready = Callable[[str | None], None]  # called once: None when mounted, else the error message


def is_dead_mount(path: str) -> bool:
    try:
        os.listdir(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def lazy_unmount(path: str) -> None:
    subprocess.run(["fusermount3", "-uz", path], check=False, capture_output=True)


def sd_notify(message: str) -> bool:
    """Send a systemd notification (READY=1, STOPPING=1, STATUS=...) if started with NOTIFY_SOCKET."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", addr, exc)
        return False
    return True


def set_kernel_readahead(dev: int, nbytes: int) -> None:
    """Raise the mount's readahead window (FUSE defaults to 128 KiB, which caps each read request)."""
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(max(4, nbytes >> 10)))
    except OSError as exc:
        log.info("could not set the kernel readahead (%s): %s", path, exc)


def check_mountpoint(path: str) -> None:
    if is_dead_mount(path):
        log.warning("%s holds a dead FUSE mount (a daemon died); clearing it", path)
        lazy_unmount(path)
    if not os.path.isdir(path):
        raise ConfigError(f"mount point {path} does not exist or is not a directory")
    if os.path.ismount(path):
        raise ConfigError(f"{path} is already a mount point")


def local_copy(config: Config, backend: Backend, store: MetaStore) -> tuple[LmdbMetaStore, str]:
    """Where a snapshot loaded from a shared store is copied on this node, and the key it is kept under:
    the node mounts from that copy when the shared store is unreachable at start-up."""
    return LmdbMetaStore(config.cache_dir / "meta-shared"), f"{store.url}#{config.meta_name or backend.source_id}"


def load_snapshot(config: Config, backend: Backend, store: MetaStore) -> tuple[Snapshot, str | None]:
    """The snapshot to serve, and why the metadata store is unreachable (None when it answered)."""
    if not isinstance(store, LmdbMetaStore):  # a shared store: load what was published, never list
        try:
            snapshot = store.load(backend.source_id)
        except BackendUnavailable as exc:
            copy, key = local_copy(config, backend, store)
            kept = copy.load(key)
            if kept is None:
                raise ConfigError(f"{exc}; and {config.cache_dir} holds no copy of a snapshot to serve") from None
            log.warning("%s; serving this node's copy of snapshot version %d (%d objects) until it answers",
                        exc, kept.version, len(kept.objects))
            return dataclasses.replace(kept, source=backend.source_id), str(exc)
        if snapshot is None:
            raise ConfigError(f"no snapshot of {backend.source_id} in {store.url}; publish one with: "
                              f"epochfs import {backend.source_id} --meta {store.url}")
        log.info("loaded snapshot version %d of %s from %s (%d objects)", snapshot.version, snapshot.source,
                 store.url, len(snapshot.objects))
        return snapshot, None
    snapshot = None if config.refresh else store.load(backend.source_id)
    if snapshot is not None and config.snapshot_ttl and time.time() - snapshot.created > config.snapshot_ttl:
        log.info("snapshot version %d is older than the TTL; listing the source again", snapshot.version)
        snapshot = None
    if snapshot is not None:
        log.info("using snapshot version %d of %s (%d objects)", snapshot.version, snapshot.source,
                 len(snapshot.objects))
        return snapshot, None
    started = time.monotonic()
    log.info("listing %s", backend.source_id)
    snapshot = store.save(backend.source_id, backend.list_objects())
    log.info("listed %d objects in %.1fs; snapshot version %d", len(snapshot.objects),
             time.monotonic() - started, snapshot.version)
    return snapshot, None


class Daemon:
    """All services of one mount."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.started = time.time()
        self.backend = open_backend(config)
        self.store = BlockStore(config.cache_dir, config.cache_size, config.free_space_ratio,
                                make_policy(config.eviction))
        self.store.open()
        try:
            self.meta = open_meta(config.meta, config.cache_dir, config.meta_name)
            self.snapshot, self.meta_error = load_snapshot(config, self.backend, self.meta)
        except BaseException:
            self.store.close()
            raise
        self.latest_version = self.snapshot.version
        self._snapshot_changed = trio.Event()  # set by refresh(); wakes the local-copy task
        self.namespace = Namespace.build(self.snapshot.objects, mtime_ns=int(self.snapshot.created * 1e9))
        self.cache = BlockCache(
            self.store, self.backend, block_size=config.block_size,
            concurrency=config.backend_concurrency, readahead_blocks=config.readahead_blocks,
        )
        self.prefetcher = Prefetcher(self.cache, capacity=config.cache_size,
                                     max_inflight=config.backend_concurrency,
                                     bandwidth=config.prefetch_bandwidth, lead=config.prefetch_lead)
        self.cache.observer = self.prefetcher
        addr = parse_addr(config.metrics_addr)
        self.metrics = MetricsServer(addr[0], addr[1], self.sample) if addr else None
        self.control = ControlServer(socket_path(config.cache_dir), {
            "status": self._status,
            "prefetch": self._prefetch,
            "warmup": self._warmup,
            "job": self._job,
            "resident": self._resident,
            "refresh": self._refresh,
            "publish_manifest": self._publish_manifest,
            "get_manifest": self._get_manifest,
        })
        self.ops = Operations(
            self.namespace, self.cache, attr_timeout=config.attr_timeout,
            root_xattrs={
                CONTROL_XATTR.encode(): lambda: str(self.control.path).encode(),
                PID_XATTR.encode(): lambda: str(os.getpid()).encode(),
                b"user.epochfs.snapshot": lambda: str(self.snapshot.version).encode(),
            },
        )

    def fuse_options(self) -> set[str]:
        opts = set(pyfuse3.default_options) | {"fsname=epochfs", "subtype=epochfs", "ro", "noatime"}
        if self.config.allow_other:
            opts.add("allow_other")
        opts.update(self.config.fuse_options)
        if self.config.debug:
            opts.add("debug")
        return opts

    def sample(self) -> Sample:
        """Every statistic the metrics expose, read on the trio thread."""
        cache, store = self.cache.statistics(), self.store.statistics()
        backend, fs, pf = self.backend.statistics(), self.ops.statistics(), self.prefetcher.statistics()
        values: dict[str, float] = {
            "cache_hits": cache.hits, "cache_misses": cache.misses,
            "cache_hit_bytes": cache.hit_bytes, "cache_miss_bytes": cache.miss_bytes,
            "cache_used_bytes": store.used_bytes, "cache_capacity_bytes": store.capacity_bytes,
            "cache_blocks": store.blocks, "cache_evictions": store.evictions,
            "cache_corrupt_blocks": store.corrupt_blocks, "cache_not_admitted": store.not_admitted,
            "prefetch_queued_bytes": pf.queued_bytes, "prefetch_lead_bytes": pf.lead_bytes,
            "prefetch_lead_seconds": pf.lead_seconds or 0.0, "prefetch_inflight": pf.inflight,
            "manifest_position": pf.file_position, "manifest_files": pf.files,
            "snapshot_version": self.snapshot.version, "snapshot_objects": len(self.snapshot.objects),
            "meta_reachable": 1.0 if self.meta_error is None else 0.0,
        }
        if self.config.backend_bandwidth:
            values["backend_bandwidth_limit_bytes"] = self.config.backend_bandwidth
        errors = dict(fs.errors)
        errors["cache_write"] = store.fill_errors
        histograms = {"read_seconds": fs.read_seconds}
        if backend.request_seconds is not None:
            histograms["backend_request_seconds"] = backend.request_seconds
        return Sample(values, backend.requests, {"demand": cache.demand_bytes, "prefetch": cache.prefetch_bytes},
                      errors, histograms)

    def status(self) -> dict[str, Any]:
        cfg = self.config
        fs, backend = self.ops.statistics(), self.backend.statistics()
        return {
            "metrics_addr": f"{self.metrics.host}:{self.metrics.port}" if self.metrics else None,
            "read_seconds": fs.read_seconds.as_dict(),
            "errors": fs.errors,
            "version": __version__,
            "pid": os.getpid(),
            "uptime_seconds": time.time() - self.started,
            "source": cfg.source.url,
            "mountpoint": str(cfg.mountpoint),
            "cache_dir": str(cfg.cache_dir),
            "block_size": cfg.block_size,
            "meta": {"url": self.meta.url, "reachable": self.meta_error is None, "error": self.meta_error,
                     "latest_version": self.latest_version},
            "snapshot": {
                "version": self.snapshot.version,
                "created": self.snapshot.created,
                "objects": len(self.snapshot.objects),
                "files": self.namespace.file_count,
                "directories": self.namespace.dir_count,
                "bytes": self.namespace.total_bytes,
            },
            "eviction": self.store.policy.name,
            "prefetch": vars(self.prefetcher.statistics()),
            "cache": vars(self.cache.statistics()),
            "store": vars(self.store.statistics()),
            "backend": {
                "requests": {f"{op}/{outcome}": n for (op, outcome), n in
                             sorted(backend.requests.items())},
                "bytes": backend.bytes_read,
            },
        }

    async def _status(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.status()

    def _resolve(self, request: dict[str, Any], *, expand_dirs: bool) -> list[File]:
        """The files named by a request's ``entries`` ([line, path] pairs); errors name the lines."""
        source = request.get("source", "manifest")
        files: list[File] = []
        missing = []
        for line, path in request["entries"]:
            node = self.namespace.resolve(path)
            if isinstance(node, File):
                files.append(node)
            elif node is not None and expand_dirs:
                prefix = node.path + "/" if node.path else ""
                files.extend(f for f in self.namespace.files() if f.path.startswith(prefix))
            else:
                missing.append(f"{source}:{line}: {path!r} is {'a directory' if node else 'not in the snapshot'}")
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ManifestError("; ".join(missing[:5]) + more)
        return files

    async def _prefetch(self, request: dict[str, Any]) -> dict[str, Any]:
        files = self._resolve(request, expand_dirs=False)
        return self.prefetcher.load([f.obj for f in files], epoch=request.get("epoch"),
                                    replace=bool(request.get("replace")))

    async def _warmup(self, request: dict[str, Any]) -> dict[str, Any]:
        files = self._resolve(request, expand_dirs=True)
        return self.prefetcher.warmup([f.obj for f in files]).as_dict()

    async def _job(self, request: dict[str, Any]) -> dict[str, Any]:
        job = self.prefetcher.job(int(request["id"]))
        if job is None:
            raise ManifestError(f"no warmup job {request['id']}")
        return job.as_dict()

    # -- snapshots ------------------------------------------------------------------------------------

    async def _meta_call(self, fn: Any, *args: Any) -> Any:
        """Call the metadata store in a worker thread, tracking whether it is reachable."""
        try:
            result = await trio.to_thread.run_sync(fn, *args)
        except EpochfsError as exc:
            if self.meta_error is None:
                log.warning("metadata store unreachable, serving snapshot version %d: %s",
                            self.snapshot.version, exc)
            self.meta_error = str(exc)
            raise
        if self.meta_error is not None:
            log.info("metadata store %s is reachable again", self.meta.url)
        self.meta_error = None
        return result

    async def refresh(self) -> dict[str, Any]:
        """Switch to a newer snapshot without unmounting. Open files keep the version they opened."""
        source = self.backend.source_id
        if isinstance(self.meta, LmdbMetaStore):
            snapshot = await trio.to_thread.run_sync(
                lambda: self.meta.save(source, self.backend.list_objects()))
        else:
            latest = await self._meta_call(self.meta.current_version, source)
            if latest is None or latest == self.snapshot.version:
                return {"changed": False, "version": self.snapshot.version}
            snapshot = await self._meta_call(self.meta.load, source)
            if snapshot is None:
                return {"changed": False, "version": self.snapshot.version}
        old = self.namespace
        new = Namespace.build(snapshot.objects, mtime_ns=int(snapshot.created * 1e9), previous=old)
        entries, inodes = diff(old, new)
        self.namespace = self.ops.namespace = new
        self.snapshot = snapshot
        self.latest_version = snapshot.version
        await trio.to_thread.run_sync(_invalidate, entries, inodes)
        log.info("now serving snapshot version %d (%d entries changed)", snapshot.version, len(entries))
        self._snapshot_changed.set()
        return {"changed": True, "version": snapshot.version, "changed_entries": len(entries)}

    async def _keep_local_copy(self) -> None:
        """Copy each snapshot loaded from a shared store into the cache directory, one copy at a time and
        off the refresh path (a refresh answers without waiting for it)."""
        if isinstance(self.meta, LmdbMetaStore):
            return
        copy, key = local_copy(self.config, self.backend, self.meta)
        while True:
            changed = self._snapshot_changed = trio.Event()  # before copying: a refresh meanwhile is seen
            if self.meta_error is None:  # not when serving this node's copy: it holds that version
                await trio.to_thread.run_sync(copy.keep, key, self.snapshot)
            await changed.wait()

    async def _refresh(self, request: dict[str, Any]) -> dict[str, Any]:
        return await self.refresh()

    async def _poll_meta(self) -> None:
        while True:
            await trio.sleep(self.config.meta_poll)
            try:
                latest = await self._meta_call(self.meta.current_version, self.backend.source_id)
                if latest is not None:
                    self.latest_version = latest
                if latest is not None and latest != self.snapshot.version:
                    await self.refresh()
            except EpochfsError:
                continue  # logged once by _meta_call; keep serving what is loaded

    async def _publish_manifest(self, request: dict[str, Any]) -> dict[str, Any]:
        await self._meta_call(self.meta.put_manifest, self.backend.source_id, request["name"], request["text"])
        return {"published": request["name"]}

    async def _get_manifest(self, request: dict[str, Any]) -> dict[str, Any]:
        text = await self._meta_call(self.meta.get_manifest, self.backend.source_id, request["name"])
        if text is None:
            raise ManifestError(f"no manifest named {request['name']!r} in {self.meta.url}")
        return {"text": text}

    async def _resident(self, request: dict[str, Any]) -> dict[str, Any]:
        files = self._resolve(request, expand_dirs=True)
        return self.prefetcher.resident([f.obj for f in files])

    async def run(self, ready: Ready) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.cache.run)
            await nursery.start(self.prefetcher.run)
            await nursery.start(self.control.run)
            if self.metrics is not None:
                await nursery.start(self.metrics.run)
            nursery.start_soon(self._handle_signals)
            if self.config.meta_poll:
                nursery.start_soon(self._poll_meta)
            nursery.start_soon(self._keep_local_copy)
            nursery.start_soon(self._announce, ready)
            await pyfuse3.main(min_tasks=4, max_tasks=128)
            nursery.cancel_scope.cancel()

    async def _handle_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s; unmounting", signal.Signals(signum).name)
                sd_notify("STOPPING=1")
                pyfuse3.terminate()

    async def _announce(self, ready: Ready) -> None:
        st = await trio.to_thread.run_sync(os.stat, self.config.mountpoint)
        if st.st_ino != pyfuse3.ROOT_INODE:
            ready(f"{self.config.mountpoint} did not answer as an epochfs mount")
            pyfuse3.terminate()
            return
        if self.config.kernel_readahead:
            set_kernel_readahead(st.st_dev, self.config.kernel_readahead)
        log.info("mounted %s at %s", self.config.source.url, self.config.mountpoint)
        ready(None)
        sd_notify(f"READY=1\nSTATUS=serving {self.config.source.url} at {self.config.mountpoint}\n"
                  f"MAINPID={os.getpid()}")

    def close(self) -> None:
        self.store.close()
        self.meta.close()
        self.backend.close()


def _invalidate(entries: list[tuple[int, bytes]], inodes: list[int]) -> None:
    """Make the kernel forget changed names and cached data (worker thread: these calls block)."""
    for inode in inodes:
        try:
            pyfuse3.invalidate_inode(inode)
        except OSError:
            pass  # the kernel did not know it
    for parent, name in entries:
        try:
            pyfuse3.invalidate_entry(parent, name)
        except OSError:
            pass


def _epochfs_error(exc: BaseException) -> EpochfsError | None:
    """The EpochfsError inside ``exc`` (trio wraps errors of nursery children in exception groups)."""
    if isinstance(exc, EpochfsError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _epochfs_error(inner)
            if found is not None:
                return found
    return None


def run(config: Config, ready: Ready) -> int:
    """Mount and serve until unmounted. Calls ``ready`` exactly once. Returns the exit code."""
    mountpoint = str(config.mountpoint)
    try:
        check_mountpoint(mountpoint)
        daemon = Daemon(config)
    except EpochfsError as exc:
        ready(str(exc))
        return 2 if isinstance(exc, ConfigError) else 1
    except Exception as exc:
        log.exception("start-up failed")
        ready(f"start-up failed: {type(exc).__name__}: {exc}")
        return 1
    try:
        pyfuse3.init(daemon.ops, mountpoint, daemon.fuse_options())
    except RuntimeError as exc:
        daemon.close()
        ready(f"cannot mount {mountpoint}: {exc}")
        return 1
    try:
        trio.run(daemon.run, ready)
    except BaseException as exc:
        known = _epochfs_error(exc)
        if known is None:
            log.exception("daemon failed")
        pyfuse3.close(unmount=True)
        daemon.close()
        ready(str(known) if known else f"daemon failed: {exc!r}; see the log")
        return 2 if isinstance(known, ConfigError) else 1
    pyfuse3.close(unmount=True)
    daemon.close()
    log.info("unmounted %s", mountpoint)
    return 0

