"""What a checkpoint costs the node: the daemon's CPU per GiB saved (the save, then its upload) and the
save's and the upload's time, side by side in one run, for an `epochfs --writeback` mount whose files the
kernel writes itself (the default), the same mount with `--no-passthrough` (every write through the
daemon), with `--compare-src` another version's `src/` run the same way, against the local disk (the
save's floor) and raw boto3 (the upload's: s3transfer's multipart upload of the same files from the local
disk, at the daemon's concurrency: 2 files at once, 4 parts each, 16 MiB parts).

`--ranks` processes each write their part (one file) in 4 MiB writes and fsync it, all released at once
(MLPerf Storage's checkpointing: the slowest rank's seconds); then `epochfs.Client(mnt).sync()` waits for
the upload. The CPU is the daemon's user + system time (/proc/PID/stat, all threads) over each phase;
then until the uploaded files are the cache's blocks (what a restore on this node reads); the bytes in
the backend are compared with what was written.

    sudo .venv/bin/python benchmarks/checkpoint/save_cost.py [--mib 1024] [--ranks 4] [--compare-src DIR]

On one machine the ranks, the daemon and the S3 server share two cores: the CPU per GiB is what to read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint import EpochfsWb, LocalDisk, phase, run_ranks, write_part  # noqa: E402
from contenders import unmount  # noqa: E402
from workloads import drop_page_cache, log, start_run  # noqa: E402

from epochfs import Client  # noqa: E402
from epochfs.dev.servers import LocalS3, client_for  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB, GiB = 1 << 20, 1 << 30
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def boto3_upload(endpoint: str, paths: list[Path], prefix: str) -> dict[str, float]:
    """s3transfer's multipart upload of ``paths`` as the daemon does it (2 at once, 4 parts each, 16 MiB
    parts): seconds, and this process's CPU seconds."""
    import boto3.s3.transfer

    client = client_for(endpoint)
    config = boto3.s3.transfer.TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=16 * MiB,
                                              max_concurrency=4)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), "ckpt", f"{prefix}/{p.name}", Config=config), paths))
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "cpu_s": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime}


def kept_in_cache(fs: EpochfsWb, total: int, timeout: float = 300.0) -> float:
    """Seconds until the uploaded files are the cache's blocks (their data files gone, the store holding
    their bytes): the rest of what a save costs the daemon."""
    data, started = fs.cache / "writeback" / "data", time.perf_counter()
    while time.perf_counter() - started < timeout:
        if not any(data.iterdir()) and Client(fs.mnt).status()["store"]["used_bytes"] >= total:
            break
        time.sleep(0.05)
    return time.perf_counter() - started


def backend_digests(endpoint: str, prefix: str, names: list[str]) -> dict[str, str]:
    client = client_for(endpoint)
    out = {}
    for name in names:
        h = hashlib.blake2b()
        for chunk in client.get_object(Bucket="ckpt", Key=f"{prefix}/{name}")["Body"].iter_chunks(4 * MiB):
            h.update(chunk)
        out[name] = h.hexdigest()
    return out


