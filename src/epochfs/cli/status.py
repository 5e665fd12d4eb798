"""``epochfs status`` (one-shot, plain or JSON) and ``epochfs stats`` (a live view): renderings of the
daemon's ``status`` reply."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from epochfs.cli.common import human
from epochfs.core.errors import ConfigError, EpochfsError
from epochfs.core.text import plural
from epochfs.doctor.cost import add_price_options


def bounded_by_disk(st: dict[str, Any]) -> str:
    """What the status line adds when the disk, not --cache-size, bounds the cache."""
    configured = st.get("configured_bytes", st["capacity_bytes"])
    if st["capacity_bytes"] >= configured:
        return ""
    return f"; the disk bounds it (--cache-size {human(configured)})"

def add_parsers(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("stats", help="live view of a mount (refreshing)",
                        description="Refreshing terminal view of MOUNTPOINT: hit ratio, throughput from the cache "
                        "and from the backend, read latency, cache fill, prefetch lead. Ctrl-C to quit.")
    st.add_argument("mountpoint", metavar="MOUNTPOINT")
    st.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default: 1)")
    st.add_argument("--count", type=int, metavar="N", help="stop after N refreshes")
    st.set_defaults(run=cmd_stats)

    d = sub.add_parser("doctor", help="is the training job waiting for storage, why, and what it costs",
                       description="Verdict on the jobs reporting to MOUNTPOINT (epochfs.watch in the training "
                       "loop): storage-bound (waits for data over half of each step, or its GPU is under 50% "
                       "busy while it waits), compute-bound (waits under a fifth), balanced, or no-job-data; the "
                       "first epoch (the cold read) and the later ones apart. Then what the mount already does, "
                       "each cause its state shows with the fix (a command or flag to paste), most helpful first, "
                       "and what an epoch and a day cost: backend requests and bytes, and GPU hours spent waiting, "
                       "at the prices below.")
    d.add_argument("mountpoint", metavar="MOUNTPOINT")
    d.add_argument("--job", metavar="NAME", help="only this job (default: every job reporting)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="how long to watch the mount's rates (default: 2)")
    d.add_argument("--save", metavar="FILE", help="also write the diagnosis to FILE (the state before a change)")
    d.add_argument("--compare", metavar="FILE", help="compare with a diagnosis saved earlier (--save): rates, "
                   "and what a day costs, before and after")
    d.add_argument("--checkpoints", metavar="MOUNTPOINT",
                   help="the job's checkpoint mount: its timed saves (epochfs.watch.saving) count with the job's "
                   "steps, and its write-back state with the advice")
    add_price_options(d)
    d.set_defaults(run=cmd_doctor)

    s = sub.add_parser("status", help="one-shot state of a mount",
                       description="Print the state of the daemon serving MOUNTPOINT: snapshot, cache use, "
                       "hits and misses, backend requests.")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from epochfs.control import request

    try:
        status = request(args.mountpoint, "status")
    except EpochfsError as exc:
        if not args.json:
            raise
        print(json.dumps({"error": str(exc)}))  # scripts parse stdout: the error is JSON there too
        return 1
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from epochfs.control import request
    from epochfs.doctor import compare, diagnose, render
    from epochfs.doctor.cost import prices_of

    if args.interval < 0 or args.interval > 600:
        raise ConfigError("--interval must be between 0 and 600 seconds")
    prices = prices_of(args)
    earlier = None
    if args.compare:
        try:
            with open(args.compare) as f:
                earlier = json.load(f)
        except (OSError, ValueError) as exc:
            raise EpochfsError(f"--compare {args.compare}: {exc}") from None
        if not isinstance(earlier, dict) or "verdict" not in earlier:
            raise EpochfsError(f"--compare {args.compare}: not a diagnosis saved with --save")
    if args.save:  # (said before the doctor watches, not after)
        try:
            with open(args.save, "a"):
                pass
        except OSError as exc:
            raise EpochfsError(f"--save {args.save}: {exc.strerror}") from None
    checkpoints = request(args.checkpoints, "status") if args.checkpoints else None
    before = request(args.mountpoint, "status")
    time.sleep(args.interval)
    after = request(args.mountpoint, "status")
    result = diagnose(before, after, args.interval, args.job, prices, checkpoints)
    if args.save:
        try:
            with open(args.save, "w") as f:
                json.dump(result, f, indent=2, sort_keys=True)
        except OSError as exc:
            raise EpochfsError(f"--save {args.save}: {exc.strerror}") from None
    if args.json:
        out = dict(result)
        if earlier is not None:
            out["compare"] = [{"what": w, "before": b, "after": a} for w, b, a in compare(earlier, result)]
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(render(result, args.mountpoint, args.job, earlier))
    return 0


def stats_table(prev: dict[str, Any], cur: dict[str, Any], seconds: float) -> Any:
    """The rows of one ``epochfs stats`` refresh, from two status snapshots ``seconds`` apart."""
    from rich.table import Table

    from epochfs.core.stats import HistogramSnapshot

    c0, c1, s1, p1 = prev["cache"], cur["cache"], cur["store"], cur["prefetch"]
    hit = c1["hit_bytes"] - c0["hit_bytes"]
    miss = c1["miss_bytes"] - c0["miss_bytes"]
    demand = c1["demand_bytes"] - c0["demand_bytes"]
    prefetched = c1["prefetch_bytes"] - c0["prefetch_bytes"]
    overall = HistogramSnapshot.from_dict(cur["read_seconds"])
    lat = overall.minus(HistogramSnapshot.from_dict(prev["read_seconds"]))
    reads = lat.count

    def ms(v: float | None) -> str:  # (interpolated within its bucket, as histogram_quantile does)
        if v is None:
            return "-"
        return f"> {overall.bounds[-1]:g} s" if v == float("inf") else f"{v * 1000:.2f} ms"

    t = Table(title=f"epochfs {cur['mountpoint']}  <-  {cur['source']}", show_header=True, expand=False)
    t.add_column("", style="bold")
    t.add_column("now", justify="right")
    t.add_column("since start", justify="right")
    total_hit, total_miss = c1["hit_bytes"], c1["miss_bytes"]
    t.add_row("hit ratio (bytes)", f"{hit / (hit + miss):.1%}" if hit + miss else "-",
              f"{total_hit / (total_hit + total_miss):.1%}" if total_hit + total_miss else "-")
    t.add_row("read from cache", f"{human(hit / seconds)}/s", human(total_hit))
    t.add_row("backend, on demand", f"{human(demand / seconds)}/s", human(c1["demand_bytes"]))
    t.add_row("backend, prefetched", f"{human(prefetched / seconds)}/s", human(c1["prefetch_bytes"]))
    t.add_row("reads", f"{reads / seconds:.0f}/s", str(c1["hits"] + c1["misses"]))
    t.add_row("read latency p50 / p99", f"{ms(lat.quantile(0.5))} / {ms(lat.quantile(0.99))}",
              f"{ms(overall.quantile(0.5))} / {ms(overall.quantile(0.99))}")
    t.add_row("cache", f"{s1['used_bytes'] / s1['capacity_bytes']:.1%} full",
              f"{human(s1['used_bytes'])} of {human(s1['capacity_bytes'])}")
    t.add_row("evictions", f"{(s1['evictions'] - prev['store']['evictions']) / seconds:.1f}/s", str(s1["evictions"]))
    if p1["blocks"]:
        lead = f"{p1['lead_seconds']:.1f} s" if p1["lead_seconds"] is not None else "-"
        t.add_row("prefetch lead", lead, human(p1["lead_bytes"]) + " cached ahead")
        t.add_row("manifest", f"file {p1['file_position'] + 1} of {p1['files']}", f"{human(p1['queued_bytes'])} queued")
    else:
        lr = cur.get("learned") or {}
        state = {"near": "nothing ahead (near backend)", "guessing": "fetching ahead", "fetched": "all fetched",
                 "held": "order handed over", "off": "off"}.get(lr.get("state", "off"), "watching")
        t.add_row("learned order", state, f"{human(lr.get('fetched_bytes', 0))} ahead, "
                  f"{human(lr.get('used_bytes', 0))} read" if lr else "")
    errors = sum(cur["errors"].values()) + s1["fill_errors"]
    t.add_row("errors / corrupt blocks", str(errors), str(s1["corrupt_blocks"]))
    return t


def cmd_stats(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from epochfs.control import request

    console = Console()
    prev, when = request(args.mountpoint, "status"), time.monotonic()
    frames = 0
    if not console.is_terminal:  # a pipe or a file: one table per refresh, each written out at once
        try:
            while args.count is None or frames < args.count:
                time.sleep(args.interval)
                cur, now = request(args.mountpoint, "status"), time.monotonic()
                console.print(stats_table(prev, cur, now - when))
                console.file.flush()
                prev, when = cur, now
                frames += 1
        except (KeyboardInterrupt, BrokenPipeError):
            pass
        return 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while args.count is None or frames < args.count:
                time.sleep(args.interval)
                cur, now = request(args.mountpoint, "status"), time.monotonic()
                live.update(stats_table(prev, cur, now - when), refresh=True)
                prev, when = cur, now
                frames += 1
        except KeyboardInterrupt:
            pass
    return 0


def age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def format_status(s: dict[str, Any]) -> str:
    c, st, snap = s["cache"], s["store"], s["snapshot"]
    reads = c["hit_bytes"] + c["miss_bytes"]
    ratio = f"{c['hit_bytes'] / reads:.1%}" if reads else "n/a"
    serving = (s.get("peer") or {}).get("role") == "server"  # a cache node: nothing mounted, no reader of its own
    head = (f"cache node of {s['source']}" if serving else f"mount      {s['mountpoint']}  <-  {s['source']}")
    prefetch = (format_prefetch(s["prefetch"], s.get("learned")) if s["prefetch"]["blocks"] or not serving else
                "prefetch   none: a cache node fetches what members ask for and what `epochfs cluster warmup` names")
    return "\n".join([
        f"{head}  (pid {s['pid']}; metrics {s['metrics_addr'] or 'off'})",
        f"snapshot   version {snap['version']}, taken {age(snap['age_seconds'])} ago: {snap['files']} files, "
        f"{snap['directories']} directories, {human(snap['bytes'])}; store {s['meta']['url']}"
        + ("" if s["meta"]["reachable"] else f" UNREACHABLE ({s['meta']['error']})")
        + (f"; master {s['meta']['master']} since {age(time.time() - s['meta']['master_since'])} ago"
           if s["meta"].get("master") and s["meta"].get("master_since") else ""),
        f"cache      {human(st['used_bytes'])} of {human(st['capacity_bytes'])} in {st['blocks']} blocks "
        f"({s['cache_dir']})" + bounded_by_disk(st),
        f"reads      hit ratio {ratio} by bytes; {c['hits']} hits, {c['misses']} misses",
        *([f"           {origins}"] if (origins := format_origins(s)) else []),
        f"backend    {human(c['demand_bytes'])} on demand, {human(c['prefetch_bytes'])} ahead; "
        f"{c['inflight']} in flight; {format_link(s['backend'].get('link'), '--backend-bandwidth')}",
        f"evictions  {st['evictions']} ({eviction_policy(s, serving)}); corrupt blocks {st['corrupt_blocks']}; "
        f"fill errors {st['fill_errors']}" + (f"; read-ahead hints let go {st['advice_dropped']} (more at once than the adviser queues; "
                                                 "harmless: the disk reads those blocks when they are asked for)"
                                              if st.get("advice_dropped") else ""),
        f"errors     {reader_errors(s)}",
        prefetch,
        *([format_writeback(s["writeback"])] if s.get("writeback") else []),
        *([format_passthrough(s["passthrough"])] if s.get("passthrough") else []),
        *([format_node_cache(s["node_cache"])] if s.get("node_cache") else []),
        *([format_shared(s["shared"])] if s.get("shared") else []),
        *([f"io_uring   {s['io_uring_requests']} requests through the ring (--io-uring)"]
          if s.get("io_uring_requests") is not None else []),
        *(format_peer(s["peer"]) if s.get("peer") else []),
    ])


def format_link(link: dict[str, Any] | None, flag: str) -> str:
    """A link's capacity and where it is known from, or that it is not known."""
    if not link or not link.get("bytes_per_second"):
        # (the cause's first words; at length, with its examples, in `--json`: the line is read every time)
        why = str(link["unknown"]).split(" (")[0].split(";")[0] if link and link.get("unknown") else "none declared"
        return f"link capacity not known ({why}): declare it with {flag} RATE, or it is measured once busy"
    detail = str(link.get("detail") or "")
    how = detail if detail.startswith(str(link["source"])) else f"{link['source']}: {detail}"  # (never "measured: measured")
    return f"link {human(link['bytes_per_second'])}/s ({how})"


