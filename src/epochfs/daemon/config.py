"""One validated, frozen :class:`Config` for a mount, and the TOML config file reader."""

from __future__ import annotations

import hashlib
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from epochfs import eviction as policies
from epochfs.backend.base import DEFAULT_ATTEMPTS, DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT
from epochfs.backend.kinds import kind_of
from epochfs.blockstore.keys import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from epochfs.core.errors import ConfigError
from epochfs.core.records import Source
from epochfs.meta.base import StoreAccess
from epochfs.prefetch.plan import DEFAULT_LEAD, DEFAULT_PREFETCH_CONCURRENCY, MAX_PREFETCH_CONCURRENCY

_SIZE_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KB": 1000, "KIB": 1 << 10,
    "M": 1 << 20, "MB": 1000**2, "MIB": 1 << 20,
    "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30,
    "T": 1 << 40, "TB": 1000**4, "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


MAX_SIZE = float(1 << 63)  # bytes (or bytes/s): what any size or rate option may be at most


def parse_size(text: str) -> int:
    """``'512M'`` -> bytes. Single letters are binary (K = 1024); ``KB``/``MB`` are decimal."""
    m = _SIZE_RE.match(str(text)[:100])
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {str(text)[:40]!r} (examples: 4M, 512MiB, 50G, 1T)")
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value > MAX_SIZE:
        raise ConfigError(f"not a size: {str(text)[:40]!r} is more than 8 EiB")
    return int(value)


_RATE_UNITS = {
    "BIT": 1 / 8, "KBIT": 1000 / 8, "MBIT": 1000**2 / 8, "GBIT": 1000**3 / 8, "TBIT": 1000**4 / 8,
}


def parse_rate(text: str) -> float:
    """A bandwidth in bytes/second: ``'10Gbit'``, ``'400MB'`` (per second), ``'1.5G'``."""
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    m = _SIZE_RE.match(s[:100])
    if m and m.group(2).upper() in _RATE_UNITS:
        rate = float(m.group(1)) * _RATE_UNITS[m.group(2).upper()]
        if not math.isfinite(rate) or rate > MAX_SIZE:
            raise ConfigError(f"not a rate: {str(text)[:40]!r} is more than 8 EiB a second")
        return rate
    try:
        return float(parse_size(s))
    except ConfigError:
        raise ConfigError(f"not a rate: {str(text)[:40]!r} (examples: 10Gbit, 1.25GB, 400M)") from None


DEFAULT_CACHE_DIR = "/var/cache/epochfs"


#: Where the daemons of a node (run as root) write their Prometheus file_sd targets by default.
DEFAULT_TARGETS_DIR = "/run/epochfs/prometheus"
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")


def default_root() -> Path:
    """Where the node's caches are by default: ``/var/cache/epochfs`` for root, ``~/.cache/epochfs`` for others."""
    return Path(DEFAULT_CACHE_DIR) if os.geteuid() == 0 else Path.home() / ".cache" / "epochfs"


def default_cache_dir(source: Source) -> Path:
    """``<default root>/<source hash>``: a store of each source's own."""
    return default_root() / hashlib.sha256(source.url.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Option:
    """How a :class:`Config` field is set from the command line and a config file (``epochfs.cli.options``
    turns these into argparse options, config-file keys and the example config)."""

    group: str  # "object store", "cache", "namespace", "prefetch", "metrics", "mount"
    help: str
    metavar: str | None = None  # None: a flag (bool) or a list
    parse: Callable[[str], Any] | None = None  # text -> value; raises ConfigError or ValueError
    flag: str | None = None  # default: --field-name
    shown: str | None = None  # the default as the user writes it (10G, not 10737418240)
    example: str | None = None  # an example value (TOML) for the example config when the default is empty


def parse_group(text: str | int) -> int:
    """A group named by number or name (looked up in the group database)."""
    if isinstance(text, int) or str(text).isdigit():
        return int(text)
    import grp

    try:
        return grp.getgrnam(str(text)).gr_gid
    except KeyError:
        raise ConfigError(f"no group named {text!r} on this node") from None


def option(default: Any, group: str, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"option": Option(group, help, **kw)})


