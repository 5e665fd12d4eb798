"""The read path against the peers, side by side in one run: one large file streamed (cold, warm, hot)
and 100 KiB files read whole (cold, warm at 1 and 16 readers, hot at 1), for epochfs, JuiceFS, s3fs-fuse,
rclone mount, raw boto3 GETs of the same objects (what the endpoint serves one client: a cold cell that
is as fast for every contender is bound by the backend's round trips), the floor of our stack (benchmarks/peers/floor.py: a minimal daemon on epochfs's FUSE session
layer doing a plain ``pread`` of the same bytes on local disk) and the raw local disk. Also the daemon's CPU seconds per GiB
of the warm stream. *Cold*: fresh mount, empty cache; *warm*: cache filled, page cache dropped; *hot*:
read again at once (and once more: the first read after the pages were filled also moves each page-cache
folio to the active list, so it pays per folio, the second does not), with the sizes of the folios the
kernel holds the file in (``benchmarks/peers/folios.py``; as root). This dataset's bytes are mostly in its
small files, so epochfs's default mount opens files with no request and reads them through the daemon;
``--variant=--passthrough`` has the kernel read every cached file itself (passthrough) beside it, with the
time until a restarted daemon lends the files a run before left. Files are opened with ``buffering=0``; the hot pass also runs with Python's default
buffering, as most datasets open files (each such open asks the file system whether the file is a
terminal: on FUSE, a request to the daemon). Each contender runs in turn, in alternating order from one
repetition to the next; each ratio is the median of the ratios within a repetition. The report is
written after each repetition (a run stopped early keeps what it measured, and says so). With
``--latency-ms`` the endpoint is reached through ``latency_proxy.py`` in a process of its own.

    sudo .venv/bin/python benchmarks/peers/readpath.py [--reps 3] [--latency-ms 20] [--cores 1] [--only epochfs,floor]
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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import Contender, Epochfs, Juicefs, RawDisk, Rclone, S3fs, proc_usage, wait_mounted  # noqa: E402
from folios import folio_kib, median_kib  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import (  # noqa: E402
    boto_parallel,
    boto_small_rate,
    drop_page_cache,
    load_text,
    log,
    machine,
    seq_read,
    settle,
    shard_and_files,
    small_files_rate,
    start_run,
)

from epochfs.dev.sample import upload, write_tree  # noqa: E402
from epochfs.dev.servers import LocalS3, client_for  # noqa: E402
from epochfs.kernel import uring  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20




def checked(c: Epochfs, timeout: float = 300.0) -> int:
    """Wait until a mount has checked the cached files a run before left (the kernel reads none of them
    until then: kept fingerprints in the same boot, hashed again after another); their bytes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = c.status()["passthrough"] or {}
        if not p.get("unchecked", 0):
            return int(p.get("whole_bytes", 0))
        time.sleep(0.05)
    raise TimeoutError(f"{c.name}: copies still unchecked after {timeout:g} s")


