"""Dedicated cache nodes, side by side in one run: 4 GPU nodes mounted as clients and 2 cache nodes
(`epochfs serve`) on this machine (loopback, one redis-server, one local S3 endpoint behind a proxy that
adds 20 ms per request), each client reading the whole dataset in its own order.

Reported:
- the cluster's backend bytes for a cold epoch of all 4 clients, as multiples of the dataset;
- one client's first epoch after `epochfs cluster warmup` against a warm local epoch (its own cache on
  its disk, page cache dropped), and against a cold epoch straight from the backend;
- a cache node killed mid-epoch: wrong bytes (0 expected) and the epoch's extra backend bytes against
  the share the node held;
- a third cache node joining: the blocks it came to hold against its share, and what it took from the
  backend (none expected: it fills from the others);
- the link utilisation of the group with --link-capacity set low, against the 70% alert line;
- the cost of one block: from a cache node, from the local cache disk, from the backend.

    sudo .venv/bin/python benchmarks/cluster/cache_nodes.py [--mib 256] [--latency-ms 20]

On one machine every daemon shares two cores and the "network" is loopback: the times say little about a
real cluster; the byte counts and the ratios within one run are what to read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN, wait_mounted  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, log, start_run  # noqa: E402

from epochfs.control import request  # noqa: E402
from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalRedis, LocalS3, free_ports  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
EPOCHFS = str(VENV_BIN / "epochfs")


class Daemon:
    def __init__(self, work: Path, name: str) -> None:
        self.dir = work / name
        self.cache = self.dir / "cache"

    def status(self) -> dict[str, Any]:
        raise NotImplementedError

    def backend_bytes(self) -> int:
        c = self.status()["cache"]
        return c["demand_bytes"] + c["prefetch_bytes"]


class Client(Daemon):
    def __init__(self, work: Path, name: str) -> None:
        super().__init__(work, name)
        self.mnt = self.dir / "mnt"

    def mount(self, endpoint: str, redis_url: str, token: Path, *extra: str) -> None:
        self.unmount()
        shutil.rmtree(self.cache, ignore_errors=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        subprocess.run([EPOCHFS, "mount", "s3://bench/ds", str(self.mnt), "--endpoint-url", endpoint, "--cache-dir",
                        str(self.cache), "--metrics-addr", "off", "--meta", redis_url, "--peer-token-file", str(token),
                        "--peer-role", "client", *extra], env=os.environ | ENV, check=True)
        wait_mounted(self.mnt)

    def unmount(self) -> None:
        if self.mnt.exists() and os.path.ismount(self.mnt):
            subprocess.run([EPOCHFS, "umount", str(self.mnt)], capture_output=True)

    def status(self) -> dict[str, Any]:
        return request(self.mnt, "status")


class Server(Daemon):
    def start(self, endpoint: str, redis_url: str, token: Path, *extra: str) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)
        self.addr = f"127.0.0.1:{free_ports(1)[0]}"
        subprocess.run([EPOCHFS, "serve", "s3://bench/ds", "--endpoint-url", endpoint, "--cache-dir", str(self.cache),
                        "--metrics-addr", "off", "--meta", redis_url, "--peer-token-file", str(token),
                        "--peer-listen", self.addr, *extra], env=os.environ | ENV, check=True)

    def status(self) -> dict[str, Any]:
        return request(self.cache, "status")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        try:
            pid = self.status()["pid"]
        except Exception:  # noqa: BLE001 - gone already
            return
        os.kill(pid, sig)
        while Path(f"/proc/{pid}").exists():
            time.sleep(0.05)


ENV: dict[str, str] = {}


def read_all(clients: list[Client], keys: list[str], contents: dict[str, bytes], seed: int,
             halfway: threading.Event | None = None, go_on: threading.Event | None = None) -> tuple[float, int]:
    """Every client reads every file at once, each in its own order; (seconds, wrong files)."""
    wrong = [0]
    lock = threading.Lock()

    def one(c: Client, order: list[str], first: bool) -> None:
        for n, key in enumerate(order):
            if first and halfway is not None and go_on is not None and n == len(order) // 2:
                halfway.set()
                go_on.wait(60)
            with open(c.mnt / key, "rb", buffering=0) as f:
                data = b"".join(iter(lambda: f.read(MiB), b""))
            if data != contents[key]:
                with lock:
                    wrong[0] += 1

    threads = []
    for i, c in enumerate(clients):
        order = keys[:]
        random.Random(seed * 100 + i).shuffle(order)
        threads.append(threading.Thread(target=one, args=(c, order, i == 0)))
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, wrong[0]


def wait_members(daemons: list[Daemon], count: int) -> None:
    deadline = time.monotonic() + 30
    while any(len(d.status()["peer"]["members"]) != count for d in daemons):
        if time.monotonic() > deadline:
            raise RuntimeError("the members did not see each other")
        time.sleep(0.2)


def block_cost(client: Client, keys: list[str], n: int = 20) -> float:
    """Median seconds to read one file of one block (page cache dropped before each)."""
    times = []
    for key in keys[:n]:
        drop_page_cache()
        start = time.perf_counter()
        with open(client.mnt / key, "rb", buffering=0) as f:
            while f.read(MiB):
                pass
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shards(mib: int, sizes_mib: list[int]) -> tuple[list[SampleFile], int]:
    """Shards of ``sizes_mib`` MiB (each plus up to 1 MiB, seeded) until they hold ``mib`` MiB; their size."""
    rng = random.Random(1)
    files, total = [], 0
    while total < mib * MiB:
        size = rng.choice(sizes_mib) * MiB + rng.randrange(MiB)
        files.append(SampleFile(f"shard-{len(files):04d}.tar", size))
        total += size
    return files, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="dataset size")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "cache-nodes")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    files, total = shards(args.mib, [2, 4, 8])
    ones = [SampleFile(f"one/{i:03d}.bin", 4 * MiB) for i in range(40)]  # one 4 MiB block each
    keys = [f.key for f in files]
    contents = {f.key: f.content() for f in files}
    token = args.work / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    s3 = LocalS3(args.work / "s3").start()
    proxy = ProxyProcess(s3.port, args.latency_ms / 1000)
    redis = LocalRedis(args.work / "redis").start()
    ENV.update(s3.env())
    clients = [Client(args.work, f"client{i}") for i in range(4)]
    servers = [Server(args.work, f"server{i}") for i in range(3)]
    out: dict[str, Any] = {"files": len(files), "bytes": total, "latency_ms": args.latency_ms}
    endpoint = proxy.endpoint
    try:
        upload(s3.client(), "bench", "ds/", [*files, *ones])
        subprocess.run([EPOCHFS, "import", "s3://bench/ds", "--meta", redis.url, "--endpoint-url", endpoint],
                       env=os.environ | ENV, check=True, capture_output=True)
        # 1. a cold epoch of four clients through two cache nodes
        for s in servers[:2]:
            s.start(endpoint, redis.url, token)
        for c in clients:
            c.mount(endpoint, redis.url, token)
        wait_members([*clients, *servers[:2]], 2)
        drop_page_cache()
        seconds, wrong = read_all(clients, keys, contents, seed=1)
        fetched = sum(d.backend_bytes() for d in [*clients, *servers[:2]])
        out["cold_epoch"] = {"seconds": seconds, "wrong_files": wrong, "backend_copies": fetched / total,
                             "held": [s.status()["store"]["used_bytes"] for s in servers[:2]]}
        log(json.dumps(out["cold_epoch"]))
        # 2. a cache node killed mid-epoch (fresh clients, so every block goes through the nodes)
        for c in clients:
            c.mount(endpoint, redis.url, token, "--peer-timeout", "2")
        wait_members(clients, 2)
        victim = servers[0]
        share = victim.status()["store"]["used_bytes"]
        before = servers[1].backend_bytes()
        halfway, go_on = threading.Event(), threading.Event()
        result: dict[str, Any] = {}

        def epoch() -> None:
            result["seconds"], result["wrong"] = read_all(clients, keys, contents, seed=2, halfway=halfway,
                                                          go_on=go_on)

        t = threading.Thread(target=epoch)
        drop_page_cache()
        t.start()
        halfway.wait(300)
        victim.stop(signal.SIGKILL)
        go_on.set()
        t.join()
        extra = servers[1].backend_bytes() - before + sum(c.backend_bytes() for c in clients)
        out["node_killed"] = {"seconds": result["seconds"], "wrong_files": result["wrong"],
                              "extra_backend_bytes": extra, "victim_share_bytes": share,
                              "extra_over_share": extra / share if share else None}
        log(json.dumps(out["node_killed"]))
        # 3. back to two nodes, then a third joins (with --rebalance)
        victim.start(endpoint, redis.url, token)
        r = subprocess.run([EPOCHFS, "cluster", "warmup", "s3://bench/ds", "--meta", redis.url, "--peer-token-file",
                            str(token), "--quiet"], capture_output=True, text=True, env=os.environ | ENV)
        assert r.returncode == 0, r.stderr
        backend_before = [s.backend_bytes() for s in servers[:2]]
        servers[2].start(endpoint, redis.url, token, "--rebalance")
        deadline = time.monotonic() + 300
        while "rebalance: filled" not in (servers[2].cache / "epochfs.log").read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise RuntimeError("the joining node did not finish its rebalance")
            time.sleep(0.5)
        third = servers[2].status()
        held_third = third["store"]["used_bytes"]
        import re

        log_text = (servers[2].cache / "epochfs.log").read_text(errors="replace")
        owned = int(re.search(r"rebalance: filling (\d+) blocks", log_text)[1])
        blocks_total = sum(-(-f.size // (4 * MiB)) for f in [*files, *ones])  # (the dataset holds both)
        out["join"] = {"held_bytes": held_third, "share_of_dataset": held_third / (total + sum(f.size for f in ones)),
                       "owned_blocks": owned, "blocks": blocks_total, "held_blocks": third["store"]["blocks"],
                       "backend_bytes": servers[2].backend_bytes(),
                       "from_other_nodes_bytes": third["peer"]["bytes_in"],
                       "others_backend_bytes_meanwhile": sum(s.backend_bytes() for s in servers[:2]) - sum(backend_before)}
        log(json.dumps(out["join"]))
        # 4. after `cluster warmup`, one client's first epoch against a warm local one and a cold one
        c = clients[0]
        c.mount(endpoint, redis.url, token)
        wait_members([c], 3)
        drop_page_cache()
        after_warmup = read_all([c], keys, contents, seed=4)[0]
        drop_page_cache()
        warm_local = read_all([c], keys, contents, seed=5)[0]  # its own cache now holds it all
        c.unmount()
        cold = Client(args.work, "cold")
        cold.mnt.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(cold.cache, ignore_errors=True)
        subprocess.run([EPOCHFS, "mount", "s3://bench/ds", str(cold.mnt), "--endpoint-url", endpoint, "--cache-dir",
                        str(cold.cache), "--metrics-addr", "off", "--meta", redis.url], env=os.environ | ENV, check=True)
        wait_mounted(cold.mnt)
        drop_page_cache()
        cold_seconds = read_all([cold], keys, contents, seed=6)[0]
        out["first_epoch"] = {"after_cluster_warmup_seconds": after_warmup, "warm_local_seconds": warm_local,
                              "cold_from_backend_seconds": cold_seconds,
                              "after_warmup_over_warm_local": after_warmup / warm_local}
        log(json.dumps(out["first_epoch"]))
        # 5. the cost of one block: cache node, local disk, backend
        one_keys = [f.key for f in ones]
        c.mount(endpoint, redis.url, token)
        wait_members([c], 3)
        subprocess.run([EPOCHFS, "cluster", "warmup", "s3://bench/ds", "--meta", redis.url, "--peer-token-file",
                        str(token), "--quiet", "one"], check=True, capture_output=True, env=os.environ | ENV)
        from_node = block_cost(c, one_keys)
        local = block_cost(c, one_keys)  # now in its own cache too
        cold.unmount()
        shutil.rmtree(cold.cache, ignore_errors=True)
        subprocess.run([EPOCHFS, "mount", "s3://bench/ds", str(cold.mnt), "--endpoint-url", endpoint, "--cache-dir",
                        str(cold.cache), "--metrics-addr", "off", "--meta", redis.url], env=os.environ | ENV, check=True)
        wait_mounted(cold.mnt)
        backend = block_cost(cold, one_keys)
        cold.unmount()
        out["block_cost"] = {"cache_node_seconds": from_node, "local_disk_seconds": local, "backend_seconds": backend}
        log(json.dumps(out["block_cost"]))
        # 6. a capped link: the group's utilisation against the 70% line
        for s in servers:
            s.stop()
        capacity = 40 * MiB
        for s in servers[:2]:
            s.start(endpoint, redis.url, token, "--link-capacity", str(capacity))
        for cl in clients:
            cl.mount(endpoint, redis.url, token)
        wait_members(clients, 2)
        r = subprocess.run([EPOCHFS, "cluster", "warmup", "s3://bench/ds", "--meta", redis.url, "--peer-token-file",
                            str(token), "--quiet"], capture_output=True, text=True, env=os.environ | ENV)
        sent0 = [s.status()["peer"]["bytes_out"] for s in servers[:2]]
        drop_page_cache()
        seconds = read_all(clients, keys, contents, seed=7)[0]
        sent = sum(s.status()["peer"]["bytes_out"] for s in servers[:2]) - sum(sent0)
        utilisation = sent / seconds / (2 * capacity)
        out["capped_link"] = {"capacity_each": capacity, "seconds": seconds, "group_utilisation": utilisation,
                              "alert_would_fire_if_sustained": utilisation > 0.7}
        log(json.dumps(out["capped_link"]))
    finally:
        for cl in clients:
            cl.unmount()
        for s in servers:
            s.stop(signal.SIGKILL)
        redis.stop()
        proxy.stop()
        s3.stop()
    date = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{date}-cache-nodes.json").write_text(json.dumps(out, indent=1) + "\n")
    ce, nk, jn, fe, bc, cl_ = (out["cold_epoch"], out["node_killed"], out["join"], out["first_epoch"],
                               out["block_cost"], out["capped_link"])
    md = [f"# Dedicated cache nodes, {date}", "",
          f"{len(files)} files, {total / MiB:.0f} MiB; 4 client mounts, 2 cache nodes (a third joins), "
          f"{args.latency_ms:g} ms added to every backend request; all on one 2-core machine over loopback.", "",
          "| what | measured |", "|---|---|",
          f"| backend bytes of a cold epoch of 4 clients / dataset | {ce['backend_copies']:.2f}x ({ce['wrong_files']} wrong files) |",
          f"| cache node killed mid-epoch: wrong files | {nk['wrong_files']} |",
          f"| its extra backend bytes / the share it held | {nk['extra_over_share']:.2f} |",
          f"| a third node joining (--rebalance): blocks held / blocks it owns | {jn['held_blocks']} / "
          f"{jn['owned_blocks']} (of {jn['blocks']}; {jn['share_of_dataset']:.0%} of the bytes) |",
          f"| ... taken from the backend / from the other nodes | {jn['backend_bytes'] / MiB:.1f} MiB / "
          f"{jn['from_other_nodes_bytes'] / MiB:.1f} MiB |",
          f"| first epoch after cluster warmup / warm local epoch | {fe['after_warmup_over_warm_local']:.2f}x "
          f"({fe['after_cluster_warmup_seconds']:.1f} s / {fe['warm_local_seconds']:.1f} s; cold from the backend "
          f"{fe['cold_from_backend_seconds']:.1f} s) |",
          f"| one 4 MiB block: cache node / local disk / backend (median) | {bc['cache_node_seconds'] * 1000:.1f} / "
          f"{bc['local_disk_seconds'] * 1000:.1f} / {bc['backend_seconds'] * 1000:.1f} ms |",
          f"| group link utilisation, --link-capacity {human(cl_['capacity_each'])}/s each | "
          f"{cl_['group_utilisation']:.0%} (the alert's line: 70%) |", ""]
    (args.out / f"{date}-cache-nodes.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


def human(n: float) -> str:
    return f"{n / MiB:.0f} MiB"


if __name__ == "__main__":
    raise SystemExit(main())
