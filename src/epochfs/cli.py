"""Command line: arguments -> Config, errors -> exit codes. Nothing else lives here.

Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import logging.handlers
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from epochfs import __version__
from epochfs.config import (
    DEFAULT_CACHE_DIR,
    Config,
    Source,
    parse_mode,
    parse_rate,
    parse_size,
    read_config_file,
)
from epochfs.errors import ConfigError, EpochfsError
from epochfs.prefetch.manifest import Entry

log = logging.getLogger("epochfs")

EPILOG = """\
Credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE,
~/.aws/credentials, instance roles); they are never taken on the command line.
"""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mode(text: str) -> int:
    try:
        return parse_mode(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epochfs",
        description="Read-only FUSE mount of an S3 prefix or a slow shared directory, "
        "served through a persistent, checksummed local block cache.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"epochfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser(
        "mount", help="mount a dataset read-only",
        description="Mount SOURCE (s3://BUCKET[/PREFIX] or file:///PATH) read-only at MOUNTPOINT. "
        "Returns once the mount answers (exit 0) or failed (non-zero, with the reason); "
        "with --foreground stays attached and unmounts on SIGINT/SIGTERM.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(_mount_parser=m)
    m.add_argument("source", metavar="SOURCE", nargs="?", help="s3://BUCKET[/PREFIX] or file:///PATH")
    m.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?",
                   help="an existing empty directory, e.g. /mnt/data")
    m.add_argument("--config", metavar="FILE",
                   help="TOML file with any of these options (keys like cache_size = \"500G\", plus source and "
                   "mountpoint); command-line flags override it")
    g = m.add_argument_group("object store")
    g.add_argument("--endpoint-url", metavar="URL",
                   help="S3-compatible endpoint (MinIO, SeaweedFS, Ceph); enables path-style addressing")
    g.add_argument("--region", help="the bucket's S3 region (default: from the AWS configuration); block reads "
                   "are signed for this region, so on AWS it must be the bucket's own")
    g.add_argument("--backend-concurrency", type=int, default=16, metavar="N",
                   help="parallel backend requests (default: %(default)s)")
    g.add_argument("--backend-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="deadline for one block fetch, retries included; past it the reader gets EIO "
                   "(default: %(default)s)")
    g.add_argument("--backend-attempts", type=int, default=5, metavar="N",
                   help="attempts per request before giving up (default: %(default)s)")
    g = m.add_argument_group("cache")
    g.add_argument("--cache-dir", type=Path, metavar="DIR",
                   help=f"block cache and metadata directory (default: {DEFAULT_CACHE_DIR}/<source hash> "
                   "for root, ~/.cache/epochfs/<source hash> otherwise); one mount per directory")
    g.add_argument("--cache-size", type=_size, default=parse_size("10G"), metavar="SIZE",
                   help="upper bound of cached bytes, e.g. 512M, 50G (default: 10G)")
    g.add_argument("--block-size", type=_size, default=parse_size("4M"), metavar="SIZE",
                   help="cache block and backend request size (default: 4M)")
    g.add_argument("--free-space-ratio", type=float, default=0.1, metavar="RATIO",
                   help="keep at least this fraction of the cache file system free (default: %(default)s)")
    g.add_argument("--readahead", type=int, default=4, dest="readahead_blocks", metavar="BLOCKS",
                   help="blocks fetched ahead of a sequential reader (default: %(default)s; 0 disables)")
    g.add_argument("--kernel-readahead", type=_size, default=parse_size("4M"), metavar="SIZE",
                   help="kernel readahead window of the mount: larger FUSE reads for sequential readers "
                   "(default: 4M; 0 keeps the kernel default of 128K; needs root)")
    g.add_argument("--eviction", choices=("manifest", "lru", "none"), default="manifest",
                   help="manifest: evict the block needed farthest in the future once 'epochfs prefetch' "
                   "has handed over a manifest (LRU until then); lru; none: fill once, then read through "
                   "(default: manifest)")
    g.add_argument("--prefetch-bandwidth", type=_rate, metavar="RATE",
                   help="cap on prefetch traffic, e.g. 400MB or 2Gbit (per second; default: no cap)")
    g.add_argument("--metrics-addr", default="127.0.0.1:9567", metavar="HOST:PORT",
                   help="Prometheus metrics at http://HOST:PORT/metrics; 'off' disables; port 0 picks a free "
                   "one (default: %(default)s, loopback only)")
    g.add_argument("--prefetch-lead", type=float, default=2.0, metavar="SECONDS",
                   help="how many seconds of reading the prefetch window covers, at most a quarter of the "
                   "cache (default: %(default)s)")
    g.add_argument("--backend-bandwidth", type=_rate, metavar="RATE",
                   help="capacity of the link to the backend, e.g. 10Gbit, for the utilisation metric")
    g.add_argument("--meta", metavar="URL",
                   help="metadata store: redis://HOST:PORT/DB to load the snapshot published by 'epochfs import' "
                   "(shared by every node; the source is never listed), or lmdb://PATH (default: LMDB in the "
                   "cache directory)")
    g.add_argument("--meta-name", metavar="NAME", help="dataset name in a shared store (default: the source URL)")
    g.add_argument("--meta-poll", type=float, default=0.0, metavar="SECONDS",
                   help="check the store for a newer snapshot this often and switch to it (default: 0, only on "
                   "'epochfs refresh')")
    g.add_argument("--refresh", action="store_true",
                   help="list the source again instead of reusing the stored namespace snapshot")
    g.add_argument("--snapshot-ttl", type=float, default=0.0, metavar="SECONDS",
                   help="list the source again when the stored snapshot is older than this "
                   "(default: 0, keep it until --refresh)")
    g = m.add_argument_group("mount")
    g.add_argument("--foreground", action="store_true", help="stay attached; unmount on SIGINT/SIGTERM")
    g.add_argument("--allow-other", action="store_true",
                   help="let other users read the mount (needs user_allow_other in /etc/fuse.conf unless root)")
    g.add_argument("--file-mode", type=_mode, metavar="OCTAL",
                   help="present every file with this mode (default: the source's for file://, 0444 for S3)")
    g.add_argument("--dir-mode", type=_mode, metavar="OCTAL",
                   help="present every directory with this mode (default: the source's for file://, 0555 for S3)")
    g.add_argument("--uid", type=int, metavar="N",
                   help="present every entry as owned by this user (default: the source's for file://, else "
                   "the daemon's)")
    g.add_argument("--gid", type=int, metavar="N", help="likewise for the group")
    g.add_argument("--attr-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="how long the kernel may cache names and attributes (default: %(default)s)")
    g.add_argument("-o", dest="fuse_options", action="append", default=[], metavar="OPT",
                   help="extra FUSE mount option (repeatable)")
    g.add_argument("--log-file", type=Path, metavar="FILE",
                   help="log here (default: stderr with --foreground, else <cache-dir>/epochfs.log)")
    g.add_argument("--debug", action="store_true", help="debug logging")
    g.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to finish",
                       description="Unmount MOUNTPOINT and wait until its daemon has exited. "
                       "A dead mount (daemon killed) is cleared with a lazy unmount.")
    u.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?")
    u.add_argument("--config", metavar="FILE", help="take the mount point from this config file")
    u.add_argument("--lazy", action="store_true",
                   help="detach at once even if busy, and succeed if nothing is mounted (for ExecStopPost)")
    u.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for the daemon to exit (default: %(default)s)")

    order = argparse.ArgumentParser(add_help=False)
    o = order.add_argument_group("epoch order")
    o.add_argument("--seed", type=int, metavar="S",
                   help="the manifest lists the dataset in index order; shuffle it as "
                   "DistributedSampler(shuffle=True, seed=S) does for --epoch")
    o.add_argument("--epoch", type=int, metavar="N", help="epoch number (with --seed: the shuffle; always: a label)")
    o.add_argument("--rank", type=int, default=0, metavar="R", help="this rank (default: 0)")
    o.add_argument("--world-size", type=int, default=1, metavar="W",
                   help="number of ranks; rank R reads every W-th entry of the padded global order (default: 1)")

    p = sub.add_parser(
        "prefetch", parents=[order], help="hand the daemon an epoch manifest and return",
        description="Hand the daemon serving MOUNTPOINT the order in which this rank will read files. The "
        "daemon fetches ahead of the reader and (with --eviction manifest) evicts the block needed farthest "
        "in the future. Returns at once; progress is in 'epochfs status'. A manifest handed over while an "
        "epoch is still being read is queued after it.",
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", metavar="FILE",
                     help="one path per line relative to the mount root (or JSON Lines with \"path\"), in read order")
    src.add_argument("--stored", metavar="NAME", help="use the manifest published to the metadata store under NAME")
    p.add_argument("--publish", metavar="NAME",
                   help="also publish --manifest to the metadata store under NAME, for the other ranks' daemons")
    p.add_argument("--replace", action="store_true", help="discard the current plan instead of queueing after it")

    im = sub.add_parser("import", help="list a source once and publish its snapshot to a metadata store",
                        description="List SOURCE and publish a new snapshot version (paths, sizes, mtimes, ETags) "
                        "to the store, atomically: daemons mounting with --meta load it instead of listing.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    im.add_argument("source", metavar="SOURCE")
    im.add_argument("--meta", required=True, metavar="URL", help="redis://HOST:PORT/DB or lmdb://PATH")
    im.add_argument("--name", metavar="NAME", help="dataset name in the store (default: the source URL)")
    im.add_argument("--endpoint-url", metavar="URL")
    im.add_argument("--region")

    fk = sub.add_parser("fsck", help="check a cache directory (while it is not mounted)",
                        description="Verify the checksum of every cached block and look for block files the index "
                        "does not know. Exit 0 if the cache is clean (or was repaired), 1 if problems remain.")
    fk.add_argument("--cache-dir", required=True, type=Path, metavar="DIR")
    fk.add_argument("--repair", action="store_true", help="drop damaged blocks and delete orphan files")

    rf = sub.add_parser("refresh", help="switch a mount to the newest snapshot without unmounting",
                        description="Load the newest published snapshot (or, with the embedded store, list the "
                        "source again) and serve it. Files already open keep reading the version they opened, "
                        "or fail with ESTALE; they never mix versions.")
    rf.add_argument("mountpoint", metavar="MOUNTPOINT")

    w = sub.add_parser("warmup", parents=[order], help="fill the cache now, with a progress bar",
                       description="Fetch files (or everything a manifest names) into the cache now, without "
                       "evicting anything; stops caching when the cache is full.")
    w.add_argument("mountpoint", metavar="MOUNTPOINT")
    w.add_argument("paths", nargs="*", metavar="PATH", help="files or directories under the mount")
    w.add_argument("--manifest", metavar="FILE", help="warm what this manifest names")
    w.add_argument("--check", action="store_true", help="only report the fraction already cached")

    pl = sub.add_parser("plan", parents=[order], help="predict hit ratio and backend bytes of an epoch",
                        description="Simulate the cache over the epoch's block sequence and report, for each "
                        "eviction policy, the hit ratio and the bytes fetched from the backend.")
    pl.add_argument("--manifest", required=True, metavar="FILE")
    pl.add_argument("--cache-size", type=_size, required=True, metavar="SIZE")
    pl.add_argument("--block-size", type=_size, default=parse_size("4M"), metavar="SIZE")
    pl.add_argument("--previous-manifest", metavar="FILE",
                    help="the epoch read before this one (its blocks warm the cache; not counted)")
    pl.add_argument("--previous-epoch", type=int, metavar="N",
                    help="with --seed: the previous epoch is this shuffle of --previous-manifest (default: --epoch - 1)")
    sizes = pl.add_mutually_exclusive_group()
    sizes.add_argument("--mount", metavar="MOUNTPOINT", help="take file sizes from this mount")
    sizes.add_argument("--root", metavar="DIR", help="take file sizes from this directory")
    pl.add_argument("--json", action="store_true", help="machine-readable output")

    mf = sub.add_parser("manifest", parents=[order], help="write an epoch manifest",
                        description="Write the read order of an epoch: PATHS-FILE lists the dataset in index "
                        "order (one path per line); with --seed the output is the shuffle DistributedSampler "
                        "uses for --epoch; with --rank/--world-size only that rank's share.")
    mf.add_argument("paths_file", metavar="PATHS-FILE")
    mf.add_argument("-o", "--output", required=True, metavar="FILE")

    st = sub.add_parser("stats", help="live view of a mount (refreshing)",
                        description="Refreshing terminal view of MOUNTPOINT: hit ratio, throughput from the cache "
                        "and from the backend, read latency, cache fill, prefetch lead. Ctrl-C to quit.")
    st.add_argument("mountpoint", metavar="MOUNTPOINT")
    st.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default: 1)")
    st.add_argument("--count", type=int, metavar="N", help="stop after N refreshes")

    s = sub.add_parser("status", help="one-shot state of a mount",
                       description="Print the state of the daemon serving MOUNTPOINT: snapshot, cache use, "
                       "hits and misses, backend requests.")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def default_cache_dir(source: Source) -> Path:
    base = Path(DEFAULT_CACHE_DIR) if os.geteuid() == 0 else Path.home() / ".cache" / "epochfs"
    return base / hashlib.sha256(source.url.encode()).hexdigest()[:16]


_NOT_IN_FILES = {"help", "ready_fd", "config", "log_file_ready"}


def apply_config_file(parser: argparse.ArgumentParser, mount_parser: argparse.ArgumentParser, argv: list[str],
                      path: str) -> argparse.Namespace:
    """Parse ``argv`` again with the config file's values as defaults, so that flags override them."""
    actions: dict[str, argparse.Action] = {}
    for action in mount_parser._actions:
        names = [o.lstrip("-").replace("-", "_") for o in action.option_strings if o.startswith("--")]
        names += [action.dest] if not action.option_strings else []
        for name in names:
            actions[name] = action
    actions["fuse_options"] = next(a for a in mount_parser._actions if a.dest == "fuse_options")
    defaults: dict[str, Any] = {}
    for key, value in read_config_file(path).items():
        action = actions.get(key)
        if action is None or key in _NOT_IN_FILES:
            known = ", ".join(sorted(k for k in actions if k not in _NOT_IN_FILES))
            raise ConfigError(f"config file {path}: unknown key {key!r} (known keys: {known})")
        defaults[action.dest] = _convert(path, key, action, value)
    mount_parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def _convert(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"config file {path}: {key}"
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings")
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: expected a string or a number")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    if action.type is None:
        return str(value)
    try:
        return action.type(str(value))  # type: ignore[misc,operator]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def config_from_args(args: argparse.Namespace) -> Config:
    if not args.source or not args.mountpoint:
        raise ConfigError("give SOURCE and MOUNTPOINT (on the command line or as source/mountpoint in --config)")
    source = Source.parse(args.source)
    mountpoint = Path(os.path.abspath(args.mountpoint))
    cache_dir = Path(os.path.abspath(args.cache_dir)) if args.cache_dir else default_cache_dir(source)
    if cache_dir == mountpoint or mountpoint in cache_dir.parents:
        raise ConfigError("the cache directory cannot be inside the mount point")
    return Config(
        source=source, mountpoint=mountpoint, cache_dir=cache_dir, cache_size=args.cache_size,
        block_size=args.block_size, free_space_ratio=args.free_space_ratio, endpoint_url=args.endpoint_url,
        region=args.region, refresh=args.refresh, snapshot_ttl=args.snapshot_ttl,
        readahead_blocks=args.readahead_blocks, kernel_readahead=args.kernel_readahead, backend_concurrency=args.backend_concurrency,
        backend_timeout=args.backend_timeout, backend_attempts=args.backend_attempts,
        attr_timeout=args.attr_timeout, eviction=args.eviction, prefetch_bandwidth=args.prefetch_bandwidth,
        prefetch_lead=args.prefetch_lead, backend_bandwidth=args.backend_bandwidth, allow_other=args.allow_other,
        foreground=args.foreground, metrics_addr=args.metrics_addr, meta=args.meta, meta_name=args.meta_name,
        meta_poll=args.meta_poll, file_mode=args.file_mode, dir_mode=args.dir_mode, uid=args.uid, gid=args.gid,
        debug=args.debug, fuse_options=tuple(args.fuse_options),
    )


def setup_logging(debug: bool, log_file: Path | None) -> None:
    handler: logging.Handler
    if log_file is not None:
        from epochfs.private import PrivateLogFile

        handler = PrivateLogFile(log_file, maxBytes=32 << 20, backupCount=3)
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.INFO if debug else logging.WARNING)


