"""``epochfs pack``: write a dataset as tar shards that a mount serves as the original tree."""

from __future__ import annotations

import argparse
import os

from epochfs.cli.common import EPILOG, human
from epochfs.cli.epoch import size_arg
from epochfs.core.records import Source

DESCRIPTION = """\
Write the files under SOURCE (s3://BUCKET/PREFIX or file:///PATH) as standard tar shards under DEST
(an S3 prefix), with an index of every member (path, shard, offset, size, mtime, xxh64) and a pointer
object written last: a mount or a reader sees the previous pack, or the new one whole.

`epochfs mount DEST` then presents the original tree (names, sizes, mtimes) and serves each file as
a range of its shard through the block cache: the first epoch reads a few large objects instead of one
request per file. The shards are plain tar files (readable by `tar` and WebDataset).

Runs are incremental: unchanged files stay where they are, new and changed files go into new shards
(a changed file's old bytes stay in their shard, unused, until --full repacks everything). A run that
is cut short resumes where it stopped: shards it uploaded whole are kept. One run at a time per DEST.
"""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pack", help="write a dataset as tar shards (a mount serves them as the original files)",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", help="s3://BUCKET/PREFIX or file:///PATH: the files to pack")
    p.add_argument("dest", metavar="DEST", help="an S3 prefix that is empty or holds an earlier pack")
    p.add_argument("--shard-size", type=size_arg, default="256M", metavar="SIZE",
                   help="bytes of files per shard, about (a larger file gets a shard of its own; default: 256M)")
    p.add_argument("--jobs", type=int, default=4, metavar="N", help="shards written at once (default: 4); each "
                   "needs about --shard-size of local disk until it is uploaded")
    p.add_argument("--readers", type=int, default=16, metavar="N",
                   help="source files read at once (default: 16)")
    p.add_argument("--full", action="store_true",
                   help="pack every file again (reclaims the space of changed files' old bytes; also the way out of a "
                   "damaged pack)")
    p.add_argument("--prune", action="store_true",
                   help="after the new pack is current, delete the shards and indexes of earlier ones it does not "
                   "use (mounts still serving an older pack then get ESTALE until they refresh)")
    p.add_argument("--work-dir", metavar="DIR", help="where shards are written before upload (default: $TMPDIR)")
    p.add_argument("--endpoint-url", metavar="URL", help="S3-compatible endpoint of SOURCE and DEST")
    p.add_argument("--region", help="the buckets' region (default: from the AWS configuration)")
    p.add_argument("--profile", metavar="NAME", help="AWS profile whose credentials to use")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_pack)


def cmd_pack(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from epochfs.backend import BackendSettings, kind_of, open_backend
    from epochfs.core.errors import ConfigError
    from epochfs.pack.writer import PackSettings, pack

    source, dest = Source.parse(args.source), Source.parse(args.dest)
    if not kind_of(dest).capabilities.write:
        raise ConfigError(f"DEST must be a place that can be written (an S3 prefix, s3://BUCKET/PREFIX); {dest.url} "
                          "cannot")
    if (source.scheme, source.bucket) == (dest.scheme, dest.bucket) and (
            source.prefix.startswith(dest.prefix) or dest.prefix.startswith(source.prefix)):
        raise ConfigError("SOURCE and DEST overlap: pack into a prefix outside the source, and the source not into it")
    if args.jobs < 1 or args.readers < 1:
        raise ConfigError("--jobs and --readers must be at least 1")

    def backend(where: Source, concurrency: int) -> object:
        return open_backend(BackendSettings(where, endpoint_url=args.endpoint_url, region=args.region,
                                            profile=args.profile, concurrency=concurrency))

    src, dst = backend(source, args.readers), backend(dest, args.jobs * 4)
    settings = PackSettings(shard_size=args.shard_size, jobs=args.jobs, readers=args.readers, full=args.full,
                            prune=args.prune, work_dir=args.work_dir)
    columns = (TextColumn("packing"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, disable=args.quiet or not os.isatty(2), transient=True) as progress:
        task = progress.add_task("pack", total=None)
        try:
            summary = pack(src, dst, settings, source_url=source.url,  # type: ignore[arg-type]
                           planned=lambda files, nbytes: progress.update(task, total=nbytes),
                           progress=lambda n: progress.advance(task, n))
        finally:
            src.close()  # type: ignore[attr-defined]
            dst.close()  # type: ignore[attr-defined]
    if not summary.written:
        print(f"epochfs: {dest.url} is up to date (generation {summary.generation}: {summary.files} files, "
              f"{human(summary.bytes)} in {summary.shards} shards)")
    else:
        print(f"epochfs: packed {summary.packed} files ({human(summary.packed_bytes)}) into {summary.new_shards} new "
              f"shards in {summary.seconds:.1f}s; kept {summary.kept} and resumed {summary.resumed} members")
        print(f"epochfs: generation {summary.generation} of {dest.url} is current: {summary.files} files, "
              f"{human(summary.bytes)} in {summary.shards} shards")
    if summary.skipped:
        print(f"epochfs: {len(summary.skipped)} files changed or vanished while they were read and were left out "
              f"(such as {summary.skipped[0]}): run again to pack them")
    if summary.unsafe:
        print(f"epochfs: {summary.unsafe} keys cannot be paths of a mount and were left out (see the log)")
    if summary.unreferenced_bytes:
        print(f"epochfs: {human(summary.unreferenced_bytes)} of earlier shards are no longer used (--prune deletes them)")
    return 1 if summary.skipped else 0
