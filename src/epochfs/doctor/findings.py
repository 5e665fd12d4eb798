"""What the mount's state shows that makes a job wait for data: each cause a finding, with what shows it
and its fix, the fixes in place left out, most helpful first (:data:`ORDER`). Pure."""

from __future__ import annotations

import shlex
from typing import Any

from epochfs.core.text import human
from epochfs.doctor.advice import (
    pack_command,
    serve_command,
    share_fix,
    size_flag,
    store_flags,
    warm_fix,
    warmup_command,
)
from epochfs.doctor.views import (
    BACKEND_BUSY,
    BACKLOG_SECONDS,
    BUFFERED_OPENS,
    CACHE_TIER,
    CPU_BUSY,
    FROM_BACKEND,
    HEADROOM,
    HIT_RATIO,
    LINK_BUSY,
    LINK_CARRYING,
    SLOW_BACKEND,
    SLOW_SAVE,
    SMALL_FILES,
    WARM,
    WARM_HITS,
    verdict_of,
)

#: Findings, most helpful first (the order they are listed in).
ORDER = ("read-errors", "peer-token-refused", "store-password-refused", "cache-too-small", "cold-first-epoch", "no-manifest", "low-hit-ratio",
         "small-files",
         "warm-read-path", "buffered-opens", "backend-saturated", "cache-nodes-busy", "node-cpu", "cache-tier",
         "cache-tier-failing",
         "cluster-share-too-large", "memory-bound", "backend-latency", "slow-checkpoints", "writeback-backlog")
MEMORY_THROTTLED = 1.0  # fetches ahead waiting for room on average over the window: memory binds


def sampler_line(m: dict[str, Any]) -> str:
    """The line that wraps a training loop's sampler for the mount (``dataset.samples``: the dataset's
    paths in its index order, as an ImageFolder has them)."""
    return f"sampler = epochfs.torch.EpochfsSampler(sampler, dataset.samples, {str(m['mountpoint'])!r})"