def eviction_policy(s: dict[str, Any], serving: bool = False) -> str:
    """The policy evictions followed: the manifest's only once an order was handed over (a cache node is
    handed none: the least recently used, said without a mount's advice)."""
    if s["eviction"] == "manifest" and not s["prefetch"]["blocks"]:
        return "least recently used" if serving else "least recently used: no order handed over yet (--eviction manifest)"
    return {"manifest": "the handed-over order", "lru": "least recently used"}.get(s["eviction"], s["eviction"])


def reader_errors(s: dict[str, Any]) -> str:
    """Reads answered with an error, by errno, and the backend requests that failed (what a mount
    whose credentials are refused shows first)."""
    errors = {k: n for k, n in (s.get("errors") or {}).items() if n}
    failed = {k: n for k, n in (s.get("backend") or {}).get("requests", {}).items()
              if n and k.split("/", 1)[-1] in ("error", "denied", "changed")}
    parts = [f"reads answered {', '.join(f'{k} {n}' for k, n in sorted(errors.items(), key=lambda kv: -kv[1]))}"
             if errors else "no read answered with an error"]
    if failed:
        parts.append("backend requests failed: " + ", ".join(f"{k} {n}" for k, n in sorted(failed.items())))
    return "; ".join(parts)


def format_origins(s: dict[str, Any]) -> str:
    """Where what readers read came from, since the mount started (nothing before a read)."""
    o = s.get("reads") or {}
    total = sum(v for v in o.values() if isinstance(v, (int, float)))
    if not total:
        return ""
    client = (s.get("peer") or {}).get("role") == "client"
    names = {"local": "this node's cache", "owner": "cache nodes" if client else "the cluster tier",
             "replica": "another replica", "backend": "the backend"}
    parts = [f"{names[k]} {o[k] / total:.0%}" for k in ("local", "owner", "replica", "backend") if o.get(k)]
    # (where the bytes were fetched from, ahead of the reader or on its demand: a hit is a byte fetched
    # before it was read, from the backend as often as not)
    return "what was read came from " + ", ".join(parts) + (" (fetched ahead of the readers or on demand)"
                                                             if o.get("backend") else "")