def one_mount(label: str, flags: tuple[str, ...], src: Path | None, work: Path, server: LocalS3,
              parts: list[memoryview], digests: dict[str, str]) -> dict[str, Any]:
    fs = EpochfsWb(work, label.replace(" ", "-"))
    fs.extra = flags
    os.environ.pop("PYTHONPATH", None)
    if src is not None:
        os.environ["PYTHONPATH"] = str(src)
    prefix = label.replace(" ", "-")
    try:
        fs.mount(server, prefix)
    finally:
        os.environ.pop("PYTHONPATH", None)
    assert fs.pid is not None
    try:
        names = [f"rank-{r}.pt" for r in range(len(parts))]
        drop_page_cache()
        cpu0 = cpu_seconds(fs.pid)
        saved = phase(run_ranks([lambda r=r: write_part([fs.root / names[r]], parts[r]) for r in range(len(parts))]),
                      [len(p) for p in parts])
        cpu1, started = cpu_seconds(fs.pid), time.perf_counter()
        Client(fs.mnt).sync(timeout=1800)
        upload_s, cpu2 = time.perf_counter() - started, cpu_seconds(fs.pid)
        kept = kept_in_cache(fs, sum(len(p) for p in parts))
        cpu3 = cpu_seconds(fs.pid)
        status = Client(fs.mnt).status()
        total = sum(len(p) for p in parts) / GiB
        # A save while the one before it uploads: that one saved, its upload under way, then this one.
        before = [f"before-{r}.pt" for r in range(len(parts))]
        run_ranks([lambda r=r: write_part([fs.root / before[r]], parts[r]) for r in range(len(parts))])
        deadline = time.monotonic() + 30
        while not Client(fs.mnt).status()["writeback"]["uploading"] and time.monotonic() < deadline:
            time.sleep(0.02)
        during = [f"during-{r}.pt" for r in range(len(parts))]
        overlapped = phase(run_ranks([lambda r=r: write_part([fs.root / during[r]], parts[r])
                                      for r in range(len(parts))]), [len(p) for p in parts])
        uploading_after = Client(fs.mnt).status()["writeback"]["uploading"]
        Client(fs.mnt).sync(timeout=1800)
        got = backend_digests(server.endpoint, prefix, names + before + during)
        wrong = sum(got[f"{kind}-{r}.pt"] != digests[f"rank-{r}.pt"] for kind in ("rank", "before", "during")
                    for r in range(len(parts)))
        w = status.get("writeback") or {}
        out = {"flags": list(flags), "src": str(src) if src else "this checkout",
               "save_slowest_rank_s": saved["slowest_rank_seconds"],
               "save_cpu_s_per_gib": (cpu1 - cpu0) / total, "upload_s": upload_s,
               "upload_cpu_s_per_gib": (cpu2 - cpu1) / total, "keep_s": kept,
               "keep_cpu_s_per_gib": (cpu3 - cpu2) / total, "cpu_s_per_gib": (cpu3 - cpu0) / total,
               "save_during_upload_s": overlapped["slowest_rank_seconds"], "still_uploading_after": uploading_after,
               "kernel_opens": w.get("kernel_opens", 0), "kernel_bytes": w.get("kernel_bytes", 0),
               "wrong_files": wrong}
        log(f"{label}: {json.dumps(out)}")
        return out
    finally:
        unmount(fs.mnt, fs.pid, timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="the checkpoint's size, over every rank")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--compare-src", type=Path, help="another version's src/ directory, measured the same way")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "save-cost")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    per = args.mib * MiB // args.ranks
    parts = [memoryview(os.urandom(per)) for _ in range(args.ranks)]
    names = [f"rank-{r}.pt" for r in range(args.ranks)]
    digests = {n: hashlib.blake2b(p).hexdigest() for n, p in zip(names, parts, strict=True)}
    server = LocalS3(args.work / "s3").start()
    out: dict[str, Any] = {"bytes": per * args.ranks, "ranks": args.ranks, "mounts": {}}
    try:
        server.client().create_bucket(Bucket="ckpt")
        disk = LocalDisk(args.work, "local-disk")
        disk.mount(server, "")
        drop_page_cache()
        local = phase(run_ranks([lambda r=r: write_part([disk.root / names[r]], parts[r]) for r in range(args.ranks)]),
                      [per] * args.ranks)
        out["local_disk_save_s"] = local["slowest_rank_seconds"]
        out["boto3_upload"] = boto3_upload(server.endpoint, [disk.root / n for n in names], "boto3")
        out["boto3_upload"]["cpu_s_per_gib"] = out["boto3_upload"]["cpu_s"] / (per * args.ranks / GiB)
        log(f"local disk {local['slowest_rank_seconds']:.2f} s; boto3 {json.dumps(out['boto3_upload'])}")
        mounts = [("kernel writes", (), None), ("through the daemon", ("--no-passthrough",), None)]
        if args.compare_src:
            mounts.append(("compared", (), args.compare_src.resolve()))
        for label, flags, src in mounts:
            out["mounts"][label] = one_mount(label, flags, src, args.work, server, parts, digests)
        disk.mount(server, "")  # (again after the mounts: this disk's speed drifts over a run)
        drop_page_cache()
        again = phase(run_ranks([lambda r=r: write_part([disk.root / names[r]], parts[r]) for r in range(args.ranks)]),
                      [per] * args.ranks)
        out["local_disk_save_again_s"] = again["slowest_rank_seconds"]
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    (args.out / f"{stamp}-save-cost.json").write_text(json.dumps(out, indent=2) + "\n")
    b = out["boto3_upload"]
    lines = [f"# What a checkpoint costs the daemon ({stamp})", "",
             f"{args.ranks} ranks, {out['bytes'] / GiB:.2f} GiB in all, one file a rank written in 4 MiB writes "
             "with fsync; then `Client.sync()` until it is in the backend.", "",
             f"Local disk: the slowest rank saved in {out['local_disk_save_s']:.2f} s before the mounts, "
             f"{out['local_disk_save_again_s']:.2f} s after them. Raw boto3 (s3transfer, 2 files "
             f"at once, 4 parts each) uploaded the same files in {b['seconds']:.2f} s at {b['cpu_s_per_gib']:.2f} s "
             "of CPU per GiB.", "",
             "| mount | save: slowest rank (s) | vs local disk | daemon CPU s/GiB: save | upload (s) | vs boto3 | "
             "daemon CPU s/GiB: upload | kept in the cache (s) | CPU s/GiB: keep | in all | kernel-written bytes | "
             "a save while the last uploads (s) | wrong files |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in out["mounts"].items():
        lines.append(f"| {label} ({' '.join(r['flags']) or 'defaults'}; {r['src']}) | {r['save_slowest_rank_s']:.2f} | "
                     f"{r['save_slowest_rank_s'] / min(out['local_disk_save_s'], out['local_disk_save_again_s']):.2f}x | {r['save_cpu_s_per_gib']:.2f} | "
                     f"{r['upload_s']:.2f} | {b['seconds'] / r['upload_s']:.2f}x | {r['upload_cpu_s_per_gib']:.2f} | "
                     f"{r['keep_s']:.2f} | {r['keep_cpu_s_per_gib']:.2f} | {r['cpu_s_per_gib']:.2f} | "
                     f"{r['kernel_bytes'] / GiB:.2f} GiB | {r['save_during_upload_s']:.2f} "
                     f"({r['save_during_upload_s'] / r['save_slowest_rank_s']:.1f}x) | {r['wrong_files']} |")
    lines += ["", "A save while the last uploads: the slowest rank's seconds, and their ratio to the first save's.",
              "", "vs local disk: the save's time over the faster of the two local-disk saves; vs boto3: boto3's upload "
              "time over the mount's (above 1: the mount uploads faster). In all: the daemon's CPU from the save's "
              "start until the files are the cache's blocks, per GiB saved.", ""]
    (args.out / f"{stamp}-save-cost.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
