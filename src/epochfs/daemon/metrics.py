"""Prometheus metrics: the only module that imports prometheus_client; every metric name is here.

Components keep plain counters and expose ``statistics()``; :class:`DaemonCollector` turns those into
series at scrape time, so the read path pays nothing for metrics. :class:`MetricsServer` serves the
text exposition over HTTP from the daemon's trio loop (no extra threads, no locks: the statistics are
read on the thread that owns them). No object keys ever appear in labels.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from epochfs.control.collected import Collected
from epochfs.core.errors import ConfigError
from epochfs.core.stats import HistogramSnapshot
from epochfs.transport.slots import Slot, Slots

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

PREFIX = "epochfs_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_CONNECTIONS = 16  # concurrent scrapes (a connection that has sent no request yields its slot)
REQUEST_TIMEOUT = 5.0  # seconds a scraper has to send its request

# name: (type, help). The name of a counter here is without its "_total" suffix.
METRICS: dict[str, tuple[str, str]] = {
    "cache_hits": ("counter", "Block reads by the reader served without waiting for the backend."),
    "cache_misses": ("counter", "Block reads by the reader that waited for (or were fetched by) the backend."),
    "cache_hit_bytes": ("counter", "Bytes returned to readers without waiting for the backend: from the cache, a "
                        "completed prefetch, or a peer's cache (cluster tier)."),
    "cache_miss_bytes": ("counter", "Bytes returned to readers that had to come from the backend on demand."),
    "kernel_pushed_bytes": ("counter", "Bytes pushed into the kernel page cache ahead of sequential readers (counted "
                            "as cache hit bytes too: their reads never reach the daemon)."),
    "kernel_push_failures": ("counter", "Pushes into the kernel page cache that failed (the reads then reach the "
                             "daemon as usual)."),
    "backend_requests": ("counter", "Requests to the backend by operation and outcome."),
    "backend_bytes": ("counter", "Bytes fetched from the backend, by purpose (demand or prefetch)."),
    "backend_request_seconds": ("histogram", "Latency of successful backend data requests."),
    "backend_bandwidth_limit_bytes": ("gauge", "Capacity of the link to the backend, bytes/s, labelled by where it is "
                                      "known from: declared (--backend-bandwidth), interface (the speed or shaping of "
                                      "the interface routing to the endpoint), or measured (the rate its transfers "
                                      "reached while they kept it busy). Absent where none is known."),
    "read_seconds": ("histogram", "Latency of FUSE read requests."),
    "isatty_requests": ("counter", "Requests asking whether a file of the mount is a terminal: one per Python open() "
                        "with default buffering (before Python 3.14), each a round trip to the daemon."),
    "cache_used_bytes": ("gauge", "Bytes of blocks in the cache."),
    "cache_capacity_bytes": ("gauge", "Upper bound of the cache: --cache-size, or less where the cache's file "
                                       "system holds less (what the cache holds plus the free space above "
                                       "--free-space-ratio)."),
    "cache_blocks": ("gauge", "Blocks in the cache."),
    "cache_evictions": ("counter", "Blocks evicted to make room."),
    "cache_corrupt_blocks": ("counter", "Cached blocks that failed verification and were dropped."),
    "cache_not_admitted": ("counter", "Fetched blocks the eviction policy chose not to cache (read through)."),
    "cache_advice_dropped": ("counter", "Read-ahead advice on cached blocks let go because the adviser's queue was full "
                                        "(a hint: the reader then waits for the disk itself)."),
    "prefetch_queued_bytes": ("gauge", "Bytes of the manifest plan ahead of the prefetch cursor, not yet fetched."),
    "prefetch_lead_seconds": ("gauge", "How long the reader can read from blocks already cached ahead of it."),
    "prefetch_lead_bytes": ("gauge", "Bytes cached contiguously ahead of the reader's manifest position."),
    "prefetch_inflight": ("gauge", "Prefetch fetches in flight."),
    "memory_limit_bytes": ("gauge", "The daemon's memory limit (--memory-limit)."),
    "memory_resident_bytes": ("gauge", "The daemon's resident set."),
    "memory_bytes": ("gauge", "What the daemon holds in memory, by use: demand fetches and fetches ahead in flight, "
                     "blocks kept for readers (recent), small files kept whole, idle buffers (pool)."),
    "memory_throttled_seconds": ("counter", "Time fetches ahead (readahead, prefetch, learned order, warmups) "
                                 "waited for room under --memory-limit; reads are never held back by it."),
    "learned_fetched_bytes": ("counter", "Bytes fetched ahead by an order learned on a plain mount (a job reading a "
                              "directory's files each once, no order handed over)."),
    "learned_used_bytes": ("counter", "Of the bytes fetched ahead by a learned order, those the job then read."),
    "manifest_position": ("gauge", "Index of the reader's current file in the manifest plan."),
    "manifest_files": ("gauge", "Files in the manifest plan (current and queued epochs)."),
    "errors": ("counter", "Errors by kind: errno answered to readers, cache_write / cache_read for failed "
               "cache fills / reads of cached blocks, upload for failed uploads and deletes (retried)."),
    "snapshot_version": ("gauge", "Version of the namespace snapshot being served."),
    "snapshot_objects": ("gauge", "Objects in the namespace snapshot."),
    "meta_reachable": ("gauge", "1 if the metadata store answered the last request, else 0 (serving the loaded snapshot)."),
    "meta_master_since_timestamp_seconds": ("gauge", "A Sentinel-managed store: since when (Unix time) the master "
                                            "named by the address label is the one in use (a failover starts a "
                                            "new series)."),
    "writeback_pending_bytes": ("gauge", "Bytes written through the mount and not yet in the backend (--writeback)."),
    "writeback_pending_files": ("gauge", "Files written through the mount and not yet in the backend."),
    "writeback_oldest_pending_seconds": ("gauge", "How long the oldest closed file not yet in the backend has waited."),
    "writeback_uploaded_bytes": ("counter", "Bytes of written files uploaded to the backend."),
    "writeback_uploaded_files": ("counter", "Written files uploaded to the backend."),
    "passthrough_opens": ("counter", "Opens the kernel read itself from a whole cached file (passthrough): each "
                          "counts in cache_hits once and its object's size in cache_hit_bytes (per open: a reader "
                          "that reads part of a file counts it whole; its reads reach no other daemon series)."),
    "passthrough_opened_bytes": ("counter", "What passthrough opens counted as read from the cache (each open: its "
                                 "object's size)."),
    "passthrough_whole_bytes": ("gauge", "Bytes of the objects whole in the cache, which the kernel may read itself."),
    "passthrough_unchecked_files": ("gauge", "Whole cached files being hashed before the kernel reads them (a change "
                                    "found at open, a machine that stopped uncleanly): read through the daemon."),
    "passthrough_damaged": ("counter", "Cached files found changed (at open) or damaged (by the scrub): read through "
                            "the daemon and refetched."),
    "shared_adopted_bytes": ("counter", "Bytes of objects copied from another mount's cache on this node (same "
                             "content, by ETag, MD5-checked) instead of fetched; read as hits."),
    "shared_adopted_objects": ("counter", "Objects copied from another mount's cache on this node instead of fetched."),
    "shared_refused": ("counter", "Offers of another mount's cache that did not lead to the content they name "
                       "(moved, evicted, or other bytes): fetched instead."),
    "node_cache_bytes": ("gauge", "The node's cache capacity that the mounts sharing it split (the largest "
                         "--cache-size of a live one)."),
    "node_cache_part_bytes": ("gauge", "What this mount may hold of the node's cache now (its fair part)."),
    "node_cache_mounts": ("gauge", "Live mounts sharing the node's cache."),
    "peer_bytes": ("counter", "Block bytes exchanged with members of the cluster cache tier: in (fetched from "
                   "an owner instead of the backend), out (served to a member)."),
    "fetched_bytes": ("counter", "Bytes this node fetched (for readers and ahead of them), by where they came from: "
                      "backend; owner, the block's first owner in the cluster tier (a cache node, or a serving "
                      "peer); replica, another member holding it (asked once the first failed). What readers "
                      "read beyond these came from this node's own cache."),
    "peer_fallbacks": ("counter", "Asks of the cluster tier that failed and went on: to another replica of the block, "
                       "or to the backend."),
    "peer_requests": ("counter", "Block requests of the cluster cache tier by outcome: ok, unavailable, bad, "
                      "declined, busy (asked by this node; busy: the member answered that every connection it has "
                      "is being answered, and was asked again); served, rejected (answered by it)."),
    "peer_closed": ("counter", "Connections this node's peer port closed, by reason: idle, unauthenticated, protocol, "
                    "stalled (its answer moved no byte), evicted (its slot taken by a new connection before it asked), "
                    "reclaimed (a kept-alive connection between requests gave its slot to a new one), busy "
                    "(answered busy), refused (past the busy answers too)."),
    "job_data_wait_seconds": ("counter", "Seconds a training job's rank waited in next() for a batch (epochfs.watch)."),
    "job_compute_seconds": ("counter", "Seconds a training job's rank spent between batches (epochfs.watch)."),
    "job_steps": ("counter", "Batches a training job's rank took (epochfs.watch)."),
    "job_checkpoint_saves": ("counter", "Checkpoint saves a training job's rank timed (epochfs.watch.saving)."),
    "job_checkpoint_save_seconds": ("counter", "Seconds those saves took, as the job saw them."),
    "job_gpu_utilization": ("gauge", "GPU utilisation (percent) a training job's rank reported last, where known."),
    "peer_out_from_files_bytes": ("counter", "Of the block bytes served to members (peer_bytes out), those the kernel "
                                  "sent from the cache's files (sendfile): never read by the daemon."),
    "peer_members": ("gauge", "Live members of the cluster cache tier this node sees, itself included."),
    "peer_store_reachable": ("gauge", "1 if the shared store answered this node's last heartbeat of the cluster tier, "
                             "else 0 (keeping its last member list; status says why, a refused password included)."),
    "peer_refusing_members": ("gauge", "Members of the cluster cache tier that refuse this node's peer token (their "
                              "answers HTTP 401: a token not the cluster's, or clocks far apart): what they own is "
                              "read from the backend instead. Above 0 fires EpochfsPeerTokenRefused."),
    "backend_link_busy_seconds": ("counter", "Seconds during which bytes were arriving on the link to the backend (a "
                                  "body moving; waiting for the first byte not counted): its rate is the share of "
                                  "the time the link carried data, whatever its capacity (near 1: the link is the bound)."),
    "peer_link_busy_seconds": ("counter", "Seconds during which this node was sending block bytes to members (its "
                               "rate: the share of the time its link carried them)."),
    "peer_link_capacity_bytes": ("gauge", "This node's network link for the cluster tier, bytes/s, labelled by where "
                                 "it is known from: declared (--link-capacity), interface (the speed or shaping of "
                                 "the interface of its peer address), or measured (from its sends while they kept "
                                 "it busy): what the tier sends is measured against it (absent where none is known)."),
    "cache_node": ("gauge", "1 on a dedicated cache node (epochfs serve): its series' mountpoint label names "
                   "its cache node group, serve:<dataset>."),
    "peer_share_bytes": ("gauge", "Bytes of the dataset this node owns in the cluster tier (replicas included; "
                         "estimated from a sample of a large dataset's blocks), on a node that keeps only the "
                         "blocks it owns (a cache node, --peer-cache owned): above cache_capacity_bytes, it evicts "
                         "blocks it owns and members that ask for them cost backend reads again."),
}


@dataclass(frozen=True)
class Sample:
    """The daemon's series, as plain values."""

    values: dict[str, float]  # unlabelled series by short name
    backend_requests: dict[tuple[str, str], int]
    backend_bytes: dict[str, int]
    errors: dict[str, int]
    histograms: dict[str, HistogramSnapshot]
    peer_bytes: dict[str, int] | None = None
    peer_requests: dict[str, int] | None = None
    jobs: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)  # series -> (job, rank) -> value
    links: dict[str, dict[str, float]] = field(default_factory=dict)  # series -> source -> capacity
    fetched: dict[str, int] = field(default_factory=dict)  # origin -> bytes
    peer_fallbacks: dict[str, int] | None = None
    peer_closed: dict[str, int] | None = None
    meta_master: dict[str, float] = field(default_factory=dict)  # address -> since (a Sentinel store)
    memory: dict[str, float] = field(default_factory=dict)  # use -> bytes held