def format_peer(p: dict[str, Any]) -> list[str]:
    r = p["requests"]
    failed = r["unavailable"] + r["bad"] + r["declined"]
    went = p.get("fallbacks") or {}
    role = p.get("role", "peer")
    what = {"server": f"a cache node ({p['me']})", "client": "a client (asks, never serves)"}.get(role, p["me"])
    replicas = f", {p['replicas']} replicas of each" if p.get("replicas", 1) > 1 else ""
    owns = (f"; owns {human(p['share_bytes'])} of the dataset's {human(p['dataset_bytes'])}"
            if p.get("share_bytes") is not None and p.get("dataset_bytes") else "")
    if p.get("cache_size_bytes") and p.get("tier_cache_bytes"):  # (members weighed by their caches)
        owns += f" (its {human(p['cache_size_bytes'])} of the members' {human(p['tier_cache_bytes'])} of cache)"
    onward = (f": {went.get('replica', 0)} then asked another replica, {went.get('backend', 0)} the backend"
              if failed and went else "")
    link = p.get("link") or {}
    by_kernel = (f" ({human(p['bytes_out_from_files'])} sent from the cache's files by the kernel)"
                 if p.get("bytes_out_from_files") else "")
    sends = (f"; its link {human(link['bytes_per_second'])}/s ({link['detail']})" if link.get("bytes_per_second")
             else "; its link's capacity not known yet" if p.get("bytes_out") else "")
    lines = [f"cluster    {plural(len(p['members']), 'member')}, keeping {p['mode']} blocks{replicas}; this node "
             f"{what}{owns}" + ("" if p["store_reachable"] else
                                 f" (store unreachable: last member list; {p.get('store_error') or 'no answer'})"),
             f"           asked {plural(r['ok'] + failed, 'block')} of the tier: {human(p['bytes_in'])} in "
             f"{plural(r['ok'], 'answer')}, {plural(failed, 'ask')} failed{onward}; served "
             f"{human(p['bytes_out'])} in {plural(r['served'], 'block')}{by_kernel}, rejected {r['rejected']}{sends}"]
    refusing = p.get("refusing") or []
    for member in p["members"]:
        mark = " (this node)" if member == p["me"] else " (bypassed: not answering)" if member in p["down"] else ""
        gate = (p.get("gates") or {}).get(member)
        if gate and member != p["me"]:
            mark += (f": {gate['in_flight']} of {gate['limit']} requests in flight"
                     + (f", {gate['waiting']} waiting" if gate["waiting"] else ""))
        lines.append(f"           member {member}{mark}")
    if refusing:
        from epochfs.peer.members import REFUSED_FIX

        lines.append(f"           ! {plural(len(refusing), 'member')} refusing this node's token "
                     f"({', '.join(refusing[:8])}): {REFUSED_FIX}")
    return lines


