"""``epochfs cluster status`` and ``epochfs cluster warmup``: the cache tier of a dataset as a whole, from
the shared store the members meet in (no mount needed).

``status`` lists the members the store holds (cache nodes and serving GPU nodes) with what each
publishes of itself at its heartbeat: role, bytes held and served, its link's utilisation; with the
peer token it also asks each for its proof, so a member that does not answer shows as such. It ranks
the published snapshot's blocks as the members do (the first 100,000 of a large one) and says what each
owner's share is against its cache: a member that keeps only its own blocks and owns more than its
cache holds evicts some, and each member that asks for one then costs a read from the backend again.

``warmup`` fills the cache nodes before the GPUs arrive: it reads the published snapshot, computes every
block of the files selected (a packed member's blocks of its shard), and asks each block's owners (the
same rendezvous ranking the members use, ``--replicas`` of them) to hold it, in parallel, with a progress
line; a block an owner holds already is answered at once, so a run cut short or repeated picks up where
it stopped. It exits 0 only once every selected block is held by every one of its owners (among the
members that prove they hold the token: one listed in the store that does not answer is left out, as
every member leaves it out, and named). A cache node asked to hold more than its cache holds (as it last
published) is named before the warming starts: it would evict blocks it is warming.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from epochfs.cli.common import EPILOG, human
from epochfs.core.errors import ConfigError, EpochfsError
from epochfs.core.records import ObjectInfo, Source
from epochfs.core.text import plural, printable
from epochfs.daemon.config import parse_rate, parse_size, store_access
from epochfs.peer.published import published_stats

HEARTBEAT_STALE = 10.0  # seconds after which a member's published statistics are old


def add_parsers(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("cluster", help="the cluster cache tier as a whole: status, warmup",
                       description="The cache tier of a dataset, from the shared store its members meet in.")
    csub = c.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("source", nargs="?", metavar="SOURCE",
                       help="the dataset's source, as the members mount it (default: source in --config)")
        p.add_argument("--config", metavar="FILE",
                       help="a member's config file (a cache node's, say): the source, store, its password, the "
                       "peer token, --replicas and --block-size the members run with, unless given here")
        p.add_argument("--meta", metavar="URL", help="the shared store (redis[s]://...; default: meta in --config)")
        p.add_argument("--meta-name", metavar="NAME", help="the dataset's name in the store (default: SOURCE)")
        p.add_argument("--meta-password-file", type=Path, metavar="FILE", help="the store's password (mode 0600)")
        p.add_argument("--meta-ca-file", type=Path, metavar="FILE", help="CA certificates of a rediss:// store")

    s = csub.add_parser("status", help="the members, their roles, what they hold and serve",
                        description="List the members of SOURCE's cluster tier: role, share of the dataset (its "
                        "blocks ranked as the members rank them), bytes held, bytes served, link utilisation "
                        "(against their --link-capacity) and health; name a member whose share outgrows its cache "
                        "and members cut at different block sizes.", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    common(s)
    s.add_argument("--peer-token-file", type=Path, metavar="FILE",
                   help="the members' token: ask each for its proof (health)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=cmd_status)

    w = csub.add_parser(
        "warmup", help="fill the cache nodes with a dataset (or paths of it) before the GPUs arrive",
        description="Have every block of the selected files (PATHs relative to the dataset's root, a "
        "--manifest, or everything) held by its owners among the cache nodes, in parallel. Resumable: a "
        "block already held is answered at once. Exit 0 only when every selected block is held by its "
        "owners; 1 with what is missing otherwise (a block an owner could not take, or a share larger than its "
        "owner's cache: it evicts blocks as it warms them). Ctrl-C stops sending (what was warmed stays).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(w)
    w.add_argument("paths", nargs="*", metavar="PATH", help="files or directories of the dataset (default: all)")
    w.add_argument("--manifest", metavar="FILE", help="the files to warm, one path a line")
    w.add_argument("--peer-token-file", type=Path, metavar="FILE",
                   help="the members' token (required; default: peer_token_file in --config)")
    w.add_argument("--block-size", type=parse_size, metavar="SIZE",
                   help="the members' --block-size (default: what the cache nodes publish, else 4M)")
    w.add_argument("--replicas", type=int, metavar="R",
                   help="the members' --replicas (default: what the cache nodes publish, else 1)")
    w.add_argument("--concurrency", type=int, default=16, metavar="N",
                   help="blocks asked for at once, in all (default: 16)")
    w.add_argument("--bandwidth", type=parse_rate, metavar="RATE",
                   help="cap on the bytes warmed per second, e.g. 2Gbit (default: none)")
    w.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="how long one owner may take to fetch one block (default: 120)")
    w.add_argument("--quiet", "-q", action="store_true", help="no progress line")
    w.set_defaults(run=cmd_warmup, needs_token=True)


#: What the cluster commands take from a member's config file (``--config``), where not given as flags.
FROM_CONFIG = ("meta", "meta_name", "meta_password_file", "meta_ca_file", "peer_token_file", "replicas", "block_size")


def with_config(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with what they leave out taken from ``--config`` (a member's config: the same keys, so a
    cache node's own file names the store, the secrets' files and the tier's geometry as it runs them);
    :class:`ConfigError` for a source or store given nowhere."""
    from epochfs.cli.options import file_values

    values = file_values(args.config) if args.config else {}
    if args.source is None:
        args.source = values.get("source")
    for name in FROM_CONFIG:
        if hasattr(args, name) and getattr(args, name) is None and values.get(name) is not None:
            setattr(args, name, values[name])
    where = f" (not in config file {args.config})" if args.config else " (or --config with a member's config file)"
    if not args.source:
        raise ConfigError("give SOURCE" + where)
    if not args.meta:
        raise ConfigError("give --meta URL" + where)
    if getattr(args, "needs_token", False) and not args.peer_token_file:
        raise ConfigError("give --peer-token-file FILE" + where)
    return args


