"""A hot read at any latency: one large file read from the page cache through two epochfs mounts of the
same bucket, one straight to the endpoint and one through the latency proxy (20 ms added to every
request and new connection); their hot passes interleaved, many times, in one run, with what each daemon did meanwhile (its CPU, the requests it made of its backend)
and the host's CPU.

    sudo .venv/bin/python benchmarks/peers/hot.py [--passes 12] [--size-mib 256] [--out F]

A hot read is the kernel's: the file's pages are in the page cache and (zero-message opens) no OPEN is
sent. Whether anything of it waits on the endpoint shows here as a difference between the two mounts
beyond their spread, and as daemon work or backend requests during the passes.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import Epochfs, proc_usage  # noqa: E402
from folios import folio_kib  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, host_cpu, log, save_results, seq_read, start_run  # noqa: E402

from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=12, help="hot passes of each mount (interleaved)")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--control", action="store_true", help="a second mount at 0 ms too (what order alone does)")
    ap.add_argument("--far-first", action="store_true", help="mount (and fill) the far one first")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "hot")
    ap.add_argument("--out", type=Path, help="results JSON (a .md beside it)")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    large = SampleFile("large.bin", args.size_mib * MiB)
    server = LocalS3(args.work / "s3").start()
    proxy = ProxyProcess(server.port, args.latency_ms / 1000)
    mounts: list[tuple[str, Epochfs]] = []
    try:
        upload(server.client(), "bench", "ds/", [large])
        ways = [("0 ms", server.endpoint), (f"{args.latency_ms:g} ms", proxy.endpoint)]
        if args.control:
            ways.append(("0 ms, a second mount", server.endpoint))
        if args.far_first:
            ways[0], ways[1] = ways[1], ways[0]
        for i, (label, endpoint) in enumerate(ways):
            common = dict(endpoint=endpoint, bucket="bench", prefix="ds/", cache_size=4 << 30)
            mounts.append((f"epochfs {label}", Epochfs(args.work, manifest=False, name=f"epochfs-{i}", **common)))
        for name, c in mounts:
            c.mount()
            seq_read(c.root / large.key)  # cold: into the block cache
            log(f"{name}: mounted, the file read once")
        drop_page_cache()
        for _, c in mounts:  # warm: from the block cache into the page cache, each mount its own copy
            seq_read(c.root / large.key)
        rows: dict[str, dict[str, Any]] = {name: {"MiB/s": [], "daemon_cpu_ms": 0.0, "backend_requests": 0,
                                                  "folio_kib": {}} for name, _ in mounts}
        busy0, all0 = host_cpu()
        for p in range(args.passes):
            order = mounts if p % 2 == 0 else mounts[::-1]
            for name, c in order:
                cpu, asked = proc_usage(c.pid)["cpu"], c.backend_requests()
                rate = seq_read(c.root / large.key) / MiB
                rows[name]["MiB/s"].append(rate)
                rows[name]["daemon_cpu_ms"] += (proc_usage(c.pid)["cpu"] - cpu) * 1000
                rows[name]["backend_requests"] += c.backend_requests() - asked
            log(f"pass {p + 1}: " + ", ".join(f"{n} {rows[n]['MiB/s'][-1]:.0f}" for n, _ in mounts))
        busy1, all1 = host_cpu()
        for name, c in mounts:  # (what the kernel holds each file in: a hot read copies folio by folio)
            rows[name]["folio_kib"] = {str(k): n for k, n in sorted(folio_kib(str(c.root / large.key)).items())}
    finally:
        for _, c in mounts:
            c.unmount()
        proxy.stop()
        server.stop()
    out = {"date": datetime.date.today().isoformat(), "size_mib": args.size_mib, "passes": args.passes,
           "latency_ms": args.latency_ms, "host_cpu_busy": (busy1 - busy0) / max(1, all1 - all0), "mounts": rows}
    text = report(out)
    print(text)
    if args.out:
        save_results(args.out, out, text)
    return 0


def report(out: dict[str, Any]) -> str:
    lines = [f"# A hot read at 0 and {out['latency_ms']:g} ms, {out['date']}", "",
             f"One {out['size_mib']} MiB file in the page cache, read in 1 MiB reads into one buffer through each "
             f"mount, {out['passes']} passes each, interleaved (the order reversed every other pass); the host's "
             f"CPU {out['host_cpu_busy']:.0%} busy over them (2 cores: one reader is half).", "",
             "| mount | median MiB/s | spread | daemon CPU ms in all passes | backend requests in all passes | "
             "folios (KiB: count) |", "|---|---|---|---|---|---|"]
    for name, r in out["mounts"].items():
        v = sorted(r["MiB/s"])
        asked = "-" if r["backend_requests"] is None else f"{r['backend_requests']}"
        lines.append(f"| {name} | {statistics.median(v):.0f} | {v[0]:.0f}-{v[-1]:.0f} | {r['daemon_cpu_ms']:.0f} | "
                     f"{asked} | {', '.join(f'{k}: {n}' for k, n in r['folio_kib'].items()) or '-'} |")
    r0, r1 = out["mounts"]["epochfs 0 ms"], out["mounts"][f"epochfs {out['latency_ms']:g} ms"]
    m0, m1 = statistics.median(r0["MiB/s"]), statistics.median(r1["MiB/s"])
    lines += ["", f"- mounted and filled in the order of the table; at {out['latency_ms']:g} ms: {m1 / m0:.2f}x "
              "the rate at 0 ms (medians)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
