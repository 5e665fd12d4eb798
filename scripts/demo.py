"""The epochfs demo: a local S3 endpoint with a sample dataset, mounted, read twice.

Prints what each pass cost the backend. Run it through ``scripts/demo.sh`` (which installs what is
needed first).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from epochfs.control import request
from epochfs.dev import pagecache
from epochfs.dev.sample import SampleFile, sample_layout, upload
from epochfs.dev.servers import LocalS3

console = Console(width=None if sys.stdout.isatty() else 120)  # a log or a pipe does not wrap at 80


def read_pass(mnt: Path, files: list[SampleFile], threads: int) -> tuple[float, int]:
    def read(f: SampleFile) -> int:
        with open(mnt / f.key, "rb", buffering=0) as fh:
            data = fh.read()
        if data != f.content():
            raise SystemExit(f"wrong bytes in {f.key}")
        return len(data)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    return time.perf_counter() - start, total


def drop_page_cache() -> bool:
    try:
        pagecache.drop()  # (holding the lock the test suite's page-cache tests hold)
        return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=Path(".demo"))
    parser.add_argument("--small", type=int, default=300, help="number of small files (default 300)")
    parser.add_argument("--large", type=int, default=3, help="number of large files (default 3)")
    parser.add_argument("--large-mib", type=int, default=24, help="size of a large file in MiB (default 24)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--port", type=int, metavar="N", help="the local S3 endpoint's port (default: a free one)")
    parser.add_argument("--metrics-port", type=int, metavar="N",
                        help="the mount's metrics port on 127.0.0.1 (default: 9567, or the next free one if taken)")
    args = parser.parse_args()

    work = args.workdir.resolve()
    mnt, cache = work / "mnt", work / "cache"
    if mnt.exists():
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
    mnt.mkdir(parents=True)

    files = sample_layout(args.small, args.large, args.large_mib)
    total = sum(f.size for f in files)
    try:
        with console.status("starting a local S3 endpoint (SeaweedFS)"):
            server = LocalS3(work / "s3", port=args.port).start()
    except RuntimeError as exc:
        console.print(f"[red]demo: {exc}[/]")
        return 1
    try:
        with console.status(f"uploading {len(files)} files, {total / 2**20:.0f} MiB"):
            upload(server.client(), "demo", "dataset/", files)
        console.print(f"S3 endpoint [bold]{server.endpoint}[/], dataset [bold]s3://demo/dataset/[/]: "
                      f"{len(files)} files, {total / 2**20:.0f} MiB")
        cmd = [sys.executable, "-m", "epochfs", "mount", "s3://demo/dataset", str(mnt),
               "--endpoint-url", server.endpoint, "--cache-dir", str(cache), "--cache-size", "2G",
               *(["--metrics-addr", f"127.0.0.1:{args.metrics_port}"] if args.metrics_port else [])]
        console.print("$ " + " ".join(cmd[2:]))
        if subprocess.run(cmd, env=server.env()).returncode != 0:
            return 1  # epochfs said why
        subprocess.run(["ls", "-l", str(mnt), str(mnt / "archives")], check=True)

        table = Table(title="reading the whole dataset through epochfs, twice")
        for col in ("pass", "seconds", "MiB/s", "GET requests at S3", "bytes from S3", "cache hit ratio"):
            table.add_column(col, justify="right")
        gets_before, backend_before = server.request_count("demo"), 0
        hits_before = misses_before = 0
        for name in ("1 (cold)", "2 (warm)"):
            dropped = drop_page_cache()
            seconds, nbytes = read_pass(mnt, files, args.threads)
            status = request(mnt, "status")
            while status["cache"]["inflight"]:
                time.sleep(0.05)
                status = request(mnt, "status")
            gets = server.request_count("demo")
            c = status["cache"]
            backend = c["demand_bytes"] + c["prefetch_bytes"]
            hit, miss = c["hit_bytes"] - hits_before, c["miss_bytes"] - misses_before
            table.add_row(name, f"{seconds:.2f}", f"{nbytes / 2**20 / seconds:.0f}", str(gets - gets_before),
                          f"{(backend - backend_before) / 2**20:.1f} MiB",
                          f"{hit / (hit + miss):.1%}" if hit + miss else "n/a")
            gets_before, backend_before = gets, backend
            hits_before, misses_before = c["hit_bytes"], c["miss_bytes"]
            if not dropped:
                console.print("[yellow]not root: the kernel page cache was not dropped between passes[/]")
        console.print(table)
        console.print("Every byte was checked against the dataset. The second pass was served from the "
                      f"block cache in {cache}.")
        subprocess.run([sys.executable, "-m", "epochfs", "status", str(mnt)], check=True)
    finally:
        subprocess.run([sys.executable, "-m", "epochfs", "umount", str(mnt)], capture_output=True)
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