def format_passthrough(p: dict[str, Any]) -> str:
    if not p["active"]:
        return (f"passthrough OFF: {p.get('off') or 'the kernel refused a backing file (see the log)'}; every file "
                "is read through the daemon")
    more = f"; {p['damaged']} cached files found changed or damaged (refetched)" if p["damaged"] else ""
    if p.get("unchecked"):
        more += f"; {p['unchecked']} being checked before the kernel reads them (read through the daemon meanwhile)"
    return (f"passthrough on: {p['opens']} opens read by the kernel, {p['cached_opens']} through the daemon; "
            f"{p['whole_files']} files whole in the cache ({human(p['whole_bytes'])}){more}")


def format_node_cache(n: dict[str, Any]) -> str:
    linked = f" (and holds {human(n['linked_bytes'])} linked from the others)" if n.get("linked_bytes") else ""
    return (f"node cache {human(n['node_bytes'])} split between {n['members']} mounts; this one may hold "
            f"{human(n['part_bytes'])} now{linked}")


def format_shared(h: dict[str, Any]) -> str:
    refused = f"; {h['refused']} offers refused (moved or not the content named: fetched)" if h["refused"] else ""
    return (f"shared     {h['adopted_objects']} objects ({human(h['adopted_bytes'])}) taken from the node's other "
            f"mounts instead of fetched ({h.get('linked', 0)} linked, on disk once); {h['offered']} offered to "
            f"them{refused}")


