"""Composition root: builds every service of a mount, runs them in one trio nursery, tears them down.

Order of start-up: clear a dead FUSE mount left by a crashed daemon; raise the descriptor limit; open
the backend; lock and open the block store; load the namespace snapshot (or list the source); mount;
start the cache service, the prefetcher, the snapshot lifecycle, the control channel and the metrics
endpoint; answer the first request through the mount; then report ready. Tear-down runs in reverse on
SIGINT/SIGTERM or an external unmount (``epochfs umount``, ``fusermount3 -u``). The process around it
(open, mount, run, close, the exit code) is :mod:`epochfs.daemon.process`.

Nothing else lives here: requests are answered in :mod:`epochfs.control.handlers`, the snapshot's
lifecycle is :mod:`epochfs.meta.snapshots`, statistics become series in :mod:`epochfs.daemon.metrics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import grp
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

import trio

from epochfs import kernel
from epochfs.backend import BackendSettings, open_backend
from epochfs.blockstore.store import BlockStore
from epochfs.cache.nodeshare import NodeShare
from epochfs.cache.passthrough import Passthrough, small_files
from epochfs.cache.push import Pusher
from epochfs.cache.service import BlockCache, CacheSettings
from epochfs.cache.shared import join_node
from epochfs.control import CONTROL_XATTR, PID_XATTR, frames
from epochfs.control.caller import caller_of
from epochfs.control.collected import Collected
from epochfs.control.handlers import ControlHandlers, MountInfo, UserBounds
from epochfs.control.inmount import MountChannel
from epochfs.control.jobs import Jobs
from epochfs.control.server import ControlServer, socket_path
from epochfs.core import memory
from epochfs.core.errors import AccessDenied, BackendUnavailable, ConfigError, EpochfsError
from epochfs.core.records import ObjectInfo
from epochfs.core.stats import read_origins
from epochfs.daemon import host as node_host
from epochfs.daemon.config import Config
from epochfs.daemon.metrics import DEFAULT_ADDR, MetricsServer, parse_addr
from epochfs.daemon.startup import startup_warnings
from epochfs.eviction import make_policy
from epochfs.links import interface
from epochfs.links.watch import Link, LinkWatch
from epochfs.meta import open_meta
from epochfs.meta.namespace import Namespace
from epochfs.meta.snapshots import Snapshots, SnapshotSettings
from epochfs.meta.vouched import Vouched
from epochfs.pack.listing import dataset_listing
from epochfs.peer import share
from epochfs.peer.client import PeerClient
from epochfs.peer.load import TierLoad
from epochfs.peer.members import Membership
from epochfs.peer.server import PeerServer
from epochfs.peer.tier import PeerAnswers, PeerStats, PeerTier
from epochfs.peer.wire import Keys, load_token, split_addr
from epochfs.prefetch.learned import Learner, LearnSettings, Observers
from epochfs.prefetch.scheduler import Prefetcher, PrefetchSettings
from epochfs.transport.buffers import pool_statistics
from epochfs.vfs.fs import Operations
from epochfs.vfs.presentation import Presentation
from epochfs.vfs.seams import KernelPages
from epochfs.writeback.journal import Journal
from epochfs.writeback.service import WriteBack, WritebackSettings
from epochfs.writeback.tree import Overlay, Tree

log = logging.getLogger(__name__)

# Called once: (None, warnings) when mounted (things the user should know: an empty source, say), else
# (the error message, []).
Ready = Callable[[str | None, Sequence[str]], None]
ACCESS_CHECK_SECONDS = 10.0  # how long a mount waits for the backend to say whether it serves it


class Daemon:
    """All services of one mount."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._stopped: trio.Event | None = None  # a cache node's: set to stop it
        self._link_sample: tuple[float, int] | None = None  # (when, bytes served) at the last heartbeat
        # Read-only mounts open files with no request; each inode number is then one version of a file.
        # (Where the kernel reads cached files itself, opens are answered: see vfs/fs.py.)
        self.zero_open = not config.open_requests and not config.writeback and not config.serving
        # A malformed address fails before the cache is locked.
        metrics_addr = parse_addr(config.metrics_addr or DEFAULT_ADDR)
        with contextlib.ExitStack() as opened:  # a part that fails to open closes those opened before it
            self._open(config, metrics_addr, opened)
            self._opened = opened.pop_all()

    def _open(self, config: Config, metrics_addr: tuple[str, int] | None, opened: contextlib.ExitStack) -> None:
        self.backend = open_backend(BackendSettings(
            config.source, endpoint_url=config.endpoint_url, region=config.region, timeout=config.backend_timeout,
            attempts=config.backend_attempts, concurrency=config.backend_concurrency, profile=config.profile))
        opened.callback(self.backend.close)
        unreachable = self._check_access(config)
        self.store = BlockStore(config.cache_dir, config.cache_size, config.free_space_ratio,
                                make_policy(config.eviction))
        self.store.open()
        opened.callback(self.store.close)
        meta = open_meta(config.meta, config.cache_dir, config.meta_name, config.store_access())
        if meta.shared and not meta.trusted:
            log.warning("the shared store %s is not authenticated (no --meta-password-file): owners and modes "
                        "are taken from the bucket's attribute records only, and an entry whose owner and mode "
                        "only the store holds (a file:// source, a pack of one) is presented to the mount's owner "
                        "only", meta.url)
            meta = Vouched(meta, self.backend.attribute_records)
        with contextlib.ExitStack() as loading:
            loading.callback(meta.close)
            self.snapshots = Snapshots(meta, SnapshotSettings(
                source_id=self.backend.source_id, cache_dir=config.cache_dir, refresh=config.refresh,
                ttl=config.snapshot_ttl, poll=config.meta_poll, name=config.meta_name,
                renumber_changed=self.zero_open,
            ), functools.partial(dataset_listing, self.backend, writable=config.writeback), on_switch=self._switch)
            loading.pop_all()  # the snapshots own the store now
        opened.callback(self.snapshots.close)
        self.journal: Journal | None = None
        self.writeback: WriteBack | None = None
        self.peer: PeerTier | None = None
        self.peer_server: PeerServer | None = None
        self.tier_load: TierLoad | None = None
        if config.peer_listen or config.peer_role == "client" or config.serving:
            self._open_peer()
        held = memory.resident()
        if config.io_uring:  # (the ring's entry buffers, made once INIT is answered: set aside first)
            from epochfs.kernel import session, uring

            held += uring.memory_needed(session.request_pages() * session.PAGE)
        try:  # (what the daemon holds now is its baseline: the limit's shares are of the rest)
            self.memory = memory.split(config.memory_limit or memory.default_limit(), held,
                                       config.block_size, config.backend_concurrency)
        except memory.MemoryTooSmall as exc:
            raise ConfigError(str(exc)) from None
        self.cache = BlockCache(self.store, self.backend, CacheSettings(
            memory=self.memory, block_size=config.block_size, concurrency=config.backend_concurrency,
            readahead_blocks=config.readahead_blocks, plan_concurrency=config.prefetch_concurrency,
            fetch_timeout=config.backend_timeout + 2.0 + (config.peer_timeout if self.peer else 0.0),
        ), source=self.peer)
        self.node: NodeShare | None = None
        if config.shared_dir() is not None and self.peer is None:  # (the node's cache: cache/shared.py)
            self.cache.shared, self.node = join_node(
                config.shared_dir(), self.store, self.backend.content_scope(), config.block_size,
                self.cache.block_id, opened, content=not meta.shared)
        self.share: share.ShareWatch | None = None
        if self.peer is not None and self.peer.members.role != "client":
            self._serve_peers()
            if self.peer.mode == "owned":  # (the only nodes whose share is at stake)
                self.share = share.ShareWatch(self.peer, lambda: self.snapshots.namespace,
                                              lambda: self.snapshots.snapshot.version, self.backend.source_id,
                                              config.block_size, self.store.bound)
        self.prefetcher = Prefetcher(self.cache, PrefetchSettings(
            capacity=config.cache_size, max_inflight=config.prefetch_concurrency,
            bandwidth=config.prefetch_bandwidth, lead=config.prefetch_lead))
        self.learner = Learner(self.cache, lambda: self.snapshots.namespace, LearnSettings(
            capacity=config.cache_size, max_inflight=config.prefetch_concurrency,
            enabled=not config.no_learned_order and not config.serving,
            user_share=UserBounds.share(config.user_share, config.cache_size).warmup_bytes),
            held=self.prefetcher.holds_order, first_byte=lambda: self.backend.statistics().first_byte_seconds,
            presented=lambda node: self.ops.presented(node))
        self.cache.wire(observer=Observers(self.prefetcher, self.learner))
        self.passthrough: Passthrough | None = None
        if config.kernel_reads:
            packing = self.store.packing
            self.passthrough = Passthrough(self.cache, lambda: self.session, scrub_every=config.passthrough_scrub,
                                           on_off=lambda: setattr(self.store, "packing", packing))
            why = None if config.passthrough else small_files(f.obj for f in self.snapshots.namespace.files())
            if os.geteuid() != 0:
                self.passthrough.off("the daemon is not root (the kernel registers backing files only for "
                                     "CAP_SYS_ADMIN)")
            elif why is not None:
                self.passthrough.off(why)
            else:
                self.store.packing = False  # (a small object in a pack cannot be a backing file)
                opened.callback(self.passthrough.close)  # (its descriptors, before the store closes)
        self.links = self._watch_links()
        self.tree = Tree(self.snapshots.namespace, Overlay() if config.writeback else None)
        if config.writeback:
            self._open_writeback(opened)
        self.metrics = MetricsServer(*metrics_addr, self.collect, config.instance(), node=config.node_name(),
                                     fallback=config.metrics_addr is None,
                                     targets=config.targets_dir(), daemon=str(config.cache_dir)) if metrics_addr else None
        info = MountInfo(
            source=config.source.url, mountpoint=config.instance(), cache_dir=str(config.cache_dir),
            block_size=config.block_size, eviction=self.store.policy.name, started=time.time(),
            metrics_addr=lambda: f"{self.metrics.host}:{self.metrics.port}" if self.metrics else None,
            node=config.node_name(), backend_concurrency=config.backend_concurrency,
            readahead_blocks=config.readahead_blocks, options=advice_options(config),
        )
        self.jobs = Jobs()
        handlers = ControlHandlers(info=info, collect=self.collect, snapshots=self.snapshots,
                                   prefetcher=self.prefetcher, writeback=self.writeback, jobs=self.jobs,
                                   presented=lambda node: self.ops.presented(node),
                                   bounds=UserBounds.share(config.user_share, config.cache_size),
                                   held=self.cache.shared.held if self.cache.shared else None)
        self.control = ControlServer(socket_path(config.cache_dir), handlers.table(),
                                     control_group=config.control_group)
        self.channel = MountChannel(self.control.serve_stream,
                                    lambda uid, gid, pid: caller_of(uid, gid, pid, config.control_group))
        self.ops = Operations(
            self.snapshots.namespace, self.cache, attr_timeout=config.attr_timeout,
            root_xattrs={
                CONTROL_XATTR.encode(): lambda: str(self.control.path).encode(),
                PID_XATTR.encode(): lambda: str(os.getpid()).encode(),
                b"user.epochfs.snapshot": lambda: str(self.snapshots.snapshot.version).encode(),
            },
            presentation=Presentation(writable=config.writeback, file_mode=config.file_mode,
                                      dir_mode=config.dir_mode, uid=config.uid, gid=config.gid,
                                      root_mode=0o1777 if config.writeback and config.allow_other else None),
            tree=self.tree, writeback=self.writeback, zero_open=self.zero_open, passthrough=self.passthrough,
            control=ChannelFile(self.channel),
        )
        if config.push_ahead:
            self.cache.wire(pusher=Pusher(self.cache, KernelPages(self.ops), ahead=config.push_ahead))
        self.warnings = startup_warnings(config, self.snapshots.snapshot.objects)
        if unreachable is not None:
            self.warnings.append(f"{config.source.url} does not answer ({unreachable}): serving the stored snapshot "
                                 f"version {self.snapshots.snapshot.version}; what is not cached fails to read (EIO) "
                                 "until it answers")

    def _check_access(self, config: Config) -> str | None:
        """Fail now if the source refuses this mount (wrong secret, unknown key, no access to the bucket,
        no bucket, not an S3 endpoint), even with a snapshot stored; say why if it does not answer (a
        stored snapshot is then served). A cache node and a write-back mount ask too."""
        answer: list[BaseException | None] = []
        asked = threading.Thread(target=lambda: answer.append(_raised(self.backend.check_access)), daemon=True,
                                 name="epochfs-check-access")
        asked.start()
        asked.join(ACCESS_CHECK_SECONDS)  # (an endpoint that does not answer is not waited for past this)
        try:
            if not answer:
                raise BackendUnavailable(f"no answer within {ACCESS_CHECK_SECONDS:g} s")
            if answer[0] is not None:
                raise answer[0]
        except BackendUnavailable as exc:
            return str(exc)
        except AccessDenied as exc:
            if exc.policy and config.meta:  # (nodes that read a published snapshot may be allowed reads only)
                log.warning("%s: listing is refused (%s); reads will say whether the credentials may read",
                            config.source.url, exc)
                return None
            raise ConfigError(f"{config.source.url}: the backend refuses this mount: {exc}") from None
        return None

    def _open_peer(self) -> None:
        """The cluster cache tier's block source and its membership in the shared store (the cache is
        built on it)."""
        config = self.config
        assert config.peer_token_file is not None
        keys = Keys(load_token(config.peer_token_file))
        client = PeerClient(keys, config.peer_timeout)
        role = "server" if config.serving else config.peer_role
        members = Membership(self.snapshots.store, self.backend.source_id,
                             config.peer_advertise or config.peer_listen or "client",
                             prove=lambda member: client.hello(member, min(2.0, config.peer_timeout)), role=role,
                             stats=self._member_stats, capacity=config.cache_size,
                             session=f"{config.node_name()}:{config.mountpoint}" if role == "client" else None)
        self.peer = PeerTier(self.backend, members, client, mode=config.peer_cache, replicas=config.replicas)
        self.tier_load = None if role == "server" else TierLoad(
            self.snapshots.store, self.backend.source_id,
            lambda: tuple(m for m in members.ring.members if m != members.me))

    def _watch_links(self) -> LinkWatch:
        """The links measured against a capacity: the one to the backend (the endpoint's route here),
        and a serving member's own (the interface of its peer address)."""
        config, peer = self.config, self.backend.link_peer()
        links = {"backend": Link("backend link", "--backend-bandwidth", config.backend_bandwidth,
                                 self.backend.transfers(),
                                 functools.partial(interface.towards, *peer) if peer else None)}
        if self.peer_server is not None:
            host = (split_addr(config.peer_advertise, any_port=True) or ("",))[0] if config.peer_advertise else ""
            host = host or self.peer_server.host or "0.0.0.0"
            links["peer"] = Link("peer link", "--link-capacity", config.link_capacity, self.peer_server.sends,
                                 functools.partial(interface.holding, host.strip("[]")))
        return LinkWatch(links)

    def _member_stats(self) -> bytes:
        """What this member publishes of itself at each heartbeat (``epochfs cluster status``): its role,
        what it holds and has served, its link's utilisation since the last heartbeat, and what sizes its
        share (the blocks it keeps, their size, the replicas)."""
        assert self.peer is not None
        now, out = time.monotonic(), self.peer_server.stats.served_bytes if self.peer_server else 0
        then, before = self._link_sample or (now, out)
        rate = (out - before) / (now - then) if now > then else 0.0
        self._link_sample = (now, out)
        st, link = self.store.statistics(), self.links.view("peer")
        capacity = link.capacity.bytes_per_second if link and link.capacity else None
        reads = read_origins(self.cache.statistics())
        return json.dumps({
            "mountpoint": str(self.config.mountpoint) if self.config.mountpoint else None,
            "tier_bytes": reads["owner"] + reads["replica"], "backend_bytes": reads["backend"],
            "local_bytes": reads["local"],
            "role": self.peer.members.role, "node": self.config.node_name(), "held_bytes": st.used_bytes,
            "capacity_bytes": st.capacity_bytes, "cache_size": self.config.cache_size, "served_bytes": out,
            "out_bytes_per_second": rate,
            "link_capacity": capacity, "link_source": link.capacity.source if link and link.capacity else None,
            "utilization": rate / capacity if capacity else None,
            "down": list(self.peer.members.down()), "snapshot": self.snapshots.snapshot.version,
            "replicas": self.config.replicas, "mode": self.peer.mode, "block_size": self.config.block_size,
            "updated": time.time()}).encode()

    def _serve_peers(self) -> None:
        """The peer port, answering other members from the cache."""
        assert self.peer is not None and self.config.peer_listen is not None
        host, port = split_addr(self.config.peer_listen, any_port=True) or ("", 0)
        members = self.peer.members
        answers = PeerAnswers(self.cache, lambda: self.snapshots.namespace)
        self.store.digests = True  # (each block hashed at fill: its answers are sent from its file)
        self.peer_server = PeerServer(host, port, self.peer.client.keys, lambda: members.me, answers.serve,
                                      capacity=self.config.cache_size)

    def _open_writeback(self, opened: contextlib.ExitStack) -> None:
        """The write-back journal and service; what an earlier run left owed is taken up before the mount
        answers."""
        if not self.backend.writable:
            raise ConfigError(f"--writeback: {self.config.source.url} cannot be written")
        self.journal = Journal(self.config.cache_dir)
        opened.callback(self.journal.close)
        self.writeback = WriteBack(
            self.journal, self.store, self.backend, self.tree, WritebackSettings(
                upload_bandwidth=self.config.upload_bandwidth, upload_concurrency=self.config.upload_concurrency,
                user_quota=self.config.writeback_user_quota),
            demand_waiting=self.cache.demand_waiting, publish=self.snapshots.apply, keep=self.cache.uploads,
            kernel=(lambda: self.session) if self.config.kernel_writes else None)
        if self.writeback.kernel is not None and os.geteuid() != 0:
            self.writeback.kernel.off("the daemon is not root (the kernel registers backing files only for "
                                      "CAP_SYS_ADMIN)")
        opened.callback(self.writeback.close)
        self.writeback.recover()

    @property
    def session(self) -> kernel.Session | None:
        return self.ops.session

    def fuse_options(self) -> set[str]:
        # The source as findmnt and df show it (commas and backslashes escaped for libfuse's option parser).
        fsname = self.config.source.url.rstrip("/").replace("\\", "\\\\").replace(",", "\\,")
        opts = {"default_permissions", f"fsname={fsname}", "subtype=epochfs", "noatime", "nosuid", "nodev"}
        if not self.config.writeback:
            opts.add("ro")
        if self.config.allow_other:
            opts.add("allow_other")
        opts.update(self.config.fuse_options)
        if self.config.debug:
            opts.add("debug")
        return opts

    def collect(self) -> Collected:
        """Every component's statistics, read on the trio thread."""
        return Collected(cache=self.cache.statistics(), store=self.store.statistics(),
                         backend=self.backend.statistics(), fs=self.ops.statistics(),
                         prefetch=self.prefetcher.statistics(), learned=self.learner.statistics(),
                         memory=self.memory, resident_bytes=memory.resident(), pool_bytes=pool_statistics()[1],
                         snapshot=self.snapshots.statistics(),
                         backend_link=self.links.view("backend"),
                         writeback=self.writeback.statistics() if self.writeback else None,
                         peer=self._peer_statistics(), jobs=self.jobs.statistics(),
                         passthrough=self.passthrough.statistics() if self.passthrough else None,
                         peer_link=self.links.view("peer"),
                         shared=self.cache.shared.statistics() if self.cache.shared else None,
                         node_cache=self.node.statistics() if self.node else None)

    def _peer_statistics(self) -> PeerStats | None:
        if self.peer is None:
            return None
        link = self.links.view("peer")
        stats = self.peer.statistics(self.peer_server.stats if self.peer_server else None,
                                     (self.share.owned, self.share.total) if self.share else (None, None),
                                     link.capacity.bytes_per_second if link and link.capacity else None)
        return dataclasses.replace(stats, load=self.tier_load.statistics()) if self.tier_load else stats

    async def _switch(self, namespace: Namespace, entries: list[tuple[int, bytes]], inodes: list[int]) -> None:
        """A new snapshot is being served: the adapter takes its tree, the kernel forgets what changed."""
        self.ops.switch(namespace, inodes)
        if self.session is not None:
            await trio.to_thread.run_sync(_invalidate, self.session, entries, inodes)

    def _terminate(self) -> None:
        if self.session is not None:
            self.session.terminate()
        if self._stopped is not None:
            self._stopped.set()

    HANDOVER_SECONDS = 60.0  # what a cache node that leaves spends at most handing its share over

    async def _hand_over(self) -> None:
        """A cache node told to stop: the blocks it holds go to their next owners (they take them from
        it while it still serves), then it leaves."""
        assert self.peer is not None
        deadline = time.monotonic() + self.HANDOVER_SECONDS
        done, failed = await trio.to_thread.run_sync(
            share.hand_over, self.peer, self.snapshots.namespace, self.cache.block_id, self.config.block_size,
            lambda bid: self.store.lookup(bid) is not None, deadline, abandon_on_cancel=True)
        if done or failed:
            log.info("handed %d blocks over to their next owners (%d not: they are fetched on demand)", done, failed)

    REBALANCE_ROUNDS = 3  # fills of a joining node's share while the members it sees change, or blocks failed

    async def _rebalance(self) -> None:
        """A cache node that joins with --rebalance: fill its share now (from the other cache nodes, then
        the backend), not as it is asked."""
        assert self.peer is not None
        tier, members = self.peer, self.peer.members
        with trio.move_on_after(3 * members.HEARTBEAT + 2):  # until the others are proven (or failed)
            while len(members.ring) < 2 or not members.settled():  # noqa: ASYNC110 - proofs run in threads
                await trio.sleep(0.2)

        def mine() -> list[tuple[ObjectInfo, int]]:
            return [(obj, index) for obj, index, _, bid in share.blocks(self.snapshots.namespace, self.cache.block_id,
                                                                        self.config.block_size)
                    if members.me in tier.owners(bid) and self.store.lookup(bid) is None]

        limiter = trio.CapacityLimiter(8)
        for round_no in range(self.REBALANCE_ROUNDS):  # (again while the members change under it, or blocks failed)
            ring = tuple(members.ring.members)
            todo = await trio.to_thread.run_sync(mine)
            log.info("rebalance: filling %d blocks of this node's share (of %d cache nodes)", len(todo),
                     len(ring))
            failed = 0

            async def one(obj: ObjectInfo, index: int) -> None:
                nonlocal failed
                async with limiter:
                    if members.me not in tier.owners(self.cache.block_id(obj, index)):
                        return  # (the members changed meanwhile: no longer this node's)
                    try:
                        await self.cache.read_for_peer(obj, index, True)
                    except EpochfsError:
                        failed += 1

            async with trio.open_nursery() as nursery:
                for obj, index in todo:
                    nursery.start_soon(one, obj, index)
            log.info("rebalance: filled %d blocks (%d failed: %s)", len(todo) - failed, failed,
                     "fetched on demand" if not failed or round_no == self.REBALANCE_ROUNDS - 1 else "asked again")
            if tuple(members.ring.members) == ring and not failed:
                break
        log.info("rebalance: done (%d cache nodes)", len(members.ring.members))

    def _announce_node(self, ready: Ready) -> None:
        assert self.peer_server is not None
        log.info("cache node of %s serving on %s:%d", self.config.source.url, self.peer_server.host,
                 self.peer_server.port)
        for warning in self.warnings:
            log.warning("%s", warning)
        ready(None, self.warnings)
        node_host.sd_notify(f"READY=1\nSTATUS=cache node of {self.config.source.url} on {self.peer.members.me if self.peer else ''}\n"
                  f"MAINPID={os.getpid()}")

    async def run(self, ready: Ready, early: node_host.StopSignals | None = None) -> None:
        """Serve until told to stop. ``early`` holds a stop signal received before the event loop listened
        (the mount already made): it is acted on as the loop starts."""
        async with trio.open_nursery() as nursery:
            if self.config.serving:
                self._stopped = trio.Event()
            await nursery.start(self._handle_signals, early)
            await nursery.start(self.cache.run)
            if self.peer is not None:
                if self.peer_server is not None:
                    await nursery.start(self.peer_server.run)
                    if self.config.peer_advertise is None:  # port 0: the one the system gave
                        self.peer.members.rename(f"{self.peer_server.host}:{self.peer_server.port}")
                await nursery.start(self.peer.members.run)
                if self.tier_load is not None:
                    await nursery.start(self.tier_load.run)
                if self.share is not None:
                    await nursery.start(self.share.run)
            await nursery.start(self.prefetcher.run)
            if self.node is not None:
                nursery.start_soon(self.node.run)
            await nursery.start(self.learner.run)
            await nursery.start(self.links.run)
            if self.passthrough is not None:
                await nursery.start(self.passthrough.run)
            await nursery.start(self.snapshots.run)
            if self.writeback is not None:
                await nursery.start(self.writeback.run)
            await nursery.start(self.control.run)
            await nursery.start(self.channel.run)
            if self.metrics is not None:
                await nursery.start(self.metrics.run)
            if self._stopped is not None:  # a cache node: no mount; it serves until told to stop
                self._announce_node(ready)
                if self.config.rebalance:
                    nursery.start_soon(self._rebalance)
                await self._stopped.wait()
                await self._hand_over()
            else:
                nursery.start_soon(self._announce, ready)
                assert self.session is not None
                await self.session.run()
                if early is not None and early.received is not None:  # (stopped before it announced)
                    ready(f"stopped by {signal.Signals(early.received).name} before the mount was ready", [])
            nursery.cancel_scope.cancel()

    async def _handle_signals(self, early: node_host.StopSignals | None,
                              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            if early is not None and early.received is not None:
                self._stop_on(early.received, " while starting")
            async for signum in signals:
                self._stop_on(signum)

    def _stop_on(self, signum: int, when: str = "") -> None:
        log.info("received %s%s; %s", signal.Signals(signum).name, when,
                 "stopping" if self.config.serving else "unmounting")
        node_host.sd_notify("STOPPING=1")
        self._terminate()

    async def _announce(self, ready: Ready) -> None:
        # (abandoned if the daemon stops first: the stat waits for the kernel's INIT to be answered,
        # which a session told to stop before it served never does; closing the device ends it)
        st = await trio.to_thread.run_sync(os.stat, self.config.mountpoint, abandon_on_cancel=True)
        if st.st_ino != kernel.ROOT_INODE:
            ready(f"{self.config.mountpoint} did not answer as an epochfs mount", [])
            self._terminate()
            return
        if self.config.kernel_readahead:
            node_host.set_kernel_readahead(st.st_dev, self.config.kernel_readahead)
            node_host.set_background_requests(st.st_dev)
        log.info("mounted %s at %s", self.config.source.url, self.config.mountpoint)
        for warning in self.warnings:
            log.warning("%s", warning)
        ready(None, self.warnings)
        node_host.sd_notify(f"READY=1\nSTATUS=serving {self.config.source.url} at {self.config.mountpoint}\n"
                  f"MAINPID={os.getpid()}")

    def close(self) -> None:
        """Close every part, the last opened first (the write-back before its journal, the snapshots
        before the store and the backend)."""
        self._opened.close()


def advice_options(config: Config) -> dict[str, object]:
    """What a command advised for this mount repeats of its options (``epochfs status``'s ``options``)."""
    return {"endpoint_url": config.endpoint_url, "meta": config.meta, "meta_name": config.meta_name,
            "meta_password_file": str(config.meta_password_file) if config.meta_password_file else None,
            "meta_ca_file": str(config.meta_ca_file) if config.meta_ca_file else None,
            "peer_token_file": str(config.peer_token_file) if config.peer_token_file else None,
            "peer_role": config.peer_role if (config.peer_listen or config.peer_role == "client") else None,
            "block_size": config.block_size, "replicas": config.replicas, "cache_size": config.cache_size,
            "peer_timeout": config.peer_timeout, "control_group": config.control_group,
            "control_group_name": group_name(config.control_group),
            "user_share_bytes": UserBounds.share(config.user_share, config.cache_size).warmup_bytes}


def group_name(gid: int | None) -> str | None:
    """The name of group ``gid`` on this node (None for none, or one /etc/group does not name)."""
    if gid is None:
        return None
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return None


def _raised(fn: Callable[[], None]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
        return exc
    return None


def _invalidate(session: kernel.Session, entries: list[tuple[int, bytes]], inodes: list[int]) -> None:
    """Make the kernel forget changed names and cached data (worker thread: these calls block)."""
    for inode in inodes:
        try:
            session.invalidate_inode(inode)
        except OSError:
            pass  # the kernel did not know it
    for parent, name in entries:
        try:
            session.invalidate_entry(parent, name)
        except OSError:
            pass


class ChannelFile:
    """The mount's control file (:class:`epochfs.vfs.seams.ControlFile`) over the channel's sessions."""

    name = frames.NAME.encode()
    command = frames.COMMAND

    def __init__(self, channel: MountChannel) -> None:
        self.call = channel.call
