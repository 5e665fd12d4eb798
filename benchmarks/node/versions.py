"""A new version of a dataset beside the old one: what reading ``v2`` costs once ``v1`` is cached on the node.

    sudo .venv/bin/python benchmarks/node/versions.py [--large 96] [--small 1500] [--changed 0.1] [--latency-ms 0 20]

``v1/``: ``--large`` files of 5 MiB and ``--small`` files of 100 KiB; ``v2/``: the same with ``--changed`` of
each kind in a new version and 2% more files added. Each run mounts ``v1`` and ``v2`` side by side (two
daemons, a cache directory each), reads all of ``v1`` (16 readers), then, page cache dropped, all of
``v2`` (16 readers, shuffled), each file checked against its ETag (MD5). Two conditions, alternated:
the default (``v2``'s mount copies from ``v1``'s cache what has the same content) and ``--share-dir off``
(each mount fetches its own). Per run: ``v2``'s wall time, the bytes its mount fetched against the bytes
that changed, its daemon's CPU (user + system) per GiB of ``v2``. ``--latency-ms``: the endpoint behind a
proxy that adds that much to every request and connection (20 ms: S3 in the same region).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)

from contenders import VENV_BIN, proc_usage, unmount, wait_mounted  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, load_text, log, machine, save_results, start_run  # noqa: E402

from epochfs.control.client import request  # noqa: E402
from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
BUCKET = "versions"
LARGE, SMALL = 5 << 20, 100 << 10


def payload(name: str, version: int, size: int) -> bytes:
    rng = random.Random(f"{name}@{version}")
    return rng.randbytes(size)


def upload(client: Any, large: int, small: int, changed: float) -> tuple[dict[str, str], dict[str, str], int]:
    """The two versions' keys -> MD5, and the bytes of ``v2`` that are not in ``v1``."""
    files = [(f"large/{i:04d}.bin", LARGE) for i in range(large)] + [(f"small/{i:05d}.bin", SMALL) for i in range(small)]
    rng = random.Random(7)
    new = set(rng.sample(range(large), round(large * changed))) | {large + i for i in rng.sample(range(small), round(small * changed))}
    added = [(f"added/{i:04d}.bin", LARGE if i % 2 else SMALL) for i in range(max(1, round(0.02 * len(files))))]
    client.create_bucket(Bucket=BUCKET)
    v1, v2, changed_bytes = {}, {}, 0
    jobs = []
    for i, (key, size) in enumerate(files):
        jobs.append(("v1/" + key, key, 0, size, v1))
        jobs.append(("v2/" + key, key, 1 if i in new else 0, size, v2))
        changed_bytes += size if i in new else 0
    for key, size in added:
        jobs.append(("v2/" + key, key, 2, size, v2))
        changed_bytes += size

    def put(job: tuple[str, str, int, int, dict[str, str]]) -> None:
        full, key, version, size, into = job
        data = payload(key, version, size)
        client.put_object(Bucket=BUCKET, Key=full, Body=data)
        into[key] = hashlib.md5(data).hexdigest()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, jobs))
    return v1, v2, changed_bytes


def mount(work: Path, endpoint: str, env: dict[str, str], version: str, share: list[str]) -> tuple[Path, int]:
    root = work / f"mnt-{version}"
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(VENV_BIN / "epochfs"), "mount", f"s3://{BUCKET}/{version}", str(root), "--endpoint-url",
                    endpoint, "--cache-dir", str(work / f"cache-{version}"), "--cache-size", "20G",
                    "--metrics-addr", "off", *share], env=env, check=True, capture_output=True)
    wait_mounted(root)
    return root, int(os.getxattr(root, "user.epochfs.pid"))


def read_checked(root: Path, files: dict[str, str], seed: int) -> tuple[float, int]:
    """Seconds to read every file with 16 readers in a shuffled order, and the files whose MD5 is wrong."""
    keys = sorted(files)
    random.Random(seed).shuffle(keys)
    it, lock, wrong = iter(keys), threading.Lock(), []

    def worker() -> None:
        while True:
            with lock:
                key = next(it, None)
            if key is None:
                return
            h = hashlib.md5()
            with open(root / key, "rb", buffering=0) as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            if h.hexdigest() != files[key]:
                wrong.append(key)

    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        for fut in [pool.submit(worker) for _ in range(16)]:
            fut.result()
    return time.perf_counter() - start, len(wrong)