def _store(args: argparse.Namespace) -> tuple[Any, str]:
    from epochfs.meta.base import SHARED_FORMS, is_shared
    from epochfs.meta.redis import RedisMetaStore

    if not is_shared(args.meta):
        raise ConfigError(f"--meta: the cluster tier meets in a shared store: {SHARED_FORMS}")
    source_id = Source.parse(args.source).url
    store = RedisMetaStore(args.meta, args.meta_name, store_access(args.meta_password_file, args.meta_ca_file))
    return store, source_id


#: Members of each role the tools take from the store at most: anyone who can write the store can list
#: members, and each one costs a proof and a share of the ranking; a tier has a handful.
MAX_LISTED = 256
PROOF_SECONDS = 30.0  # all the proofs together, whatever the members listed do
RANK_BUDGET = 4_000_000  # blocks ranked times members: what ranking the shares may cost at most


def _members(store: Any, source_id: str, clients: list[str] | None = None) -> dict[str, str]:
    """Member address -> role, as the store lists them (checked: literal addresses only), at most
    :data:`MAX_LISTED` of each role (the rest said on standard error); the clients' sessions (printable
    names) into ``clients``, when given."""
    from epochfs.peer.wire import member_addr

    out: dict[str, str] = {}
    for role, entries in store.heartbeat(source_id, None, 0.0, MAX_LISTED + 1).items():
        if role == "client":  # (sessions of mounts that read through the tier: never members)
            if clients is not None:
                clients += [name for raw in entries[:MAX_LISTED] if isinstance(raw, bytes) and len(raw) <= 256
                            and (name := raw.decode("utf-8", "replace")).isprintable()]
            continue
        if len(entries) > MAX_LISTED:
            print(f"epochfs: the store lists more than {MAX_LISTED} members of role {role}: the first {MAX_LISTED} "
                  "are taken (members of a real tier are a handful: someone may have planted entries)",
                  file=sys.stderr)
        for raw in entries[:MAX_LISTED]:
            addr = member_addr(raw.decode("ascii", "replace")) if isinstance(raw, bytes) and len(raw) <= 64 else None
            if addr is not None:
                out.setdefault(addr, role)
    return out


def _stats(store: Any, source_id: str, members: dict[str, str]) -> dict[str, bytes]:
    """The listed members' published statistics, each read only if it is of a member's size."""
    return store.member_stats_of(source_id, sorted(members)) if members else {}


