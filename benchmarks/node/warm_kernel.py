"""The kernel's warm read, judged at the same moment as the disk under it: one large file read through a
default mount (passthrough: the kernel reads the store's own file), the store's file itself read
directly, and a local copy of it written at the run's start, in turns, each after the page cache is
dropped, on a mount restarted over the filled cache (nothing of the cold pass in memory).

    sudo .venv/bin/python benchmarks/node/warm_kernel.py [--large-mib 512] [--small 2000] [--rounds 6] [--out F]

Then the same for a dataset of 100 KiB files on a mount of its own (the default there: opened with no
request, read through the daemon from the cache disk), 16 readers in a shuffled order against local
copies read in the same order.

Why in turns: on this VM how fast a read from the disk goes depends on what the machine did just before
(its memory balloon hands free pages back to the host, and the host's own cache of the disk image comes
and goes), so one pass of each, minutes apart, compares moments rather than paths (the read-path
benchmark once gave passthrough 530 MiB/s against the local disk's 1,993, and its own file read directly
at that moment gave 464). Each round takes the three in a rotated order; the report gives each one's
median, the ratios of the medians, the daemon's CPU per GiB read through the mount (no READ reaches it),
and the machine's first read after the restart apart (of a third file: slow whatever it reads).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cores import BUCKET, Mount  # noqa: E402
from workloads import drop_page_cache, log, machine, save_results, seq_read, small_files_rate, start_run  # noqa: E402

from epochfs import Client  # noqa: E402
from epochfs.dev.sample import SampleFile, upload, write_tree  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB, GiB = 1 << 20, 1 << 30
STORE = "the store's file"


def same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(16 * MiB), fb.read(16 * MiB)
            if x != y:
                return False
            if not x:
                return True


def store_file(cache: Path, size: int) -> Path:
    """The store's file of the object of ``size`` bytes (the only one this run caches)."""
    found = [p for p in (cache / "blocks").rglob("*") if p.is_file() and p.stat().st_size == size]
    if len(found) != 1:
        raise RuntimeError(f"expected one object file of {size} bytes in {cache}, found {len(found)}")
    return found[0]


