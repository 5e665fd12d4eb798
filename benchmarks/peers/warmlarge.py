"""The warm large stream against the floor of our stack, many passes interleaved: one large file read
through epochfs (from its block cache) and through the floor (``floor.py``: a plain ``pread`` of the
same bytes on local disk), each pass with the mount's pages dropped first, in two regimes:

- **memory**: the sources (epochfs's block files, the floor's file) stay in the page cache and only the
  mount's own pages are dropped (``POSIX_FADV_DONTNEED`` on the mounted file): each daemon's own path
  (request, read, verify, reply) with no disk in it;
- **disk**: every page dropped (``drop_caches``) before each pass, the sources written at the same
  moment (epochfs's blocks by its cold pass, the floor's file beside it), so neither is the fresher.

The order rotates each round and each ratio is the median of the ratios within a round: this machine's
disk reads one pass at a time at rates 3x apart, so a few passes (``readpath.py`` makes four) do not
separate a tenth of the rate from the disk's moods. Also the daemons' CPU per GiB in each regime.

    sudo .venv/bin/python benchmarks/peers/warmlarge.py [--rounds 16] [--size-mib 512] [--variant FLAGS] [--out F]
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

from contenders import Contender, Epochfs, proc_usage  # noqa: E402
from readpath import Floor  # noqa: E402
from workloads import drop_page_cache, log, save_results, seq_read, start_run  # noqa: E402

from epochfs.dev.sample import SampleFile, drop_file_pages, upload, write_tree  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
REGIMES = ("memory", "disk")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=16, help="passes of each mount in each regime (interleaved)")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--variant", default="", help="also an epochfs mount with these extra flags")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "warmlarge")
    ap.add_argument("--out", type=Path, help="results JSON (a .md beside it)")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    large = SampleFile("large.bin", args.size_mib * MiB)
    server = LocalS3(args.work / "s3").start()
    common = dict(endpoint=server.endpoint, bucket="bench", prefix="ds/", cache_size=4 << 30)
    mounts: list[Contender] = [Epochfs(args.work, manifest=False, name="epochfs", **common),
                               Floor(args.work, raw=args.work / "raw", blksize=128 << 10, readahead_kb=0, **common)]
    if args.variant:
        variant = Epochfs(args.work, manifest=False, name="epochfs-variant", **common)
        variant.extra = args.variant.split()
        mounts.insert(1, variant)
    rows: dict[str, dict[str, dict[str, list[float]]]] = {
        r: {c.name: {"MiB/s": [], "cpu_s_per_gib": []} for c in mounts} for r in REGIMES}
    try:
        upload(server.client(), "bench", "ds/", [large])
        for c in mounts:  # the sources written together: the cold passes, then the floor's file
            if isinstance(c, Epochfs):
                c.mount()
                seq_read(c.root / large.key)
        write_tree(str(args.work / "raw"), [large])
        for c in mounts:
            if not isinstance(c, Epochfs):
                c.mount()
        for c in mounts:
            if isinstance(c, Epochfs):
                c.status()  # (the daemon answers: its blocks are written behind the reader, let them land)
        drop_page_cache()
        for c in mounts:  # every source into the page cache for the memory regime
            seq_read(c.root / large.key)
        for regime in REGIMES:
            for r in range(args.rounds):
                k = r % len(mounts)
                for c in mounts[k:] + mounts[:k]:
                    path = c.root / large.key
                    if regime == "memory":
                        drop_file_pages(path)
                    else:
                        drop_page_cache()
                    cpu = proc_usage(c.pid)["cpu"]
                    rate = seq_read(path)
                    row = rows[regime][c.name]
                    row["MiB/s"].append(rate / MiB)
                    row["cpu_s_per_gib"].append((proc_usage(c.pid)["cpu"] - cpu) / (large.size / (1 << 30)))
                log(f"{regime} round {r + 1}: " + ", ".join(f"{n} {v['MiB/s'][-1]:.0f}" for n, v in rows[regime].items()))
    finally:
        for c in mounts:
            c.unmount()
        server.stop()
    out = {"date": datetime.date.today().isoformat(), "size_mib": args.size_mib, "rounds": args.rounds,
           "variant": args.variant, "regimes": rows}
    text = report(out)
    print(text)
    if args.out:
        save_results(args.out, out, text)
    return 0


def paired(a: list[float], b: list[float]) -> str:
    ratios = sorted(x / y for x, y in zip(a, b, strict=True) if y)
    if not ratios:
        return "-"
    q = len(ratios) // 4
    return f"{statistics.median(ratios):.2f}x ({ratios[q]:.2f}-{ratios[-1 - q]:.2f})"


def report(out: dict[str, Any]) -> str:
    lines = [f"# The warm large stream against the floor, {out['date']}", "",
             f"One {out['size_mib']} MiB file, {out['rounds']} passes of each mount per regime, the order rotating "
             "each round; 1 MiB reads into one buffer." + (f" *epochfs-variant*: `{out['variant']}`." if out["variant"] else ""),
             "", "| regime | mount | median MiB/s | spread | daemon CPU s per GiB |", "|---|---|---|---|---|"]
    for regime, mounts in out["regimes"].items():
        for name, v in mounts.items():
            m = sorted(v["MiB/s"])
            lines.append(f"| {regime} | {name} | {statistics.median(m):.0f} | {m[0]:.0f}-{m[-1]:.0f} | "
                         f"{statistics.median(v['cpu_s_per_gib']):.2f} |")
    lines += ["", "| regime | ratio | paired median (middle half) |", "|---|---|---|"]
    for regime, mounts in out["regimes"].items():
        for name in mounts:
            if name != "floor":
                lines.append(f"| {regime} | {name} / floor | {paired(mounts[name]['MiB/s'], mounts['floor']['MiB/s'])} |")
        if "epochfs-variant" in mounts:
            lines.append(f"| {regime} | epochfs / epochfs-variant | "
                         f"{paired(mounts['epochfs']['MiB/s'], mounts['epochfs-variant']['MiB/s'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
