"""The cluster cache tier, side by side in one run: 1, 2 and 4 epochfs daemons on this machine (separate
cache directories, loopback peer ports, one redis-server, one local S3 endpoint) read the same dataset at
the same time, each in its own shuffled order, without and with the tier. Reports the cluster's backend
bytes as multiples of one copy of the dataset and the time of the cold pass; then, with each node's cache
holding 40% of the dataset, the backend bytes of a second pass: alone (`all` without peers), and with
`--peer-cache owned`.

    sudo .venv/bin/python benchmarks/cluster/cluster.py [--mib 512] [--nodes 1,2,4]

On one machine the nodes share two cores and the "network" is loopback: the times say little about a
real cluster; the byte counts are what the tier changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN, wait_mounted  # noqa: E402
from workloads import drop_page_cache, log, start_run  # noqa: E402

from epochfs.control import request  # noqa: E402
from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalRedis, LocalS3, free_ports  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


class Node:
    def __init__(self, work: Path, i: int) -> None:
        self.mnt, self.cache = work / f"n{i}" / "mnt", work / f"n{i}" / "cache"

    def mount(self, server: LocalS3, redis_url: str, token: Path, cache_size: int, peer: str | None) -> None:
        self.unmount()
        shutil.rmtree(self.cache, ignore_errors=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        extra = ["--peer-listen", f"127.0.0.1:{free_ports(1)[0]}", "--peer-token-file", str(token),
                 "--peer-cache", peer] if peer else []
        subprocess.run([str(VENV_BIN / "epochfs"), "mount", "s3://bench/ds", str(self.mnt), "--endpoint-url",
                        server.endpoint, "--cache-dir", str(self.cache), "--cache-size", str(cache_size),
                        "--metrics-addr", "off", "--meta", redis_url, *extra], env=server.env(), check=True)
        wait_mounted(self.mnt)

    def unmount(self) -> None:
        if self.mnt.exists() and os.path.ismount(self.mnt):
            subprocess.run([str(VENV_BIN / "epochfs"), "umount", str(self.mnt)], capture_output=True)

    def backend_bytes(self) -> int:
        c = request(self.mnt, "status")["cache"]
        return c["demand_bytes"] + c["prefetch_bytes"]

    def members(self) -> int:
        peer = request(self.mnt, "status")["peer"]
        return len(peer["members"]) if peer else 1


def mount_all(group: list[Node], server: LocalS3, redis_url: str, token: Path, cache_size: int,
              peer: str | None) -> None:
    """Mount every node of ``group``; with the tier, wait until each sees all of them."""
    for node in group:
        node.mount(server, redis_url, token, cache_size, peer)
    while peer and any(node.members() != len(group) for node in group):
        time.sleep(0.2)


def read_pass(nodes: list[Node], keys: list[str], seed: int) -> float:
    """Every node reads every file, all at once, each in its own order; seconds until the last is done."""
    errors: list[BaseException] = []

    def one(node: Node, order: list[str]) -> None:
        try:
            for key in order:
                with open(node.mnt / key, "rb", buffering=0) as f:
                    while f.read(MiB):
                        pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = []
    for i, node in enumerate(nodes):
        order = keys[:]
        random.Random(seed * 100 + i).shuffle(order)
        threads.append(threading.Thread(target=one, args=(node, order)))
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="dataset size")
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "cluster")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    counts = [int(n) for n in args.nodes.split(",")]
    # A mix like an image dataset's shards: mostly 2-16 MiB files.
    rng = random.Random(1)
    files, total = [], 0
    while total < args.mib * MiB:
        size = rng.choice([2, 4, 8, 16]) * MiB + rng.randrange(MiB)
        files.append(SampleFile(f"shard-{len(files):04d}.tar", size))
        total += size
    keys = [f.key for f in files]
    token = args.work / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    server = LocalS3(args.work / "s3").start()
    redis = LocalRedis(args.work / "redis").start()
    nodes = [Node(args.work, i) for i in range(max(counts))]
    rows: list[dict[str, Any]] = []
    try:
        upload(server.client(), "bench", "ds/", files)
        subprocess.run([str(VENV_BIN / "epochfs"), "import", "s3://bench/ds", "--meta", redis.url,
                        "--endpoint-url", server.endpoint], env=server.env(), check=True, capture_output=True)
        big = 4 * total
        for n in counts:
            for peer in (None, "all"):
                if peer and n == 1:
                    continue
                group = nodes[:n]
                mount_all(group, server, redis.url, token, big, peer)
                drop_page_cache()
                seconds = read_pass(group, keys, seed=1)
                fetched = sum(node.backend_bytes() for node in group)
                row = {"nodes": n, "tier": peer or "off", "cold_seconds": seconds,
                       "backend_copies": fetched / total}
                rows.append(row)
                log(json.dumps(row))
                for node in group:
                    node.unmount()
        for n in [c for c in counts if c >= 3] or [max(counts)]:
            small = int(total * 0.4)
            for peer in (None, "owned"):
                group = nodes[:n]
                mount_all(group, server, redis.url, token, small, peer)
                drop_page_cache()
                read_pass(group, keys, seed=2)
                first = sum(node.backend_bytes() for node in group)
                drop_page_cache()
                seconds = read_pass(group, keys, seed=3)
                second = sum(node.backend_bytes() for node in group) - first
                row = {"nodes": n, "tier": peer or "off", "cache": "40% each", "second_pass_seconds": seconds,
                       "first_pass_copies": first / total, "second_pass_fraction_per_node": second / total / n}
                rows.append(row)
                log(json.dumps(row))
                for node in group:
                    node.unmount()
    finally:
        for node in nodes:
            node.unmount()
        redis.stop()
        server.stop()

    lines = [f"# Cluster cache tier, {datetime.date.today().isoformat()}: {len(files)} files, {total / MiB:.0f} MiB; "
             "every node reads everything at once", "",
             "| nodes | tier | cold pass (s) | backend bytes / one copy |", "|---|---|---|---|"]
    for r in rows:
        if "backend_copies" in r:
            lines.append(f"| {r['nodes']} | {r['tier']} | {r['cold_seconds']:.1f} | {r['backend_copies']:.2f}x |")
    lines += ["", "Each node's cache holds 40% of the dataset; a second pass after a cold one:", "",
              "| nodes | tier | first pass backend / one copy | second pass: backend bytes per node / dataset | "
              "second pass (s) |", "|---|---|---|---|---|"]
    for r in rows:
        if "second_pass_fraction_per_node" in r:
            lines.append(f"| {r['nodes']} | {r['tier']} | {r['first_pass_copies']:.2f}x | "
                         f"{r['second_pass_fraction_per_node']:.1%} | {r['second_pass_seconds']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-cluster"
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps({"files": len(files), "bytes": total, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
