"""The doctor's view of a job and a mount: the job's phases and verdict from its ranks' reports, and the
mount's state between two ``status`` replies (rates, where reads came from, the links, the cluster
tier's load). Pure: plain values in, plain values out. May import the cache's accounting, the
statistics and text helpers; nothing of the daemon."""

from __future__ import annotations

import math
from typing import Any

from epochfs.core.stats import HistogramSnapshot, read_origins

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


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def number(value: Any) -> float | None:
    """A finite number of the status, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value) if math.isfinite(value) else None
        except OverflowError:  # (an integer past a float's range)
            return None
    return None


def _needed(peer: dict[str, Any]) -> float | None:
    """The bytes the cluster tier's caches must hold together: the dataset times its replicas."""
    total, replicas = number(peer.get("dataset_bytes")), number(peer.get("replicas"))
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
    gpus = [g for j in ranks if (g := number(j.get("gpu_utilization"))) is not None]
    gpu = sum(gpus) / len(gpus) if gpus else None
    saves = sum(int(w.get("saves", 0)) for w in win)
    save_seconds = sum(float(w.get("save_seconds", 0.0)) for w in win)
    with_epochs = len({j.get("rank") for j in ranks if j.get("epochs")}) or 1
    phases = {"first": _phase("first", [(n, e) for n, e in by_epoch if n == 0], with_epochs, gpu),
              "later": _phase("later", [(n, e) for n, e in by_epoch if n > 0], with_epochs, gpu)}
    window_fraction = _share(wait, wait + compute)
    current = phases["later"] or phases["first"]
    handed = [j.get("handed_over") for j in ranks if isinstance(j.get("handed_over"), bool)]
    return {"jobs": sorted({str(j.get("job")) for j in ranks}), "ranks": len(ranks), "steps": steps,
            # whether the job's users handed the mount an epoch order (None: the daemon does not say)
            "handed_over": any(handed) if handed else None,
            "window_data_wait_fraction": window_fraction,
            "data_wait_fraction": current["data_wait_fraction"] if current else window_fraction,
            "judged_on": current["phase"] if current else "window",
            "phases": phases,
            "step_seconds": (wait + compute) / steps if steps else None, "gpu_utilization": gpu,
            "checkpoint_save_seconds": save_seconds / saves if saves else None}


def checkpoint_view(view: dict[str, Any] | None, status: dict[str, Any], *, named: bool) -> dict[str, Any] | None:
    """The job's checkpoint saves (their time as it sees it) and the write-back mount's uploads
    (``status``: the checkpoint mount's where ``named``, else the data mount's): None when there are
    neither."""
    save = number((view or {}).get("checkpoint_save_seconds"))
    wb = status.get("writeback") if isinstance(status.get("writeback"), dict) else None
    if save is None and wb is None:
        return None
    out: dict[str, Any] = {"save_seconds": save, "writeback": wb is not None, "named": named}
    for key in ("pending_files", "pending_bytes", "oldest_pending_seconds", "uploaded_files", "uploaded_bytes",
                "upload_errors"):
        out[key] = number((wb or {}).get(key))
    return out


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
    if isinstance(cpu, list) and len(cpu) >= 2 and all(number(x) is not None for x in cpu[:2]):
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
    x0, x1 = number(b0.get("busy_seconds")), number(b1.get("busy_seconds"))
    return min(1.0, max(0.0, (x1 - x0) / seconds)) if x0 is not None and x1 is not None else None


def tier_view(load: Any, needed: float) -> dict[str, Any] | None:
    """The members a node reads from, as they published their load (fresh figures only): how much
    they hold against ``needed`` (the dataset times its replicas), and the busiest link."""
    rows = [r for r in load if isinstance(r, dict)] if isinstance(load, list) else []
    fresh = [r for r in rows if (number(r.get("age_seconds")) is not None and r["age_seconds"] <= FRESH)]
    if not fresh:
        return None
    held = [h for r in fresh if (h := number(r.get("held_bytes"))) is not None]
    busy = [(u, r) for r in fresh if (u := number(r.get("utilization"))) is not None and number(r.get("link_capacity"))]
    busiest = max(busy, key=lambda ur: ur[0]) if busy else None
    return {"members": len(fresh), "held_bytes": sum(held) if held else None, "needed_bytes": needed or None,
            "warm": bool(held) and bool(needed) and sum(held) >= WARM * needed,
            "busiest": {"member": busiest[1].get("member"), "utilization": busiest[0],
                        "link_capacity": busiest[1]["link_capacity"], "source": busiest[1].get("link_source")}
            if busiest else None,
            "unmeasured": sum(1 for r in fresh if not number(r.get("link_capacity"))),
            "cache_size": sorted(c for r in fresh if (c := number(r.get("capacity_bytes"))))[len(fresh) // 2]
            if all(number(r.get("capacity_bytes")) for r in fresh) else None,
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
           if all(number(d.get(k)) is not None for d in (start, end) for k in ("cpu_busy", "cpu_all")) else None)
    busy = None
    if all(number(d.get(k)) is not None for d in (start, end) for k in ("backend_busy_seconds", "time")):
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
    asks0, asks1 = number(before.get("isatty_asks")), number(after.get("isatty_asks"))
    return {"hit_ratio": _share(hit, hit + miss),
            "peer_role": p1.get("role"), "peer_share": _share(peer_in, hit + miss) if p1 else None,
            "peer_failures": failed, "peer_mode": p1.get("mode"), "peer_share_bytes": number(p1.get("share_bytes")),
            "peer_refusing": [str(r) for r in (p1.get("refusing") or [])][:16],
            "peer_store_error": str(p1.get("store_error") or "")[:300] if p1.get("store_reachable") is False else "",
            "peer_cache_size_bytes": number(p1.get("cache_size_bytes")),
            "peer_tier_cache_bytes": number(p1.get("tier_cache_bytes")),
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
            "prefetch_wanted_inflight": number(after["prefetch"].get("wanted_inflight")),
            "prefetch_max_inflight": number(after["prefetch"].get("max_inflight")),
            "prefetch_advised_inflight": number(after["prefetch"].get("advised_inflight")),
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
            "tier": tier_view(p1.get("load"), _needed(p1) or (snap["bytes"] or 0) * (number(p1.get("replicas")) or 1))
            if p1 else None,
            "memory": _memory_view(before, after, seconds),
            "options": after.get("options") if isinstance(after.get("options"), dict) else {}}


def _memory_view(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, float] | None:
    """The memory limit, the resident set and how much of the window fetches ahead waited for room under
    it (their waits summed: 2.0 is two fetches waiting all along); None where the daemon does not say."""
    m0, m1 = before.get("memory") or {}, after.get("memory") or {}
    limit, t1 = number(m1.get("limit")), number(m1.get("throttled_seconds"))
    t0 = number(m0.get("throttled_seconds")) or 0.0  # (an earlier reply without it: since the start)
    if limit is None or t1 is None or seconds <= 0:
        return None
    return {"limit": limit, "resident": number(m1.get("resident")) or 0.0, "throttled": max(0.0, t1 - t0) / seconds}


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
        out.append("the kernel reads cached files itself (passthrough)")
    return out
