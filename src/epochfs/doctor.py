"""``epochfs doctor``: is the training job waiting for storage, and if so, why, what is already in place,
what to change, and what it costs. Pure: it reads two ``status`` replies taken ``seconds`` apart (the
jobs' own reports, see :mod:`epochfs.watch`, and the mount's state) and returns a verdict with its
findings.

The rules are the operators' ones:

- a job that waits for data more than half of its step time, or whose GPU is under 50% busy while it
  waits at least a fifth, is ``storage-bound``; one that waits under a fifth is ``compute-bound``; in
  between, ``balanced``; without reports, ``no-job-data``;
- the first epoch (the cold read) and the later ones (read from the cache) are judged apart, as each
  report names its epoch; the verdict is the later epochs' once there are any, else the first's (a job
  whose reports name no epoch is judged over the daemon's window, the last 10 minutes);
- for a storage-bound or balanced job, each cause the mount's state shows is a finding: what shows it,
  and the fix, as a command or flag to paste, only where it is not in place already, most helpful first;
- what an epoch and a day cost: the backend's requests and bytes of each epoch (the mount's counters
  where the job's epochs began) and the GPU hours spent waiting, at the operator's prices
  (:mod:`epochfs.cost`).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from epochfs.cache.flights import read_origins
from epochfs.cost import DAY, Cost, Prices, Usage, describe_dict, usage_of
from epochfs.stats import HistogramSnapshot
from epochfs.text import human

STORAGE_BOUND = 0.5  # of step time spent waiting for data
COMPUTE_BOUND = 0.2
GPU_IDLE = 50.0  # percent
HIT_RATIO = 0.85  # the alert's threshold
BACKEND_BUSY = 0.7  # of --backend-bandwidth
SLOW_BACKEND = 0.020  # seconds, median of a block request
SMALL_FILES = 1 << 20  # average object size below which small files dominate
WARM_HITS = 0.99  # of the bytes read were cache hits: what is left is the read path from the cache
BACKLOG_SECONDS = 60.0  # the oldest written file waiting this long for its upload
SLOW_SAVE = 30.0  # seconds a checkpoint save keeps the job from training
CACHE_TIER = 0.5  # of the bytes read that came from the cluster tier's members
HEADROOM = 1.1  # the cache size advised: the dataset and a tenth
WARM = 0.95  # of the dataset cached: a job started now reads it warm
BUFFERED_OPENS = 500.0  # a second: asks whether a file is a terminal (~40 us of the daemon's time each)
FROM_BACKEND = 0.25  # of what an epoch read came from the backend: the node read it cold itself
LINK_BUSY = 0.7  # of a cache node's link: the alert's line
CPU_BUSY = 0.9  # of the node's CPU time: the node itself is the bound
LINK_CARRYING = 0.9  # of the time bytes arrived on the backend link: it ran full, whatever its capacity
FRESH = 60.0  # seconds: a member's published load older than this is not its load now

#: Findings, most helpful first (the order they are listed in).
ORDER = ("read-errors", "cold-first-epoch", "no-manifest", "cache-too-small", "low-hit-ratio", "small-files",
         "warm-read-path", "buffered-opens", "backend-saturated", "cache-nodes-busy", "node-cpu", "cache-tier",
         "cache-tier-failing",
         "cluster-share-too-large", "backend-latency", "slow-checkpoints", "writeback-backlog")


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _num(value: Any) -> float | None:
    """A finite number of the status, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value) if math.isfinite(value) else None
        except OverflowError:  # (an integer past a float's range)
            return None
    return None


def _needed(peer: dict[str, Any]) -> float | None:
    """The bytes the cluster tier's caches must hold together: the dataset times its replicas."""
    total, replicas = _num(peer.get("dataset_bytes")), _num(peer.get("replicas"))
    return total * (replicas or 1) if total is not None else None


def _ranks(status: dict[str, Any], job: str | None) -> list[dict[str, Any]]:
    return [j for j in status.get("jobs") or [] if isinstance(j, dict) and (job is None or j.get("job") == job)]


def verdict_of(wait: float | None, gpu: float | None) -> str:
    if wait is None:
        return "no-job-data"
    if wait > STORAGE_BOUND or (gpu is not None and gpu < GPU_IDLE and wait >= COMPUTE_BOUND):
        return "storage-bound"
    return "compute-bound" if wait < COMPUTE_BOUND else "balanced"