def cmd_mount(args: argparse.Namespace, argv: list[str]) -> int:
    config = config_from_args(args)
    if not args.foreground:
        return _spawn_daemon(config, args, argv)

    from epochfs import mount

    setup_logging(args.debug, args.log_file)
    ready_fd = args.ready_fd
    reported = False

    def ready(error: str | None) -> None:
        nonlocal reported
        if reported:
            return
        reported = True
        if error is not None:
            log.error("%s", error)
        if ready_fd is not None:
            os.write(ready_fd, b"ok\n" if error is None else error.encode() + b"\n")
            os.close(ready_fd)

    return mount.run(config, ready)


def _spawn_daemon(config: Config, args: argparse.Namespace, argv: list[str]) -> int:
    from epochfs.private import open_private, private_dir

    log_file = args.log_file or config.cache_dir / "epochfs.log"
    private_dir(config.cache_dir)  # checked before anything is written into it
    log_fd = open_private(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "epochfs", *argv, "--foreground", "--ready-fd", str(write_fd),
           "--log-file", str(log_file)]
    try:
        proc = subprocess.Popen(cmd, pass_fds=(write_fd,), start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=log_fd)
    finally:
        os.close(write_fd)
        os.close(log_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        answer = pipe.read().decode(errors="replace").strip()
    if answer == "ok":
        return 0
    code = proc.wait()
    if not answer:
        answer = f"the daemon exited with status {code} before the mount was ready; see {log_file}"
    print(f"epochfs: {answer}", file=sys.stderr)
    return code or 1


def cmd_umount(args: argparse.Namespace) -> int:
    from epochfs.control import PID_XATTR
    from epochfs.mount import is_dead_mount, lazy_unmount

    mountpoint = args.mountpoint
    if args.config:
        mountpoint = mountpoint or read_config_file(args.config).get("mountpoint")
    if not mountpoint:
        raise ConfigError("give MOUNTPOINT (or --config with a mountpoint key)")
    path = os.path.abspath(mountpoint)
    if is_dead_mount(path):
        lazy_unmount(path)
        print(f"epochfs: cleared a dead mount at {path}", file=sys.stderr)
        return 0
    if not os.path.ismount(path):
        if args.lazy:
            return 0
        raise ConfigError(f"{path} is not mounted")
    if args.lazy:
        lazy_unmount(path)
        return 0
    try:
        pid = int(os.getxattr(path, PID_XATTR))
    except OSError:
        pid = None
    result = subprocess.run(["fusermount3", "-u", path], capture_output=True, text=True)
    if result.returncode != 0:
        raise EpochfsError(f"unmount failed: {result.stderr.strip()}")
    deadline = time.monotonic() + args.timeout
    while pid is not None and _alive(pid):
        if time.monotonic() > deadline:
            raise EpochfsError(f"unmounted, but daemon pid {pid} is still running after {args.timeout}s")
        time.sleep(0.05)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmd_status(args: argparse.Namespace) -> int:
    from epochfs.control import request

    status = request(args.mountpoint, "status")
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


def stats_table(prev: dict[str, Any], cur: dict[str, Any], seconds: float) -> Any:
    """The rows of one ``epochfs stats`` refresh, from two status snapshots ``seconds`` apart."""
    from rich.table import Table

    from epochfs.stats import HistogramSnapshot

    c0, c1, s1, p1 = prev["cache"], cur["cache"], cur["store"], cur["prefetch"]
    hit = c1["hit_bytes"] - c0["hit_bytes"]
    miss = c1["miss_bytes"] - c0["miss_bytes"]
    backend = (c1["demand_bytes"] + c1["prefetch_bytes"]) - (c0["demand_bytes"] + c0["prefetch_bytes"])
    lat = HistogramSnapshot.from_dict(cur["read_seconds"]).minus(HistogramSnapshot.from_dict(prev["read_seconds"]))
    reads = lat.count

    def ms(v: float | None) -> str:
        return "-" if v is None else ("> 30 s" if v == float("inf") else f"{v * 1000:.2f} ms")

    t = Table(title=f"epochfs {cur['mountpoint']}  <-  {cur['source']}", show_header=True, expand=False)
    t.add_column("", style="bold")
    t.add_column("now", justify="right")
    t.add_column("since start", justify="right")
    total_hit, total_miss = c1["hit_bytes"], c1["miss_bytes"]
    t.add_row("hit ratio (bytes)", f"{hit / (hit + miss):.1%}" if hit + miss else "-",
              f"{total_hit / (total_hit + total_miss):.1%}" if total_hit + total_miss else "-")
    t.add_row("from cache", f"{_human(hit / seconds)}/s", _human(total_hit))
    t.add_row("from backend", f"{_human(backend / seconds)}/s", _human(c1["demand_bytes"] + c1["prefetch_bytes"]))
    t.add_row("reads", f"{reads / seconds:.0f}/s", str(c1["hits"] + c1["misses"]))
    t.add_row("read latency p50 / p99", f"{ms(lat.quantile(0.5))} / {ms(lat.quantile(0.99))}", "")
    t.add_row("cache", f"{s1['used_bytes'] / s1['capacity_bytes']:.1%} full",
              f"{_human(s1['used_bytes'])} of {_human(s1['capacity_bytes'])}")
    t.add_row("evictions", f"{(s1['evictions'] - prev['store']['evictions']) / seconds:.1f}/s", str(s1["evictions"]))
    if p1["blocks"]:
        lead = f"{p1['lead_seconds']:.1f} s" if p1["lead_seconds"] is not None else "-"
        t.add_row("prefetch lead", lead, _human(p1["lead_bytes"]))
        t.add_row("manifest", f"file {p1['file_position'] + 1} of {p1['files']}", f"{_human(p1['queued_bytes'])} queued")
    else:
        t.add_row("prefetch", "no manifest", "")
    errors = sum(cur["errors"].values()) + s1["fill_errors"]
    t.add_row("errors / corrupt blocks", str(errors), str(s1["corrupt_blocks"]))
    return t


def cmd_stats(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from epochfs.control import request

    console = Console()
    prev, when = request(args.mountpoint, "status"), time.monotonic()
    frames = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while args.count is None or frames < args.count:
                time.sleep(args.interval)
                cur, now = request(args.mountpoint, "status"), time.monotonic()
                live.update(stats_table(prev, cur, now - when), refresh=True)
                prev, when = cur, now
                frames += 1
        except KeyboardInterrupt:
            pass
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_status(s: dict[str, Any]) -> str:
    c, st, snap = s["cache"], s["store"], s["snapshot"]
    reads = c["hit_bytes"] + c["miss_bytes"]
    ratio = f"{c['hit_bytes'] / reads:.1%}" if reads else "n/a"
    return "\n".join([
        f"mount      {s['mountpoint']}  <-  {s['source']}  (pid {s['pid']})",
        f"snapshot   version {snap['version']}: {snap['files']} files, {snap['directories']} directories, "
        f"{_human(snap['bytes'])}; store {s['meta']['url']}"
        + ("" if s["meta"]["reachable"] else f" UNREACHABLE ({s['meta']['error']})"),
        f"cache      {_human(st['used_bytes'])} of {_human(st['capacity_bytes'])} in {st['blocks']} blocks "
        f"({s['cache_dir']})",
        f"reads      hit ratio {ratio} by bytes; {c['hits']} hits, {c['misses']} misses",
        f"backend    {_human(c['demand_bytes'])} on demand, {_human(c['prefetch_bytes'])} ahead; "
        f"{c['inflight']} in flight",
        f"evictions  {st['evictions']} ({s['eviction']}); corrupt blocks {st['corrupt_blocks']}; "
        f"fill errors {st['fill_errors']}",
        format_prefetch(s["prefetch"]),
    ])


def format_prefetch(p: dict[str, Any]) -> str:
    if not p["blocks"]:
        return "prefetch   no manifest (epochfs prefetch MOUNTPOINT --manifest FILE)"
    lead = f"{p['lead_seconds']:.1f}s" if p["lead_seconds"] is not None else "n/a"
    epoch = f"epoch {p['epoch']}, " if p["epoch"] is not None else ""
    return (f"prefetch   {epoch}file {p['file_position'] + 1} of {p['files']} "
            f"({_human(p['position_bytes'])} of {_human(p['plan_bytes'])}); "
            f"lead {_human(p['lead_bytes'])} = {lead}; queued {_human(p['queued_bytes'])}; "
            f"{p['inflight']} in flight" + ("" if p["active"] else "; done"))


def _order(args: argparse.Namespace, manifest: str) -> list[Entry]:
    """The entries this rank reads, from a manifest and the epoch-order flags."""
    from epochfs.prefetch.manifest import ManifestError, partition, permutation, read

    entries = read(manifest)
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise ConfigError("--rank must be in [0, --world-size)")
    if args.seed is not None:
        if args.epoch is None:
            raise ConfigError("--seed needs --epoch")
        perm = permutation(len(entries), args.seed + args.epoch)
        entries = [entries[i] for i in perm]
    try:
        return partition(entries, args.rank, args.world_size)
    except ValueError as exc:
        raise ManifestError(str(exc)) from None


def _mount_relative(mountpoint: str, path: str) -> str:
    full = os.path.abspath(path if os.path.isabs(path) else os.path.join(mountpoint, path))
    rel = os.path.relpath(full, os.path.abspath(mountpoint))
    if rel.startswith(".."):
        raise ConfigError(f"{path} is not under {mountpoint}")
    return "" if rel == "." else rel


def cmd_prefetch(args: argparse.Namespace) -> int:
    import tempfile

    from epochfs.control import request

    manifest = args.manifest
    if args.stored:
        text = request(args.mountpoint, "get_manifest", name=args.stored)["text"]
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as tmp:
            tmp.write(text)
        manifest = tmp.name
    try:
        entries = _order(args, manifest)
    finally:
        if args.stored:
            os.unlink(manifest)
    if args.publish:
        with open(args.manifest, encoding="utf-8") as f:
            request(args.mountpoint, "publish_manifest", name=args.publish, text=f.read())
        print(f"epochfs: published {args.manifest} as {args.publish!r}")
    reply = request(args.mountpoint, "prefetch", entries=[[e.line, e.path] for e in entries],
                    source=args.manifest or args.stored, epoch=args.epoch, replace=args.replace)
    how = "queued after the current plan" if reply["appended"] else "loaded"
    print(f"epochfs: {reply['files']} files ({_human(reply['plan_bytes'])} in the plan) {how}")
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from epochfs.control import request

    if args.manifest:
        entries = [[e.line, e.path] for e in _order(args, args.manifest)]
        source = args.manifest
    elif args.paths:
        entries = [[i, _mount_relative(args.mountpoint, p)] for i, p in enumerate(args.paths, 1)]
        source = "argument"
    else:
        raise ConfigError("name PATHs or --manifest")
    if args.check:
        r = request(args.mountpoint, "resident", entries=entries, source=source)
        frac = r["resident_bytes"] / r["total_bytes"] if r["total_bytes"] else 1.0
        print(f"{frac:.1%} cached: {_human(r['resident_bytes'])} of {_human(r['total_bytes'])}; "
              f"{r['resident_files']} of {r['files']} files whole")
        return 0
    job = request(args.mountpoint, "warmup", entries=entries, source=source)
    columns = (TextColumn("[bold]warmup"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
               TextColumn("{task.fields[files]}"), TimeRemainingColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("warmup", total=job["total_bytes"], files="")
        while True:
            job = request(args.mountpoint, "job", id=job["id"])
            progress.update(task, completed=job["done_bytes"] + job["skipped_bytes"],
                            files=f"{job['done_files']}/{job['files']} files")
            if job["finished"]:
                break
            time.sleep(0.2)
    print(f"epochfs: warmed {_human(job['done_bytes'])} of {_human(job['total_bytes'])} "
          f"in {job['elapsed']:.1f}s")
    if job["skipped_bytes"]:
        print(f"epochfs: the cache is full: {_human(job['skipped_bytes'])} not cached", file=sys.stderr)
    for err in job["errors"]:
        print(f"epochfs: {err}", file=sys.stderr)
    return 1 if job["errors"] else 0


def _sizes(args: argparse.Namespace, entries: list[Entry], manifest: str) -> list[tuple[str, int]]:
    out = []
    for e in entries:
        size = e.size
        if size is None:
            base = args.mount or args.root
            if base is None:
                raise ConfigError(f"{manifest}:{e.line}: no size; give --mount or --root, or use JSON Lines with \"size\"")
            try:
                size = os.stat(os.path.join(base, e.path)).st_size
            except OSError as exc:
                raise ConfigError(f"{manifest}:{e.line}: {e.path}: {exc.strerror}") from None
        out.append((e.path, size))
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    from epochfs.prefetch.simulate import block_sequence, simulate

    current = block_sequence(_sizes(args, _order(args, args.manifest), args.manifest), args.block_size)
    previous = []
    if args.previous_manifest:
        prev_args = argparse.Namespace(**vars(args))
        if args.seed is not None:
            prev_args.epoch = args.previous_epoch if args.previous_epoch is not None else args.epoch - 1
        previous = block_sequence(_sizes(args, _order(prev_args, args.previous_manifest), args.previous_manifest),
                                  args.block_size)
    results = [simulate(current, args.cache_size, name, warmup=previous) for name in ("manifest", "lru", "none")]
    total = sum(size for _, size in current)
    if args.json:
        print(json.dumps({"epoch_bytes": total, "cache_size": args.cache_size, "block_size": args.block_size,
                          "policies": {r.policy: {"hit_ratio": r.hit_ratio, "backend_bytes": r.miss_bytes,
                                                  "hits": r.hits, "reads": r.reads} for r in results}}, indent=2))
        return 0
    print(f"epoch: {len(current)} blocks, {_human(total)}; cache {_human(args.cache_size)}"
          + (" (warm from the previous epoch)" if previous else " (cold)"))
    print(f"{'policy':<10} {'hit ratio':>10} {'backend bytes':>15}")
    for r in results:
        print(f"{r.policy:<10} {r.hit_ratio:>10.1%} {_human(r.miss_bytes):>15}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from epochfs.backend import BackendSettings, open_backend
    from epochfs.meta import open_meta

    source = Source.parse(args.source)
    backend = open_backend(BackendSettings(source, endpoint_url=args.endpoint_url, region=args.region))
    store = open_meta(args.meta, Path("."), args.name)
    started = time.monotonic()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed:,} objects"),
                  TimeElapsedColumn()) as progress:
        task = progress.add_task(f"listing {source.url}", total=None)
        listed = []
        for obj in backend.list_objects():
            listed.append(obj)
            if len(listed) % 1000 == 0:
                progress.update(task, completed=len(listed))
        progress.update(task, completed=len(listed), description="listed")
        pub = progress.add_task(f"publishing to {store.url}", total=len(listed))
        snapshot = store.save(backend.source_id, listed, lambda n: progress.update(pub, completed=n))
    store.close()
    print(f"epochfs: published version {snapshot.version} of {backend.source_id}: {len(listed)} objects "
          f"in {time.monotonic() - started:.1f}s")
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    from epochfs.control import request

    reply = request(args.mountpoint, "refresh", timeout=3600)
    if reply["changed"]:
        print(f"epochfs: now serving snapshot version {reply['version']} ({reply['changed_entries']} entries changed)")
    else:
        print(f"epochfs: already serving the newest snapshot (version {reply['version']})")
    return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    from epochfs.cache.policies import make_policy
    from epochfs.cache.store import BlockStore

    if not (args.cache_dir / "index").is_dir():
        raise ConfigError(f"{args.cache_dir} is not an epochfs cache directory")
    store = BlockStore(args.cache_dir, 1 << 62, 0.0, make_policy("lru"))
    store.open(reconcile=False)
    try:
        r = store.fsck(args.repair)
    finally:
        store.close()
    problems = r["damaged"] + r["orphans"]
    print(f"{r['blocks']} blocks ({_human(r['used_bytes'])}): {r['damaged']} damaged, {r['orphans']} orphan files "
          f"({_human(r['orphan_bytes'])})" + ("; repaired" if args.repair and problems else ""))
    return 0 if args.repair or not problems else 1


def cmd_manifest(args: argparse.Namespace) -> int:
    from epochfs.prefetch.manifest import write

    entries = _order(args, args.paths_file)
    write(args.output, (e.path for e in entries))
    print(f"epochfs: wrote {len(entries)} paths to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {
        "mount": lambda a: cmd_mount(a, argv), "umount": cmd_umount, "status": cmd_status, "stats": cmd_stats,
        "prefetch": cmd_prefetch, "warmup": cmd_warmup, "plan": cmd_plan, "manifest": cmd_manifest,
        "import": cmd_import, "refresh": cmd_refresh, "fsck": cmd_fsck,
    }
    try:
        if args.command == "mount" and args.config:
            args = apply_config_file(parser, args._mount_parser, argv, args.config)
        return commands[args.command](args)
    except ConfigError as exc:
        print(f"epochfs: {exc}", file=sys.stderr)
        return 2
    except EpochfsError as exc:
        print(f"epochfs: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
