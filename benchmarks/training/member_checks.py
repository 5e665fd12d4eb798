"""What checking every packed member against its own checksum costs the daemon: the first epoch of a packed
dataset read in the local order (4 reader threads, as a DataLoader's workers; 20 ms added per request),
its daemon CPU measured, beside the CPU the member checks themselves take (xxh64 over each member's bytes,
timed in this process on the same bytes: the work the check adds per member), and a second epoch with the
page cache dropped (members already checked are remembered: no check).

    sudo .venv/bin/python benchmarks/training/member_checks.py [--files 2000] [--reps 3] [--latency-ms 20]

Writes benchmarks/training/results/DATE-member-checks.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import Epochfs, proc_usage  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, fresh_workdir, log  # noqa: E402

from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
BUCKET = "bench"


def read_epoch(root: Path, keys: list[str], threads: int = 4) -> float:
    started = time.monotonic()

    def read(key: str) -> int:
        with open(root / key, "rb") as f:
            return len(f.read())

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, keys))
    assert total > 0
    return time.monotonic() - started


def check_cpu(files: list[SampleFile], reps: int = 5) -> float:
    """CPU seconds of xxh64 over every member's bytes (the check a first read adds), best of ``reps``."""
    import xxhash

    contents = [f.content() for f in files]
    best = float("inf")
    for _ in range(reps):
        started = time.process_time()
        for c in contents:
            xxhash.xxh64_intdigest(c)
        best = min(best, time.process_time() - started)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "member-checks")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    fresh_workdir(args.work)
    files = [SampleFile(f"class{i % 20:02d}/img{i:06d}.jpg", 100 << 10) for i in range(args.files)]
    server = LocalS3(args.work / "s3").start()
    proxy = ProxyProcess(server.port, args.latency_ms / 1000)
    rows = []
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        upload(client, BUCKET, "raw/", files)
        import subprocess

        subprocess.run([sys.executable, "-m", "epochfs", "pack", f"s3://{BUCKET}/raw", f"s3://{BUCKET}/packed",
                        "--endpoint-url", server.endpoint, "--shard-size", "8M", "--quiet"], env=server.env(),
                       check=True, capture_output=True)
        checks = check_cpu(files)
        for rep in range(args.reps):
            c = Epochfs(args.work, proxy.endpoint, BUCKET, "packed/", 4 << 30, manifest=False, name="epochfs")
            c.mount()
            try:
                from epochfs import Client

                where = Client(c.root).locate([str(c.root / f.key) for f in files])
                order = [f.key for _, f in sorted(zip(where, files, strict=True), key=lambda p: (p[0][0], p[0][1]))]
                epochs = []
                for _ in range(2):
                    drop_page_cache()
                    before = proc_usage(c.pid)["cpu"]
                    seconds = read_epoch(c.root, order)
                    epochs.append({"seconds": seconds, "daemon_cpu": proc_usage(c.pid)["cpu"] - before})
            finally:
                c.unmount()
            row = {"rep": rep, "epochs": epochs, "check_cpu": checks,
                   "check_share_e1": checks / epochs[0]["daemon_cpu"]}
            log(f"rep {rep}: epoch 1 {epochs[0]['seconds']:.1f} s, daemon CPU {epochs[0]['daemon_cpu']:.2f} s; "
                f"checks {checks * 1000:.1f} ms = {row['check_share_e1']:.1%}")
            rows.append(row)
    finally:
        proxy.stop()
        server.stop()
    date = datetime.date.today().isoformat()
    share = statistics.median(r["check_share_e1"] for r in rows)
    result = {"date": date, "files": args.files, "file_size": 100 << 10, "latency_ms": args.latency_ms,
              "rows": rows, "median_check_share_e1": share}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{date}-member-checks.json").write_text(json.dumps(result, indent=1))
    cpu1 = statistics.median(r["epochs"][0]["daemon_cpu"] for r in rows)
    cpu2 = statistics.median(r["epochs"][1]["daemon_cpu"] for r in rows)
    md = [f"# What the packed members' checks cost, {date}", "",
          f"{args.files} files of 100 KiB packed in 8 MiB shards, read once in the local order by 4 threads, "
          f"{args.latency_ms:g} ms added per request; medians of {args.reps} repetitions.", "",
          "| | value |", "|---|---|",
          f"| daemon CPU, first epoch | {cpu1:.2f} s ({cpu1 / args.files * 1000:.2f} ms per file) |",
          f"| daemon CPU, second epoch (page cache dropped) | {cpu2:.2f} s |",
          f"| xxh64 over every member (the check's work) | {checks * 1000:.1f} ms "
          f"({checks / args.files * 1e6:.1f} us per file) |",
          f"| the checks' share of the first epoch's daemon CPU | {share:.1%} |", ""]
    (args.out / f"{date}-member-checks.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