class Floor(Contender):
    """benchmarks/peers/floor.py over the same bytes on local disk: warm reads only (it keeps nothing)."""

    name = "floor"

    def __init__(self, work: Path, *args, raw: Path, blksize: int, readahead_kb: int, name: str = "floor",  # type: ignore[no-untyped-def]
                 **kw) -> None:
        self.name, self.raw, self.blksize, self.readahead_kb = name, raw, blksize, readahead_kb
        self.tuning = f"st_blksize {blksize}, read_ahead_kb {readahead_kb or 'kernel default'}"
        super().__init__(work, *args, **kw)

    def _mount(self) -> None:
        argv = [sys.executable, str(HERE / "floor.py"), str(self.raw), str(self.root), "--blksize", str(self.blksize)]
        if self.readahead_kb:
            argv += ["--readahead-kb", str(self.readahead_kb)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_mounted(self.root)
        self.pid = self.proc.pid


def _let_servers_use_io_uring(wanted: bool) -> str | None:
    """Root's switch for FUSE over io_uring set (``--io-uring`` asked for in a run): what it was, to put
    back at the end; None where nothing was changed."""
    if not wanted:
        return None
    if not Path(uring.ENABLE).exists():
        raise SystemExit(f"--io-uring: this kernel has no FUSE over io_uring ({uring.ENABLE} is absent)")
    was = Path(uring.ENABLE).read_text().strip()
    Path(uring.ENABLE).write_text("Y")
    return was


def _backend_asked(c: Contender) -> int | None:
    """The requests an epochfs daemon has made of its backend (any other contender: None)."""
    return c.backend_requests() if isinstance(c, Epochfs) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=4000,
                    help="100 KiB files (4000: a warm pass at 16 readers lasts about half a second; 1000 before)")
    ap.add_argument("--large-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=0.0, help="added per request and new connection (a proxy)")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="pin everything to this many cores")
    ap.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    ap.add_argument("--epochfs-args", default="", help="extra mount flags for epochfs")
    ap.add_argument("--variant", default="", help="also run epochfs with these extra mount flags (as 'epochfs variant')")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "readpath")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    os.sched_setaffinity(0, set(range(args.cores)))
    if not start_run(args.work):
        return 2
    small, large = shard_and_files(args.files, args.large_mib)
    keys = [f.key for f in small]
    # The cold small passes read files no pass before them read: one reader a share of the files,
    # sixteen the rest (the warm and hot passes read them all).
    one_reader = keys[:max(1, len(keys) // 8)]
    sixteen = keys[len(one_reader):]
    rows: dict[tuple[str, str], list[float]] = {}
    stem = args.out / (f"{datetime.date.today().isoformat()}-readpath-{args.cores}core"
                       + (f"-{args.latency_ms:g}ms" if args.latency_ms else ""))
    if Path(f"{stem}.md").exists():  # an earlier run of the same day stays
        stem = stem.with_name(stem.name + time.strftime("-%H%M"))

    def record(who: str, what: str, value: float) -> None:
        rows.setdefault((who, what), []).append(value)
        log(f"{who:18s} {what:34s} {value:10.2f}")

    uring_was = _let_servers_use_io_uring("--io-uring" in f"{args.epochfs_args} {args.variant}".split())
    server = LocalS3(args.work / "s3").start()
    proxy = ProxyProcess(server.port, args.latency_ms / 1000) if args.latency_ms else None
    endpoint = proxy.endpoint if proxy else server.endpoint
    raw = args.work / "raw"
    common = dict(endpoint=endpoint, bucket="bench", prefix="ds/", cache_size=20 << 30)
    epochfs = Epochfs(args.work, manifest=False, name="epochfs", **common)
    epochfs.extra = args.epochfs_args.split()
    contenders: list[Contender] = [
        RawDisk(args.work, data_dir=raw, **common),
        Floor(args.work, raw=raw, blksize=128 << 10, readahead_kb=0, **common),
        Floor(args.work, raw=raw, blksize=MiB, readahead_kb=4096, name="floor-1M", **common),
        epochfs, Juicefs(args.work, **common), S3fs(args.work, **common), Rclone(args.work, **common)]
    if args.variant:
        variant = Epochfs(args.work, manifest=False, name="epochfs-variant", **common)
        variant.extra = args.variant.split()
        variant.tuning += " " + args.variant
        contenders.insert(contenders.index(epochfs) + 1, variant)
    if args.only:
        wanted = set(args.only.split(","))
        contenders = [c for c in contenders if c.name in wanted]
    try:
        upload(server.client(), "bench", "ds/", [*small, large])
        client = client_for(endpoint)  # raw GETs take the contenders' way to the endpoint (the proxy)
        write_tree(str(raw), [*small, large])
        log(f"uploaded; quiet after {settle():.0f} s")

        def measure(c: Contender) -> None:
            fs = c.name not in ("raw disk", "floor", "floor-1M")
            if not fs:
                # The local file written afresh, as each mount's cold pass writes its cache blocks: this
                # machine's disk reads what was written a moment ago faster (the floor read a file
                # written at the run's start at 455-536 MiB/s, and at 1,784 in the repetition after it).
                write_tree(str(raw), [large])
                os.sync()
            c.mount()
            try:
                if fs:  # cold: an empty cache
                    drop_page_cache()
                    record(c.name, "cold small files/s, 1 reader", small_files_rate(c.root, one_reader, 1))
                    record(c.name, "cold small files/s, 16 readers", small_files_rate(c.root, sixteen, 16))
                    drop_page_cache()
                    record(c.name, "cold large MiB/s", seq_read(c.root / large.key) / MiB)
                    passthrough = isinstance(c, Epochfs) and bool((c.status().get("passthrough") or {}).get("active"))
                    time.sleep(1)  # what was written behind the reader lands
                    c.unmount()  # a fresh mount over the filled cache: nothing of the cold pass in memory
                    c._mount()
                    wait_mounted(c.root)
                    if passthrough:  # (the files a run before left are lent once known right again)
                        started = time.monotonic()
                        gib = checked(c) / (1 << 30)
                        if gib:
                            record(c.name, "passthrough check after a restart, s per GiB",
                                   (time.monotonic() - started) / gib)
                drop_page_cache()
                before = proc_usage(c.pid)["cpu"]
                record(c.name, "warm large MiB/s", seq_read(c.root / large.key) / MiB)
                if c.pid:
                    record(c.name, "daemon CPU s per warm GiB",
                           (proc_usage(c.pid)["cpu"] - before) / (large.size / (1 << 30)))
                asked, before = _backend_asked(c), proc_usage(c.pid)["cpu"]
                record(c.name, "hot large MiB/s", seq_read(c.root / large.key) / MiB)
                record(c.name, "hot large MiB/s, read again", seq_read(c.root / large.key) / MiB)
                if c.pid:  # a hot read is the kernel's: what the daemon did meanwhile is what can slow it
                    record(c.name, "daemon CPU ms in the hot large passes", (proc_usage(c.pid)["cpu"] - before) * 1000)
                if asked is not None:
                    record(c.name, "backend requests in the hot large passes", _backend_asked(c) - asked)  # type: ignore[operator]
                if os.geteuid() == 0:  # what the kernel holds the file in: a hot read copies folio by folio
                    kib = median_kib(folio_kib(str(c.root / large.key)))
                    if kib:  # (none where an open drops the file's pages: s3fs, which does not keep the cache)
                        record(c.name, "page-cache folio KiB, large file", kib)
                for threads in (1, 16):
                    drop_page_cache()
                    before = proc_usage(c.pid)["cpu"]
                    record(c.name, f"warm small files/s, {threads} readers", small_files_rate(c.root, keys, threads))
                    if c.pid:
                        record(c.name, f"daemon CPU ms per warm file, {threads} readers",
                               (proc_usage(c.pid)["cpu"] - before) * 1000 / len(keys))
                small_files_rate(c.root, keys, 1)
                record(c.name, "hot small files/s, 1 reader", small_files_rate(c.root, keys, 1))
                record(c.name, "hot small files/s, 1 reader, buffered open",
                       small_files_rate(c.root, keys, 1, buffered=True))
            finally:
                c.unmount()

        def boto() -> None:  # what the endpoint serves one client (what every contender's cold read waits on)
            drop_page_cache()
            record("raw boto3", "cold large MiB/s",
                   boto_parallel(client, "bench", [("ds/" + large.key, large.size)], 8, 8 * MiB) / MiB)
            record("raw boto3", "cold small files/s, 1 reader",
                   boto_small_rate(client, "bench", ["ds/" + k for k in one_reader], 1))
            record("raw boto3", "cold small files/s, 16 readers",
                   boto_small_rate(client, "bench", ["ds/" + k for k in sixteen], 16))

        runs: list[Callable[[], None]] = [boto] + [lambda c=c: measure(c) for c in contenders]
        for rep in range(args.reps):
            log(f"repetition {rep + 1} of {args.reps}")
            for run in runs if rep % 2 == 0 else runs[::-1]:
                run()
            if rep + 1 < args.reps:  # what a run stopped early measured stays, marked as such
                save(stem, rows, args, contenders, done=rep + 1)
    finally:
        for c in contenders:
            c.unmount()
        if proxy:
            proxy.stop()
        server.stop()
        shutil.rmtree(args.work / "s3", ignore_errors=True)
        if uring_was is not None:
            Path(uring.ENABLE).write_text(uring_was)

    print(save(stem, rows, args, contenders, done=args.reps))
    return 0


def save(stem: Path, rows: dict[tuple[str, str], list[float]], args: argparse.Namespace,
         contenders: list[Contender], *, done: int) -> str:
    """Write the report and the raw rows of ``done`` repetitions to ``stem``.md and .json; the report."""
    text = report(rows, args, contenders, done)
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps(
        {"files": args.files, "large_mib": args.large_mib, "cores": args.cores, "latency_ms": args.latency_ms,
         "reps": args.reps, "reps_done": done, "epochfs_args": args.epochfs_args, "variant": args.variant,
         "tuning": {c.name: c.tuning for c in contenders},
         "rows": [{"who": k[0], "what": k[1], "values": v} for k, v in rows.items()]}, indent=2) + "\n")
    return text


MEASURES = ["cold large MiB/s", "warm large MiB/s", "hot large MiB/s", "hot large MiB/s, read again",
            "page-cache folio KiB, large file", "passthrough check after a restart, s per GiB",
            "daemon CPU s per warm GiB", "daemon CPU ms in the hot large passes",
            "backend requests in the hot large passes",
            "cold small files/s, 1 reader", "cold small files/s, 16 readers", "warm small files/s, 1 readers", "warm small files/s, 16 readers",
            "daemon CPU ms per warm file, 1 readers", "daemon CPU ms per warm file, 16 readers",
            "hot small files/s, 1 reader", "hot small files/s, 1 reader, buffered open"]

NOT_RATIOS = {"page-cache folio KiB, large file",  # (a size the kernel chose, not a speed)
              "backend requests in the hot large passes", "daemon CPU ms in the hot large passes"}


def report(rows: dict[tuple[str, str], list[float]], args: argparse.Namespace, contenders: list[Contender],
           done: int) -> str:
    who = ["raw boto3"] + [c.name for c in contenders]
    med = {k: statistics.median(v) for k, v in rows.items()}

    def paired(a: tuple[str, str], b: tuple[str, str]) -> str:
        if a not in rows or b not in rows:
            return ""
        ratios = sorted(x / y for x, y in zip(rows[a], rows[b], strict=False) if y)
        return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})" if ratios else ""

    variant = f", *epochfs-variant*: `{args.variant}`" if args.variant else ""
    lines = [f"# Read path, {datetime.date.today().isoformat()}: one {args.large_mib} MiB file and {args.files} x "
             f"100 KiB; {args.cores} core(s), {args.latency_ms:g} ms added; medians of {done}"
             + ("" if done == args.reps else f" (the run was stopped after {done} of {args.reps} repetitions)"), "",
             "Machine: {cpu}, {cpus} cores, {memory_gib:g} GiB, Linux {kernel}".format(**machine()), "",
             load_text(), "",
             f"epochfs flags: `{args.epochfs_args or '(defaults)'}`{variant}", "",
             "| measurement | " + " | ".join(who) + " |", "|---|" + "---|" * len(who)]
    for what in MEASURES:
        cells = [f"{med[(w, what)]:.4g}" if (w, what) in med else "" for w in who]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio | value |", "|---|---|"]
    peers = [w for w in ("JuiceFS", "s3fs", "rclone") if any(k[0] == w for k in rows)]
    for what in (m for m in MEASURES if m not in NOT_RATIOS):
        for ref in peers + ["floor", "floor-1M", "raw disk", "raw boto3", "epochfs-variant"]:
            r = paired(("epochfs", what), (ref, what))
            if r:
                lines.append(f"| epochfs / {ref}, {what} | {r} |")
    for what in (m for m in MEASURES if m not in NOT_RATIOS):  # the variant against the same references
        for ref in peers + ["raw disk", "raw boto3"]:
            r = paired(("epochfs-variant", what), (ref, what))
            if r:
                lines.append(f"| epochfs-variant / {ref}, {what} | {r} |")
    r = paired(("epochfs", "warm small files/s, 16 readers"), ("epochfs", "warm small files/s, 1 readers"))
    if r:
        lines.append(f"| epochfs 16 readers / 1 reader, warm small | {r} |")
    lines += ["", "Tuning: " + "; ".join(f"**{c.name}**: {c.tuning}" for c in contenders)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
