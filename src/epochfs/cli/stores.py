"""Commands about the stores rather than one epoch: ``import`` (publish a snapshot), ``refresh``
(switch a mount to the newest one), ``sync`` (wait until what was written is in the backend) and
``fsck`` (check a cache directory offline)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from epochfs.cli.common import EPILOG, human
from epochfs.core.errors import ConfigError
from epochfs.core.records import Source
from epochfs.core.text import printable


def add_parsers(sub: argparse._SubParsersAction) -> None:
    im = sub.add_parser("import", help="list a source once and publish its snapshot to a metadata store",
                        description="List SOURCE and publish a new snapshot version (paths, sizes, mtimes, ETags) "
                        "to the store, atomically: daemons mounting with --meta load it instead of listing.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    im.add_argument("source", metavar="SOURCE")
    im.add_argument("--meta", required=True, metavar="URL", help="redis[s]://[USER@]HOST:PORT/DB or lmdb://PATH")
    im.add_argument("--meta-password-file", type=Path, metavar="FILE",
                    help="file holding the store's password (mode 0600; or EPOCHFS_META_PASSWORD): the records "
                    "published are signed with it, and mounts with it take owners and modes from them")
    im.add_argument("--meta-ca-file", type=Path, metavar="FILE",
                    help="CA certificates a rediss:// store's certificate must chain to (default: the system's)")
    im.add_argument("--meta-name", "--name", dest="name", metavar="NAME",
                    help="the dataset's name in the store, as mount, serve and cluster take it (default: the "
                    "source URL)")
    im.add_argument("--endpoint-url", metavar="URL")
    im.add_argument("--region", help="the bucket's region (default: from the AWS configuration, or as the "
                    "endpoint says)")
    im.add_argument("--profile", metavar="NAME", help="AWS profile whose credentials to use")
    im.set_defaults(run=cmd_import)

    fk = sub.add_parser("fsck", help="check a cache directory (while it is not mounted)",
                        description="Verify the checksum of every cached block and look for block files the index "
                        "does not know, malformed index entries and entries that are not cache files. Without "
                        "--repair nothing in the directory is changed (a cache whose index a mount would discard, "
                        "damaged or of another version, is reported as an error). Exit 0 if the cache is clean "
                        "(or was repaired), 1 if problems remain.")
    fk.add_argument("--cache-dir", required=True, type=Path, metavar="DIR")
    fk.add_argument("--repair", action="store_true",
                    help="drop damaged blocks and malformed entries, delete orphan and stray files (an index a "
                    "mount would discard is discarded)")
    fk.set_defaults(run=cmd_fsck)

    rf = sub.add_parser("refresh", help="switch a mount to the newest snapshot without unmounting",
                        description="Load the newest published snapshot (or, with the embedded store, list the "
                        "source again) and serve it. Files already open keep reading the version they opened, "
                        "or fail with ESTALE; they never mix versions.")
    rf.add_argument("mountpoint", metavar="MOUNTPOINT")
    rf.set_defaults(run=cmd_refresh)

    sy = sub.add_parser("sync", help="wait until what was written through a --writeback mount is in the backend",
                        description="Block until every file written through MOUNTPOINT (or under each PATH) is "
                        "uploaded and published, then exit 0. Files still open for writing are waited for too. "
                        "Exit 1 naming what is still pending when --timeout passes (nothing is lost: the uploads "
                        "go on), 2 for a usage error. A read-only mount has nothing to sync.")
    sy.add_argument("mountpoint", metavar="MOUNTPOINT")
    sy.add_argument("paths", nargs="*", metavar="PATH", help="files or directories, absolute or relative to the "
                    "mount root (default: everything)")
    sy.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after this long (default: wait "
                    "as long as it takes)")
    sy.add_argument("--quiet", "-q", action="store_true", help="no progress line, and nothing said on success")
    sy.set_defaults(run=cmd_sync)


def cmd_import(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from epochfs.backend import BackendSettings, open_backend
    from epochfs.daemon.config import store_access
    from epochfs.meta import open_meta
    from epochfs.pack.listing import dataset_listing

    source = Source.parse(args.source)
    backend = open_backend(BackendSettings(source, endpoint_url=args.endpoint_url, region=args.region,
                                           profile=args.profile))
    store = open_meta(args.meta, Path("."), args.name, store_access(args.meta_password_file, args.meta_ca_file))
    started = time.monotonic()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed:,} objects"),
                  TimeElapsedColumn()) as progress:
        task = progress.add_task(f"listing {source.url}", total=None)
        listed = []
        for obj in dataset_listing(backend):
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
    from epochfs.blockstore.store import BlockStore
    from epochfs.eviction import make_policy

    if not (args.cache_dir / "index").is_dir():
        raise ConfigError(f"{args.cache_dir} is not an epochfs cache directory")
    store = BlockStore(args.cache_dir, 1 << 62, 0.0, make_policy("lru"))
    store.open(reconcile=False, inspect=not args.repair)  # without --repair, nothing is changed
    try:
        r = store.fsck(args.repair)
    finally:
        store.close()
    problems = r["damaged"] + r["orphans"] + r["malformed"] + r["strays"]
    extra = "".join(f", {r[k]} {what}" for k, what in (("malformed", "malformed index entries"),
                                                         ("strays", "entries that are not cache files")) if r[k])
    # (blocks are named by a hash of their identity, never by the dataset's names: see docs/block-cache.md)
    if args.repair and problems:
        print(f"{r['checked']} blocks checked: {r['damaged']} damaged and {r['orphans']} orphan files "
              f"({human(r['orphan_bytes'])}){extra} removed (a removed block is fetched again when next read); "
              f"{r['blocks']} blocks ({human(r['used_bytes'])}) remain")
    else:
        print(f"{r['blocks']} blocks ({human(r['used_bytes'])}): {r['damaged']} damaged, {r['orphans']} orphan files "
              f"({human(r['orphan_bytes'])}){extra}" + ("; `epochfs fsck --repair` removes them (the daemon "
                                                         "fetches them again)" if problems else ""))
    return 0 if args.repair or not problems else 1


def _list_pending(reply: dict) -> None:
    import sys

    from epochfs.writeback.owed import PENDING_WHY, state_kind

    for item in reply["pending"]:
        size = f" {human(item['bytes'])}" if item["bytes"] else ""
        state = str(item["state"])
        kind = state_kind(state)
        why = f": {PENDING_WHY[kind]}" if kind in PENDING_WHY else ""
        print(f"  {printable(str(item['key']))}{size} ({printable(state)}{why})", file=sys.stderr)
    if reply["pending_total"] > len(reply["pending"]):
        print(f"  ... and {reply['pending_total'] - len(reply['pending'])} more", file=sys.stderr)


def cmd_sync(args: argparse.Namespace) -> int:
    import sys

    from epochfs.client import Client
    from epochfs.core.errors import NotDurable

    if args.timeout is not None and not args.timeout >= 0:
        raise ConfigError("--timeout must be a number of seconds >= 0")
    show = not args.quiet and sys.stderr.isatty()

    from epochfs.core.text import printable
    from epochfs.writeback.owed import pending_summary

    def progress(reply: dict) -> None:
        if show:
            why = printable(pending_summary(reply["pending"], reply["pending_total"]))[:300]
            print(f"\rwaiting for {reply['pending_total']} uploads ({human(reply['pending_bytes'])}): {why}\033[K",
                  end="", file=sys.stderr, flush=True)

    try:
        reply = Client(args.mountpoint).sync(args.paths, timeout=args.timeout, progress=progress)
    except KeyboardInterrupt:
        print("\nepochfs sync: interrupted; the uploads go on", file=sys.stderr)
        return 130
    except NotDurable as exc:
        if show:
            print("\r\033[K", end="", file=sys.stderr)
        print(f"epochfs sync: {exc.message}:", file=sys.stderr)
        _list_pending(exc.reply)
        return 1
    if show:
        print("\r\033[K", end="", file=sys.stderr)
    if not reply["writeback"]:
        print(f"{args.mountpoint} is read-only: nothing to sync", file=sys.stderr)
    elif not args.quiet:
        under = f" under {', '.join(args.paths)}" if args.paths else ""
        print(f"epochfs sync: every file written{under} is in the backend", file=sys.stderr)
    return 0
