"""The commands about an epoch's read order: ``prefetch`` and ``warmup`` (hand it to a daemon),
``manifest`` (write it) and ``plan`` (predict what it will cost)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from epochfs.cli.common import human
from epochfs.client import Client, merge_rank
from epochfs.core.errors import ConfigError
from epochfs.daemon.config import parse_rate, parse_size
from epochfs.doctor.cost import add_price_options
from epochfs.links.sizing import WORKLOADS
from epochfs.prefetch.manifest import Entry, mount_relative


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def rate_arg(text: str) -> float:
    try:
        return parse_rate(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def count_arg(low: int, high: int):  # type: ignore[no-untyped-def]
    """An argparse type: a whole number from ``low`` to ``high`` (bounded where it is parsed: a number
    of 400 digits is a clear error, never an overflow further on)."""
    def parse(text: str) -> int:
        if not text.strip().lstrip("+-").isdigit() or len(text.strip()) > 20:
            raise argparse.ArgumentTypeError(f"not a whole number from {low} to {high}: {text[:40]!r}")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not from {low} to {high}")
        return value
    return parse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    order = argparse.ArgumentParser(add_help=False)
    o = order.add_argument_group("epoch order")
    o.add_argument("--seed", type=int, metavar="S",
                   help="the manifest lists the dataset in index order; shuffle it as "
                   "DistributedSampler(shuffle=True, seed=S) does for --epoch")
    o.add_argument("--epoch", type=int, metavar="N", help="epoch number (with --seed: the shuffle; always: a label)")
    o.add_argument("--rank", type=int, metavar="R",
                   help="this rank (default: 0); the hand-overs of the ranks of one epoch on a node are merged "
                   "side by side")
    o.add_argument("--drop-last", action="store_true",
                   help="as DistributedSampler(drop_last=True): cut the order to a multiple of W instead of padding")
    o.add_argument("--world-size", type=int, default=1, metavar="W",
                   help="number of ranks; rank R reads every W-th entry of the padded global order (default: 1)")

    p = sub.add_parser(
        "prefetch", parents=[order], help="hand the daemon an epoch manifest and return",
        description="Hand the daemon serving MOUNTPOINT the order in which this rank will read files. The "
        "daemon fetches ahead of the reader and (with --eviction manifest) evicts the block needed farthest "
        "in the future. Returns at once; progress is in 'epochfs status'. A manifest handed over while an "
        "epoch is still being read is queued after it.",
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", metavar="FILE",
                     help="one path per line relative to the mount root (or JSON Lines with \"path\"), in read order")
    src.add_argument("--stored", metavar="NAME", help="use the manifest published to the metadata store under NAME")
    p.add_argument("--publish", metavar="NAME",
                   help="also publish --manifest to the metadata store under NAME, for the other ranks' daemons")
    p.add_argument("--replace", action="store_true", help="discard the current plan instead of queueing after it")
    p.add_argument("--start", type=int, default=0, metavar="N",
                   help="a job resumed mid-epoch: this rank has read the first N entries of its order already "
                   "(its step times its batch size); only the rest is handed over (default: 0)")
    p.set_defaults(run=cmd_prefetch)

    w = sub.add_parser("warmup", parents=[order], help="fill the cache now, with a progress bar",
                       description="Fetch files (or everything a manifest names) into the cache now. A full "
                       "cache makes room as its eviction policy says (blocks the handed-over order does not "
                       "read first, or the least recently used); a warmup never fills more than the cache holds, "
                       "so it never evicts what it warmed: the rest is reported as not cached.")
    w.add_argument("mountpoint", metavar="MOUNTPOINT")
    w.add_argument("paths", nargs="*", metavar="PATH",
                   help="files or directories under the mount (relative to the current directory); none and no "
                   "--manifest: the whole mount")
    w.add_argument("--manifest", metavar="FILE", help="warm what this manifest names")
    w.add_argument("--check", action="store_true", help="only report the fraction already cached")
    w.set_defaults(run=cmd_warmup)

    pl = sub.add_parser("plan", parents=[order], help="predict hit ratio and backend bytes of an epoch; size a "
                        "cluster (--cluster)",
                        description="Simulate the cache over the epoch's block sequence and report, for each "
                        "eviction policy, the hit ratio and the bytes fetched from the backend. With --cluster, "
                        "size a cluster on paper instead: what its links carry, the cache nodes that keep them under "
                        "70%, and the first epoch's accelerator utilisation.")
    pl.add_argument("--manifest", metavar="FILE", help="the epoch's order (required without --cluster)")
    pl.add_argument("--cache-size", type=size_arg, metavar="SIZE", help="the node's cache (required without --cluster)")
    pl.add_argument("--block-size", type=size_arg, default=4 << 20, metavar="SIZE")
    pl.add_argument("--previous-manifest", metavar="FILE",
                    help="the epoch read before this one (its blocks warm the cache; not counted)")
    pl.add_argument("--previous-epoch", type=int, metavar="N",
                    help="with --seed: the previous epoch is this shuffle of --previous-manifest (default: --epoch - 1)")
    sizes = pl.add_mutually_exclusive_group()
    sizes.add_argument("--mount", metavar="MOUNTPOINT", help="take file sizes from this mount")
    sizes.add_argument("--root", metavar="DIR", help="take file sizes from this directory")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    cost = pl.add_argument_group("the cost of an epoch")
    cost.add_argument("--epoch-hours", type=float, metavar="H",
                      help="what one epoch takes the job with no data wait (its compute): gives the epochs of a "
                      "day and, with --backend-bandwidth, the wait fetching cannot hide")
    cost.add_argument("--gpus", type=count_arg(1, 10_000_000), default=1, metavar="N", help="GPUs that wait when the job waits "
                      "(default: 1)")
    cost.add_argument("--backend-bandwidth", type=rate_arg, metavar="RATE",
                      help="what the backend gives this node (10Gbit, 400MB)")
    add_price_options(pl)
    cl = pl.add_argument_group("a cluster on paper (--cluster)")
    cl.add_argument("--cluster", action="store_true",
                    help="size a cluster: its links' utilisation, the cache nodes that keep them under 70%%, the "
                    "first epoch's accelerator utilisation, for plain mounts and cache nodes cold or warmed")
    cl.add_argument("--nodes", type=count_arg(1, 1_000_000), metavar="N", help="GPU nodes")
    cl.add_argument("--gpus-per-node", type=count_arg(1, 1024), default=8, metavar="G", help="GPUs per node (default: 8)")
    demand = cl.add_mutually_exclusive_group()
    demand.add_argument("--gpu-demand", type=rate_arg, metavar="RATE",
                        help="what one GPU reads while it trains, e.g. 2.8GB (per second)")
    demand.add_argument("--workload", choices=sorted(WORKLOADS), help="MLPerf Storage's demand per H100: unet3d "
                        "2.8 GiB/s, resnet50 0.19 GiB/s, cosmoflow 0.55 GiB/s")
    cl.add_argument("--dataset", type=size_arg, metavar="SIZE", help="the dataset, e.g. 20T")
    cl.add_argument("--wan", type=rate_arg, metavar="RATE",
                    help="the object store's link, shared by the cluster, e.g. 100Gbit")
    cl.add_argument("--node-link", type=rate_arg, metavar="RATE", help="each GPU node's link, e.g. 100Gbit")
    cl.add_argument("--cache-node-link", type=rate_arg, metavar="RATE",
                    help="each cache node's link (default: --node-link)")
    cl.add_argument("--cache-nodes", type=count_arg(1, 1_000_000), metavar="K", help="cache nodes (default: as many as keep their links "
                    "under 70%%)")
    cl.add_argument("--cache-node-cache", type=size_arg, metavar="SIZE",
                    help="what each cache node holds (with --replicas: cache nodes enough to hold the dataset)")
    cl.add_argument("--replicas", type=count_arg(1, 64), default=1, metavar="R", help="cache nodes holding each block (default: 1)")
    pl.set_defaults(run=cmd_plan)

    mf = sub.add_parser("manifest", parents=[order], help="write an epoch manifest",
                        description="Write the read order of an epoch: PATHS-FILE lists the dataset in index "
                        "order (one path per line); with --seed the output is the shuffle DistributedSampler "
                        "uses for --epoch; with --rank/--world-size only that rank's share.")
    mf.add_argument("paths_file", metavar="PATHS-FILE")
    mf.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write it ('-': standard output)")
    mf.set_defaults(run=cmd_manifest)


def _order(args: argparse.Namespace, manifest: str) -> list[Entry]:
    """The entries this rank reads, from a manifest and the epoch-order flags."""
    from epochfs.prefetch.manifest import epoch_order, read

    if args.seed is not None and args.epoch is None:
        raise ConfigError("--seed needs --epoch")
    return epoch_order(read(manifest), seed=args.seed, epoch=args.epoch, rank=args.rank or 0,
                       world_size=args.world_size, drop_last=args.drop_last)


def cmd_prefetch(args: argparse.Namespace) -> int:
    import tempfile

    from epochfs.control import request

    manifest = args.manifest
    if args.stored:
        text = request(args.mountpoint, "get_manifest", name=args.stored)["text"]
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as tmp:
            tmp.write(text)
        manifest = tmp.name
    if args.start < 0:
        raise ConfigError("--start must be 0 or more (the entries of this rank's order already read)")
    try:
        entries = _order(args, manifest)[args.start:]
    finally:
        if args.stored:
            os.unlink(manifest)
    if args.publish:
        with open(args.manifest, encoding="utf-8") as f:
            request(args.mountpoint, "publish_manifest", name=args.publish, text=f.read())
        print(f"epochfs: published {args.manifest} as {args.publish!r}")
    reply = request(args.mountpoint, "prefetch",
                    entries=[[e.line, mount_relative(args.mountpoint, e.path)] for e in entries],
                    source=args.manifest or args.stored, epoch=args.epoch, replace=args.replace,
                    rank=merge_rank(args.rank, args.world_size))
    how = ("merged with the other ranks' shares" if reply["merged"] else
           "queued after the current plan" if reply["appended"] else "loaded")
    print(f"epochfs: {reply['files']} files ({human(reply['plan_bytes'])} in the plan) {how}")
    return 0


def shell_path(mountpoint: str, path: str) -> str:
    """A path typed in a shell (relative to the current directory) relative to the mount root."""
    full = os.path.abspath(path)
    root = os.path.abspath(mountpoint)
    if os.path.commonpath([full, root]) != root:
        hint = os.path.join(root, path)
        did = f"; did you mean {hint}?" if not os.path.isabs(path) and os.path.lexists(hint) else ""
        raise ConfigError(f"{path} is not under the mount point {root} (a relative path is taken from the "
                          f"current directory){did}")
    return mount_relative(root, full)


def cmd_warmup(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from epochfs.control import request

    if args.manifest:
        entries = [[e.line, mount_relative(args.mountpoint, e.path)] for e in _order(args, args.manifest)]
        source = args.manifest
    elif args.paths:
        entries = [[i, shell_path(args.mountpoint, p)] for i, p in enumerate(args.paths, 1)]
        source = "argument"
    else:  # the whole mount, as `juicefs warmup DIR` takes it
        entries, source = [[0, ""]], "the mount"
    if args.check:
        r = request(args.mountpoint, "resident", entries=entries, source=source)
        frac = r["resident_bytes"] / r["total_bytes"] if r["total_bytes"] else 1.0
        print(f"{frac:.1%} cached: {human(r['resident_bytes'])} of {human(r['total_bytes'])}; "
              f"{r['resident_files']} of {r['files']} files whole")
        return 0
    job = request(args.mountpoint, "warmup", entries=entries, source=source)
    columns = (TextColumn("[bold]warmup"), BarColumn(), DownloadColumn(binary_units=True),
               TextColumn("{task.fields[speed]}"), TextColumn("{task.fields[files]}"), TimeRemainingColumn())
    try:
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task("warmup", total=job["total_bytes"], files="", speed="")
            while True:
                job = request(args.mountpoint, "job", id=job["id"])
                speed = f"{human(job['done_bytes'] / job['elapsed'])}/s" if job["elapsed"] > 0 else ""
                progress.update(task, completed=job["done_bytes"], speed=speed,
                                files=f"{job['done_files']}/{job['files']} files")
                if job["finished"]:
                    break
                time.sleep(0.2)
    except KeyboardInterrupt:
        job = request(args.mountpoint, "cancel", id=job["id"])
        print(f"epochfs: warmup cancelled after {human(job['done_bytes'])} of {human(job['total_bytes'])}; "
              "fetches in flight finish", file=sys.stderr)
        return 130
    print(f"epochfs: warmed {human(job['done_bytes'])} of {human(job['total_bytes'])} "
          f"in {job['elapsed']:.1f}s" + ("" if job["done_bytes"] >= job["total_bytes"] else "; the rest is not cached"))
    if job["skipped_bytes"]:
        print(f"epochfs: the cache is full: {human(job['skipped_bytes'])} not cached (the cache holds less than "
              "this warmup, or the rest is what the handed-over order reads: grow --cache-size, or warm less)",
              file=sys.stderr)
    evicted = job.get("evicted_bytes", 0)
    if evicted:
        print(f"epochfs: {human(evicted)} of what this warmup fetched was evicted again before it ended (the "
              "cache cannot hold this warmup and what was read or prefetched meanwhile, such as a handed-over "
              "order: grow --cache-size, or warm less); `epochfs warmup --check` shows what is cached now",
              file=sys.stderr)
    for err in job["errors"]:
        print(f"epochfs: {err}", file=sys.stderr)
    return 1 if job["errors"] or job["skipped_bytes"] or evicted else 0


def _sizes(args: argparse.Namespace, entries: list[Entry], manifest: str) -> list[tuple[str, int]]:
    out = []
    for e in entries:
        size = e.size
        if size is None:
            base = args.mount or args.root
            if base is None:
                raise ConfigError(f"{manifest}:{e.line}: no size; give --mount or --root, or use JSON Lines with \"size\"")
            try:
                size = os.stat(os.path.join(base, e.path)).st_size
            except OSError as exc:
                raise ConfigError(f"{manifest}:{e.line}: {e.path}: {exc.strerror}") from None
        out.append((e.path, size))
    return out


def _stored(args: argparse.Namespace, files: list[tuple[str, int]]) -> list[tuple[str, int, int] | None] | None:
    """Where a mount stores each file (a packed dataset's members are ranges of shards), or None without
    --mount (a local copy: each file an object)."""
    if not args.mount:
        return None
    return list(Client(args.mount).locate([path for path, _ in files]))


def cmd_plan(args: argparse.Namespace) -> int:
    if args.cluster:
        return cmd_plan_cluster(args)
    missing = [flag for flag, value in (("--manifest", args.manifest), ("--cache-size", args.cache_size)) if value is None]
    if missing:
        raise ConfigError(f"plan needs {' and '.join(missing)} (or --cluster to size a cluster)")
    from epochfs.prefetch.simulate import block_sequence, simulate

    files = _sizes(args, _order(args, args.manifest), args.manifest)
    stored = _stored(args, files)
    current = block_sequence(files, args.block_size, stored)
    previous = []
    if args.previous_manifest:
        prev_args = argparse.Namespace(**vars(args))
        if args.seed is not None:
            prev_args.epoch = args.previous_epoch if args.previous_epoch is not None else args.epoch - 1
        before = _sizes(args, _order(prev_args, args.previous_manifest), args.previous_manifest)
        previous = block_sequence(before, args.block_size, _stored(args, before))
    held = [i for i, h in enumerate(Client(args.mount).shared(path for path, _ in files)) if h] if args.mount else []
    if held:  # (another mount of the node holds them by content: a first read copies them, fetching nothing)
        previous += block_sequence([files[i] for i in held], args.block_size,
                                   [stored[i] for i in held] if stored is not None else None)
    held_bytes = sum(files[i][1] for i in held)
    from epochfs.doctor.cost import describe_dict, predicted, prices_of
    from epochfs.eviction import names

    if args.epoch_hours is not None and not 0 < args.epoch_hours <= 10_000:
        raise ConfigError("--epoch-hours must be a number of hours above 0")
    if args.gpus < 1:
        raise ConfigError("--gpus must be at least 1")
    prices = prices_of(args)
    results = [simulate(current, args.cache_size, name, warmup=previous) for name in names()]
    costs = {r.policy: predicted(r.reads - r.hits, r.miss_bytes, prices, epoch_hours=args.epoch_hours,
                                 gpus=args.gpus, bandwidth=args.backend_bandwidth) for r in results}
    total = sum(size for _, size in current)
    if args.json:
        print(json.dumps({"epoch_bytes": total, "cache_size": args.cache_size, "block_size": args.block_size,
                          "note": PLAN_NOTE, "prices": prices.as_dict(),
                          "shared_files": len(held), "shared_bytes": held_bytes,
                          "policies": {r.policy: {"hit_ratio": r.hit_ratio, "backend_bytes": r.miss_bytes,
                                                  "hits": r.hits, "reads": r.reads, "cost": costs[r.policy]}
                                       for r in results}}, indent=2))
        return 0
    print(f"epoch: {len(current)} blocks, {human(total)}; cache {human(args.cache_size)}"
          + (" (warm from the previous epoch)" if args.previous_manifest else " (cold)" if not held else ""))
    if held:
        print(f"held by the node's other mounts (the same content): {len(held)} files, {human(held_bytes)}: copied "
              "at their first read, not fetched")
    print(f"assumptions: blocks of {human(args.block_size)} (--block-size), each fetched whole with one GET; "
          + (f"the backend's link {human(args.backend_bandwidth)}/s (--backend-bandwidth)" if args.backend_bandwidth
             else "no backend bandwidth given (the wait that fetching cannot hide is not counted)")
          + (f"; {args.epoch_hours:g} h of compute an epoch on {args.gpus} GPUs (--epoch-hours, --gpus)"
             if args.epoch_hours is not None else "")
          + "; prices as below (--config's [cost], or --price-*)")
    print(f"{'policy':<10} {'fetched from the backend':>26} {'cached when the epoch begins':>30}")
    for r in results:
        print(f"{r.policy:<10} {human(r.miss_bytes):>26} {r.hit_ratio:>30.1%}")
    print(PLAN_NOTE)
    print("\nWhat it costs" + ("" if args.backend_bandwidth and args.epoch_hours else
                              " (--epoch-hours and --backend-bandwidth add the wait fetching cannot hide)") + ":")
    for r in results:
        c = costs[r.policy]
        print(f"{r.policy:<10} " + describe_dict(c["epoch"], prices, "per epoch"))
        if "day" in c:
            print(f"{'':<10} " + describe_dict(c["day"], prices, f"per day ({c['epochs_per_day']:.1f} epochs)"))
    return 0


def cmd_plan_cluster(args: argparse.Namespace) -> int:
    from epochfs.links.sizing import Cluster, plan

    demand = WORKLOADS[args.workload] if args.workload else args.gpu_demand
    missing = [flag for flag, value in (("--nodes", args.nodes), ("--gpu-demand or --workload", demand),
                                        ("--dataset", args.dataset), ("--wan", args.wan),
                                        ("--node-link", args.node_link)) if value is None]
    if missing:
        raise ConfigError(f"plan --cluster needs {', '.join(missing)}")
    cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_demand=demand, dataset=args.dataset,
                      wan=args.wan, node_link=args.node_link, cache_node_link=args.cache_node_link or args.node_link,
                      cache_nodes=args.cache_nodes, replicas=args.replicas, cache_node_cache=args.cache_node_cache)
    problems = cluster.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    result = plan(cluster)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("\n".join(cluster_lines(result)))
    return 0


def cluster_lines(result: dict[str, Any]) -> list[str]:
    """``plan --cluster`` in words: the inputs, each set-up's epochs, the cache nodes to buy."""
    from epochfs.links.interface import rate_text

    i = result["inputs"]
    gpus = i["nodes"] * i["gpus_per_node"]
    lines = [f"{i['nodes']} GPU nodes x {i['gpus_per_node']} GPUs ({gpus}) asking {rate_text(i['gpu_demand'])} each: "
             f"{rate_text(i['demand'])} in all, {rate_text(i['node_demand'])} a node; a dataset of {human(i['dataset'])}",
             f"links: the object store's {rate_text(i['wan'])} (shared), each GPU node's {rate_text(i['node_link'])}, "
             f"each cache node's {rate_text(i['cache_node_link'])}",
             f"cache nodes that keep their links under 70%: {result['cache_nodes_needed']}, sized for "
             f"{rate_text(result['sized_for']['bytes_per_second'])} (bound first by {result['sized_for']['bound']}"
             + (f": {i['nodes']} links of {rate_text(i['node_link'])} for {rate_text(i['node_demand'])} asked a node"
                if result["sized_for"]["bound"] == "the GPU nodes' links" else "") + ")"
             + (f" (planned with {result['cache_nodes']})" if result["cache_nodes"] != result["cache_nodes_needed"] else ""),
             "assumptions: every GPU asks its rate the whole epoch (data-parallel, each epoch reads the dataset "
             "once in a fresh order, prefetched with the order handed over: latency hidden); a link carries its "
             "rate in full; a later epoch finds only what each node read before (1/nodes) in its own cache, in every set-up; "
             "cache nodes hold the whole dataset (warm) or fetch it once (cold)",
             "", f"{'set-up':<22} {'epoch':>5} {'object store link':>18} {'cache node links':>17} {'GPU node link':>14} "
             f"{'WAN bytes/dataset':>18} {'AU':>5}  bound"]
    for name, s in result["setups"].items():
        for n in (1, 2):
            e = s[f"epoch{n}"]
            cache = f"{e['cache_node_link_utilisation']:.0%}" if e["cache_node_link_utilisation"] is not None else "-"
            label = name + (f" ({s['cache_nodes']})" if s["cache_nodes"] else "") if n == 1 else ""
            lines.append(f"{label:<22} {n:>5} {e['wan_utilisation']:>18.0%} {cache:>17} "
                         f"{e['node_link_utilisation']:>14.0%} {e['backend_bytes_per_dataset']:>18.2f} {e['au']:>5.0%}  "
                         f"{e['bound']}")
    warm = result["setups"]["warm-cache-nodes"]["warmup_seconds"]
    lines += ["", f"warming the cache nodes moves the dataset over the object store's link once: {warm / 3600:.1f} h "
              "at its full rate (epochfs cluster warmup); a utilisation over 70% is what the alerts fire on "
              "(EpochfsBackendBandwidthHigh, EpochfsCacheNodesBusy)"]
    return lines


PLAN_NOTE = ("The second column is what the epoch must fetch from the backend with each eviction policy; the "
             "third, the share of its reads whose blocks are cached before the epoch begins. With a manifest "
             "handed over, the daemon fetches the rest ahead of the reader: those reads become hits too "
             "(the hit-ratio metric) whenever the backend keeps up with the reader, so this predicts backend "
             "traffic, not the hit ratio a prefetched epoch shows.")


def cmd_manifest(args: argparse.Namespace) -> int:
    from epochfs.prefetch.manifest import write

    entries = _order(args, args.paths_file)
    if args.output == "-":
        for e in entries:
            sys.stdout.write(e.path + "\n")
        return 0
    write(args.output, (e.path for e in entries))
    print(f"epochfs: wrote {len(entries)} paths to {args.output}")
    return 0
