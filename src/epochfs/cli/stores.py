"""Commands about the stores rather than one epoch: ``import`` (publish a snapshot), ``refresh``
(switch a mount to the newest one) and ``fsck`` (check a cache directory offline)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from epochfs.cli.common import EPILOG, human
from epochfs.config import Source
from epochfs.errors import ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    im = sub.add_parser("import", help="list a source once and publish its snapshot to a metadata store",
                        description="List SOURCE and publish a new snapshot version (paths, sizes, mtimes, ETags) "
                        "to the store, atomically: daemons mounting with --meta load it instead of listing.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    im.add_argument("source", metavar="SOURCE")
    im.add_argument("--meta", required=True, metavar="URL", help="redis://HOST:PORT/DB or lmdb://PATH")
    im.add_argument("--name", metavar="NAME", help="dataset name in the store (default: the source URL)")
    im.add_argument("--endpoint-url", metavar="URL")
    im.add_argument("--region", help="the bucket's region (default: from the AWS configuration, or as the "
                    "endpoint says)")
    im.add_argument("--profile", metavar="NAME", help="AWS profile whose credentials to use")
    im.set_defaults(run=cmd_import)

    fk = sub.add_parser("fsck", help="check a cache directory (while it is not mounted)",
                        description="Verify the checksum of every cached block and look for block files the index "
                        "does not know. Exit 0 if the cache is clean (or was repaired), 1 if problems remain.")
    fk.add_argument("--cache-dir", required=True, type=Path, metavar="DIR")
    fk.add_argument("--repair", action="store_true", help="drop damaged blocks and delete orphan files")
    fk.set_defaults(run=cmd_fsck)

    rf = sub.add_parser("refresh", help="switch a mount to the newest snapshot without unmounting",
                        description="Load the newest published snapshot (or, with the embedded store, list the "
                        "source again) and serve it. Files already open keep reading the version they opened, "
                        "or fail with ESTALE; they never mix versions.")
    rf.add_argument("mountpoint", metavar="MOUNTPOINT")
    rf.set_defaults(run=cmd_refresh)


def cmd_import(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from epochfs.backend import BackendSettings, open_backend
    from epochfs.meta import open_meta

    source = Source.parse(args.source)
    backend = open_backend(BackendSettings(source, endpoint_url=args.endpoint_url, region=args.region,
                                           profile=args.profile))
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
    print(f"{r['blocks']} blocks ({human(r['used_bytes'])}): {r['damaged']} damaged, {r['orphans']} orphan files "
          f"({human(r['orphan_bytes'])})" + ("; repaired" if args.repair and problems else ""))
    return 0 if args.repair or not problems else 1
