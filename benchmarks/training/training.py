"""The first epoch of the training simulation (MLPerf Storage style, benchmarks/shared/workloads.py::train) with
and without an epoch manifest, beside JuiceFS (its defaults; the dataset written through it once,
untimed) and raw boto3 GETs from the same readers, behind a latency proxy. The manifest is handed over
at the start of each epoch (as a job would from its sampler), not before.

    sudo .venv/bin/python benchmarks/training/training.py [--latency-ms 20 50] [--accelerators 1 2 4] [--reps 3]

Demand is set by the compute time per batch: 8 x 100 KiB per step per accelerator. The backend's
capacity at the prefetcher's concurrency is measured in the same run (16 parallel GETs through the
proxy), so each row says what fraction of it the job asks for. With ``--reps`` each contender runs that
many times per row, in alternating order; the table gives medians, and the range of the per-repetition
ratio to JuiceFS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import Contender, Epochfs, Juicefs  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import (  # noqa: E402
    boto_small_rate,
    drop_page_cache,
    fresh_workdir,
    load_text,
    log,
    machine,
    simulate,
    train,
)

from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalS3, client_for  # noqa: E402

HERE = Path(__file__).resolve().parent


def boto_train(client: Any, keys: list[str], *, accelerators: int, batch: int, compute: float, workers: int,
               seed: int) -> float:
    """First-epoch AU of the same simulation reading with boto3 GETs (no file system, no cache)."""
    def read(key: str) -> int:
        return len(client.get_object(Bucket="bench", Key="ds/" + key)["Body"].read())

    (au,) = simulate(read, keys, accelerators=accelerators, batch=batch, compute=compute, workers=workers,
                     epochs=1, seed=seed)
    return au


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[20.0])
    ap.add_argument("--accelerators", type=int, nargs="+", default=[4])
    ap.add_argument("--demand", type=float, nargs="+", default=[0.5, 0.78, 3.9],
                    help="demand as fractions of what the backend gives 16 parallel GETs (sets the compute time)")
    ap.add_argument("--reps", type=int, default=1, help="runs of each contender per row (medians reported)")
    ap.add_argument("--epochfs-args", default="")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "training")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    fresh_workdir(args.work)
    files = [SampleFile(f"small/{i % 20:02d}/{i:05d}.jpg", 100 * 1024) for i in range(args.files)]
    keys = [f.key for f in files]
    batch, workers = 8, 4
    rows: list[dict[str, Any]] = []
    measured_on = machine()
    server = LocalS3(args.work / "s3").start()
    try:
        upload(server.client(), "bench", "ds/", files)
        for latency in args.latency_ms:
            proxy = ProxyProcess(server.port, latency / 1000)
            client = client_for(proxy.endpoint)
            capacity = boto_small_rate(client, "bench", ["ds/" + k for k in keys[:400]], 16)
            log(f"{latency:g} ms: the backend gives {capacity:.0f} files/s to 16 parallel GETs")
            juicefs = Juicefs(args.work / f"lat{latency:g}", proxy.endpoint, "bench", "ds/", 1 << 34)
            for n, fraction in ((n, f) for n in args.accelerators for f in args.demand):
                demand = fraction * capacity
                compute = n * batch / demand
                row: dict[str, Any] = {"latency_ms": latency, "accelerators": n, "demand_files_s": demand,
                                       "backend_files_s": capacity, "demand_over_backend": fraction,
                                       "compute_ms": compute * 1000, "machine": measured_on}
                contenders: list[Contender] = [juicefs]
                for manifest in (False, True):
                    c = Epochfs(args.work / f"lat{latency:g}", proxy.endpoint, "bench", "ds/", 1 << 34,
                                manifest=manifest)
                    c.extra = args.epochfs_args.split()
                    contenders.append(c)
                runs: dict[str, list[float]] = {name: [] for name in ["raw boto3", *(c.name for c in contenders)]}
                cpu: dict[str, list[float]] = {c.name: [] for c in contenders}
                for rep in range(args.reps):
                    runs["raw boto3"].append(boto_train(client, keys, accelerators=n, batch=batch, compute=compute,
                                                        workers=workers, seed=42))
                    for c in contenders if rep % 2 == 0 else contenders[::-1]:
                        c.mount()  # (an empty cache)
                        drop_page_cache()
                        before = c.usage()["cpu"]
                        (au,) = train(c.root, keys, accelerators=n, batch=batch, compute=compute, workers=workers,
                                      epochs=1, seed=42, before_epoch=c.before_epoch)
                        runs[c.name].append(au)
                        cpu[c.name].append((c.usage()["cpu"] - before) * 1000 / len(keys))
                        c.unmount()
                for name, values in runs.items():
                    row[name] = statistics.median(values)
                    row[f"{name} runs"] = values
                for name, values in cpu.items():
                    row[f"{name} daemon CPU ms/file"] = statistics.median(values)
                ratios = [m / j for m, j in zip(runs["epochfs+manifest"], runs["JuiceFS"], strict=True)]
                row["manifest / JuiceFS range"] = [min(ratios), max(ratios)]
                log(f"{latency:g} ms, {n} accelerators ({demand / capacity:.0%} of the backend): " +
                    ", ".join(f"{k} {v:.1%}" for k, v in row.items() if k in ("raw boto3", "JuiceFS", "epochfs lru",
                                                                                "epochfs+manifest")))
                rows.append(row)
            proxy.stop()
    finally:
        server.stop()
    lines = [f"# First-epoch AU, {datetime.date.today().isoformat()}: {args.files} x 100 KiB, batch {batch}, "
             f"{workers} readers per accelerator; the manifest handed over at the start of the epoch"
             + (f"; medians of {args.reps}" if args.reps > 1 else ""), "",
             "Machine: {cpu}, {cpus} cores, {memory_gib:g} GiB, Linux {kernel}".format(**measured_on),
             "", load_text(), "", f"epochfs flags: `{args.epochfs_args or '(defaults)'}`", "",
             "| latency | accelerators | demand / backend | raw boto3 | JuiceFS | epochfs lru | epochfs+manifest | "
             "epochfs+manifest / JuiceFS | daemon CPU ms/file (JuiceFS / lru / manifest) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['latency_ms']:g} ms | {r['accelerators']} | {r['demand_over_backend']:.0%} | "
                     f"{r['raw boto3']:.1%} | {r['JuiceFS']:.1%} | {r['epochfs lru']:.1%} | "
                     f"{r['epochfs+manifest']:.1%} | {r['epochfs+manifest'] / r['JuiceFS']:.2f}x"
                     + (" ({:.2f}-{:.2f})".format(*r["manifest / JuiceFS range"]) if args.reps > 1 else "") + " | "
                     f"{r['JuiceFS daemon CPU ms/file']:.2f} / {r['epochfs lru daemon CPU ms/file']:.2f} / "
                     f"{r['epochfs+manifest daemon CPU ms/file']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-training"
    if Path(f"{stem}.md").exists():  # an earlier run of the same day stays
        stem = stem.with_name(stem.name + time.strftime("-%H%M"))
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
