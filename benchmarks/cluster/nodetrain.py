"""One GPU node's share of a data-parallel training simulation (MLPerf Storage style), for
``benchmarks/cluster/clusterbox.py``: its ``--accelerators`` simulated accelerators are global ranks
``node * accelerators ...`` of ``nodes * accelerators``; each epoch every rank reads its
DistributedSampler share of a fresh seeded shuffle of the dataset in batches, through ``--workers``
readers that keep two batches ahead, and computes (sleeps) ``--compute`` seconds per batch. AU is
compute time over wall time from the end of each rank's first batch, averaged over the node's ranks.

Every file read is checked against its digest (``--digests``: key and xxh3-64 a line): a wrong byte
is counted, never hidden. With ``--hand-over`` each epoch's order is handed to the daemon as
``EpochfsSampler`` does, rank by rank; the loop is measured by ``epochfs.watch`` and reported to the
mount (the doctor reads it), where there is a daemon.

Epochs begin together across nodes: before each one this writes ``ready-E`` in ``--sync`` and waits
for ``go-E`` (the box drops the page cache between the two); the order is handed over then, so what
each epoch fetches is counted in that epoch. It prints a JSON line per epoch and one
progress line (``progress E DONE TOTAL``) every second.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from epochfs.prefetch.manifest import partition, shuffled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True, help="the mount (or directory) the dataset is under")
    ap.add_argument("--digests", type=Path, required=True)
    ap.add_argument("--node", type=int, required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--accelerators", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--compute", type=float, required=True, help="seconds per batch")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--first-epoch", type=int, default=0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--job", default="box")
    ap.add_argument("--hand-over", action="store_true")
    ap.add_argument("--watch", action="store_true", help="report the loop to the mount's daemon (epochfs.watch)")
    ap.add_argument("--sync", type=Path, required=True)
    args = ap.parse_args()
    digests = dict(line.split() for line in args.digests.read_text().splitlines() if line.strip())
    keys = sorted(digests)
    world = args.nodes * args.accelerators
    ranks = [args.node * args.accelerators + j for j in range(args.accelerators)]
    reporters = {}
    if args.watch:
        from epochfs.watch import Meter, Reporter

        reporters = {r: Reporter(args.root, args.job, r, Meter(), interval=1.0) for r in ranks}
        for r in reporters.values():
            r.epochs = args.first_epoch
    for epoch in range(args.first_epoch, args.first_epoch + args.epochs):
        order = shuffled(keys, args.seed, epoch)
        shares = {r: partition(order, r, world) for r in ranks}
        (args.sync / f"ready-{epoch}-{args.node}").touch()
        while not (args.sync / f"go-{epoch}").exists():
            time.sleep(0.05)
        if args.hand_over:  # (as the sampler does at set_epoch: the epoch's bytes are the epoch's own)
            from epochfs.client import Client

            client = Client(args.root)
            for r in ranks:
                client.hand_over(shares[r], epoch=epoch, rank=r)
        print(json.dumps(run_epoch(args, epoch, shares, digests, reporters)), flush=True)
    for r in reporters.values():
        r.flush()
    return 0


def run_epoch(args: argparse.Namespace, epoch: int, shares: dict[int, list[str]], digests: dict[str, str],
              reporters: dict) -> dict:  # type: ignore[type-arg]
    wrong, read, done = [0], [0], [0]
    lock = threading.Lock()
    total = sum(len(s) for s in shares.values())

    def load(batch: list[str]) -> int:
        n = 0
        for key in batch:
            with open(args.root / key, "rb", buffering=0) as f:
                data = f.read()
            ok = xxhash.xxh3_64_hexdigest(data) == digests[key]
            with lock:
                read[0] += len(data)
                done[0] += 1
                wrong[0] += 0 if ok else 1
            n += len(data)
        return n

    def loader(share: list[str]):  # type: ignore[no-untyped-def]
        batches = [share[i:i + args.batch] for i in range(0, len(share), args.batch)]
        with ThreadPoolExecutor(args.workers) as pool:
            pending = [pool.submit(load, b) for b in batches[:2]]
            nxt = 2
            while pending:
                got = pending.pop(0).result()
                if nxt < len(batches):
                    pending.append(pool.submit(load, batches[nxt]))
                    nxt += 1
                yield got

    aus: dict[int, float] = {}

    def rank_loop(rank: int) -> None:
        batches = loader(shares[rank])
        if rank in reporters:
            from epochfs.watch import watch

            batches = watch(batches, args.root, job=args.job, rank=rank, reporter=reporters[rank])
        first_done, steps = None, 0
        for _ in batches:
            time.sleep(args.compute)
            steps += 1
            if first_done is None:
                first_done = time.perf_counter()
        wall = time.perf_counter() - first_done if first_done is not None else 0.0
        aus[rank] = min(1.0, (steps - 1) * args.compute / wall) if steps > 1 and wall > 0 else 1.0

    stop = threading.Event()

    def progress() -> None:
        while not stop.wait(1.0):
            print(f"progress {epoch} {done[0]} {total}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in shares]
    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    return {"node": args.node, "epoch": epoch, "au": sum(aus.values()) / len(aus), "aus": aus,
            "seconds": time.perf_counter() - started, "files": done[0], "bytes": read[0], "wrong_files": wrong[0]}


if __name__ == "__main__":
    raise SystemExit(main())
