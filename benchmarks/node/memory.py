"""The daemon's memory under load, with its default ``--memory-limit`` and a small one, side by side.

    sudo .venv/bin/python benchmarks/node/memory.py [--limits default 160M] [--rounds 2] [--out F]

16 readers read 16 files of ``--file-mib`` MiB at once (more than the small limit together), their order
handed over first (the prefetch plan fetches ahead of them), from a local SeaweedFS behind the latency
proxy at each ``--latency-ms``, page cache dropped,
an empty cache each round. The daemon's resident set is sampled every 20 ms; every byte is checked.
Reported per limit: the peak resident set against the limit, the throughput, how long fetches ahead
waited for room, and the limit's shares (``epochfs status``)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, load_text, log, machine, save_results, start_run  # noqa: E402

from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
BUCKET = "membench"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def one(work: Path, server: LocalS3, endpoint: str, files: list[SampleFile], limit: str) -> dict[str, Any]:
    mnt, cache = work / "mnt", work / f"cache-{limit}"
    shutil.rmtree(cache, ignore_errors=True)
    mnt.mkdir(exist_ok=True)
    flags = [] if limit == "default" else ["--memory-limit", limit]
    subprocess.run([str(VENV_BIN / "epochfs"), "mount", f"s3://{BUCKET}", str(mnt), "--endpoint-url", endpoint,
                    "--cache-dir", str(cache), "--cache-size", "4G", "--metrics-addr", "off", *flags],
                   env=server.env(), check=True)
    try:
        pid = int(os.getxattr(mnt, "user.epochfs.pid"))
        drop_page_cache()
        idle = rss(pid)
        manifest = work / "order.txt"
        manifest.write_text("".join(f.key + "\n" for f in files))
        subprocess.run([str(VENV_BIN / "epochfs"), "prefetch", str(mnt), "--manifest", str(manifest), "--epoch", "0"],
                       check=True, capture_output=True)
        peak, done, wrong = [idle], threading.Event(), []

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss(pid))
                time.sleep(0.02)

        def read(f: SampleFile) -> None:
            with open(mnt / f.key, "rb") as fh:
                if fh.read() != f.content():
                    wrong.append(f.key)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        readers = [threading.Thread(target=read, args=(f,)) for f in files]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        seconds = time.monotonic() - started
        done.set()
        sampler.join()
        status = json.loads(subprocess.run([str(VENV_BIN / "epochfs"), "status", str(mnt), "--json"], check=True,
                                           capture_output=True, text=True).stdout)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        time.sleep(0.5)
    mem = status["memory"]
    return {"limit": limit, "limit_bytes": mem["limit"], "idle_rss": idle, "peak_rss": peak[0],
            "peak_over_limit": peak[0] / mem["limit"], "seconds": seconds,
            "mib_s": sum(f.size for f in files) / MiB / seconds, "wrong_files": len(wrong),
            "throttled_seconds": mem["throttled_seconds"],
            "shares": {k: mem[k] for k in ("baseline", "demand_slots", "ahead", "recent", "whole", "pool")}}


def report(out: dict[str, Any]) -> str:
    m = out["machine"]
    lines = [f"# The daemon's memory under load, {out['date']}", "",
             f"Machine: {m['cpu']}, {m['cpus']} cores, {m['memory_gib']:g} GiB, Linux {m['kernel']}. Command: "
             f"`{out['command']}`.", "", load_text(), "",
             f"16 readers of 16 files of {out['file_mib']} MiB at once ({16 * out['file_mib']} MiB), their order "
             "handed over first; a local SeaweedFS behind the latency proxy, an empty cache, the page cache dropped; the daemon's resident "
             "set sampled every 20 ms.", "",
             "| latency | limit | round | peak resident | peak / limit | MiB/s | fetches ahead waited (s, summed) | "
             "wrong files |", "|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        lines.append(f"| {r['latency_ms']:g} ms | {r['limit']} ({r['limit_bytes'] / MiB:.0f} MiB) | {r['round']} | {r['peak_rss'] / MiB:.0f} MiB "
                     f"| {r['peak_over_limit']:.2f}x | {r['mib_s']:.0f} | {r['throttled_seconds']:.1f} | "
                     f"{r['wrong_files']} |")
    lines += ["", "Shares of each limit (bytes; demand fetches in blocks): "
              + "; ".join(f"{r['limit']}: " + ", ".join(f"{k} {v / MiB:.0f} MiB" if k != "demand_slots" else
                                                         f"{v} demand fetches" for k, v in r["shares"].items())
                          for r in out["runs"] if r["round"] == 1 and r["latency_ms"] == out["runs"][0]["latency_ms"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limits", nargs="+", default=["default", "160M"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0],
                    help="added to each request by the latency proxy (default: 0 and 20)")
    ap.add_argument("--file-mib", type=int, default=32)
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "memory")
    ap.add_argument("--out", type=Path, help="results JSON (a .md beside it); default: benchmarks/node/results/DATE-memory.json")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(),
                           "command": " ".join(sys.argv), "file_mib": args.file_mib, "runs": []}
    server = LocalS3(args.work / "s3").start()
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        files = [SampleFile(f"big/f{i:02d}.bin", args.file_mib * MiB + 4099 * i) for i in range(16)]
        upload(client, BUCKET, "", files)
        for latency in args.latency_ms:
            proxy = ProxyProcess(server.port, latency / 1000)
            try:
                for rnd in range(1, args.rounds + 1):
                    for limit in args.limits:  # (side by side, alternating)
                        row = {**one(args.work, server, proxy.endpoint, files, limit), "round": rnd,
                               "latency_ms": latency}
                        out["runs"].append(row)
                        log(f"{latency:g} ms, {limit}: peak {row['peak_rss'] / MiB:.0f} MiB "
                            f"({row['peak_over_limit']:.2f}x), {row['mib_s']:.0f} MiB/s, waited "
                            f"{row['throttled_seconds']:.1f} s, {row['wrong_files']} wrong")
            finally:
                proxy.stop()
    finally:
        server.stop()
    text = report(out)
    print(text)
    target = args.out or HERE / "results" / f"{out['date']}-memory.json"
    save_results(target, out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