def _phase(name: str, rows: list[tuple[int, dict[str, Any]]], ranks: int, gpu: float | None) -> dict[str, Any] | None:
    """One phase (the first epoch, or the later ones) summed over the ranks' per-epoch totals."""
    if not rows:
        return None
    wait = sum(float(e.get("data_wait", 0.0)) for _, e in rows)
    compute = sum(float(e.get("compute", 0.0)) for _, e in rows)
    steps = sum(int(e.get("steps", 0)) for _, e in rows)
    epochs = sorted({n for n, _ in rows})
    fraction = _share(wait, wait + compute)
    if not steps or fraction is None:
        return None
    return {"phase": name, "epochs": [epochs[0], epochs[-1]], "epoch_count": len(epochs), "steps": steps,
            "data_wait_fraction": fraction, "verdict": verdict_of(fraction, gpu),
            "seconds": max(float(e.get("last_report", 0.0)) for _, e in rows)
            - min(float(e.get("first_report", 0.0)) for _, e in rows),
            # an epoch's length as one rank sees it, and the GPU time all ranks waited in one epoch
            "epoch_seconds": (wait + compute) / ranks / len(epochs),
            "gpu_hours_lost_per_epoch": wait / 3600 / len(epochs), "ranks": ranks}


def job_view(status: dict[str, Any], job: str | None) -> dict[str, Any] | None:
    """The chosen job's ranks: summed over the daemon's window, and per phase where the reports name
    their epochs (None: no reports in the window and no epochs)."""
    ranks = _ranks(status, job)
    recent = [j for j in ranks if (j.get("window") or {}).get("steps") or (j.get("window") or {}).get("saves")]
    by_epoch = [(int(e["epoch"]), e) for j in ranks for e in j.get("epochs") or []
                if isinstance(e, dict) and isinstance(e.get("epoch"), int)]
    if not recent and not by_epoch:
        return None
    win = [j.get("window") or {} for j in recent]
    wait = sum(float(w.get("data_wait", 0.0)) for w in win)
    compute = sum(float(w.get("compute", 0.0)) for w in win)
    steps = sum(int(w.get("steps", 0)) for w in win)
    gpus = [g for j in ranks if (g := _num(j.get("gpu_utilization"))) is not None]
    gpu = sum(gpus) / len(gpus) if gpus else None
    saves = sum(int(w.get("saves", 0)) for w in win)
    save_seconds = sum(float(w.get("save_seconds", 0.0)) for w in win)
    with_epochs = len({j.get("rank") for j in ranks if j.get("epochs")}) or 1
    phases = {"first": _phase("first", [(n, e) for n, e in by_epoch if n == 0], with_epochs, gpu),
              "later": _phase("later", [(n, e) for n, e in by_epoch if n > 0], with_epochs, gpu)}
    window_fraction = _share(wait, wait + compute)
    current = phases["later"] or phases["first"]
    return {"jobs": sorted({str(j.get("job")) for j in ranks}), "ranks": len(ranks), "steps": steps,
            "window_data_wait_fraction": window_fraction,
            "data_wait_fraction": current["data_wait_fraction"] if current else window_fraction,
            "judged_on": current["phase"] if current else "window",
            "phases": phases,
            "step_seconds": (wait + compute) / steps if steps else None, "gpu_utilization": gpu,
            "checkpoint_save_seconds": save_seconds / saves if saves else None}


def describe_window(view: dict[str, Any]) -> str:
    """What the verdict was judged on, in words."""
    phase = view["phases"].get(view["judged_on"]) if view["judged_on"] != "window" else None
    if phase is None:
        return "the reports of the last 10 minutes"
    lo, hi = phase["epochs"]
    which = "the first epoch" if phase["phase"] == "first" else (f"epoch {lo}" if lo == hi else f"epochs {lo}-{hi}")
    return f"{which} ({phase['steps']} steps over {phase['seconds']:.0f} s)"


def _origins(c: dict[str, Any], before: dict[str, Any] | None) -> dict[str, int] | None:
    """Where the reads between two sets of the cache's counters came from (None: counters of a daemon
    that does not keep them)."""
    if not isinstance(c, dict) or "demand_bytes" not in c or (before is not None and "demand_bytes" not in before):
        return None
    return read_origins(c, before)


def _cpu(status: dict[str, Any]) -> tuple[float, float] | None:
    cpu = status.get("host_cpu")
    if isinstance(cpu, list) and len(cpu) >= 2 and all(_num(x) is not None for x in cpu[:2]):
        return float(cpu[0]), float(cpu[1])
    return None


def _cpu_busy(a: tuple[float, float] | None, b: tuple[float, float] | None) -> float | None:
    """The fraction of the machine's CPU time that was busy between two readings."""
    if a is None or b is None or b[1] <= a[1] or b[0] < a[0]:
        return None
    return min(1.0, (b[0] - a[0]) / (b[1] - a[1]))