def _prove(addrs: list[str], token_file: Path, timeout: float = 2.0
           ) -> tuple[Any, dict[str, str | None], dict[str, int | None]]:
    """A peer client; for each member, None if it proved it holds the token, else why not; and the cache
    size each one that proved it stated (its weight in the ring)."""
    from epochfs.peer.client import PeerClient
    from epochfs.peer.wire import Keys, load_token

    client = PeerClient(Keys(load_token(token_file)), timeout)
    stated: dict[str, int | None] = {}

    def one(addr: str) -> str | None:
        try:
            stated[addr] = client.hello(addr, timeout)
        except Exception as exc:  # noqa: BLE001 - any failure is a failed proof
            return str(exc)[:200]
        return None

    pool = concurrent.futures.ThreadPoolExecutor(32)
    futures = {pool.submit(one, addr): addr for addr in addrs}
    done, late = concurrent.futures.wait(futures, timeout=PROOF_SECONDS)
    proofs: dict[str, str | None] = {futures[f]: f.result() for f in done}
    for f in late:
        f.cancel()
        proofs[futures[f]] = f"not asked: the proofs of {len(addrs)} members took over {PROOF_SECONDS:g} s"
    pool.shutdown(wait=False, cancel_futures=True)
    return client, proofs, stated


def cmd_status(args: argparse.Namespace) -> int:
    with_config(args)
    store, source_id = _store(args)
    sessions: list[str] = []
    try:
        members = _members(store, source_id, sessions)
        stats = _stats(store, source_id, {**members, **dict.fromkeys(sessions, "client")})
        snapshot = store.load(source_id) if members else None
    finally:
        store.close()
    _, proofs, stated = _prove(sorted(members), args.peer_token_file) if args.peer_token_file else (None, {}, {})
    now = time.time()
    rows = [member_row(addr, members[addr], stats.get(addr), now, proofs.get(addr, "")) for addr in
            sorted(members, key=lambda a: (members[a] != "server", a))]
    shares, warnings = _shares(rows, snapshot, source_id, {a for a, why in proofs.items() if why is not None},
                               stated)
    clients = [member_row(name, "client", stats.get(name), now) for name in sorted(sessions)]
    if args.json:
        print(json.dumps({"source": source_id, "members": rows, "shares": shares, "warnings": warnings,
                          "clients": clients}, indent=1))
    else:
        print("\n".join(status_lines(source_id, rows, shares, warnings) + client_lines(clients)))
    return 0


def client_lines(clients: list[dict[str, Any]]) -> list[str]:
    """The mounts that read through the tier (``--peer-role client``), as they publish themselves."""
    if not clients:
        return ["no client mounts (GPU nodes with --peer-role client) read through the tier now"]
    lines = [f"{plural(len(clients), 'client mount')} read through it:"]
    for c in clients:
        read = (f"read {human(c.get('tier_bytes') or 0)} through the tier, {human(c.get('backend_bytes') or 0)} from "
                f"the backend, {human(c.get('local_bytes') or 0)} from its own cache"
                if c.get("tier_bytes") is not None else "nothing published yet")
        lines.append(f"  {printable(c['member'])}: {read}; {c['health']}")
    return lines


def member_row(addr: str, role: str, raw: object, now: float, proof: str | None = "") -> dict[str, Any]:
    """One member's line of ``cluster status``: what it publishes (checked: :func:`~epochfs.peer.published.published_stats`), and its
    health: ``proof`` None when it proved it holds the token, why not otherwise, "" when not asked."""
    row: dict[str, Any] = {"member": addr, "role": role}
    published = published_stats(raw)
    if published is not None:
        updated = published.pop("updated")
        row.update(published)
        row["age_seconds"] = now - updated if updated is not None else None
    health = "up"
    if row.get("age_seconds") is None:
        health = "no statistics"
    elif row["age_seconds"] > HEARTBEAT_STALE:
        health = f"stale ({row['age_seconds']:.0f} s)"
    if proof:
        health = f"not answering: {proof}"
    row["health"] = health
    return row


def status_lines(source_id: str, rows: list[dict[str, Any]], shares: dict[str, Any] | None,
                 warnings: list[str]) -> list[str]:
    """``cluster status`` in words."""
    servers = sum(1 for r in rows if r["role"] == "server")
    lines = [f"cluster tier of {source_id}: {plural(servers, 'cache node')}, "
             f"{plural(len(rows) - servers, 'serving GPU node')}"]
    for r in rows:
        util, capacity = r.get("utilization"), r.get("link_capacity")
        link = (f"{util:.0%} of {human(capacity)}/s" if util is not None and capacity
                else f"{human(r.get('out_bytes_per_second') or 0)}/s out")
        held, owns = r.get("held_bytes"), r.get("share_bytes")
        share = (f"owns {human(owns)} ({owns / shares['total_bytes']:.0%}), "
                 if owns is not None and shares and shares["total_bytes"] else "")
        lines.append(f"  {r['member']:<22} {r['role']:<6} " + (
            f"{share}holds {human(held)} of {human(r.get('capacity_bytes') or 0)}, "
            f"served {human(r.get('served_bytes') or 0)}, link {link}; {r['health']}" if held is not None
            else r["health"]))
    if shares:
        holders = f"{shares['replicas']} holder{'s' if shares['replicas'] > 1 else ''} per block"
        lines.append(f"  shares of {human(shares['total_bytes'])} in blocks of {human(shares['block_size'])}, {holders}"
                     + (f" (estimated from the first {shares['blocks_ranked']} blocks)" if shares["sampled"] else ""))
    lines += [f"  ! {w}" for w in warnings]
    return lines


