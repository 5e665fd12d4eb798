"""A reader that pauses: an epoch handed over with `Client.hand_over`, then read after a pause of 4 s or
12 s (a hand-over before the first batch, validation, a checkpoint), and an epoch read halfway, paused,
and read on. Reported: the share of the bytes read after each pause that were in the cache (hits), and
the daemon's CPU during the pause. 20 ms added to every backend request; 4 reader threads.

    sudo .venv/bin/python benchmarks/training/pause.py [--files 300] [--pauses 4 12] [--reps 2]

To compare with another version of the daemon, run it with PYTHONPATH pointing at that version's src.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import Epochfs, proc_usage  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, fresh_workdir, log  # noqa: E402

from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def read(root: Path, keys: list[str]) -> float:
    started = time.monotonic()

    def one(key: str) -> int:
        with open(root / key, "rb") as f:
            return len(f.read())

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, keys))
    return time.monotonic() - started


def hit_bytes(c: Epochfs) -> tuple[int, int]:
    cache = c.status()["cache"]
    return cache["hit_bytes"], cache["miss_bytes"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--pauses", type=float, nargs="+", default=[4.0, 12.0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--label", default="", help="a name for this daemon's version in the results")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "pause")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    fresh_workdir(args.work)
    files = [SampleFile(f"s/{i:05d}.bin", MiB - 17 * i) for i in range(args.files)]
    keys = [f.key for f in files]
    server = LocalS3(args.work / "s3").start()
    proxy = ProxyProcess(server.port, args.latency_ms / 1000)
    rows: list[dict[str, Any]] = []
    try:
        client = server.client()
        client.create_bucket(Bucket="bench")
        upload(client, "bench", "ds/", files)
        for rep in range(args.reps):
            for pause in args.pauses:
                for where in ("before", "halfway"):
                    c = Epochfs(args.work, proxy.endpoint, "bench", "ds/", 4 << 30, manifest=True, name="epochfs")
                    c.extra = ["--block-size", "1M"]
                    c.mount()
                    try:
                        from epochfs import Client

                        Client(c.root).hand_over(keys, epoch=0)
                        drop_page_cache()
                        if where == "halfway":
                            read(c.root, keys[: len(keys) // 2])
                        after = keys if where == "before" else keys[len(keys) // 2:]
                        h0, m0 = hit_bytes(c)
                        cpu0 = proc_usage(c.pid)["cpu"]
                        time.sleep(pause)
                        cpu = proc_usage(c.pid)["cpu"] - cpu0
                        seconds = read(c.root, after)
                        h1, m1 = hit_bytes(c)
                    finally:
                        c.unmount()
                    row = {"rep": rep, "pause": pause, "where": where, "hit_share": (h1 - h0) / ((h1 - h0) + (m1 - m0)),
                           "read_seconds": seconds, "pause_cpu_seconds": cpu}
                    log(json.dumps(row))
                    rows.append(row)
    finally:
        proxy.stop()
        server.stop()
    date = datetime.date.today().isoformat()
    label = f"-{args.label}" if args.label else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{date}-pause{label}.json").write_text(json.dumps({"files": args.files, "rows": rows}, indent=1))
    lines = [f"# A reader that pauses{' (' + args.label + ')' if args.label else ''}, {date}", "",
             f"{args.files} files of 1 MiB, 1 MiB blocks, handed over at once; {args.latency_ms:g} ms per backend "
             f"request; 4 readers; medians of {args.reps} repetitions.", "",
             "| pause | where | hits among the bytes read after it | read after it (s) | daemon CPU during it (s) |",
             "|---|---|---|---|---|"]
    for pause in args.pauses:
        for where in ("before", "halfway"):
            rs = [r for r in rows if r["pause"] == pause and r["where"] == where]
            lines.append(f"| {pause:g} s | {where} | {statistics.median(r['hit_share'] for r in rs):.1%} "
                         f"({min(r['hit_share'] for r in rs):.0%}-{max(r['hit_share'] for r in rs):.0%}) | "
                         f"{statistics.median(r['read_seconds'] for r in rs):.2f} | "
                         f"{statistics.median(r['pause_cpu_seconds'] for r in rs):.2f} |")
    text = "\n".join(lines) + "\n"
    (args.out / f"{date}-pause{label}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