def sample_of(c: Collected) -> Sample:
    """The one mapping from component statistics to series names."""
    cache, store, pf, snap = c.cache, c.store, c.prefetch, c.snapshot
    values: dict[str, float] = {
        "cache_hits": cache.hits, "cache_misses": cache.misses,
        "cache_hit_bytes": cache.hit_bytes, "cache_miss_bytes": cache.miss_bytes,
        "kernel_pushed_bytes": cache.pushed_bytes, "kernel_push_failures": cache.push_failures,
        "cache_used_bytes": store.used_bytes, "cache_capacity_bytes": store.capacity_bytes,
        "cache_blocks": store.blocks, "cache_evictions": store.evictions,
        "cache_corrupt_blocks": store.corrupt_blocks, "cache_not_admitted": store.not_admitted,
        "cache_advice_dropped": store.advice_dropped, "prefetch_queued_bytes": pf.queued_bytes, "prefetch_lead_bytes": pf.lead_bytes,
        "prefetch_lead_seconds": pf.lead_seconds or 0.0, "prefetch_inflight": pf.inflight,
        "manifest_position": pf.file_position, "manifest_files": pf.files,
        "snapshot_version": snap.version, "snapshot_objects": snap.objects,
        "meta_reachable": 1.0 if snap.reachable else 0.0,
        "isatty_requests": c.fs.isatty_asks,
    }
    links = {short: {view.capacity.source: view.capacity.bytes_per_second}
             for short, view in (("backend_bandwidth_limit_bytes", c.backend_link),
                                 ("peer_link_capacity_bytes", c.peer_link)) if view is not None and view.capacity}
    for short, view in (("backend_link_busy_seconds", c.backend_link), ("peer_link_busy_seconds", c.peer_link)):
        if view is not None:
            values[short] = view.busy_seconds
    errors = dict(c.fs.errors)
    errors["cache_write"] = store.fill_errors
    errors["cache_read"] = store.read_errors
    wb = c.writeback
    if wb is not None:
        values.update({
            "writeback_pending_bytes": wb.pending_bytes, "writeback_pending_files": wb.pending_files,
            "writeback_oldest_pending_seconds": wb.oldest_pending_seconds,
            "writeback_uploaded_bytes": wb.uploaded_bytes, "writeback_uploaded_files": wb.uploaded_files,
        })
        errors["upload"] = wb.upload_errors
    memory: dict[str, float] = {}
    if c.memory is not None:
        values.update({"memory_limit_bytes": c.memory.limit, "memory_resident_bytes": c.resident_bytes,
                       "memory_throttled_seconds": cache.throttled_seconds})
        memory = {"demand": cache.demand_inflight_bytes, "ahead": cache.ahead_bytes, "recent": cache.recent_bytes,
                  "whole": cache.whole_bytes, "pool": c.pool_bytes}
    if c.learned is not None:
        values.update({"learned_fetched_bytes": c.learned.fetched_bytes, "learned_used_bytes": c.learned.used_bytes})
    pt = c.passthrough
    if pt is not None:
        values.update({"passthrough_opens": pt.opens, "passthrough_opened_bytes": pt.bytes_opened,
                       "passthrough_whole_bytes": pt.whole_bytes, "passthrough_unchecked_files": pt.unchecked,
                       "passthrough_damaged": pt.damaged})
    if c.node_cache is not None:
        values.update({"node_cache_bytes": c.node_cache.node_bytes, "node_cache_part_bytes": c.node_cache.part_bytes,
                       "node_cache_mounts": c.node_cache.members})
    if c.shared is not None:
        values.update({"shared_adopted_bytes": c.shared.adopted_bytes, "shared_adopted_objects": c.shared.adopted_objects,
                       "shared_refused": c.shared.refused})
    histograms = {"read_seconds": c.fs.read_seconds}
    if c.backend.request_seconds is not None:
        histograms["backend_request_seconds"] = c.backend.request_seconds
    peer = c.peer
    if peer is not None:
        values["peer_members"] = len(peer.members)
        values["peer_out_from_files_bytes"] = peer.bytes_out_from_files
        values["peer_refusing_members"] = len(peer.refusing)
        values["peer_store_reachable"] = 1.0 if peer.store_reachable else 0.0
        if peer.role == "server":
            values["cache_node"] = 1
        if peer.share_bytes is not None:  # (ranked only where the node keeps only what it owns)
            values["peer_share_bytes"] = peer.share_bytes
    jobs: dict[str, dict[tuple[str, str], float]] = {}
    for j in c.jobs:
        key = (j.job, str(j.rank))
        jobs.setdefault("job_data_wait_seconds", {})[key] = j.data_wait_seconds
        jobs.setdefault("job_compute_seconds", {})[key] = j.compute_seconds
        jobs.setdefault("job_steps", {})[key] = j.steps
        jobs.setdefault("job_checkpoint_saves", {})[key] = j.saves
        jobs.setdefault("job_checkpoint_save_seconds", {})[key] = j.save_seconds
        if j.gpu_utilization is not None:
            jobs.setdefault("job_gpu_utilization", {})[key] = j.gpu_utilization
    return Sample(values, c.backend.requests, {"demand": cache.demand_bytes, "prefetch": cache.prefetch_bytes},
                  errors, histograms,
                  peer_bytes={"in": peer.bytes_in, "out": peer.bytes_out} if peer else None,
                  peer_requests=dict(peer.requests) if peer else None, jobs=jobs, links=links,
                  fetched={"backend": cache.demand_bytes + cache.prefetch_bytes,
                           **({"owner": cache.peer_bytes - cache.replica_bytes, "replica": cache.replica_bytes}
                              if peer else {})},
                  peer_fallbacks=dict(peer.fallbacks or {}) if peer else None,
                  peer_closed=dict(peer.closed) if peer and peer.closed is not None else None,
                  meta_master={snap.master: snap.master_since or 0.0} if snap.master else {}, memory=memory)