def _published_int(row: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    """A member's published figure, if it is an integer in [lo, hi] (the store is not trusted for more)."""
    value = row.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi else None


def _shares(rows: list[dict[str, Any]], snapshot: Any, source_id: str, unproven: set[str],
            stated: dict[str, int | None] | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """Rank the snapshot's blocks over the members that own blocks (the cache nodes where there are any,
    else the serving GPU nodes; those that failed their proof left out, as every member leaves them out),
    at the block size and replicas they publish and weighted by the cache sizes they stated in their
    proofs (``stated``; those not asked: the sizes they publish); set each such row's ``share_bytes``.
    The shares' geometry (None where there is nothing to rank) and what is wrong with it."""
    from epochfs.blockstore.keys import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
    from epochfs.doctor import share_fix
    from epochfs.peer.ring import Ring, ring_weights
    from epochfs.peer.share import SHARE_SAMPLE, ownership

    servers = [r for r in rows if r["role"] == "server"]
    owners = [r for r in (servers or [r for r in rows if r["role"] == "peer"]) if r["member"] not in unproven]
    if not owners:
        return None, []
    if snapshot is None:
        return None, [f"no snapshot of {source_id} in the store: the members' shares are not known (epochfs import)"]
    warnings = []
    sizes = Counter(b for r in owners if (b := _published_int(r, "block_size", MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)))
    replicas = Counter(n for r in owners if (n := _published_int(r, "replicas", 1, 64)))
    block_size = sizes.most_common(1)[0][0] if sizes else 4 << 20
    count = min(replicas.most_common(1)[0][0] if replicas else 1, len(owners))
    if len(sizes) > 1:
        warnings.append("the members cut blocks at different sizes (" + ", ".join(
            f"{human(b)}: {n}" for b, n in sizes.most_common()) + "): a block id names its size, so members of "
            "different --block-size never serve each other a block; mount them all with one")
    stated = stated or {}
    sizes_stated = {r["member"]: stated[r["member"]] if r["member"] in stated
                    else _published_int(r, "cache_size", 0, 1 << 62) for r in owners}
    ring = Ring(sizes_stated, ring_weights(sizes_stated, sizes_stated))
    owned = ownership(snapshot.objects, source_id, ring, block_size, count,
                      sample=max(1000, min(SHARE_SAMPLE, RANK_BUDGET // max(1, len(owners)))))
    for r in owners:
        r["share_bytes"] = share = owned.owned.get(r["member"], 0)
        capacity = _published_int(r, "capacity_bytes", 0, 1 << 62)
        keeps_own = r["role"] == "server" or r.get("mode") == "owned"
        if keeps_own and capacity is not None and share > capacity:
            fix = share_fix(share, capacity, ring.cache_of(r["member"]), ring.cache_bytes(), owned.total * count)
            warnings.append(
                f"{r['member']} owns {human(share)} of the dataset and its cache holds {human(capacity)}: it "
                f"evicts blocks it owns, and each member that asks for one then costs a backend read again ({fix})")
    return {"block_size": block_size, "replicas": count, "total_bytes": owned.total, "blocks_ranked": owned.ranked,
            "sampled": owned.sampled}, warnings


def geometry(args: argparse.Namespace, servers: list[str], stats: dict[str, Any]) -> None:
    """Fill in ``--replicas`` and ``--block-size`` from what the cache nodes (``servers``: those that
    proved they hold the token) publish, the most common figure within bounds, and warn where those
    given differ from theirs: a warmup at other replicas leaves blocks
    unheld (or held twice), at another block size it warms blocks no member asks for."""
    from epochfs.blockstore.keys import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE

    published = [published_stats(stats.get(a)) or {} for a in servers]
    bounds = {"replicas": (1, 64), "block_size": (MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)}  # (as cluster status holds them)
    for flag, key, default in (("--replicas", "replicas", 1), ("--block-size", "block_size", 4 << 20)):
        theirs = Counter(v for p in published if (v := _published_int(p, key, *bounds[key])))
        common = theirs.most_common(1)[0][0] if theirs else None
        given = getattr(args, key)
        if given is None:
            setattr(args, key, common or default)
        elif common is not None and given != common:
            print(f"epochfs: warning: the cache nodes run with {flag} {common}, this warmup with {flag} {given}: "
                  f"it warms blocks as {flag} {given} places them (leave {flag} out to take theirs)", file=sys.stderr)


def _warn_outgrown(work: list[tuple[str, bytes, ObjectInfo, int, int]], stats: dict[str, Any],
                   ring: Any) -> dict[str, tuple[int, int]]:
    """Name each cache node asked to hold more than its cache holds (as it last published it): it would
    evict blocks it is warming, and each member that asks for one of them then costs a backend read.
    Those nodes: (bytes asked of it, its cache's size)."""
    from epochfs.doctor import share_fix

    asked = Counter[str]()
    for owner, *_, length in work:
        asked[owner] += length
    over = {}
    for owner, nbytes in sorted(asked.items()):
        published = published_stats(stats.get(owner)) or {}
        capacity = published.get("capacity_bytes")
        if capacity is not None and nbytes > capacity:
            over[owner] = (nbytes, int(capacity))
            fix = share_fix(nbytes, capacity, ring.cache_of(owner), ring.cache_bytes(), sum(asked.values()))
            print(f"epochfs: warning: {owner} is asked to hold {human(nbytes)} and its cache holds "
                  f"{human(capacity)}: it will evict blocks it is warming (each read from the backend again when "
                  f"asked): {fix}; or warm less", file=sys.stderr)
    return over


def _selected(objects: list[ObjectInfo], args: argparse.Namespace) -> list[ObjectInfo]:
    from epochfs.prefetch import manifest

    if not args.paths and not args.manifest:
        return [o for o in objects if not o.key.endswith("/")]
    by_key = {o.key: o for o in objects if not o.key.endswith("/")}
    wanted: list[ObjectInfo] = []
    missing = []
    names = [e.path for e in manifest.read(args.manifest)] if args.manifest else []
    for name in [*names, *args.paths]:
        key = name.strip("/")
        if key in by_key:
            wanted.append(by_key[key])
            continue
        under = [o for k, o in by_key.items() if k.startswith(key + "/") or not key]
        if not under:
            missing.append(name)
        wanted += under
    if missing:
        raise ConfigError(f"{len(missing)} paths are not in the dataset's snapshot, such as {missing[0]!r}")
    return list({o.key: o for o in wanted}.values())


def cmd_warmup(args: argparse.Namespace) -> int:
    from epochfs.core.blocks import block_id, extent_blocks
    from epochfs.core.records import stored_extent
    from epochfs.peer.client import PeerFailure
    from epochfs.peer.ring import Ring, ring_weights
    from epochfs.peer.wire import BlockRequest

    with_config(args)
    if (args.replicas is not None and args.replicas < 1) or args.concurrency < 1:
        raise ConfigError("--replicas and --concurrency must be at least 1")
    store, source_id = _store(args)
    try:
        snapshot = store.load(source_id)
        members = _members(store, source_id)
        stats = _stats(store, source_id, members)
    finally:
        store.close()
    if snapshot is None:
        named = f" under the name {args.meta_name!r}" if args.meta_name else ""
        raise ConfigError(f"no snapshot of {source_id}{named} in the store: publish one with `epochfs import "
                          f"{source_id} --meta {args.meta}" + (f" --meta-name {args.meta_name}" if args.meta_name else "")
                          + "` (the name the members mount it under: --meta-name)")
    servers = sorted(a for a, role in members.items() if role == "server") or sorted(members)
    if not servers:
        raise EpochfsError("no member of the cluster tier is up (start the cache nodes: epochfs serve)")
    client, proofs, stated = _prove(servers, args.peer_token_file)
    client.timeout = args.timeout
    down = {a: why for a, why in proofs.items() if why is not None}
    up = [a for a in servers if a not in down]
    ring = Ring(up, ring_weights(up, stated))  # (as the cache nodes rank: by the cache sizes they stated)
    if not len(ring):
        raise EpochfsError("no cache node proved it holds the token: " + "; ".join(f"{a}: {w}" for a, w in down.items()))
    geometry(args, up, stats)  # (from the members that proved themselves: anyone can list one in the store)
    if args.replicas > len(ring):
        print(f"epochfs: warning: {args.replicas} replicas of each block asked for, and {plural(len(ring), 'cache node')} "
              f"up: each block is held {len(ring)} times", file=sys.stderr)
        args.replicas = len(ring)
    blocks: dict[bytes, tuple[ObjectInfo, int, int]] = {}
    for obj in _selected(list(snapshot.objects), args):
        stored, base = stored_extent(obj)
        for index, length, _ in extent_blocks(base, obj.size, stored.size, args.block_size):
            blocks.setdefault(block_id(source_id, stored.key, stored.etag, index, block_size=args.block_size),
                              (stored, index, length))
    work = [(owner, bid, *blocks[bid]) for bid in blocks for owner in ring.owners(bid, args.replicas)]
    total = sum(w[4] for w in work)
    over = _warn_outgrown(work, stats, ring)
    done, failed, per_node = [0, 0], Counter[str](), Counter[str]()
    lock, stop = threading.Lock(), threading.Event()
    started = time.monotonic()

    def warm(owner: str, bid: bytes, obj: ObjectInfo, index: int, length: int) -> None:
        if stop.is_set():
            return
        if args.bandwidth:  # keep to the cap: this block may start once the bytes before it had their time
            with lock:
                due = started + (done[0] + length) / args.bandwidth
            time.sleep(max(0.0, due - time.monotonic()))
        try:
            client.get(owner, BlockRequest(bid, obj.key, obj.etag, index, length, warm=True))
        except PeerFailure as exc:
            with lock:
                failed[f"{owner}: {str(exc)[:120]}"] += 1
            return
        with lock:
            done[0] += length
            done[1] += 1
            per_node[owner] += length

    def progress(final: bool = False) -> None:
        if args.quiet or not sys.stderr.isatty() and not final:
            return
        seconds = max(time.monotonic() - started, 1e-6)
        nodes = ", ".join(f"{a} {human(n)}" for a, n in sorted(per_node.items()))
        print(f"\rwarmed {human(done[0])} of {human(total)} ({done[1]}/{len(work)} blocks) at "
              f"{human(done[0] / seconds)}/s; {nodes}", end="\n" if final else "", file=sys.stderr, flush=True)

    pool = concurrent.futures.ThreadPoolExecutor(args.concurrency, thread_name_prefix="warm")
    try:
        # First each block's first owner (it fetches it once), then its other owners (they take it from
        # the first, never the backend again).
        for phase in (0, 1):
            pending = {pool.submit(warm, *w) for w in work if (w[0] == ring.owners(w[1], 1)[0]) == (phase == 0)}
            while pending:
                _, pending = concurrent.futures.wait(pending, timeout=0.5)
                progress()
    except KeyboardInterrupt:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        progress(final=True)
        print("epochfs: cancelled; what was warmed stays (run again to finish)", file=sys.stderr)
        return 130
    pool.shutdown(wait=True)
    progress(final=True)
    missing = len(work) - done[1]
    if down:  # (no member counts them among the owners either: they are bypassed until they answer)
        print(f"epochfs: {plural(len(down), 'cache node')} listed in the store did not prove themselves and were left out "
              "(gone, or not yet up; their share went to the others): "
              + "; ".join(f"{a}: {w}" for a, w in sorted(down.items())), file=sys.stderr)
    if missing:
        for what, n in failed.most_common(5):
            print(f"epochfs: {n} blocks failed at {what}", file=sys.stderr)
        print(f"epochfs: {missing} of {len(work)} blocks are not held by their owners (run again)", file=sys.stderr)
        return 1
    if over:  # (every block was answered, and the nodes that cannot hold their share evicted some as they warmed)
        for owner, (nbytes, capacity) in sorted(over.items()):
            print(f"epochfs: {owner} holds at most {human(capacity)} of the {human(nbytes)} this warmup asked of it: "
                  f"at least {human(nbytes - capacity)} of it is not cached there (evicted as it warmed)",
                  file=sys.stderr)
        print("epochfs: the warmup is not complete: the cache nodes above cannot hold their shares (see the "
              "warnings for the fix)", file=sys.stderr)
        return 1
    print(f"epochfs: {len(blocks)} blocks ({human(sum(b[2] for b in blocks.values()))}) held by their owners "
          f"({args.replicas} each, {plural(len(ring), 'cache node')}) in {time.monotonic() - started:.1f}s")
    return 0