def whole_and_checked(root: Path, timeout: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = Client(root).status()["passthrough"] or {}
        if p.get("whole_files") and not p.get("unchecked"):
            return p
        time.sleep(0.1)
    raise TimeoutError("the cached file was never whole and checked")


def table(rows: list[dict[str, Any]], medians: dict[str, float], key: str, unit: str) -> list[str]:
    """A report's table: each read's median and every round's figure."""
    lines = [f"| read | median {unit} | every round |", "|---|---|---|"]
    for name, median in medians.items():
        every = ", ".join(f"{x[key]:.0f}" for x in rows if x["read"] == name)
        lines.append(f"| {name} | {median:.0f} | {every} |")
    return lines


def small_rounds(args: argparse.Namespace, server: LocalS3) -> tuple[list[dict[str, Any]], float]:
    """The same for ``--small`` files of 100 KiB on a mount of their own (a dataset of small files: opened
    with no request, read through the daemon from the cache disk), 16 readers in a new shuffled order
    each round, the local copies read in the same order: (rows, the machine's first read after the
    restart, files/s)."""
    files = [SampleFile(f"d{i % 20:02d}/f{i:05d}.bin", 100 << 10, version=i) for i in range(args.small)]
    upload(server.client(), "small-files", "", files)
    local = args.work / "small-copies"
    write_tree(str(local), files)
    spare = args.work / "small-spare"
    write_tree(str(spare), files)
    os.sync()
    keys = [f.key for f in files]
    m = Mount(args.work / "small-mount", server, [], source="s3://small-files/")
    m.start(os.cpu_count() or 1)
    rows: list[dict[str, Any]] = []
    try:
        drop_page_cache()
        small_files_rate(m.root, keys, 16)  # (the cold pass fills the cache)
        time.sleep(1)
        m.stop()
        m.start(os.cpu_count() or 1, fresh=False)
        drop_page_cache()
        first = small_files_rate(spare, keys, 16)
        for r in range(args.rounds):
            order = keys[:]
            random.Random(r).shuffle(order)
            for name, root in ([("through the mount", m.root), ("local copy", local)][:: 1 if r % 2 else -1]):
                drop_page_cache()
                cpu0 = m.cpu()
                rate = small_files_rate(root, order, 16)
                rows.append({"round": r, "read": name, "files_s": rate,
                             "daemon_cpu_ms_per_file": (m.cpu() - cpu0) / len(keys) * 1000})
                log(f"round {r}: small files, {name} {rate:.0f} files/s")
    finally:
        m.stop()
    return rows, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--small", type=int, default=2000, help="100 KiB files of the small-file rounds (0: none)")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "warm-kernel")
    ap.add_argument("--out", type=Path, help="results JSON (a .md beside it); default: benchmarks/node/results/DATE-warm-kernel.json")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    size = args.large_mib * MiB + 4321  # (an odd tail: the last block is short)
    server = LocalS3(args.work / "s3").start()
    m = Mount(args.work / "mount", server, [])
    rows: list[dict[str, Any]] = []
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        local = args.work / "local-copy"
        with open(local, "wb") as f:
            for _ in range(0, size, 64 * MiB):
                f.write(os.urandom(min(64 * MiB, size - f.tell())))
        client.upload_file(str(local), BUCKET, "large")
        os.sync()
        m.start(os.cpu_count() or 1)
        drop_page_cache()
        cold = seq_read(m.root / "large") / MiB
        whole_and_checked(m.root)
        m.stop()
        m.start(os.cpu_count() or 1, fresh=False)  # (over the filled cache: its fingerprints kept)
        p = whole_and_checked(m.root)
        mine = store_file(m.work / "cache", size)
        readers = {"through the mount": m.root / "large", STORE: mine, "local copy": local}
        order = list(readers)
        opens0 = p["opens"]
        # The machine's first read after the restart is slow whatever it reads (the daemon's exit and the
        # unmount freed memory, which the balloon then gives back: 464-657 MiB/s seen, the store's file
        # read directly and through the mount alike): it is made of a file of neither, and reported apart.
        drop_page_cache()
        spare = args.work / "spare"
        shutil.copyfile(local, spare)
        drop_page_cache()
        first = seq_read(spare) / MiB
        spare.unlink()
        for r in range(args.rounds):
            for name in order[r % 3:] + order[:r % 3]:
                drop_page_cache()
                cpu0 = m.cpu()
                rate = seq_read(readers[name]) / MiB
                rows.append({"round": r, "read": name, "mib_s": rate,
                             "daemon_cpu_s_per_gib": (m.cpu() - cpu0) / (size / GiB)})
                log(f"round {r}: {name} {rate:.0f} MiB/s")
        p = Client(m.root).status()
        passthrough_opens = p["passthrough"]["opens"] - opens0
        daemon_reads = p["read_seconds"]["count"]
        same = same_bytes(mine, local)  # (the store's file is the object, byte for byte)
        m.stop()
        small, small_first = small_rounds(args, server) if args.small else ([], 0.0)
    finally:
        try:
            m.stop()
        finally:
            server.stop()
    med = {name: statistics.median(x["mib_s"] for x in rows if x["read"] == name) for name in readers}
    cpu = statistics.median(x["daemon_cpu_s_per_gib"] for x in rows if x["read"] == "through the mount")
    today = datetime.date.today().isoformat()
    out = {"date": today, "machine": machine(), "command": " ".join(sys.argv), "size": size, "cold_mib_s": cold,
           "rows": rows, "medians": med, "daemon_cpu_s_per_gib": cpu, "passthrough_opens": passthrough_opens,
           "daemon_reads": daemon_reads, "store_file_is_the_object": same, "first_read_after_restart_mib_s": first,
           "small_rows": small, "small_first_read_after_restart_files_s": small_first}
    lines = [f"# The kernel's warm read against the disk under it ({today})", "",
             f"One file of {size / MiB:.0f} MiB; a default mount restarted over its filled cache; "
             f"{args.rounds} rounds, each read after the page cache is dropped, the order rotated.", "",
             *table(rows, med, "mib_s", "MiB/s")]
    lines += ["", f"- through the mount / the store's file: **{med['through the mount'] / med[STORE]:.2f}x**; "
              f"/ the local copy: **{med['through the mount'] / med['local copy']:.2f}x**",
              f"- the daemon's CPU per GiB read through the mount: {cpu:.4f} s; READs it answered: {daemon_reads}; "
              f"passthrough opens: {passthrough_opens}",
              f"- the machine's first read after the restart (a third file, not counted): {first:.0f} MiB/s",
              f"- cold pass (filling): {cold:.0f} MiB/s; the store's file is the object byte for byte: {same}", ""]
    if small:
        sm = {name: statistics.median(x["files_s"] for x in small if x["read"] == name)
              for name in ("through the mount", "local copy")}
        ms = statistics.median(x["daemon_cpu_ms_per_file"] for x in small if x["read"] == "through the mount")
        out["small_medians"] = sm
        lines += [f"{args.small} files of 100 KiB on a mount of their own (opened with no request, read through "
                  "the daemon), 16 readers, a new shuffled order each round, the local copies in the same order:", "",
                  *table(small, sm, "files_s", "files/s")]
        lines += ["", f"- through the mount / the local copies: **{sm['through the mount'] / sm['local copy']:.2f}x**; "
                  f"the daemon's CPU: {ms:.3f} ms a file",
                  f"- the machine's first read after the restart (a third copy, not counted): {small_first:.0f} files/s", ""]
    target = args.out or HERE / "results" / f"{today}-warm-kernel.json"
    save_results(target, out, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