class DaemonCollector(Collector):
    """Every series of one mount, each labelled ``node`` (the same for every mount of a node, whatever
    port it serves on) and ``mountpoint`` (which of the node's mounts)."""

    def __init__(self, collect: Callable[[], Collected], mountpoint: str, node: str) -> None:
        self._collect = collect
        self._mountpoint = mountpoint
        self._node = node

    def _family(self, short: str, labels: list[str]) -> Metric:
        kind, help_text = METRICS[short]
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        return cls(PREFIX + short, help_text, labels=["node", "mountpoint", *labels])

    def collect(self) -> Iterator[Metric]:
        s = sample_of(self._collect())
        node, mp = self._node, self._mountpoint
        for short, value in s.values.items():
            fam = self._family(short, [])
            fam.add_metric([node, mp], value)
            yield fam
        labelled = [("backend_requests", ["op", "outcome"], s.backend_requests.items()),
                    ("backend_bytes", ["purpose"], s.backend_bytes.items()), ("errors", ["kind"], s.errors.items())]
        labelled.append(("fetched_bytes", ["source"], s.fetched.items()))
        if s.peer_bytes is not None and s.peer_requests is not None:
            labelled += [("peer_bytes", ["direction"], s.peer_bytes.items()),
                         ("peer_requests", ["outcome"], s.peer_requests.items()),
                         ("peer_fallbacks", ["to"], (s.peer_fallbacks or {}).items())]
        if s.peer_closed is not None:
            labelled.append(("peer_closed", ["reason"], s.peer_closed.items()))
        labelled += [(short, ["training_job", "rank"], series.items()) for short, series in s.jobs.items()]
        labelled += [(short, ["source"], series.items()) for short, series in s.links.items()]
        if s.memory:
            labelled.append(("memory_bytes", ["use"], s.memory.items()))
        if s.meta_master:
            labelled.append(("meta_master_since_timestamp_seconds", ["address"], s.meta_master.items()))
        for short, label, series in labelled:
            fam = self._family(short, label)
            for key, n in sorted(series):
                fam.add_metric([node, mp, *(key if isinstance(key, tuple) else (key,))], n)
            yield fam
        for short, h in s.histograms.items():
            cumulative, buckets = 0, []
            for bound, n in zip((*h.bounds, float("inf")), h.counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            fam = HistogramMetricFamily(PREFIX + short, METRICS[short][1], labels=["node", "mountpoint"])
            fam.add_metric([node, mp], buckets=buckets, sum_value=h.total)
            yield fam


class TargetFile:
    """This mount's entry in Prometheus file-based service discovery: ``DIR/epochfs-<hash>.json``,
    ``[{"targets": ["HOST:PORT"], "labels": {"node": ..., "mountpoint": ...}}]``, written atomically
    once the port is known and removed at unmount, so a scrape job over ``DIR/*.json`` finds every
    mount of the node, one file per daemon. A restart of the same mount replaces its file; a mount that died and was not
    restarted leaves a target that is down (``up == 0``), which is what it is. Never fails the mount:
    a directory that cannot be used is logged and skipped."""

    def __init__(self, directory: Path, mountpoint: str, node: str, daemon: str = "") -> None:
        self.directory = directory
        self.mountpoint = mountpoint
        self.node = node
        # Named for the daemon (its cache directory, one daemon per directory): two cache nodes of one
        # dataset on one host share the mountpoint label and must not share a file.
        name = mountpoint if not daemon else f"{mountpoint}\0{daemon}"
        self.path = directory / f"epochfs-{hashlib.sha256(name.encode()).hexdigest()[:16]}.json"
        self.written = False

    def write(self, host: str, port: int) -> None:
        if host in ("0.0.0.0", "::", ""):  # every interface: the scraper knows the node by its name
            host = socket.gethostname()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        body = json.dumps([{"targets": [address], "labels": {"node": self.node, "mountpoint": self.mountpoint}}])
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            st = os.stat(self.directory)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise OSError(errno.EPERM, "another user could write there")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                data = memoryview(body.encode() + b"\n")
                while data:
                    data = data[os.write(fd, data):]
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("metrics: cannot write the Prometheus target %s (%s): a scrape job over that directory "
                        "will not find this mount", self.path, exc.strerror or exc)
            return
        self.written = True
        log.info("metrics: Prometheus target %s written (%s)", self.path, address)

    def remove(self) -> None:
        if self.written:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.written = False


DEFAULT_ADDR = "127.0.0.1:9567"


def parse_addr(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[v6]:PORT`` too) or ``off`` -> (host, port) or None."""
    if text.strip().lower() == "off":
        return None
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--metrics-addr {text!r}: expected HOST:PORT (e.g. 127.0.0.1:9567) or off")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsServer:
    """A minimal HTTP server for ``GET /metrics`` on the trio loop."""

    #: With the default address, ports tried after the default one when it is taken (another mount).
    FALLBACK_PORTS = 100

    def __init__(self, host: str, port: int, collect: Callable[[], Collected], mountpoint: str, *,
                 node: str = "localhost", fallback: bool = False, targets: Path | None = None,
                 daemon: str = "") -> None:
        self.host, self.port = host, port
        self.fallback = fallback
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(collect, mountpoint, node))
        self.target = TargetFile(targets, mountpoint, node, daemon) if targets is not None else None
        self._slots = Slots(MAX_CONNECTIONS)  # earned by a complete request

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def _listen(self) -> list[trio.SocketListener]:
        """Listen on the address; with the default one, on the next free port when it is taken."""
        wanted = self.port
        tries = self.FALLBACK_PORTS if self.fallback and wanted else 1
        for port in range(wanted, min(wanted + tries, 65536)):
            try:
                listeners = await trio.open_tcp_listeners(port, host=self.host)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE and port + 1 < wanted + tries:
                    continue
                hint = " (the default port and the next ones are taken)" if tries > 1 else ""
                raise ConfigError(f"--metrics-addr {self.host}:{port}: {exc.strerror}{hint}; choose another "
                                  "HOST:PORT or 'off'") from None
            if port != wanted:
                log.warning("metrics port %d is taken (another mount?); serving metrics at %s:%d instead",
                            wanted, self.host, port)
            return listeners
        raise AssertionError("unreachable")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await self._listen()
        self.port = listeners[0].socket.getsockname()[1]
        if not is_loopback(self.host):
            log.warning("metrics are exposed on %s:%d (not loopback): anyone who can reach it can read them",
                        self.host, self.port)
        log.info("metrics at http://%s:%d/metrics", self.host, self.port)
        if self.target is not None:
            self.target.write(self.host, self.port)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                await trio.serve_listeners(self._serve, listeners, handler_nursery=nursery)
        finally:
            if self.target is not None:
                self.target.remove()

    async def _serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            slot = self._slots.take()
            try:
                with slot.scope:
                    await self._answer(stream, slot)
            finally:
                self._slots.release(slot)

    async def _answer(self, stream: trio.SocketStream, slot: Slot) -> None:
        try:
            with trio.fail_after(REQUEST_TIMEOUT):
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 16384:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return
                    head += chunk
            if not self._slots.earn(slot):  # a whole request: no new connection takes this slot now
                return  # every slot is answering a scrape: closed at once, so they cannot eat our descriptors
            with trio.fail_after(10):
                parts = head.split(b"\r\n", 1)[0].split()
                if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
                    await self._reply(stream, 405, b"method not allowed\n", "text/plain")
                elif parts[1].split(b"?")[0] in (b"/metrics", b"/"):
                    body = self.render()
                    slot.sending = True  # (a client that does not read its page gives up its slot to the next)
                    await self._reply(stream, 200, body if parts[0] == b"GET" else b"", CONTENT_TYPE, len(body))
                else:
                    await self._reply(stream, 404, b"not found; try /metrics\n", "text/plain")
        except (trio.TooSlowError, trio.BrokenResourceError, OSError):
            return
        except Exception:  # a scrape never takes the daemon down
            log.exception("metrics: unexpected error answering a scrape")

    @staticmethod
    async def _reply(stream: trio.SocketStream, status: int, body: bytes, ctype: str, length: int | None = None) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[status]
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n")
        await stream.send_all(head.encode() + body)

