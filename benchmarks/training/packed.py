"""Packed datasets against the shard loaders: two epochs of a PyTorch DataLoader training loop (batch 16,
4 workers, a fixed compute time per batch, page cache dropped before each epoch) over the same files as
plain objects (through epochfs, and through JuiceFS with its defaults: the files written through it
once, untimed), as an epochfs pack (``epochfs pack``), as Mosaic Streaming MDS shards and as WebDataset
tar shards, behind a latency proxy, side by side in one run.

    sudo .venv/bin/python benchmarks/training/packed.py [--latency-ms 20 50] [--files 2000] [--compute-ms 30]

Mosaic Streaming and WebDataset run in their own virtualenv (``bash benchmarks/training/loaders-setup.sh``;
Mosaic Streaming pins xxhash<4) through ``loaders.py``. Reported per contender: conversion seconds,
AU of epochs 1 and 2, GETs at the endpoint per epoch, whether each epoch read every sample exactly
once, and the daemon's CPU per sample (epochfs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN, Epochfs, Juicefs  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from trainloop import one_epoch  # noqa: E402
from workloads import drop_page_cache, fresh_workdir, log, settle  # noqa: E402

from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
LOADERS = HERE.parent / "work" / ".venv-loaders" / "bin" / "python"
BUCKET, SEED, BATCH, WORKERS = "bench", 42, 16, 4


class Files:
    """A map-style dataset of files under ``root``: sample ``i`` is ``keys[i]``, read whole."""

    def __init__(self, root: Path, keys: list[str]) -> None:
        self.root, self.keys = root, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> str:
        with open(self.root / self.keys[i], "rb") as f:
            f.read()
        return self.keys[i]


def loader_epoch(root: Path, keys: list[str], sampler: Any, compute: float) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    loader = DataLoader(Files(root, keys), batch_size=BATCH, sampler=sampler, num_workers=WORKERS)
    return one_epoch(loader, compute)


def shuffled_sampler(n: int) -> Any:
    from torch.utils.data import DistributedSampler

    return DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=SEED)


def child(op: str, args: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env.update(AWS_ACCESS_KEY_ID="any", AWS_SECRET_ACCESS_KEY="any", AWS_DEFAULT_REGION="us-east-1")
    r = subprocess.run([str(LOADERS), str(HERE / "loaders.py"), op, json.dumps(args)], env=env, capture_output=True,
                       text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def epochs_of(name: str, run_epoch: Any, server: LocalS3, epochs: int, usage: Any = None,
              n: int = 0, bucket: str = BUCKET) -> dict[str, Any]:
    row: dict[str, Any] = {"contender": name, "epochs": []}
    for epoch in range(epochs):
        drop_page_cache()
        gets, cpu = server.request_count(bucket), usage() if usage else 0.0
        r = run_epoch(epoch)
        r["gets"] = server.request_count(bucket) - gets
        if usage:
            r["daemon_cpu_ms_per_sample"] = (usage() - cpu) * 1000 / max(1, r["samples"])
        r["exact"] = r["samples"] == r["distinct"] == n
        row["epochs"].append(r)
        log(f"  {name}, epoch {epoch + 1}: AU {r['au']:.1%}, {r['gets']} GETs, {r['distinct']} distinct of "
            f"{r['samples']} samples" + (f", daemon {r['daemon_cpu_ms_per_sample']:.2f} ms/sample" if usage else ""))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[20.0, 50.0])
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="compute time per batch of 16 (default: three times what local disk takes to load one, "
                    "measured first: local disk is then about 25%% busy)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every contender, interleaved (medians)")
    ap.add_argument("--shard-size", default="8M", help="shard size of every packed format (default: 8M)")
    ap.add_argument("--window", type=int, default=4, help="shards shuffled together by the local order")
    ap.add_argument("--only", nargs="*", help="contenders to run (default: all)")
    ap.add_argument("--small-cache", type=float, default=0.25,
                    help="the packed contenders also run with a cache of this fraction of the data (default: 0.25)")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "packed")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    small = f"cache {args.small_cache:g} of the data"
    wanted = set(args.only or ["local disk", "epochfs plain", "JuiceFS plain", "epochfs packed, local order",
                               "epochfs packed, random order", "Mosaic Streaming", "WebDataset",
                               f"epochfs packed, local order, {small}", f"epochfs packed, random order, {small}"])
    if wanted & {"Mosaic Streaming", "WebDataset"} and not LOADERS.exists():
        raise SystemExit(f"{LOADERS} is missing: run  bash benchmarks/training/loaders-setup.sh (or leave the shard "
                         "loaders out with --only)")
    fresh_workdir(args.work)
    files = [SampleFile(f"c{i % 20:02d}/{i:05d}.jpg", 100 * 1024) for i in range(args.files)]
    keys = [f.key for f in files]
    disk = args.work / "disk"
    for f in files:
        (disk / f.key).parent.mkdir(parents=True, exist_ok=True)
        (disk / f.key).write_bytes(f.content())
    shard_bytes = int(args.shard_size.rstrip("M")) << 20
    if args.compute_ms is None:
        drop_page_cache()
        loaded = loader_epoch(disk, keys, shuffled_sampler(len(keys)), 0.0)
        args.compute_ms = 3000 * loaded["seconds"] / loaded["steps"]
        log(f"local disk loads a batch in {loaded['seconds'] * 1000 / loaded['steps']:.1f} ms: compute "
            f"{args.compute_ms:.1f} ms per batch")
    server = LocalS3(args.work / "s3").start()
    results: dict[str, Any] = {"date": datetime.date.today().isoformat(), "files": args.files, "file_size": 100 * 1024,
                               "batch": BATCH, "workers": WORKERS, "compute_ms": args.compute_ms,
                               "shard_size": args.shard_size, "window": args.window, "reps": args.reps,
                               "convert": {}, "runs": []}
    try:
        upload(server.client(), BUCKET, "raw/", files)
        if any(name.startswith("epochfs packed") for name in wanted):
            started = time.perf_counter()
            subprocess.run([str(VENV_BIN / "epochfs"), "pack", f"s3://{BUCKET}/raw", f"s3://{BUCKET}/packed",
                            "--endpoint-url", server.endpoint, "--shard-size", args.shard_size, "-q"],
                           env=server.env(), check=True, capture_output=True)
            results["convert"]["epochfs pack"] = {"seconds": time.perf_counter() - started}
        base = {"endpoint": server.endpoint, "bucket": BUCKET, "raw": "raw/", "keys": keys,
                "work": str(args.work), "shard_size": shard_bytes}
        if "Mosaic Streaming" in wanted:
            results["convert"]["Mosaic Streaming"] = child("convert-mds", {**base, "prefix": "mds/"})
        wds_shards: list[str] = []
        if "WebDataset" in wanted:
            results["convert"]["WebDataset"] = child("convert-wds", {**base, "prefix": "wds/"})
            wds_shards = sorted(o["Key"][4:] for o in
                                server.client().list_objects_v2(Bucket=BUCKET, Prefix="wds/")["Contents"])
        log(f"converted: {json.dumps(results['convert'])}; quiet after {settle():.0f} s")
        for latency in args.latency_ms:
            proxy = ProxyProcess(server.port, latency / 1000)
            log(f"{latency:g} ms added per request")
            try:
                reps = [run_latency(args, server, proxy, args.work / f"lat{latency:g}-{rep}", keys, disk, wds_shards,
                                    wanted) for rep in range(args.reps)]
                rows = [median_row([rep[i] for rep in reps]) for i in range(len(reps[0]))]
            finally:
                proxy.stop()
            results["runs"].append({"latency_ms": latency, "rows": rows})
    finally:
        server.stop()
    text = report(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{results['date']}-packed"
    if Path(f"{stem}.md").exists():  # an earlier run of the same day stays
        stem = stem.with_name(stem.name + time.strftime("-%H%M"))
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


def run_latency(args: argparse.Namespace, server: LocalS3, proxy: ProxyProcess, work: Path, keys: list[str],
                disk: Path, wds_shards: list[str], wanted: set[str]) -> list[dict[str, Any]]:
    compute, n, rows = args.compute_ms / 1000, len(keys), []  # (one latency's contenders, in turn)
    if "local disk" in wanted:
        sampler = shuffled_sampler(n)

        def disk_epoch(e: int) -> dict[str, Any]:
            sampler.set_epoch(e)
            return loader_epoch(disk, keys, sampler, compute)

        rows.append(epochs_of("local disk", disk_epoch, server, args.epochs, n=n))
    whole, small = 1 << 34, int(args.small_cache * n * 100 * 1024)
    for name, prefix, local, cache_size in (
            ("epochfs plain", "raw/", False, whole), ("epochfs packed, local order", "packed/", True, whole),
            ("epochfs packed, random order", "packed/", False, whole),
            (f"epochfs packed, local order, cache {args.small_cache:g} of the data", "packed/", True, small),
            (f"epochfs packed, random order, cache {args.small_cache:g} of the data", "packed/", False, small)):
        if name in wanted:
            rows.append(epochfs_run(args, server, proxy, work, name, prefix, local, keys, cache_size))
        if name == "epochfs plain" and "JuiceFS plain" in wanted:
            rows.append(juicefs_run(args, server, proxy, work, keys))
    common = {"proxy": proxy.endpoint, "bucket": BUCKET, "seed": SEED, "batch": BATCH, "workers": WORKERS,
              "compute": compute}
    if "Mosaic Streaming" in wanted:
        cache = str(work / "mds-cache")
        rows.append(epochs_of("Mosaic Streaming", lambda e: child(
            "read-mds", {**common, "prefix": "mds/", "cache": cache, "epoch": e}), server, args.epochs, n=n))
    if "WebDataset" in wanted:
        rows.append(epochs_of("WebDataset", lambda e: child(
            "read-wds", {**common, "prefix": "wds/", "shards": wds_shards, "epoch": e, "buffer": 1000}),
            server, args.epochs, n=n))
    return rows


def epochfs_run(args: argparse.Namespace, server: LocalS3, proxy: ProxyProcess, work: Path, name: str, prefix: str,
                local: bool, keys: list[str], cache_size: int) -> dict[str, Any]:
    from epochfs.torch import EpochfsSampler, local_sampler

    c = Epochfs(work, proxy.endpoint, BUCKET, prefix, cache_size, manifest=True, name=name)
    c.mount()
    try:
        paths = [str(c.root / k) for k in keys]
        sampler = (local_sampler(paths, c.root, seed=SEED, window=args.window) if local
                   else EpochfsSampler(shuffled_sampler(len(keys)), paths, c.root))

        def fs_epoch(e: int) -> dict[str, Any]:
            sampler.set_epoch(e)
            sampler.wait()
            return loader_epoch(c.root, keys, sampler, args.compute_ms / 1000)

        return epochs_of(name, fs_epoch, server, args.epochs, usage=lambda: c.usage()["cpu"], n=len(keys))
    finally:
        c.unmount()


def juicefs_run(args: argparse.Namespace, server: LocalS3, proxy: ProxyProcess, work: Path,
                keys: list[str]) -> dict[str, Any]:
    """The plain files through JuiceFS, read by the same DataLoader in the same shuffled order as
    ``epochfs plain`` (no order handed over: JuiceFS takes none). Its GETs are counted at its own
    volume's bucket."""
    c = Juicefs(work, proxy.endpoint, BUCKET, "raw/", 1 << 34)
    c.mount()
    try:
        sampler = shuffled_sampler(len(keys))

        def fs_epoch(e: int) -> dict[str, Any]:
            sampler.set_epoch(e)
            return loader_epoch(c.root, keys, sampler, args.compute_ms / 1000)

        return epochs_of("JuiceFS plain", fs_epoch, server, args.epochs, usage=lambda: c.usage()["cpu"],
                         n=len(keys), bucket=c.volume)
    finally:
        c.unmount()