def findings_of(m: dict[str, Any], view: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """What the mount's state shows that makes the job wait for data, each with its fix, the ones in
    place left out; most helpful first (:data:`ORDER`)."""
    out: dict[str, dict[str, str]] = {}
    mnt, src = shlex.quote(str(m["mountpoint"])), shlex.quote(str(m["source"]))  # (pasted into a shell)
    phases = (view or {}).get("phases") or {}
    first = phases.get("first")
    judged = (view or {}).get("judged_on", "window")
    dataset, cap = m["dataset_bytes"], m["cache_capacity_bytes"]
    # (the plan may hold another user's order: a job whose own user handed over none has no plan of its own)
    handed = bool(m["manifest_files"]) and (view or {}).get("handed_over") is not False
    fits = bool(dataset) and cap >= dataset
    warm = bool(dataset) and (m.get("cached_bytes") or 0) >= WARM * dataset

    def found(cause: str, evidence: str, fix: str) -> None:
        out[cause] = {"cause": cause, "evidence": evidence, "fix": fix}

    if m["errors"]:
        named = ", ".join(f"{k} {n}" for k, n in sorted(m["errors"].items(), key=lambda kv: -kv[1]))
        found("read-errors", f"reads answered with errors while the doctor watched: {named}",
              f"`epochfs status {mnt}` and the daemon's log name the cause; EACCES or EPERM from the backend: "
              "the credentials or the bucket policy; EIO: the backend failing (its requests in the log)")
    client = m.get("peer_role") == "client"
    refusing = m.get("peer_refusing") or []
    if refusing:
        found("peer-token-refused", f"{len(refusing)} members of the cluster tier refuse this node's peer token "
              f"({', '.join(refusing[:4])}{', ...' if len(refusing) > 4 else ''}): what they own is read from the "
              "backend instead", "give every node the same token file (`peer_token_file`: made once, copied to "
              "each node) and restart the nodes whose file differed; the refusal can also mean clocks far apart "
              "(`timedatectl`)")
    if "refused the password" in (m.get("peer_store_error") or ""):
        found("store-password-refused", f"the shared store refuses this node's password: {m['peer_store_error']}",
              "give every node the same password file (`meta_password_file`: made once, copied to each node) and "
              "restart this one; until then it keeps its last member list")
    tier = m.get("tier")
    origins, first_cpu = m.get("first_origins"), m.get("first_cpu")
    through_tier = False  # the reads that made the job wait came from the cluster tier
    if first and first["verdict"] in ("storage-bound", "balanced"):
        plan = " (the order was handed over: these are the cold read's misses, not a missing plan)" if handed else ""
        total = sum(origins.values()) if origins else 0
        backend = origins["backend"] / total if total else None
        via = (origins["owner"] + origins["replica"]) / total if total else None
        waited = f"the first epoch waited {first['data_wait_fraction']:.0%} of step time"
        if backend is None and not warm:  # (a daemon that does not say where its reads came from)
            found("cold-first-epoch", f"{waited} reading from the backend{plan}", warm_fix(m, mnt, src, fits))
        elif backend is not None and backend >= FROM_BACKEND and not (client and m.get("peer_failures")):
            found("cold-first-epoch", f"{waited}: {backend:.0%} of what it read came from the backend{plan}",
                  warm_fix(m, mnt, src, fits))
        elif via is not None and via >= CACHE_TIER:
            if tier is not None and tier["held_bytes"] is not None and not tier["warm"] and tier["needed_bytes"]:
                found("cold-first-epoch", f"{waited}: {via:.0%} of what it read came through the cache nodes, which "
                      f"held {human(tier['held_bytes'])} of the {human(tier['needed_bytes'])} the dataset needs there: "
                      "what they lacked they fetched from the backend on the way",
                      f"warm the cache nodes before the job: `{warmup_command(m)}`")
            else:
                through_tier = True
    window = m.get("origins")
    tier_share = ((window["owner"] + window["replica"]) / sum(window.values()) if window and sum(window.values())
                  else m.get("peer_share"))  # (a daemon that does not say: the bytes its peers sent)
    if tier_share is not None and tier_share >= CACHE_TIER and judged != "first":
        through_tier = True
    if not handed:
        whose = (" by this job's user (the plan holds another user's order)" if m["manifest_files"]
                 else "")
        found("no-manifest", f"no epoch order was handed over{whose}: nothing is fetched ahead of the reader",
              f"wrap the sampler with the dataset's paths in its index order: `{sampler_line(m)}`, or run "
              f"`epochfs prefetch {mnt} --manifest FILE` before each epoch")
    if "cold-first-epoch" in out and dataset and not fits and not client:
        found("cache-too-small", f"the dataset ({size_flag(dataset)}) is larger than the cache ({size_flag(cap)}): "
              "no warmup holds an epoch, and each epoch evicts what the next one reads",
              f"remount with `--cache-size {size_flag(dataset * HEADROOM)}` (the dataset and a tenth; a larger "
              "cache disk if this one is smaller)")
    hit = m["hit_ratio"]
    steady = judged != "first"  # (a first epoch's misses are the cold read)
    if steady and hit is not None and hit < HIT_RATIO:
        if dataset and not fits:
            found("cache-too-small", f"hit ratio {hit:.0%} with a cache of {size_flag(cap)} for a dataset of "
                  f"{size_flag(dataset)}: each epoch evicts what the next one reads",
                  f"remount with `--cache-size {size_flag(dataset * HEADROOM)}` (the dataset and a tenth; a larger "
                  "cache disk if this one is smaller)")
        elif handed and m.get("eviction") not in (None, "manifest"):
            found("low-hit-ratio", f"hit ratio {hit:.0%} with the order handed over and --eviction {m['eviction']}",
                  "remount with `--eviction manifest`: it keeps what the plan reads next")
        elif fits and handed:
            found("low-hit-ratio", f"hit ratio {hit:.0%} though the cache holds the dataset and the order is "
                  "handed over", f"`epochfs warmup {mnt} --check` shows what is cached; misses then come from "
                  "objects that changed (a new snapshot) or reads outside the handed-over order")
    avg = m["average_object_bytes"]
    if avg is not None and avg < SMALL_FILES and not m["shards"]:
        found("small-files", f"objects average {avg / 1024:.0f} KiB: each costs a request and an open",
              f"pack them: `{pack_command(m)}` and mount the packed prefix (members read as the same files, a "
              "shard per request)")
    verdict = verdict_of(view["data_wait_fraction"], view["gpu_utilization"]) if view else None  # (the judged phase's)
    pt = m.get("passthrough")
    judged_origins = origins if judged == "first" else m.get("origins")
    if judged_origins and sum(judged_origins.values()):  # (a hit from the cluster tier is not this cache's)
        cached = judged_origins["local"] / sum(judged_origins.values())
    else:
        cached = hit
    if (verdict == "storage-bound" and cached is not None and cached >= WARM_HITS
            and avg is not None and avg >= SMALL_FILES and not m["shards"] and not m.get("writeback")
            and not (pt or {}).get("active")):
        if pt is None:
            found("warm-read-path", f"the job waits for data though {cached:.0%} of what it reads is cached: the "
                  "daemon's read path is the bound, and the kernel does not read cached files itself on this mount",
                  "remount without `--no-passthrough` (the daemon as root, Linux 6.9+): the kernel then reads a "
                  "cached file from the cache disk itself, at the disk's speed")
        elif (pt.get("off") or "").startswith("most of the dataset's bytes"):
            found("warm-read-path", f"the job waits for data though {cached:.0%} of what it reads is cached, and "
                  f"the kernel does not read cached files itself: {pt['off']}", "remount with `--passthrough`: the "
                  "kernel then reads every cached file from the cache disk itself (an open then costs a request)")
        else:
            found("warm-read-path", f"the job waits for data though {cached:.0%} of what it reads is cached, and "
                  f"passthrough is off ({pt.get('off') or 'the kernel refused it'})", "run the daemon as root on "
                  "Linux 6.9 or later (the kernel registers backing files only for CAP_SYS_ADMIN); the daemon's "
                  "log says which")
    asks = m.get("isatty_asks_per_second")
    if asks is not None and asks >= BUFFERED_OPENS:
        found("buffered-opens", f"{asks:.0f} requests a second ask whether a file is a terminal: Python's open() "
              "with its default buffering asks at every open (before Python 3.14), a round trip to the daemon even "
              "for a file in memory (measured: hot 100 KiB files opened so read at a third of the unbuffered rate)",
              "open the dataset's files unbuffered and read them whole: `with open(path, 'rb', buffering=0) as f: "
              "data = f.read()` (decode from `io.BytesIO(data)`), or run the job on Python 3.14 or later")
    limit = m["backend_bandwidth_limit"]
    rate = m["backend_bytes_per_second"]
    busy = m.get("link_busy")
    if judged == "first" and first:  # (the cold read's own)
        if limit and origins and first.get("seconds", 0) > 0:
            rate = max(rate, origins["backend"] / first["seconds"])
        busy = m.get("first_link_busy") if m.get("first_link_busy") is not None else busy
    if (limit and rate > BACKEND_BUSY * limit) or (busy is not None and busy >= LINK_CARRYING):
        link = m.get("backend_link") or "--backend-bandwidth"
        carrying = f"; bytes were arriving {busy:.0%} of the time" if busy is not None else ""
        if client or m.get("peer_role") == "peer":
            fix = (f"add a cache node (on a spare machine, with the token and password files copied to the same "
                   f"paths): `{serve_command(m)}`")
        else:
            fix = ("put cache nodes in front of it: a Redis store, `epochfs serve` on spare machines (`epochfs cluster "
                   "warmup` fills them before the job) and the GPU nodes remounted with `--peer-role client` "
                   "(docs/cluster-cache.md): each block then crosses this link once for the cluster")
        load = (f"{rate / limit:.0%} busy ({human(rate)}/s of {human(limit)}/s: {link})" if limit
                else f"carrying {human(rate)}/s, its capacity not known")
        found("backend-saturated", f"the link to the backend is {load}{carrying}: it is the bound", fix)
    if through_tier:
        busiest = (tier or {}).get("busiest")
        cpu = first_cpu if judged == "first" and first_cpu is not None else m.get("cpu_busy")
        if busiest is not None and busiest["utilization"] >= LINK_BUSY:
            found("cache-nodes-busy", f"this node reads through the cache nodes, and {busiest['member']}'s link is "
                  f"{busiest['utilization']:.0%} busy (of {human(busiest['link_capacity'])}/s"
                  + (f", {busiest['source']}" if busiest.get("source") else "") + "): the cache tier is the bound",
                  f"add a cache node (on a spare machine, with the token and password files copied to the same "
                  f"paths): `{serve_command(m)}`; it takes its share from the others at once")
        elif cpu is not None and cpu >= CPU_BUSY:
            found("node-cpu", "this node reads through the cache nodes, their links are not busy"
                  + (f" (at most {busiest['utilization']:.0%})" if busiest else "") + f", and its CPUs were "
                  f"{cpu:.0%} busy: the wait is for this node's CPU time (the loader, the job and the daemon share it)",
                  "give the loader fewer workers than the node has cores, move other work off the node, or run the "
                  "job on nodes with more cores")
        elif busiest is None or (tier or {}).get("unmeasured"):
            found("cache-tier", f"{tier_share or 0.0:.0%} of what this node reads comes from the cluster tier's "
                  f"{'cache nodes' if client else 'members'}, whose links' load is not known",
                  f"`epochfs cluster status {src} {store_flags(m) or '--meta URL'}` shows their load; past 70% "
                  f"(EpochfsCacheNodesBusy) add a cache node: `{serve_command(m)}`")
    if m.get("peer_failures"):
        found("cache-tier-failing", f"{m['peer_failures']} requests to the cluster tier failed (no answer in "
              "time, or one that did not check out) and went to the backend",
              f"`epochfs status {mnt}` lists the members bypassed; their logs say why; --peer-timeout bounds each wait")
    owned = m.get("peer_share_bytes")
    if m.get("peer_mode") == "owned" and owned is not None and owned > cap:
        found("cluster-share-too-large", f"this node owns {size_flag(owned)} of the dataset in the cluster tier and "
              f"keeps only what it owns, in a cache of {size_flag(cap)}: it evicts blocks it owns, and each member "
              "that asks for one reads it from the backend again",
              share_fix(owned, cap, m.get("peer_cache_size_bytes"), m.get("peer_tier_cache_bytes"),
                        m.get("peer_needed_bytes"))
              + f" (`epochfs cluster status {src} --meta URL` shows each member's share against its cache)")
    median = m["backend_median_seconds"]
    # (a saturated link's requests wait in its queue: more of them in flight only lengthens it)
    if median is not None and median > SLOW_BACKEND and (hit is None or hit < 0.99) and "backend-saturated" not in out:
        conc = m.get("backend_concurrency")
        wanted, cap = m.get("prefetch_wanted_inflight"), m.get("prefetch_max_inflight")
        advised = m.get("prefetch_advised_inflight")
        evidence = f"a block request takes {median * 1000:.0f} ms (median)"
        if handed and advised and wanted and cap:
            # The order is handed over and what keeps ahead of the reader at this latency is more than
            # the plan's fetches may have in flight: their cap is what binds, not the readers' slots.
            evidence += (f", and to keep ahead of the reader at that latency the prefetcher wants {wanted:.0f} "
                         f"fetches in flight where it may start {cap:.0f}")
            fix = f"let the plan keep more in flight: remount with `--prefetch-concurrency {advised:.0f}`"
        else:
            more = f"--backend-concurrency {max(32, 2 * conc)}" if conc else "--backend-concurrency 32"
            fix = f"keep more requests in flight: remount with `{more}`"
            if not handed:
                fix += ", and hand over the order so the prefetcher fetches ahead"
        found("backend-latency", evidence, fix)
    mem = m.get("memory")
    if mem and mem["throttled"] >= MEMORY_THROTTLED:
        found("memory-bound", f"fetches ahead of the readers waited for room under --memory-limit "
              f"{size_flag(mem['limit'])} ({mem['throttled']:.1f} fetches waiting on average; the daemon holds "
              f"{size_flag(mem['resident'])}): less was fetched ahead than the readers needed",
              f"remount with `--memory-limit {size_flag(2 * mem['limit'])}` if the node has the memory to spare, "
              "or a smaller --block-size (each fetch holds a block)")
    save = view.get("checkpoint_save_seconds") if view else None
    if save is not None and save > SLOW_SAVE:
        found("slow-checkpoints", f"a checkpoint save takes {save:.0f} s as the job sees it",
              "save to a write-back mount: `epochfs mount s3://BUCKET/ckpt /mnt/ckpt --writeback`, saves return at "
              "local-disk speed and upload in the background" if not m.get("checkpoint_writeback") else
              "the checkpoint mount writes back already: its cache disk is the bound (a faster disk, or fewer "
              "bytes per save)")
    wb = m["writeback"]
    if wb and wb.get("pending_bytes") and wb.get("oldest_pending_seconds", 0) > BACKLOG_SECONDS:
        found("writeback-backlog", f"{human(wb['pending_bytes'])} written wait for upload, the oldest "
              f"{wb['oldest_pending_seconds']:.0f} s", "uploads compete with reads for the link: cap them "
              "(--upload-bandwidth) or save checkpoints less often")
    return [out[c] for c in ORDER if c in out]