def _link_busy(before: dict[str, Any], after: dict[str, Any], seconds: float) -> float | None:
    """The share of the time between two replies the backend link carried bytes."""
    b0, b1 = ((s.get("backend") or {}).get("link") or {} for s in (before, after))
    if not isinstance(b0, dict) or not isinstance(b1, dict) or seconds <= 0:
        return None
    x0, x1 = _num(b0.get("busy_seconds")), _num(b1.get("busy_seconds"))
    return min(1.0, max(0.0, (x1 - x0) / seconds)) if x0 is not None and x1 is not None else None


def tier_view(load: Any, needed: float) -> dict[str, Any] | None:
    """The members a node reads from, as they published their load (fresh figures only): how much
    they hold against ``needed`` (the dataset times its replicas), and the busiest link."""
    rows = [r for r in load if isinstance(r, dict)] if isinstance(load, list) else []
    fresh = [r for r in rows if (_num(r.get("age_seconds")) is not None and r["age_seconds"] <= FRESH)]
    if not fresh:
        return None
    held = [h for r in fresh if (h := _num(r.get("held_bytes"))) is not None]
    busy = [(u, r) for r in fresh if (u := _num(r.get("utilization"))) is not None and _num(r.get("link_capacity"))]
    busiest = max(busy, key=lambda ur: ur[0]) if busy else None
    return {"members": len(fresh), "held_bytes": sum(held) if held else None, "needed_bytes": needed or None,
            "warm": bool(held) and bool(needed) and sum(held) >= WARM * needed,
            "busiest": {"member": busiest[1].get("member"), "utilization": busiest[0],
                        "link_capacity": busiest[1]["link_capacity"], "source": busiest[1].get("link_source")}
            if busiest else None,
            "unmeasured": sum(1 for r in fresh if not _num(r.get("link_capacity"))),
            "cache_size": sorted(c for r in fresh if (c := _num(r.get("capacity_bytes"))))[len(fresh) // 2]
            if all(_num(r.get("capacity_bytes")) for r in fresh) else None,
            "port": _common_port([str(r.get("member", "")) for r in fresh])}


def _common_port(members: list[str]) -> int | None:
    ports = [int(p) for m in members if (p := m.rpartition(":")[2]).isdigit() and 0 < int(p) < 65536]
    return max(set(ports), key=ports.count) if ports else None


def phase_origins(after: dict[str, Any], view: dict[str, Any] | None, job: str | None,
                  epoch: int = 0) -> tuple[dict[str, int] | None, float | None, float | None]:
    """Where epoch ``epoch``'s reads came from, how busy the node's CPUs were meanwhile, and the share
    of its time the backend link carried bytes: between the counters the mount kept where it began and
    where the next began (else now); (None, None, None) where the mount kept none."""
    names = [job] if job else (view or {}).get("jobs") or []
    marks = {}
    for name in names:
        for mk in (after.get("job_epochs") or {}).get(name, []):
            if isinstance(mk, dict) and isinstance(mk.get("counters"), dict) and isinstance(mk.get("epoch"), int):
                marks.setdefault(mk["epoch"], mk["counters"])
    start = marks.get(epoch)
    if start is None:
        return None, None, None
    later = [n for n in marks if n > epoch]
    link = (after.get("backend") or {}).get("link")
    end = marks[min(later)] if later else {
        **(after.get("cache") or {}), **dict(zip(("cpu_busy", "cpu_all"), _cpu(after) or (), strict=False)),
        "backend_busy_seconds": link.get("busy_seconds") if isinstance(link, dict) else None, "time": after.get("now")}
    cpu = (_cpu_busy((start["cpu_busy"], start["cpu_all"]), (end["cpu_busy"], end["cpu_all"]))
           if all(_num(d.get(k)) is not None for d in (start, end) for k in ("cpu_busy", "cpu_all")) else None)
    busy = None
    if all(_num(d.get(k)) is not None for d in (start, end) for k in ("backend_busy_seconds", "time")):
        spent = end["time"] - start["time"]
        busy = min(1.0, max(0.0, (end["backend_busy_seconds"] - start["backend_busy_seconds"]) / spent)) \
            if spent > 0 else None
    return _origins(end, start), cpu, busy


def mount_view(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The mount's rates between the two replies, and the state the findings read."""
    c0, c1 = before["cache"], after["cache"]
    hit = c1["hit_bytes"] - c0["hit_bytes"]
    miss = c1["miss_bytes"] - c0["miss_bytes"]
    if hit + miss == 0:  # nothing read in between: since the mount started
        hit, miss = c1["hit_bytes"], c1["miss_bytes"]
    backend = after["backend"]["bytes"] - before["backend"]["bytes"]
    latency = after["backend"].get("request_seconds")
    snap = after["snapshot"]
    p0, p1 = before.get("peer") or {}, after.get("peer") or {}
    peer_in = p1.get("bytes_in", 0) - p0.get("bytes_in", 0) if p1 else 0
    failed = sum(p1.get("requests", {}).get(k, 0) - p0.get("requests", {}).get(k, 0) for k in ("unavailable", "bad"))
    store = after["store"]
    errors = {k: n - (before.get("errors") or {}).get(k, 0) for k, n in (after.get("errors") or {}).items()}
    origins = _origins(c1, c0)
    if origins is not None and not sum(origins.values()):  # nothing read in between: since the mount started
        origins = _origins(c1, None)
    asks0, asks1 = _num(before.get("isatty_asks")), _num(after.get("isatty_asks"))
    return {"hit_ratio": _share(hit, hit + miss),
            "peer_role": p1.get("role"), "peer_share": _share(peer_in, hit + miss) if p1 else None,
            "peer_failures": failed, "peer_mode": p1.get("mode"), "peer_share_bytes": _num(p1.get("share_bytes")),
            "peer_cache_size_bytes": _num(p1.get("cache_size_bytes")),
            "peer_tier_cache_bytes": _num(p1.get("tier_cache_bytes")),
            "peer_needed_bytes": _needed(p1),
            "backend_bytes_per_second": backend / seconds if seconds > 0 else 0.0,
            "backend_bandwidth_limit": after["backend"].get("bandwidth_limit"),
            "backend_median_seconds": HistogramSnapshot.from_dict(latency).quantile(0.5) if latency else None,
            "average_object_bytes": snap["bytes"] / snap["objects"] if snap["objects"] else None,
            "dataset_bytes": snap["bytes"], "shards": snap.get("shards", 0),
            "manifest_files": after["prefetch"]["files"], "plan_bytes": after["prefetch"]["plan_bytes"],
            "cache_capacity_bytes": store["capacity_bytes"], "cached_bytes": store.get("used_bytes"),
            "eviction": after.get("eviction"), "source": after.get("source", "SOURCE"),
            "mountpoint": after.get("mountpoint", "MOUNTPOINT"),
            "backend_concurrency": after.get("backend_concurrency"),
            "errors": {k: n for k, n in errors.items() if n > 0},
            "errors_total": {k: n for k, n in (after.get("errors") or {}).items() if n > 0},
            "writeback": after.get("writeback"), "passthrough": after.get("passthrough"),
            "isatty_asks_per_second": (asks1 - asks0) / seconds if asks0 is not None and asks1 is not None
            and seconds > 0 and asks1 >= asks0 else None,
            "origins": origins, "cpu_busy": _cpu_busy(_cpu(before), _cpu(after)),
            "link_busy": _link_busy(before, after, seconds),
            "backend_link": (after["backend"].get("link") or {}).get("detail"),
            "backend_link_source": (after["backend"].get("link") or {}).get("source"),
            "peer_fallbacks": p1.get("fallbacks") if p1 else None,
            "tier": tier_view(p1.get("load"), _needed(p1) or (snap["bytes"] or 0) * (_num(p1.get("replicas")) or 1))
            if p1 else None,
            "options": after.get("options") if isinstance(after.get("options"), dict) else {}}


def size_flag(nbytes: float, *, down: bool = False) -> str:
    """A size as ``--cache-size`` takes it, rounded up (``down``: rounded down): ``320G``, ``1.5T``."""
    gib = nbytes / (1 << 30)
    if gib >= 1024:
        return f"{(math.floor if down else math.ceil)(gib / 1024 * 10) / 10:g}T"
    if gib < 1 and down:
        return f"{max(1, math.floor(nbytes / (1 << 20)))}M"
    return f"{max(1, (math.floor if down else math.ceil)(gib))}G"


def share_fix(share: float, capacity: float, cache_size: float | None = None, tier_cache: float | None = None,
              needed: float | None = None) -> str:
    """What makes a cluster tier member's ``share`` fit its cache (``capacity``: what it holds now).

    Where the members are weighted by their caches (``tier_cache``: the ``--cache-size`` of the ring's
    members together; ``cache_size``: this member's), a share follows its member's ``--cache-size``:
    raising one moves more blocks to it, so what fits is the tier's caches together against ``needed``
    (the dataset times its replicas), or a member whose disk holds less than its ``--cache-size`` told
    what it holds (it is weighed by what it says). Unweighted, this member's cache alone."""
    if tier_cache is None or cache_size is None or needed is None:
        return f"give it `--cache-size {size_flag(share * HEADROOM)}` (its share and a tenth), or add members"
    if capacity < cache_size:
        return (f"its disk holds less than its --cache-size, which is what the members weigh it by: give it "
                f"`--cache-size {size_flag(capacity, down=True)}` (what it holds) or free its disk")
    factor = max(HEADROOM, needed * HEADROOM / tier_cache) if tier_cache > 0 else HEADROOM
    return (f"each member's share follows its --cache-size, and the members' caches hold {human(tier_cache)} "
            f"together for {human(needed)} of blocks: raise every member's by {factor:.2g}x (this one's: "
            f"`--cache-size {size_flag(cache_size * factor)}`), or add members with "
            f"{human(max(needed * HEADROOM - tier_cache, share * HEADROOM))} of cache")


PEER_PORT = 9570  # the cache nodes' port where none is known (the documentation's)


def size_arg(nbytes: Any) -> str:
    """A size as the options take it, exactly: ``4M``, ``1G``, ``65536``."""
    n = int(nbytes)
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def store_flags(m: dict[str, Any]) -> str | None:
    """The options that reach the mount's shared store, as it was mounted with them (None: not known)."""
    o = m.get("options") or {}
    if not isinstance(o.get("meta"), str) or not o["meta"]:
        return None
    parts = ["--meta", o["meta"]]
    for key, flag in (("meta_name", "--meta-name"), ("meta_password_file", "--meta-password-file"),
                      ("meta_ca_file", "--meta-ca-file")):
        if isinstance(o.get(key), str) and o[key]:
            parts += [flag, o[key]]
    return " ".join(shlex.quote(p) for p in parts)


def _tier_flags(m: dict[str, Any]) -> str:
    o = m.get("options") or {}
    token = o.get("peer_token_file")
    flags = [store_flags(m) or "--meta URL", "--peer-token-file " + (shlex.quote(token) if isinstance(token, str)
                                                                    else "FILE")]
    if _num(o.get("block_size")):
        flags.append(f"--block-size {size_arg(o['block_size'])}")
    if _num(o.get("replicas")):
        flags.append(f"--replicas {int(o['replicas'])}")
    return " ".join(flags)


def warmup_command(m: dict[str, Any]) -> str:
    """``epochfs cluster warmup`` for the mount's dataset and tier, every option as the mount has it."""
    return f"epochfs cluster warmup {shlex.quote(str(m['source']))} {_tier_flags(m)}"


def serve_command(m: dict[str, Any]) -> str:
    """``epochfs serve`` of one more cache node for the mount's dataset and tier: its options as the mount
    and the other cache nodes have them (their port, their cache size), its address the machine's own."""
    o, tier = m.get("options") or {}, m.get("tier") or {}
    endpoint = f" --endpoint-url {shlex.quote(o['endpoint_url'])}" if isinstance(o.get("endpoint_url"), str) else ""
    size = _num(tier.get("cache_size")) or _num(o.get("cache_size"))
    listen = f"\"$(hostname -I | cut -d' ' -f1):{tier.get('port') or PEER_PORT}\""
    return (f"epochfs serve {shlex.quote(str(m['source']))}{endpoint} {_tier_flags(m)} --peer-listen {listen}"
            + (f" --cache-size {size_flag(size)}" if size else "") + " --rebalance")


def _warm_fix(m: dict[str, Any], mnt: str, src: str, fits: bool) -> str:
    if m.get("peer_role") == "client":
        return f"warm the cache nodes before the job: `{warmup_command(m)}`"
    if fits:
        return f"warm the cache before the job starts: `epochfs warmup {mnt}` (the dataset fits the cache)"
    return (f"warm what the first epoch reads before the job starts: `epochfs warmup {mnt} --manifest "
            "FIRST-EPOCH.txt` with the first epoch's order (the whole dataset does not fit the cache)")


def in_place(m: dict[str, Any]) -> list[str]:
    """What the mount already does that the findings would otherwise advise."""
    out = []
    if m["manifest_files"]:
        out.append(f"the epoch's order is handed over ({m['manifest_files']} files in the plan)")
    dataset, cap = m["dataset_bytes"], m["cache_capacity_bytes"]
    if dataset and cap >= dataset:
        out.append(f"the cache holds {cap / dataset:.1f}x the dataset")
    if dataset and m.get("cached_bytes") is not None:
        out.append(f"{min(1.0, m['cached_bytes'] / dataset):.0%} of the dataset's size is cached")
    if m["shards"]:
        out.append(f"the dataset is packed ({m['shards']} shards)")
    if m.get("peer_role"):
        out.append("reads through the cluster tier's cache nodes" if m["peer_role"] == "client"
                   else "shares blocks with the cluster tier")
    if m.get("eviction") == "manifest" and m["manifest_files"]:
        out.append("eviction follows the plan (manifest)")
    if m.get("writeback"):
        out.append("writes go to the cache first (--writeback)")
    if (m.get("passthrough") or {}).get("active"):
        out.append("the kernel reads cached files itself (--passthrough)")
    return out


def findings_of(m: dict[str, Any], view: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """What the mount's state shows that makes the job wait for data, each with its fix, the ones in
    place left out; most helpful first (:data:`ORDER`)."""
    out: dict[str, dict[str, str]] = {}
    mnt, src = shlex.quote(str(m["mountpoint"])), shlex.quote(str(m["source"]))  # (pasted into a shell)
    phases = (view or {}).get("phases") or {}
    first = phases.get("first")
    judged = (view or {}).get("judged_on", "window")
    dataset, cap = m["dataset_bytes"], m["cache_capacity_bytes"]
    handed = bool(m["manifest_files"])
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
            found("cold-first-epoch", f"{waited} reading from the backend{plan}", _warm_fix(m, mnt, src, fits))
        elif backend is not None and backend >= FROM_BACKEND and not (client and m.get("peer_failures")):
            found("cold-first-epoch", f"{waited}: {backend:.0%} of what it read came from the backend{plan}",
                  _warm_fix(m, mnt, src, fits))
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
        found("no-manifest", "no epoch order was handed over: nothing is fetched ahead of the reader",
              "wrap the sampler: `sampler = epochfs.torch.EpochfsSampler(sampler, MOUNTPOINT)`, or run "
              f"`epochfs prefetch {mnt} --manifest FILE` before each epoch")
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
              f"pack them: `epochfs pack {src} {shlex.quote(str(m['source']).rstrip('/') + '-packed')}` and mount the "
              "packed prefix (members read "
              "as the same files, a shard per request)")
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
                  "daemon's read path is the bound", "remount with `--passthrough` (the daemon as root, Linux 6.9+): "
                  "the kernel then reads a cached file from the cache disk itself, at the disk's speed")
        else:
            found("warm-read-path", f"the job waits for data though {cached:.0%} of what it reads is cached, and "
                  "--passthrough is off (the kernel refused it)", "run the daemon as root on Linux 6.9 or later "
                  "(the kernel registers backing files only for CAP_SYS_ADMIN); the daemon's log says which")
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
    if median is not None and median > SLOW_BACKEND and (hit is None or hit < 0.99):
        conc = m.get("backend_concurrency")
        more = f"--backend-concurrency {max(32, 2 * conc)}" if conc else "--backend-concurrency 32"
        fix = f"keep more requests in flight: remount with `{more}`"
        if not handed:
            fix += ", and hand over the order so the prefetcher fetches ahead"
        found("backend-latency", f"a block request takes {median * 1000:.0f} ms (median)", fix)
    save = view.get("checkpoint_save_seconds") if view else None
    if save is not None and save > SLOW_SAVE:
        found("slow-checkpoints", f"a checkpoint save takes {save:.0f} s as the job sees it",
              "save to a write-back mount: `epochfs mount s3://BUCKET/ckpt /mnt/ckpt --writeback`, saves return at "
              "local-disk speed and upload in the background" if not m.get("checkpoint_writeback") else
              "the checkpoint mount writes back already: its cache disk is the bound (a faster disk, or fewer "
              "bytes per save)")
    wb = m["writeback"]
    if wb and wb.get("pending_bytes") and wb.get("oldest_pending_seconds", 0) > BACKLOG_SECONDS:
        found("writeback-backlog", f"{wb['pending_bytes']} bytes written wait for upload, the oldest "
              f"{wb['oldest_pending_seconds']:.0f} s", "uploads compete with reads for the link: cap them "
              "(--upload-bandwidth) or save checkpoints less often")
    return [out[c] for c in ORDER if c in out]


def _usage(status: dict[str, Any]) -> Usage:
    b = status.get("backend") or {}
    u = b.get("usage")
    if isinstance(u, dict):
        return Usage(float(u.get("gets", 0)), float(u.get("lists", 0)), float(u.get("bytes", 0)))
    return usage_of(b.get("requests") or {}, int(b.get("bytes", 0)))


def costs_of(after: dict[str, Any], view: dict[str, Any] | None, job: str | None, prices: Prices) -> dict[str, Any]:
    """Per phase, what an epoch costs and a day of it: the backend's usage between the marks where the
    job's epochs began (the last whole epoch of the phase, else the one being read, so far), and the GPU
    hours its ranks waited."""
    out: dict[str, Any] = {"prices": prices.as_dict()}
    if view is None:
        return out
    names = [job] if job else view["jobs"]
    marks: dict[int, Usage] = {}
    for name in names:
        for mk in (after.get("job_epochs") or {}).get(name, []):
            u = Usage(float(mk["gets"]), float(mk["lists"]), float(mk["bytes"]))
            n = int(mk["epoch"])
            marks[n] = u if n not in marks else Usage(min(u.gets, marks[n].gets), min(u.lists, marks[n].lists),
                                                      min(u.bytes, marks[n].bytes))
    now = _usage(after)
    for name, phase in view["phases"].items():
        if phase is None:
            continue
        lo, hi = phase["epochs"]
        whole = [n for n in range(lo, hi + 1) if n in marks and n + 1 in marks]
        if whole:
            n = whole[-1]
            used, measured = marks[n + 1] - marks[n], f"epoch {n}"
        elif hi in marks:
            used, measured = now - marks[hi], f"epoch {hi}, so far"
        else:
            continue
        epoch = Cost(used, phase["gpu_hours_lost_per_epoch"], prices)
        per_day = DAY / phase["epoch_seconds"] if phase["epoch_seconds"] > 0 else 0.0
        out[name] = {"measured_on": measured, "epoch": epoch.as_dict(), "epochs_per_day": per_day,
                     "day": epoch.scaled(per_day).as_dict()}
    return out


def diagnose(before: dict[str, Any], after: dict[str, Any], seconds: float, job: str | None = None,
             prices: Prices | None = None, checkpoints: dict[str, Any] | None = None) -> dict[str, Any]:
    """The doctor's answer (what ``epochfs doctor --json`` prints). ``checkpoints``: the status of the
    job's checkpoint mount (``--checkpoints``), whose timed saves count with the job's."""
    view = job_view(after, job)
    if checkpoints is not None and view is not None:
        theirs = job_view(checkpoints, job)
        if theirs and theirs["checkpoint_save_seconds"] is not None and view["checkpoint_save_seconds"] is None:
            view["checkpoint_save_seconds"] = theirs["checkpoint_save_seconds"]
    verdict = verdict_of(view["data_wait_fraction"], view["gpu_utilization"]) if view else "no-job-data"
    mount = mount_view(before, after, seconds)
    mount["first_origins"], mount["first_cpu"], mount["first_link_busy"] = phase_origins(after, view, job)
    if checkpoints is not None:
        mount["checkpoint_writeback"] = bool(checkpoints.get("writeback"))
    first = (view or {}).get("phases", {}).get("first")
    troubled = verdict in ("storage-bound", "balanced") or bool(first and first["verdict"] != "compute-bound")
    findings = findings_of(mount, view) if troubled or mount["errors"] else []
    return {"verdict": verdict, "job": view,
            "data_wait_fraction": view["data_wait_fraction"] if view else None,
            "judged_on": describe_window(view) if view else None,
            "mount": mount, "in_place": in_place(mount), "findings": findings,
            "cost": costs_of(after, view, job, prices or Prices())}


COMPARED = [("data wait share", ("data_wait_fraction",), "{:.0%}"), ("step time, s", ("job", "step_seconds"), "{:.4f}"),
            ("GPU utilisation, %", ("job", "gpu_utilization"), "{:.0f}"), ("hit ratio", ("mount", "hit_ratio"), "{:.1%}"),
            ("backend bytes/s while doctor ran", ("mount", "backend_bytes_per_second"), "{:.0f}"),
            ("checkpoint save, s", ("job", "checkpoint_save_seconds"), "{:.2f}"),
            ("first epoch: data wait share", ("job", "phases", "first", "data_wait_fraction"), "{:.0%}"),
            ("first epoch: GPU hours waiting", ("cost", "first", "epoch", "gpu_hours_lost"), "{:.3f}"),
            ("first epoch: total, $", ("cost", "first", "epoch", "total_usd"), "${:.4f}"),
            ("per day (the later epochs', else the first's):", (), ""),
            ("GPU hours waiting per day", ("cost", "*", "day", "gpu_hours_lost"), "{:.2f}"),
            ("backend requests per day, $", ("cost", "*", "day", "requests_usd"), "${:.2f}"),
            ("backend transfer per day, $", ("cost", "*", "day", "transfer_usd"), "${:.2f}"),
            ("GPU time waiting per day, $", ("cost", "*", "day", "gpu_usd"), "${:.2f}"),
            ("total per day, $", ("cost", "*", "day", "total_usd"), "${:.2f}")]


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows (what, before, after) of two diagnoses (``--save``, then ``--compare``); money is the per-day
    cost of the phase each was judged on, and the last row what the change saves per day."""
    def get(d: dict[str, Any], path: tuple[str, ...], fmt: str) -> str:
        v = _get(d, path)
        return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    rows = [("verdict", str(before.get("verdict", "-")), str(after.get("verdict", "-")))]
    rows += [(what, get(before, path, fmt), get(after, path, fmt)) if path else (what, "", "")
             for what, path, fmt in COMPARED]
    b, a = _get(before, ("cost", "*", "day", "total_usd")), _get(after, ("cost", "*", "day", "total_usd"))
    if isinstance(b, (int, float)) and isinstance(a, (int, float)):
        rows.append(("saved per day, $", "", f"${b - a:,.2f}"))
    return rows


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if key == "*":  # the phase the diagnosis was judged on: the later epochs once there are any
            key = "later" if isinstance(d, dict) and isinstance(d.get("later"), dict) else "first"
        d = d.get(key) if isinstance(d, dict) else None
    return d


def render(result: dict[str, Any], mountpoint: str, job: str | None = None,
           earlier: dict[str, Any] | None = None) -> str:
    """The diagnosis as ``epochfs doctor`` prints it (any state a mount can be in, never an error)."""
    lines = []
    view = result.get("job")
    wait = result.get("data_wait_fraction")
    if view is None:
        lines.append(f"no-job-data: no training job reported to {mountpoint} in the last 10 minutes"
                     + (f" under the name {job!r}" if job else "")
                     + " (wrap the loader: `for batch in epochfs.watch.watch(loader, MOUNTPOINT, job=NAME)`)")
    elif wait is None:
        saves = view.get("checkpoint_save_seconds")
        took = f", a save taking {saves:.1f} s as the job sees it" if isinstance(saves, (int, float)) else ""
        lines.append(f"no-job-data: {', '.join(view['jobs'])} reported checkpoint saves only{took}: no training "
                     "steps (wrap the data loader, on the data mount, with epochfs.watch.watch; `epochfs doctor "
                     "DATA-MOUNT --checkpoints THIS-MOUNT` reads these saves with its steps)")
    else:
        gpu = view.get("gpu_utilization")
        gpu_text = f", GPU {gpu:.0f}% busy" if isinstance(gpu, (int, float)) else ""
        lines.append(f"{result['verdict']}: {', '.join(view['jobs'])} ({view['ranks']} rank(s)) waited for data "
                     f"{wait:.0%} of step time{gpu_text}, over {result.get('judged_on') or 'its reports'}")
        phases = view.get("phases") or {}
        for name, label in (("first", "first epoch"), ("later", "later epochs")):
            ph = phases.get(name)
            if ph is None:
                continue
            lo, hi = ph["epochs"]
            which = label if name == "first" else (f"epoch {lo}" if lo == hi else f"epochs {lo}-{hi}")
            lines.append(f"  {which:<14} {ph['verdict']}, waited {ph['data_wait_fraction']:.0%} "
                         f"({ph['steps']} steps, {ph['epoch_seconds']:.0f} s an epoch)")
    placed = result.get("in_place") or []
    if placed and view is not None:
        lines.append("  in place: " + "; ".join(placed))
    findings = result.get("findings") or []
    if findings:
        heading = {"balanced": "what would move it", "compute-bound": "worth doing"}.get(result.get("verdict", ""),
                                                                                        "what to change")
        lines.append(f"  {heading}, most helpful first:")
    for n, f in enumerate(findings, 1):
        lines.append(f"  {n}. {f['cause']}: {f['evidence']}\n     fix: {f['fix']}")
    if result.get("verdict") == "storage-bound" and not findings:
        lines.append("  the mount's own state shows no cause: look at the loader (workers, decoding) and the node")
    cost = result.get("cost") or {}
    for name, label in (("first", "the first epoch"), ("later", "a later epoch")):
        c = cost.get(name)
        if not isinstance(c, dict):
            continue
        prices = Prices(**cost["prices"])
        lines.append(f"  cost of {label} ({c['measured_on']}):")
        rows = [("per epoch", "epoch")] if name == "first" and isinstance(cost.get("later"), dict) else \
            [("per epoch", "epoch"), (f"per day ({c['epochs_per_day']:.1f} epochs like it)", "day")]
        lines += ["    " + describe_dict(c[key], prices, what) for what, key in rows]
    if view is not None and not any(isinstance(cost.get(k), dict) for k in ("first", "later")):
        lines.append("  cost: not yet known (it needs the job's epochs: epochfs.watch.watch names them)")
    if earlier is not None:
        rows = compare(earlier, result)
        width = max(len(w) for w, _, _ in rows)
        lines.append(f"\n{'':{width}}  {'before':>14}  {'after':>14}")
        lines += [f"{what:{width}}  {b:>14}  {a:>14}" for what, b, a in rows]
    return "\n".join(lines)
