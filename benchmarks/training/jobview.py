"""The article's loop, measured: a training job run three ways, each with ``epochfs.watch`` in its loop,
and ``epochfs doctor`` on the mounts before and after the change.

1. raw S3: every sample a boto3 GET (the job before epochfs); ``watch`` measures its data wait;
2. epochfs, the job pointed at the mount as is (cold cache, no manifest): ``doctor --save``;
3. epochfs with the sampler hook (the epoch's order handed over at its start): ``doctor --compare``.

One simulated accelerator reads a fresh seeded shuffle of 100 KiB files per epoch, in batches through
a pool of readers (two batches ahead), and computes (sleeps) a fixed time per batch, behind the latency
proxy; ``--epochs`` passes (default 2: the cold read and one from the cache). The doctor prices GPU time
at ``--gpu-hour``.

    sudo .venv/bin/python benchmarks/training/jobview.py [--files 1000] [--latency-ms 20] [--compute-ms 40] [--epochs 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN, Epochfs  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, log, start_run  # noqa: E402

from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalS3, client_for  # noqa: E402
from epochfs.prefetch.manifest import shuffled  # noqa: E402
from epochfs.watch import Meter, Reporter, watch  # noqa: E402

HERE = Path(__file__).resolve().parent


def batches(read: Callable[[str], int], order: list[str], batch: int, workers: int) -> Iterator[int]:
    """A loader: batches of ``order`` read by ``workers`` threads, two batches ahead."""
    groups = [order[i:i + batch] for i in range(0, len(order), batch)]
    with ThreadPoolExecutor(workers) as pool:
        pending = [pool.submit(lambda g: sum(read(k) for k in g), g) for g in groups[:2]]
        nxt = 2
        while pending:
            got = pending.pop(0).result()
            if nxt < len(groups):
                pending.append(pool.submit(lambda g: sum(read(k) for k in g), groups[nxt]))
                nxt += 1
            yield got


def train(loader: Iterator[int], compute: float, reporting: Path, job: str, reporter: Reporter | None = None) -> dict:
    start = time.perf_counter()
    steps = 0
    for _ in watch(loader, reporting, job=job, interval=1.0, reporter=reporter):
        time.sleep(compute)
        steps += 1
    wall = time.perf_counter() - start
    return {"steps": steps, "wall_seconds": wall, "au": steps * compute / wall}


def doctor(mount: Path, job: str, *extra: str) -> tuple[dict, str]:
    cmd = [str(VENV_BIN / "epochfs"), "doctor", str(mount), "--job", job, "--interval", "1", *extra]
    result = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout)
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return result, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--compute-ms", type=float, default=40.0, help="compute per batch of 8")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--gpu-hour", type=float, default=2.5, help="what the doctor prices a GPU hour at")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "jobview")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    files = [SampleFile(f"train/{i % 20:02d}/{i:05d}.jpg", 100 * 1024) for i in range(args.files)]
    keys = [f.key for f in files]
    order = shuffled(keys, 42, 0)
    compute, batch, workers = args.compute_ms / 1000, 8, 4
    out: dict = {"files": args.files, "latency_ms": args.latency_ms, "compute_ms": args.compute_ms}
    server = LocalS3(args.work / "s3").start()
    proxy = ProxyProcess(server.port, args.latency_ms / 1000)
    try:
        upload(server.client(), "bench", "ds/", files)
        client = client_for(proxy.endpoint)

        def get(key: str) -> int:
            return len(client.get_object(Bucket="bench", Key="ds/" + key)["Body"].read())

        meter = Meter()  # raw S3 has no daemon to report to: the job's own measurements
        reporter = Reporter(args.work, "raw-s3", 0, meter, interval=3600, send=lambda fields: None)
        epochs = [train(batches(get, shuffled(keys, 42, e), batch, workers), compute, args.work, "raw-s3", reporter)
                  for e in range(args.epochs)]
        raw = {"epochs": epochs, "data_wait_fraction": meter.data_wait / (meter.data_wait + meter.compute)}
        out["raw S3"] = raw
        log(f"raw S3: AU {[round(e['au'], 2) for e in epochs]}, waited for data {raw['data_wait_fraction']:.0%}")

        saved = args.work / "before.json"
        for manifest in (False, True):
            c = Epochfs(args.work / ("hook" if manifest else "plain"), proxy.endpoint, "bench", "ds/", 1 << 34,
                        manifest=manifest)
            c.mount()
            drop_page_cache()
            job = "resnet"
            epochs = []
            for e in range(args.epochs):
                order = shuffled(keys, 42, e)
                if manifest:
                    c.hand_over(order, e, replace=True)  # what EpochfsSampler does at the epoch's start
                epochs.append(train(batches(lambda k, root=c.root: len((root / k).read_bytes()), order, batch,
                                            workers), compute, c.root, job))
            time.sleep(1.5)  # the last report lands
            result, text = doctor(c.root, job, "--gpu-hour", str(args.gpu_hour),
                                  *(["--compare", str(saved)] if manifest else ["--save", str(saved)]))
            run = {"epochs": epochs, "verdict": result["verdict"], "data_wait_fraction": result["data_wait_fraction"],
                   "findings": [f["cause"] for f in result["findings"]], "doctor": text, "cost": result["cost"]}
            out["epochfs + sampler hook" if manifest else "epochfs"] = run
            log(f"{c.name}: AU {[round(e['au'], 2) for e in epochs]}, doctor: {result['verdict']} {run['findings']}")
            c.unmount()
    finally:
        proxy.stop()
        server.stop()

    lines = [f"# The job's view, {datetime.date.today().isoformat()}: {args.files} x 100 KiB, batches of {batch}, "
             f"{args.compute_ms:g} ms compute per batch, {workers} readers, {args.latency_ms:g} ms added latency, "
             f"cold cache, {args.epochs} epochs", "",
             "| run | AU, first epoch | AU, later epochs | data wait share (doctor's) | doctor's verdict | findings |",
             "|---|---|---|---|---|---|"]
    for name in ("raw S3", "epochfs", "epochfs + sampler hook"):
        r = out[name]
        later = [e["au"] for e in r["epochs"][1:]]
        lines.append(f"| {name} | {r['epochs'][0]['au']:.0%} | {sum(later) / len(later):.0%} | "
                     if later else f"| {name} | {r['epochs'][0]['au']:.0%} | - | ")
        lines[-1] += (f"{r['data_wait_fraction']:.0%} | {r.get('verdict', '(no daemon)')} | "
                      f"{', '.join(r.get('findings', [])) or '-'} |")
    lines += ["", "`epochfs doctor` on the plain mount (saved with `--save`):", "", "```",
              out["epochfs"]["doctor"].rstrip(), "```", "",
              "`epochfs doctor --compare` on the mount with the sampler hook:", "", "```",
              out["epochfs + sampler hook"]["doctor"].rstrip(), "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-jobview"
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
