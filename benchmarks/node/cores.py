"""How many cores the daemon can use: the same cold and warm reads with the daemon held to 1 core and
given 2 (``taskset`` on every thread of the daemon; the readers and the S3 server are not pinned).

    sudo .venv/bin/python benchmarks/node/cores.py [--cores 1 2] [--rounds 2] [--large-mib 1024] [--out F]

Workloads, each on a fresh mount with the page cache dropped (default options, so the warm large read is
the kernel's own, passthrough, and is measured through the daemon as well with ``--no-passthrough``):
- cold large: one reader of a ``--large-mib`` MiB file, 1 MiB reads, an empty cache;
- warm large through the daemon (``--no-passthrough``): the same file again, from the cache disk;
- cold small: 16 readers of ``--small`` files of 100 KiB, an empty cache.

Per run: the rate, the daemon's CPU (user + system, every thread) per GiB or per 1,000 files, and the cores
it used (its CPU seconds over the run's seconds). Beside them, raw boto3 on the same endpoint: 8 x 8 MiB
ranged GETs of the large file, and 16 threads of GETs of the small files (its own CPU per GiB). The rounds
alternate the order of the core counts. On this 2-core machine the reader and the S3 server compete
with the daemon for the same cores: the ratio of 2 cores to 1 says whether the daemon's threads run
at once, not what a 16-core node would give.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)

from contenders import VENV_BIN, proc_usage, unmount, wait_mounted  # noqa: E402
from workloads import (  # noqa: E402
    boto_parallel,
    boto_small_rate,
    drop_page_cache,
    load_text,
    log,
    machine,
    save_results,
    seq_read,
    small_files_rate,
    start_run,
)

from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
BUCKET = "cores"
SMALL = 100 << 10


def pin(pid: int, cores: int) -> None:
    """Every thread of ``pid`` (and those it starts later) onto the first ``cores`` CPUs."""
    subprocess.run(["taskset", "-a", "-c", "-p", f"0-{cores - 1}", str(pid)], check=True, capture_output=True)


class Mount:
    def __init__(self, work: Path, server: LocalS3, extra: list[str], source: str = f"s3://{BUCKET}/") -> None:
        self.work, self.server, self.extra, self.source = work, server, extra, source
        self.root = work / "mnt"
        self.pid = 0

    def start(self, cores: int, fresh: bool = True) -> None:
        """Mount (``fresh``: over an empty cache; else over what the last mount left) and pin the daemon."""
        if fresh:
            shutil.rmtree(self.work, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(VENV_BIN / "epochfs"), "mount", self.source, str(self.root),
                        "--endpoint-url", self.server.endpoint, "--cache-dir", str(self.work / "cache"),
                        "--cache-size", "20G", "--metrics-addr", "off", *self.extra],
                       env=self.server.env(), check=True, capture_output=True)
        wait_mounted(self.root)
        self.pid = int(os.getxattr(self.root, "user.epochfs.pid"))
        pin(self.pid, cores)

    def cpu(self) -> float:
        return proc_usage(self.pid)["cpu"]

    def stop(self) -> None:
        unmount(self.root, self.pid)


def measure(m: Mount, run: Any) -> tuple[float, float, float]:
    """(what ``run()`` returns, seconds, daemon CPU seconds) with the page cache dropped first."""
    drop_page_cache()
    cpu0, t0 = m.cpu(), time.perf_counter()
    result = run()
    return result, time.perf_counter() - t0, m.cpu() - cpu0


def one_round(args: argparse.Namespace, server: LocalS3, small: list[str], cores: int) -> list[dict[str, Any]]:
    rows = []
    gib = args.large_mib / 1024
    m = Mount(args.work / "mount", server, [])
    m.start(cores)
    try:
        rate, secs, cpu = measure(m, lambda: seq_read(m.root / "large"))
        rows.append({"workload": "cold large", "cores": cores, "rate": rate / 2**20, "unit": "MiB/s",
                     "cpu_per": cpu / gib, "per": "GiB", "cores_used": cpu / secs})
        rate, secs, cpu = measure(m, lambda: small_files_rate(m.root, small, 16))
        rows.append({"workload": "cold small, 16 readers", "cores": cores, "rate": rate, "unit": "files/s",
                     "cpu_per": cpu / len(small) * 1000, "per": "1,000 files", "cores_used": cpu / secs})
    finally:
        m.stop()
    m = Mount(args.work / "mount", server, ["--no-passthrough"])
    m.start(cores)
    try:
        measure(m, lambda: seq_read(m.root / "large"))  # (filled)
        rate, secs, cpu = measure(m, lambda: seq_read(m.root / "large"))
        rows.append({"workload": "warm large, --no-passthrough", "cores": cores, "rate": rate / 2**20,
                     "unit": "MiB/s", "cpu_per": cpu / gib, "per": "GiB", "cores_used": cpu / secs})
    finally:
        m.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--large-mib", type=int, default=1024)
    ap.add_argument("--small", type=int, default=2000, help="100 KiB files of the small workload")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "cores")
    ap.add_argument("--out", type=Path, help="results JSON (a .md beside it); default: benchmarks/node/results/DATE-cores.json")
    args = ap.parse_args()
    if max(args.cores) > (os.cpu_count() or 1):
        ap.error(f"--cores: this machine has {os.cpu_count()}")
    if not start_run(args.work):
        return 2
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(),
                           "command": " ".join(sys.argv), "large_mib": args.large_mib, "small": args.small,
                           "runs": [], "boto3": []}
    server = LocalS3(args.work / "s3").start()
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        src = args.work / "large"
        with open(src, "wb") as f:
            for _ in range(args.large_mib):
                f.write(os.urandom(1 << 20))
        client.upload_file(str(src), BUCKET, "large")
        src.unlink()
        small = [f"small/{i:05d}" for i in range(args.small)]
        body = os.urandom(SMALL)
        for k in small:
            client.put_object(Bucket=BUCKET, Key=k, Body=body[: SMALL - len(k)] + k.encode())
        for r in range(args.rounds):
            for cores in (args.cores if r % 2 == 0 else list(reversed(args.cores))):
                for row in one_round(args, server, small, cores):
                    row["round"] = r
                    out["runs"].append(row)
                    log(f"{row['workload']}, {cores} core(s): {row['rate']:.0f} {row['unit']}, "
                        f"{row['cpu_per']:.2f} s CPU per {row['per']}, {row['cores_used']:.2f} cores")
            usage0 = proc_usage(os.getpid())["cpu"]
            t0 = time.perf_counter()
            rate = boto_parallel(client, BUCKET, [("large", args.large_mib << 20)], 8, 8 << 20)
            cpu = (proc_usage(os.getpid())["cpu"] - usage0) / (args.large_mib / 1024)
            files = boto_small_rate(client, BUCKET, small, 16)
            out["boto3"].append({"round": r, "large_mib_s": rate / 2**20, "large_cpu_per_gib": cpu,
                                 "small_files_s": files, "seconds": time.perf_counter() - t0})
    finally:
        server.stop()
    text = report(out)
    print(text)
    save_results(args.out or HERE / "results" / f"{out['date']}-cores.json", out, text)
    return 0


def report(out: dict[str, Any]) -> str:
    m = out["machine"]
    lines = [f"# The daemon on 1 and 2 cores, {out['date']}", "",
             f"Machine: {m['cpu']}, {m['cpus']} cores, {m['memory_gib']:g} GiB, Linux {m['kernel']}. Command: "
             f"`{out['command']}`.", "", load_text(), "",
             f"A {out['large_mib']} MiB file and {out['small']} files of 100 KiB on a local SeaweedFS; the daemon "
             "pinned with taskset (every thread), the readers and the server not. Medians over the rounds.", "",
             "| workload | daemon cores | rate | daemon CPU | cores the daemon used | rate / 1 core's |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in out["runs"]:
        groups.setdefault((r["workload"], r["cores"]), []).append(r)
    for (workload, cores), rows in groups.items():
        rate = statistics.median(r["rate"] for r in rows)
        one = groups.get((workload, 1))
        ratio = f"{rate / statistics.median(r['rate'] for r in one):.2f}x" if one else "—"
        lines.append(f"| {workload} | {cores} | {rate:.0f} {rows[0]['unit']} | "
                     f"{statistics.median(r['cpu_per'] for r in rows):.2f} s per {rows[0]['per']} | "
                     f"{statistics.median(r['cores_used'] for r in rows):.2f} | {ratio} |")
    b = out["boto3"]
    if b:
        lines += ["", f"Raw boto3 on the same endpoint: 8 x 8 MiB ranged GETs "
                  f"{statistics.median(x['large_mib_s'] for x in b):.0f} MiB/s at "
                  f"{statistics.median(x['large_cpu_per_gib'] for x in b):.2f} s of its CPU per GiB; 16 threads of "
                  f"small GETs {statistics.median(x['small_files_s'] for x in b):.0f} files/s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