def one_run(work: Path, endpoint: str, env: dict[str, str], v1: dict[str, str], v2: dict[str, str],
            shared: bool, seed: int) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    share = ["--share-dir", str(work / "shared")] if shared else ["--share-dir", "off"]
    r1, p1 = mount(work, endpoint, env, "v1", share)
    r2, p2 = mount(work, endpoint, env, "v2", share)
    try:
        drop_page_cache()
        _, wrong1 = read_checked(r1, v1, seed)
        deadline = time.monotonic() + 30
        while shared and (request(r1, "status")["shared"] or {}).get("offered", 0) < len(v1):
            if time.monotonic() > deadline:
                raise SystemExit("v1's mount did not offer its objects")
            time.sleep(0.2)
        drop_page_cache()
        cpu0 = proc_usage(p2)["cpu"]
        secs, wrong2 = read_checked(r2, v2, seed + 1)
        cpu = proc_usage(p2)["cpu"] - cpu0
        s = request(r2, "status")
    finally:
        unmount(r2, p2)
        unmount(r1, p1)
    return {"shared": shared, "seconds": secs, "fetched": s["backend"]["bytes"], "cpu": cpu,
            "adopted_objects": (s["shared"] or {}).get("adopted_objects", 0), "wrong": wrong1 + wrong2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large", type=int, default=96)
    ap.add_argument("--small", type=int, default=1500)
    ap.add_argument("--changed", type=float, default=0.1)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "versions")
    ap.add_argument("--out", type=Path, help="results JSON (a .md beside it); default: benchmarks/node/results/DATE-versions.json")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv),
                           "large": args.large, "small": args.small, "changed": args.changed, "runs": []}
    server = LocalS3(args.work / "s3").start()
    try:
        v1, v2, changed = upload(server.client(), args.large, args.small, args.changed)
        v2_bytes = sum(LARGE if k.startswith("large/") or (k.startswith("added/") and int(k[6:10]) % 2) else SMALL
                       for k in v2)
        out.update(changed_bytes=changed, v2_bytes=v2_bytes)
        for latency in args.latency_ms:
            proxy = ProxyProcess(server.port, latency / 1000) if latency else None
            endpoint = proxy.endpoint if proxy else server.endpoint
            try:
                for r in range(args.rounds):
                    for shared in ((True, False) if r % 2 == 0 else (False, True)):
                        row = one_run(args.work / "run", endpoint, server.env(), v1, v2, shared, seed=r)
                        row.update(latency_ms=latency, round=r)
                        log(f"{latency:g} ms, {'shared' if shared else 'own fetch'}: v2 in {row['seconds']:.1f} s, "
                            f"fetched {row['fetched'] / 2**20:.0f} MiB (changed {changed / 2**20:.0f}), "
                            f"daemon {row['cpu']:.2f} s CPU, {row['adopted_objects']} copied, {row['wrong']} wrong")
                        out["runs"].append(row)
            finally:
                if proxy:
                    proxy.stop()
    finally:
        server.stop()
    out["load"] = load_text()
    save_results(args.out or HERE / "results" / f"{out['date']}-versions.json", out, report(out))
    return 0


def report(out: dict[str, Any]) -> str:
    gib = out["v2_bytes"] / 2**30
    lines = [f"# A new version beside the old one ({out['date']})", "",
             f"`v1`: {out['large']} files of 5 MiB, {out['small']} of 100 KiB; `v2`: {out['changed']:.0%} of each changed, "
             f"2% added: {out['v2_bytes'] / 2**20:.0f} MiB, of which {out['changed_bytes'] / 2**20:.0f} MiB not in `v1`. "
             "Two mounts side by side, `v1` read first; `v2` read with 16 readers, every file checked against its MD5.",
             f"Machine: {out['machine']['cpus']} cores ({out['machine']['cpu']}), kernel {out['machine']['kernel']}. "
             f"{out['load']}", "", f"Command: `{out['command']}`", "",
             "| latency | v2's mount | v2 read (s, median) | fetched / changed | daemon CPU per GiB of v2 | objects copied | wrong files |",
             "|---|---|---|---|---|---|---|"]
    for latency in sorted({r["latency_ms"] for r in out["runs"]}):
        for shared in (True, False):
            rows = [r for r in out["runs"] if r["latency_ms"] == latency and r["shared"] == shared]
            if not rows:
                continue
            lines.append(f"| {latency:g} ms | {'default (shares)' if shared else '--share-dir off'} | "
                         f"{statistics.median(r['seconds'] for r in rows):.2f} "
                         f"({', '.join(format(r['seconds'], '.2f') for r in rows)}) | "
                         f"{statistics.median(r['fetched'] for r in rows) / out['changed_bytes']:.2f}x | "
                         f"{statistics.median(r['cpu'] for r in rows) / gib:.2f} s | "
                         f"{rows[0]['adopted_objects']} | {sum(r['wrong'] for r in rows)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