@dataclass(frozen=True)
class Config:
    """Everything a mount needs; validated on construction. The metadata of each field is the one
    definition of its command-line flag, config-file key, help text and default."""

    source: Source
    mountpoint: Path | None  # None: a cache node (``epochfs serve``), which mounts nothing
    # -- object store
    endpoint_url: str | None = option(
        None, "object store", "S3-compatible endpoint (MinIO, SeaweedFS, Ceph); enables path-style addressing",
        metavar="URL", parse=str, example='"http://10.0.0.5:9000"')
    region: str | None = option(
        None, "object store", "the bucket's S3 region (default: from the AWS configuration); block reads are "
        "signed for this region, so on AWS it must be the bucket's own", metavar="REGION", parse=str,
        example='"us-east-1"')
    profile: str | None = option(
        None, "object store", "AWS profile whose credentials to use (default: the standard chain: environment, "
        "AWS_PROFILE, ~/.aws/credentials, instance role)", metavar="NAME", parse=str, example='"training"')
    backend_concurrency: int = option(DEFAULT_CONCURRENCY, "object store", "parallel backend requests", metavar="N",
                                      parse=int)
    backend_timeout: float = option(
        DEFAULT_TIMEOUT, "object store", "deadline of one block fetch, retries and the whole body included; past it the "
        "reader gets EIO", metavar="SECONDS", parse=float)
    backend_attempts: int = option(DEFAULT_ATTEMPTS, "object store", "attempts per request before giving up",
                                   metavar="N", parse=int)
    backend_bandwidth: float | None = option(
        None, "object store", "capacity of the link to the backend, e.g. 10Gbit, for the utilisation metric "
        "and its 70% alert (default: the lower of what the interface routing to the endpoint states, its speed "
        "or shaping, and what the mount's transfers measure while they keep the link busy; `epochfs status` "
        "says which)", metavar="RATE", parse=lambda t: parse_rate(t), example='"10Gbit"')
    # -- cache
    cache_dir: Path | None = option(
        None, "cache", f"block cache and metadata directory (default: {DEFAULT_CACHE_DIR}/<source hash> for root, "
        "~/.cache/epochfs/<source hash> otherwise); one mount per directory; it must belong to this user and "
        "be writable by nobody else", metavar="DIR", parse=Path, example='"/var/cache/epochfs/data"')
    cache_size: int = option(10 << 30, "cache", "upper bound of cached bytes, e.g. 512M, 50G", metavar="SIZE",
                             parse=lambda t: parse_size(t), shown="10G")
    block_size: int = option(4 << 20, "cache", "cache block and backend request size (64K to 64M)",
                             metavar="SIZE", parse=lambda t: parse_size(t), shown="4M")
    free_space_ratio: float = option(0.10, "cache", "keep at least this fraction of the cache file system free",
                                     metavar="RATIO", parse=float)
    readahead_blocks: int = option(4, "cache", "blocks fetched ahead of a sequential reader at first; doubles as "
                                   "it keeps up, to 4x (64 MiB at most); 0 disables",
                                   metavar="BLOCKS", parse=int, flag="--readahead")
    push_ahead: int = option(
        0, "cache", "blocks pushed into the kernel page cache ahead of a sequential reader, from worker "
        "threads: the reader's reads of them never reach the daemon (0 disables)", metavar="BLOCKS", parse=int)
    kernel_readahead: int = option(
        4 << 20, "cache", "kernel readahead window of the mount: larger FUSE reads for sequential readers "
        "(0 keeps the kernel default of 128K; needs root)", metavar="SIZE", parse=lambda t: parse_size(t),
        shown="4M")
    memory_limit: int | None = option(
        None, "cache", "what the daemon may hold in memory: fetches in flight, blocks kept for readers, small "
        "files kept whole, idle buffers (the page cache is the kernel's). Under it the daemon fetches less ahead; "
        "a read is never failed or held back by it. Default: a sixteenth of the machine's (or the pod's cgroup's) "
        "memory, 512M to 8G; epochfs status shows the shares", metavar="SIZE", parse=lambda t: parse_size(t),
        shown="1/16 of memory", example="\"2G\"")
    share_dir: str | None = option(
        None, "cache", "the node's cache, shared by the mounts that name it: they split one capacity (the largest "
        "--cache-size of a live one) fairly, and offer each other the objects they hold whole, by content (an S3 "
        "single-part ETag, the MD5 of the bytes, checked on every copy): a mount copies an object another mount of "
        "the same bucket and credentials holds instead of fetching it (a hard link: on disk once). Default: "
        "<default root>/shared for mounts without --cache-dir, none with it; the cache directory must be under "
        "its parent; off: a cache of its own", metavar="DIR", parse=str, example='"/var/cache/epochfs/shared"')
    eviction: str = option(policies.DEFAULT, "cache", "eviction policy: " + policies.describe(),
                           metavar="POLICY", parse=str)
    # -- prefetch
    prefetch_bandwidth: float | None = option(
        None, "prefetch", "cap on prefetch traffic, e.g. 400MB or 2Gbit (per second)", metavar="RATE",
        parse=lambda t: parse_rate(t), example='"4Gbit"')
    prefetch_lead: float = option(
        DEFAULT_LEAD, "prefetch", "how many seconds of reading the prefetch window covers, at most a quarter of the cache",
        metavar="SECONDS", parse=float)
    prefetch_concurrency: int = option(
        DEFAULT_PREFETCH_CONCURRENCY, "prefetch", "fetches of the handed-over order (and of a warmup) in flight at "
        "most; the prefetcher keeps twice what carries the reader's rate at the backend's latency, so a backend "
        "that answers fast gets a few and a far one many (README: what 16 and 96 carried at 20 ms)", metavar="N",
        parse=int)
    no_learned_order: bool = option(
        False, "prefetch", "do not learn the epoch on a plain mount: by default, where no order is handed over and "
        "a job reads a directory's files each once in an order of its own (DLIO, a loader without our sampler), "
        "the rest of that directory is fetched ahead, 64 MiB at first and then at most twice what the job has "
        "read of it (a wrong guess costs no more), while the endpoint takes 10 ms or more to answer")
    # -- write-back
    writeback: bool = option(
        False, "write-back", "accept new files (checkpoints): written to the cache disk at local speed, uploaded "
        "in the background from a crash-safe journal; 'epochfs sync' waits for them (S3 sources)")
    upload_bandwidth: float | None = option(
        None, "write-back", "cap on upload traffic, e.g. 400MB or 2Gbit (per second)", metavar="RATE",
        parse=lambda t: parse_rate(t), example='"2Gbit"')
    upload_concurrency: int = option(2, "write-back", "files uploaded at once (each large one in 4 parallel parts)",
                                     metavar="N", parse=int)
    writeback_user_quota: int | None = option(
        None, "write-back", "most bytes one user's files may hold in the cache before they are uploaded (past "
        "it that user's writes fail with EDQUOT; default: only the cache size bounds them)", metavar="SIZE",
        parse=lambda t: parse_size(t), example='"20G"')
    # -- namespace
    meta: str | None = option(
        None, "namespace", "metadata store: redis://[USER@]HOST:PORT/DB (rediss:// for TLS), or through Redis "
        "Sentinel redis+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB], to load the snapshot "
        "published by 'epochfs import' (shared by every node; the source is never listed; a password goes in "
        "--meta-password-file, never the URL), or lmdb://PATH (default: LMDB in the cache directory)",
        metavar="URL", parse=str, example='"rediss://epochfs@10.0.0.9:6379/0"')
    meta_password_file: Path | None = option(
        None, "namespace", "file holding the shared store's password (mode 0600, the daemon's user; or "
        "EPOCHFS_META_PASSWORD): it authenticates the connection (a user name goes in the URL: "
        "redis://USER@HOST:6379/0) and signs every record published, so owners and modes are taken only from "
        "records its holders wrote; without it a shared store is not trusted for them", metavar="FILE",
        parse=Path, example='"/etc/epochfs/redis-password"')
    meta_ca_file: Path | None = option(
        None, "namespace", "CA certificates a rediss:// store's certificate must chain to (default: the "
        "system's)", metavar="FILE", parse=Path, example='"/etc/epochfs/redis-ca.pem"')
    meta_name: str | None = option(None, "namespace", "dataset name in a shared store (default: the source URL)",
                                   metavar="NAME", parse=str, example='"imagenet"')
    meta_poll: float = option(
        0.0, "namespace", "check the store for a newer snapshot this often and switch to it (0: only on "
        "'epochfs refresh')", metavar="SECONDS", parse=float)
    refresh: bool = option(False, "namespace", "list the source again instead of reusing the stored snapshot")
    snapshot_ttl: float = option(
        0.0, "namespace", "list the source again when the stored snapshot is older than this (0: keep it until "
        "--refresh)", metavar="SECONDS", parse=float)
    # -- cluster cache tier
    peer_listen: str | None = option(
        None, "cluster cache", "join the cluster cache tier of this dataset and answer other members' block "
        "requests on HOST:PORT (needs --meta redis://... and --peer-token-file); each block then crosses the "
        "backend link once per cluster", metavar="HOST:PORT", parse=str, example='"10.0.0.21:9570"')
    peer_advertise: str | None = option(
        None, "cluster cache", "literal IP address other members reach this node at (default: --peer-listen; "
        "required when that is a wildcard such as 0.0.0.0 or a name)", metavar="IP:PORT", parse=str, example='"10.0.0.21:9570"')
    peer_token_file: Path | None = option(
        None, "cluster cache", "file holding the secret shared by the members (mode 0600; e.g. openssl rand "
        "-hex 32): members prove they hold it before they are asked, and every request and answer is "
        "authenticated with it", metavar="FILE", parse=Path, example='"/etc/epochfs/peer-token"')
    peer_cache: str = option(
        "all", "cluster cache", "'all': keep every block read here too (later epochs are local); 'owned': keep "
        "only the blocks this node owns, so the members' caches add up to one", metavar="MODE", parse=str)
    peer_timeout: float = option(
        5.0, "cluster cache", "a block request to a member that takes longer is given up and the block read from "
        "the backend", metavar="SECONDS", parse=float)
    peer_role: str = option(
        "peer", "cluster cache", "'peer': with --peer-listen, this node holds and serves its share of the blocks "
        "(where no cache node is up); 'client': it asks the cache nodes (epochfs serve) and the serving peers, "
        "and never serves nor holds a share, so a node that comes and goes moves nothing (needs --meta and "
        "--peer-token-file, not --peer-listen)", metavar="ROLE", parse=str)
    replicas: int = option(
        1, "cluster cache", "how many members hold each block (the same on every node): losing one of them then "
        "costs nothing but bandwidth", metavar="R", parse=int)
    rebalance: bool = option(
        False, "cluster cache", "a cache node (epochfs serve) that joins fills its whole share at once, from the "
        "other cache nodes first and the backend after, instead of as it is asked")
    link_capacity: float | None = option(
        None, "cluster cache", "this node's network link, e.g. 25Gbit: what the peer tier sends over it is "
        "exported as a utilisation, and the 70% rule fires for a cache node group past it (default: the lower "
        "of what the interface of the peer address states and what its sends measure while they keep the "
        "link busy)", metavar="RATE", parse=lambda t: parse_rate(t), example='"25Gbit"')
    # -- metrics
    metrics_addr: str | None = option(
        None, "metrics", "Prometheus metrics at http://HOST:PORT/metrics; 'off' disables; port 0 picks a free "
        "one; an address given here that is taken is an error (default: 127.0.0.1:9567, or the next free "
        "port when another mount has it)", metavar="HOST:PORT", parse=str, example='"127.0.0.1:9567"')
    node: str | None = option(
        None, "metrics", "this node's name in the `node` label of every series, the same for all its mounts, so "
        "the rules and the dashboard add a node's mounts up (default: the host name)", metavar="NAME", parse=str,
        example='"gpu-node-01"')
    metrics_targets: str | None = option(
        None, "metrics", "directory where the daemon writes a Prometheus file_sd target for its metrics (one file "
        "per mount, removed at unmount), so one scrape job finds every mount of the node; 'off' disables "
        f"(default: {DEFAULT_TARGETS_DIR} for root, else off)", metavar="DIR", parse=str,
        example=f'"{DEFAULT_TARGETS_DIR}"')
    # -- mount
    allow_other: bool = option(
        False, "mount", "let other users read the mount, with the permissions the source gives them (needs "
        "user_allow_other in /etc/fuse.conf unless root); with --writeback the root is presented 1777, so each "
        "user may make a directory of their own in it (--dir-mode sets another)")
    file_mode: int | None = option(
        None, "mount", "present every file with this mode (default: the source's for file://, 0444 for S3, 0644 "
        "with --writeback)",
        metavar="OCTAL", parse=lambda t: parse_mode(t), example='"0444"')
    dir_mode: int | None = option(
        None, "mount", "present every directory with this mode (default: the source's for file://, 0555 for S3, "
        "0755 with --writeback; 1777 lets every user create files and keeps them from removing each other's)",
        metavar="OCTAL", parse=lambda t: parse_mode(t), example='"0555"')
    uid: int | None = option(
        None, "mount", "present every entry as owned by this user (default: the source's for file://, else the "
        "daemon's)", metavar="N", parse=int, example="1000")
    gid: int | None = option(None, "mount", "likewise for the group", metavar="N", parse=int, example="1000")
    control_group: int | None = option(
        None, "mount", "members of this group (a name or a number) may change the mount for everybody through "
        "its control channel (refresh, publish a manifest, replace or cancel another user's order or warmup); "
        "root and the daemon's user always may. Any user who can read the mount may read its state and hand "
        "over orders of the files they may read", metavar="GROUP", parse=lambda t: parse_group(t),
        example='"epochfs-operators"')
    user_share: float = option(
        0.5, "mount", "the share of the hand-over limit (8 Mi blocks of orders not yet read) and of --cache-size "
        "(what warmups running or ended in the last 10 minutes fill, and what a learned order holds fetched "
        "ahead) one user who is not an operator may hold, so no user crowds out the others",
        metavar="FRACTION", parse=float)
    allow_non_empty: bool = option(
        False, "mount", "mount even if MOUNTPOINT is not empty (its files are hidden while mounted)")
    open_requests: bool = option(
        False, "mount", "have the kernel ask the daemon at every open and close of a file; without it a "
        "read-only mount opens files with no request, so a file already in the page cache is read with no "
        "daemon work at all (write-back mounts always ask)")
    passthrough: bool = option(
        False, "mount", "the kernel reads every fully cached file from the cache's own file itself, small ones "
        "too (FUSE passthrough, Linux 6.9+, a root daemon), with no daemon work per read. Without this flag it "
        "does so where most of the dataset's bytes are in files of 1 MiB and more (a mount of small files "
        "opens them with no request instead, which serves them faster); --no-passthrough: never. Those reads are not checked one by one: each "
        "file's bytes are checked when they enter the cache, the file's fingerprint at each open, and all "
        "of it by the scrub (--passthrough-scrub); a file that fails is read through the daemon, verified, "
        "until refetched. Where the kernel or the daemon cannot (an older kernel, not root), "
        "files are read through the daemon, as the log and `epochfs status` say. On a --writeback mount the "
        "kernel also writes the files made there itself (their data files in the cache), unless --no-passthrough")
    no_passthrough: bool = option(
        False, "mount", "read every file through the daemon, each read checked against the cache's "
        "checksums (today's check of every read, at the daemon's CPU per byte), instead of the kernel "
        "reading fully cached files itself; on a --writeback mount, every write through the daemon too")
    io_uring: bool = option(
        False, "mount", "take the kernel's requests through an io_uring (FUSE over io_uring, Linux 6.14+) "
        "instead of reading and writing /dev/fuse; the kernel offers it only once root has set "
        "/sys/module/fuse/parameters/enable_uring to Y (else: /dev/fuse, with a warning). It changes the "
        "transport, not the page cache; measured beside /dev/fuse in benchmarks/peers (docs/kernel-paths.md)")
    passthrough_size: int | None = option(
        None, "mount", "no longer used (passthrough reads the cache's own files: there are no copies to bound); "
        "accepted, with a warning", metavar="SIZE", parse=lambda t: parse_size(t), example='"200G"')
    passthrough_scrub: float = option(
        86400.0, "mount", "hash every fully cached file the kernel may read against its checksums again at least "
        "this often (64 MiB/s at most: a 1 TiB cache takes 4.6 h; 0: only a file whose fingerprint was lost, "
        "before the kernel reads it again)", metavar="SECONDS", parse=float)
    attr_timeout: float = option(3600.0, "mount", "how long the kernel may cache names and attributes",
                                 metavar="SECONDS", parse=float)
    fuse_options: tuple[str, ...] = option((), "mount", "extra FUSE mount option (repeatable)", flag="-o",
                                           metavar="OPT", example='["max_read=1048576"]')
    foreground: bool = option(False, "mount", "stay attached; unmount on SIGINT/SIGTERM")
    log_file: Path | None = option(
        None, "mount", "log here (default: stderr with --foreground, else <cache-dir>/epochfs.log)",
        metavar="FILE", parse=Path, example='"/var/log/epochfs/data.log"')
    debug: bool = option(False, "mount", "debug logging")

    def store_access(self) -> StoreAccess:
        """The shared store's password (from its file, else the environment) and certificates."""
        return store_access(self.meta_password_file, self.meta_ca_file)

    def node_name(self) -> str:
        """The ``node`` label of every series: ``--node``, else the host name."""
        return self.node or socket.gethostname() or "localhost"

    def targets_dir(self) -> Path | None:
        """Where to write this mount's Prometheus target (None: nowhere)."""
        if self.metrics_targets is None:
            return Path(DEFAULT_TARGETS_DIR) if os.geteuid() == 0 else None
        return None if self.metrics_targets.strip().lower() == "off" else Path(os.path.abspath(self.metrics_targets))

    def shared_dir(self) -> Path | None:
        """The share directory this mount offers and adopts objects through (None: none)."""
        if self.share_dir is None:
            return default_root() / "shared" if self.cache_dir == default_cache_dir(self.source) else None
        return None if self.share_dir.strip().lower() == "off" else Path(os.path.abspath(self.share_dir))

    def instance(self) -> str:
        """What tells this daemon from the node's others (the ``mountpoint`` label): its mount point, or
        ``serve:<dataset>`` for a cache node (the cache node group it belongs to)."""
        if self.mountpoint is not None:
            return str(self.mountpoint)
        return f"serve:{self.meta_name or self.source.url}"

    @property
    def serving(self) -> bool:
        """A cache node (``epochfs serve``): no mount, a member of the cluster tier that holds its share."""
        return self.mountpoint is None

    @property
    def kernel_writes(self) -> bool:
        """A write-back mount's files may be written by the kernel itself (passthrough; not with
        --no-passthrough): :mod:`epochfs.writeback.kernel`."""
        return self.writeback and not self.no_passthrough

    @property
    def kernel_reads(self) -> bool:
        """Passthrough may be used: a mount (not a cache node) without --no-passthrough (where the dataset
        pays for it, or with --passthrough: :func:`epochfs.cache.passthrough.small_files`)."""
        return not self.no_passthrough and not self.serving

    def __post_init__(self) -> None:
        cache_dir = Path(os.path.abspath(self.cache_dir)) if self.cache_dir else default_cache_dir(self.source)
        object.__setattr__(self, "cache_dir", cache_dir)
        object.__setattr__(self, "fuse_options", tuple(self.fuse_options))
        if self.mountpoint is not None:
            object.__setattr__(self, "mountpoint", Path(os.path.abspath(self.mountpoint)))
            if cache_dir == self.mountpoint or self.mountpoint in cache_dir.parents:
                raise ConfigError("the cache directory cannot be inside the mount point")
        if self.block_size < MIN_BLOCK_SIZE or self.block_size > MAX_BLOCK_SIZE:
            raise ConfigError("--block-size must be between 64K and 64M")
        if self.block_size % (64 << 10):
            raise ConfigError("--block-size must be a multiple of 64K")
        if self.memory_limit is not None and self.memory_limit < 64 << 20:
            raise ConfigError("--memory-limit must be at least 64M (the daemon alone holds about that)")
        if self.cache_size < self.block_size:
            raise ConfigError("--cache-size must hold at least one block")
        if not 0.0 <= self.free_space_ratio < 1.0:
            raise ConfigError("--free-space-ratio must be in [0, 1)")
        if self.readahead_blocks < 0:
            raise ConfigError("--readahead must be >= 0")
        if not 0 <= self.push_ahead <= 64:
            raise ConfigError("--push-ahead must be between 0 and 64 blocks")
        if self.backend_concurrency < 1:
            raise ConfigError("--backend-concurrency must be >= 1")
        if not 1 <= self.prefetch_concurrency <= MAX_PREFETCH_CONCURRENCY:
            raise ConfigError(f"--prefetch-concurrency must be between 1 and {MAX_PREFETCH_CONCURRENCY}")
        if self.backend_timeout <= 0:
            raise ConfigError("--backend-timeout must be > 0")
        if self.backend_attempts < 1:
            raise ConfigError("--backend-attempts must be >= 1")
        if self.endpoint_url is not None:
            u = urlparse(self.endpoint_url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConfigError(f"--endpoint-url {self.endpoint_url!r}: expected http(s)://HOST[:PORT]")
        if self.eviction not in policies.names():
            raise ConfigError(f"--eviction {self.eviction!r}: choose {', '.join(policies.names())}")
        if self.upload_concurrency < 1:
            raise ConfigError("--upload-concurrency must be >= 1")
        if self.passthrough_scrub < 0:
            raise ConfigError("--passthrough-scrub must be >= 0 seconds")
        if self.writeback and not kind_of(self.source).capabilities.write:
            raise ConfigError(f"--writeback needs a source that can be written; {self.source.url} is read-only")
        for name in ("prefetch_bandwidth", "backend_bandwidth", "upload_bandwidth"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.prefetch_lead <= 0:
            raise ConfigError("--prefetch-lead must be positive")
        if self.meta_poll < 0:
            raise ConfigError("--meta-poll must be >= 0")
        if self.snapshot_ttl < 0:
            raise ConfigError("--snapshot-ttl must be >= 0")
        if self.attr_timeout < 0:
            raise ConfigError("--attr-timeout must be >= 0")
        self._check_peer()
        if self.node is not None and not NODE_NAME.fullmatch(self.node):
            raise ConfigError(f"--node {self.node!r}: 1 to 253 letters, digits and . _ : - (a host name)")
        if not 0 < self.user_share <= 1:
            raise ConfigError("--user-share must be a fraction above 0 and at most 1")
        if self.control_group is not None and not 0 <= self.control_group < 0xFFFFFFFF:
            raise ConfigError("--control-group must be a group name or number")
        if self.writeback_user_quota is not None and self.writeback_user_quota <= 0:
            raise ConfigError("--writeback-user-quota must be a size above 0")
        if self.file_mode is not None and not 0 <= self.file_mode <= 0o777:
            raise ConfigError("--file-mode must be an octal mode from 000 to 777")
        if self.dir_mode is not None and not 0 <= self.dir_mode <= 0o1777:
            raise ConfigError("--dir-mode must be an octal mode from 000 to 1777 (1777: anyone may create, only "
                              "owners may remove or rename, as in /tmp)")
        for name in ("uid", "gid"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 0xFFFFFFFF:
                raise ConfigError(f"--{name} must be a user or group number")


    def _check_peer(self) -> None:
        from epochfs.peer.rules import check_options

        check_options(listen_text=self.peer_listen, advertise=self.peer_advertise, token_file=self.peer_token_file,
                      meta=self.meta, cache=self.peer_cache, timeout=self.peer_timeout, role=self.peer_role,
                      replicas=self.replicas, serving=self.serving, writeback=self.writeback,
                      rebalance=self.rebalance)


#: Where a shared store's password may come from besides --meta-password-file (a container's secret).
PASSWORD_ENV = "EPOCHFS_META_PASSWORD"


def store_access(password_file: Path | None, ca_file: Path | None) -> StoreAccess:
    """A shared store's access: the password from ``password_file`` (a private file) or
    ``$EPOCHFS_META_PASSWORD``; ``ca_file`` checked to be readable."""
    from epochfs.core.private import read_secret

    password = None
    if password_file is not None:
        password = read_secret(password_file, "--meta-password-file")
    elif os.environ.get(PASSWORD_ENV):
        password = os.environ[PASSWORD_ENV].strip().encode("utf-8", "surrogateescape")
    if ca_file is not None and not os.access(ca_file, os.R_OK):
        raise ConfigError(f"--meta-ca-file {ca_file}: not a readable file")
    return StoreAccess(password, str(ca_file) if ca_file is not None else None)


def parse_mode(text: str) -> int:
    """An octal permission mode: ``'0444'``, ``'755'``."""
    try:
        mode = int(str(text), 8)
    except ValueError:
        raise ConfigError(f"not an octal mode: {text!r} (examples: 0444, 755)") from None
    if not 0 <= mode <= 0o1777:
        raise ConfigError(f"not a permission mode: {text!r} (000 to 777, or 1777 with the sticky bit)")
    return mode


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The table of a TOML config file, keys normalised to ``snake_case``. Errors name the file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "cost" and isinstance(value, dict):
            continue  # the prices `epochfs doctor` and `epochfs plan --config` read (epochfs.doctor.cost)
        if isinstance(value, dict):
            raise ConfigError(f"config file {path}: [{key}]: tables are not supported; put keys at the top level "
                              "(the one table is [cost], the prices doctor and plan read)")
        out[key.replace("-", "_")] = value
    return out