def format_writeback(w: dict[str, Any]) -> str:
    pending = (f"{w['pending_files']} files ({human(w['pending_bytes'])}) not yet in the backend, oldest "
               f"waiting {age(w['oldest_pending_seconds'])}; {w['uploading']} uploading"
               if w["pending_files"] else "nothing pending")
    more = f"; {w['deletes_pending']} deletes pending" if w["deletes_pending"] else ""
    errors = f"; {w['upload_errors']} failed attempts (retried)" if w["upload_errors"] else ""
    if w.get("kernel_writes"):
        kernel = f"; the kernel writes files itself ({w['kernel_opens']} opens, {human(w['kernel_bytes'])} written)"
    elif w.get("kernel_off"):
        kernel = f"; files are written through the daemon ({w['kernel_off']})"
    else:
        kernel = ""
    gave = (f"; uploads gave way to a fast writer {w['gave_way']} times ({w.get('gave_way_seconds', 0):.1f} s)"
            if w.get("gave_way") else "")
    return (f"write-back {pending}{more}; uploaded {w['uploaded_files']} files ({human(w['uploaded_bytes'])})"
            f"{errors}{kernel}{gave}")


_HAND_OVER = "hand one over: epochfs.torch.EpochfsSampler, or epochfs prefetch"


def format_learned(lr: dict[str, Any] | None) -> str:
    """What the order learned from a plain mount's reads did, for a mount with no manifest: whether it
    fetches ahead, in which directory (the viewer's own guess alone), and how much of it was read."""
    if lr is None or lr["state"] == "off":
        return f"prefetch   no manifest, learned order off (--no-learned-order); {_HAND_OVER}"
    done = (f"; fetched ahead {human(lr['fetched_bytes'])}, {human(lr['used_bytes'])} of it read by the job"
            if lr["fetched_bytes"] else "")
    state, scope = lr["state"], lr.get("scope")
    where = f" in {scope or '/'}" if scope is not None else ""
    if state == "near":
        what = ("learned order: nothing fetched ahead (the backend answers within 10 ms, or has not been "
                "read from yet: a read on demand waits about as long as fetching ahead would save)")
    elif state == "guessing":
        what = f"learned order: fetching ahead{where}, {lr['inflight']} in flight"
    elif state == "fetched":
        what = f"learned order: everything guessed{where} is fetched"
    elif state == "held":
        what = "learned order: an order handed over rules instead"
    else:
        what = "learned order: watching (no directory read file after file yet, so nothing fetched ahead)"
    return f"prefetch   no manifest; {what}{done}"


def format_prefetch(p: dict[str, Any], learned: dict[str, Any] | None = None) -> str:
    if not p["blocks"]:
        return format_learned(learned)
    epoch = f"epoch {p['epoch']}, " if p["epoch"] is not None else ""
    where = (f"prefetch   {epoch}file {p['file_position'] + 1} of {p['files']} "
             f"({human(p['position_bytes'])} of {human(p['plan_bytes'])}); ")
    if not p["active"]:
        if not p["position_bytes"]:  # (the plan's reads never reached the daemon)
            return where + ("done: every block of the plan is cached; no read of it has reached the daemon yet "
                            "(reads the kernel's page cache serves never do, so the position stays)")
        return where + "done: every block of the plan fetched or read"
    if not p["queued_bytes"] and not p["inflight"]:
        return where + f"everything ahead is cached ({human(p['lead_bytes'])})"
    lead = f" = {p['lead_seconds']:.1f} s of reading" if p["lead_seconds"] is not None else ""
    return where + (f"cached ahead {human(p['lead_bytes'])}{lead}; queued {human(p['queued_bytes'])}; "
                    f"{p['inflight']} in flight")