def median_row(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's repetitions: per epoch the median of each figure, its AU range, every run's rows."""
    import statistics

    epochs = []
    for e in range(len(reps[0]["epochs"])):
        runs = [r["epochs"][e] for r in reps]
        out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))
               and not isinstance(runs[0][k], bool)}
        out["exact"] = all(r["exact"] for r in runs)
        out["au_range"] = [min(r["au"] for r in runs), max(r["au"] for r in runs)]
        epochs.append(out)
    return {"contender": reps[0]["contender"], "epochs": epochs, "reps": reps}


def _exact(epoch: dict[str, Any]) -> str:
    return "yes" if epoch["exact"] else f"no: {epoch['distinct']} distinct of {epoch['samples']}"


def _au(epoch: dict[str, Any]) -> str:
    lo, hi = epoch["au_range"]
    return f"{epoch['au']:.1%} [{lo:.0%}-{hi:.0%}]"


def _gets(epochs: list[dict[str, Any]]) -> str:
    return " / ".join(f"{e['gets']:g}" for e in epochs)


def report(results: dict[str, Any]) -> str:
    conv = results["convert"]
    lines = [f"# Packed datasets and the shard loaders, {results['date']}", "",
             f"{results['files']} x 100 KiB files in 20 class folders; a DataLoader with {results['workers']} "
             f"workers, batch {results['batch']}, {results['compute_ms']:.1f} ms of compute per batch; page cache "
             f"dropped before each epoch; shards of {results['shard_size']} for every packed format; local order "
             f"window {results['window']} shards.", "",
             "Conversion: " + (", ".join(f"{k} {v['seconds']:.1f} s" for k, v in conv.items()) or "none") + ".", "",
             f"JuiceFS plain: {Juicefs.tuning}; its GETs are counted at its own volume's bucket.", "",
             f"Medians of {results['reps']} interleaved repetitions (AU range in brackets); a 2-core machine runs "
             "the loader workers, the daemon, the S3 server and the latency proxy at once. AU excludes the first "
             "batch (as MLPerf Storage does), so a loader that fetches much before its first batch gains by it: "
             "the epoch's seconds (first batch included) are beside it.", ""]
    for run in results["runs"]:
        lines += [f"## {run['latency_ms']:g} ms added per request", "",
                  "| contender | epoch-1 AU | epoch-2 AU | epoch seconds e1 / e2 | GETs e1 / e2 | every sample once "
                  "(e1 / e2) | daemon CPU ms/sample (e1) |", "|---|---|---|---|---|---|---|"]
        for row in run["rows"]:
            e = row["epochs"]
            cpu = e[0].get("daemon_cpu_ms_per_sample")
            lines.append(f"| {row['contender']} | {_au(e[0])} | {_au(e[-1])} | "
                         f"{' / '.join(f'{x:.1f}' for x in (e[0]['seconds'], e[-1]['seconds']))} | {_gets(e)} | "
                         f"{' / '.join(map(_exact, e))} | "
                         f"{'' if cpu is None else f'{cpu:.2f}'} |")
        lines.append("")
    lines += ["Mosaic Streaming 0.13 keeps the S3 client each stream made while reading the index in the "
              "process that builds the dataset: DataLoader workers forked after it would share its connection "
              "(a 60 s stall, and in some runs a shard saved under another shard's name). `loaders.py` drops "
              "it (`stream._downloader.clean_up()`) before the workers fork. WebDataset reads with a shard "
              "shuffle, a sample shuffle buffer of 1000 and each worker its own shards, and no resampling.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
