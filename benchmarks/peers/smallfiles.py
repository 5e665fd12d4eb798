"""The small-file path, side by side in one run: raw boto3 GETs, epochfs (cold: empty cache; warm: block
cache on disk, page cache dropped) and the two floors of our stack: a minimal daemon on epochfs's FUSE
session layer over the same bytes on local disk (benchmarks/peers/floor.py, for warm reads) and one that answers each read with a
ranged GET through epochfs's S3 client and keeps nothing (benchmarks/peers/floor_s3.py, for cold reads).
Reports files/s at 1 and 16 reader threads, the daemon's CPU per file, and one cold large-file stream
against 8 parallel ranged GETs. The contenders run in alternating order from one repetition to the
next, and each ratio is the median of the ratios within a repetition (with their range), so a drift of
the machine's speed does not favour one. ``--cores 1`` runs everything (the S3 server too) pinned to
one core, to show how the numbers scale from 1 to 2 cores; ``--server-cores 1`` gives the S3 server a
core of its own and the readers and daemons the rest, as on a node whose object store is elsewhere.

    sudo .venv/bin/python benchmarks/peers/smallfiles.py [--files 1000] [--reps 3] [--cores 2] [--server-cores 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import proc_usage, unmount, wait_mounted  # noqa: E402
from workloads import (  # noqa: E402
    boto_parallel,
    boto_small_rate,
    drop_page_cache,
    fresh_workdir,
    log,
    seq_read,
    shard_and_files,
    small_files_rate,
)

from epochfs.dev.sample import upload, write_tree  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20




class Mounted:
    """A FUSE daemon under test: epochfs or the floor; its pid for CPU accounting."""

    def __init__(self, work: Path, name: str) -> None:
        self.mnt, self.cache, self.name = work / f"{name}-mnt", work / f"{name}-cache", name
        self.pid: int | None = None

    def unmount(self) -> None:
        unmount(self.mnt, self.pid)
        self.pid = None

    def cpu(self) -> float:
        return proc_usage(self.pid)["cpu"]


def mount_epochfs(m: Mounted, server: LocalS3, cold: bool, extra: list[str]) -> None:
    m.unmount()
    if cold:
        shutil.rmtree(m.cache, ignore_errors=True)
    m.mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "epochfs", "mount", "s3://bench/ds", str(m.mnt), "--endpoint-url",
                    server.endpoint, "--cache-dir", str(m.cache), "--metrics-addr", "off", "--cache-size", "20G",
                    *extra], env=server.env(), check=True)
    m.pid = int(os.getxattr(m.mnt, "user.epochfs.pid"))


def start_daemon(m: Mounted, argv: list[str], env: dict[str, str] | None = None) -> None:
    """Mount ``m`` with a floor daemon (a script here, in the foreground) and note its pid."""
    m.unmount()
    m.mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_mounted(m.mnt)
    m.pid = proc.pid


def mount_floor(m: Mounted, raw: Path) -> None:
    start_daemon(m, [str(HERE / "floor.py"), str(raw), str(m.mnt)])


def mount_cold_floor(m: Mounted, server: LocalS3) -> None:
    start_daemon(m, [str(HERE / "floor_s3.py"), "s3://bench/ds", str(m.mnt), "--endpoint-url", server.endpoint],
                 env=server.env())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--large-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="pin everything to this many cores")
    ap.add_argument("--server-cores", type=int, default=0,
                    help="give the S3 server this many of the cores to itself (default: it shares them all)")
    ap.add_argument("--epochfs-args", default="", help="extra mount flags for epochfs")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "smallfiles")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (FUSE mounts, dropping the page cache)", file=sys.stderr)
        return 2
    if not 0 <= args.server_cores < args.cores:
        print("--server-cores must leave at least one of --cores to the readers", file=sys.stderr)
        return 2
    cores = list(range(args.cores))
    os.sched_setaffinity(0, set(cores[:args.server_cores] or cores))  # inherited by the S3 server
    fresh_workdir(args.work)
    small, large = shard_and_files(args.files, args.large_mib)
    keys = [f.key for f in small]
    rows: dict[tuple[str, str], list[float]] = {}

    def record(who: str, what: str, value: float) -> None:
        rows.setdefault((who, what), []).append(value)
        log(f"{who:10s} {what:40s} {value:9.2f}")

    server = LocalS3(args.work / "s3").start()
    os.sched_setaffinity(0, set(cores[args.server_cores:]))  # inherited by the readers and the daemons
    epochfs, floor, cold_floor = (Mounted(args.work, name) for name in ("epochfs", "floor", "cold-floor"))
    extra = args.epochfs_args.split()
    try:
        client = server.client()
        upload(client, "bench", "ds/", [*small, large])
        raw = args.work / "raw"
        write_tree(str(raw), [*small, large])

        def run_boto() -> None:
            # Every cold run starts with the page cache dropped, raw boto3's too: the S3 server then
            # reads the objects from its disk for both, as it does for a dataset it has not served lately.
            for threads in (1, 16):
                drop_page_cache()
                record("raw boto3", f"cold files/s, {threads} thr", boto_small_rate(client, "bench",
                                                                                     ["ds/" + k for k in keys], threads))
            drop_page_cache()
            record("raw boto3", "cold large MiB/s (8 x 8 MiB ranged)",
                   boto_parallel(client, "bench", [("ds/" + large.key, large.size)], 8, 8 * MiB) / MiB)

        def run_epochfs() -> None:
            for threads in (1, 16):
                mount_epochfs(epochfs, server, cold=True, extra=extra)
                drop_page_cache()
                before = epochfs.cpu()
                record("epochfs", f"cold files/s, {threads} thr", small_files_rate(epochfs.mnt, keys, threads))
                record("epochfs", f"cold daemon CPU ms/file, {threads} thr", (epochfs.cpu() - before) * 1000 / len(keys))
                time.sleep(1)  # fills written behind the readers land
                drop_page_cache()
                before = epochfs.cpu()
                record("epochfs", f"warm files/s, {threads} thr", small_files_rate(epochfs.mnt, keys, threads))
                record("epochfs", f"warm daemon CPU ms/file, {threads} thr", (epochfs.cpu() - before) * 1000 / len(keys))
            mount_epochfs(epochfs, server, cold=True, extra=extra)
            drop_page_cache()
            record("epochfs", "cold large MiB/s (1 stream)", seq_read(epochfs.mnt / large.key) / MiB)
            time.sleep(1)
            drop_page_cache()
            record("epochfs", "warm large MiB/s (1 stream)", seq_read(epochfs.mnt / large.key) / MiB)
            epochfs.unmount()

        def run_floor() -> None:
            # The local files written afresh, as epochfs's cold pass writes its cache blocks: this
            # machine's disk reads what was written a moment ago faster (readpath.py, 2026-12-06).
            write_tree(str(raw), [*small, large])
            os.sync()
            mount_floor(floor, raw)
            for threads in (1, 16):
                drop_page_cache()
                before = floor.cpu()
                record("floor", f"warm files/s, {threads} thr", small_files_rate(floor.mnt, keys, threads))
                record("floor", f"warm daemon CPU ms/file, {threads} thr", (floor.cpu() - before) * 1000 / len(keys))
            drop_page_cache()
            record("floor", "warm large MiB/s (1 stream)", seq_read(floor.mnt / large.key) / MiB)
            floor.unmount()

        def run_cold_floor() -> None:
            for threads in (1, 16):
                mount_cold_floor(cold_floor, server)
                drop_page_cache()
                before = cold_floor.cpu()
                record("cold floor", f"cold files/s, {threads} thr", small_files_rate(cold_floor.mnt, keys, threads))
                record("cold floor", f"cold daemon CPU ms/file, {threads} thr",
                       (cold_floor.cpu() - before) * 1000 / len(keys))
            mount_cold_floor(cold_floor, server)
            drop_page_cache()
            record("cold floor", "cold large MiB/s (1 stream)", seq_read(cold_floor.mnt / large.key) / MiB)
            cold_floor.unmount()

        for rep in range(args.reps):
            # The order alternates, so a drift of the machine's speed during the run (a VM's neighbours)
            # does not always favour the same contender; ratios are taken within a repetition.
            order = [run_boto, run_epochfs, run_floor, run_cold_floor]
            log(f"repetition {rep + 1} of {args.reps}")
            for run in order if rep % 2 == 0 else order[::-1]:
                run()
    finally:
        for m in (epochfs, floor, cold_floor):
            m.unmount()
        server.stop()

    med = {k: statistics.median(v) for k, v in rows.items()}

    def find(who: str, what: str) -> tuple[str, str] | None:
        return next((k for k in med if k[0] == who and k[1].startswith(what)), None)

    def paired(what: str, ref: str) -> str:
        mine, other = find("epochfs", what), find(ref, what)
        if not (mine and other):
            return ""
        ratios = sorted(a / b for a, b in zip(rows[mine], rows[other], strict=True) if b)
        return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"

    placement = (f"the S3 server on {args.server_cores} core(s) of its own" if args.server_cores
                 else "the S3 server sharing them")
    lines = [f"# Small-file path, {datetime.date.today().isoformat()}: {args.files} x 100 KiB, one "
             f"{args.large_mib} MiB file; {args.cores} core(s), {placement}; medians of {args.reps}",
             "", f"epochfs flags: `{args.epochfs_args or '(defaults)'}`", "",
             "Ratios are the median of the ratios within each repetition (range in brackets); contenders "
             "ran in alternating order. *floor*: a minimal daemon on epochfs's FUSE session layer over the bytes on local disk; "
             "*cold floor*: one that answers each read with a ranged GET and keeps nothing.", "",
             "| measurement | raw boto3 | epochfs | floor | cold floor | epochfs / reference | epochfs / cold floor |",
             "|---|---|---|---|---|---|---|"]
    for what, ref in [("cold files/s, 1 thr", "raw boto3"), ("cold files/s, 16 thr", "raw boto3"),
                      ("cold daemon CPU ms/file, 1 thr", None), ("cold daemon CPU ms/file, 16 thr", None),
                      ("warm files/s, 1 thr", "floor"), ("warm files/s, 16 thr", "floor"),
                      ("warm daemon CPU ms/file, 1 thr", "floor"), ("warm daemon CPU ms/file, 16 thr", "floor"),
                      ("cold large MiB/s", "raw boto3"), ("warm large MiB/s (1 stream)", "floor")]:
        def cell(who: str, what: str = what) -> str:
            key = find(who, what)
            return f"{med[key]:.2f}" if key else ""

        lines.append(f"| {what} | {cell('raw boto3')} | {cell('epochfs')} | {cell('floor')} | "
                     f"{cell('cold floor')} | {paired(what, ref) if ref else ''} | {paired(what, 'cold floor')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"{datetime.date.today().isoformat()}-smallfiles-{args.cores}core"
                       + (f"-server{args.server_cores}" if args.server_cores else ""))
    if Path(f"{stem}.md").exists():  # an earlier run of the same day stays
        stem = stem.with_name(stem.name + time.strftime("-%H%M"))
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps({"files": args.files, "cores": args.cores, "server_cores": args.server_cores,
                                                "reps": args.reps,
                                                "epochfs_args": args.epochfs_args,
                                                "rows": [{"who": k[0], "what": k[1], "values": v}
                                                         for k, v in rows.items()]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
