"""``epochfs doctor``: is the training job waiting for storage, and if so, why. Pure: it reads two
``status`` replies taken ``seconds`` apart (the jobs' own reports, see :mod:`epochfs.watch`, and the
mount's state) and returns a verdict with its findings.

The rules are the operators' ones:

- a job that waits for data more than half of its step time, or whose GPU is under 50% busy while it
  waits at least a fifth, is ``storage-bound``; one that waits under a fifth is ``compute-bound``; in
  between, ``balanced``; without reports in the daemon's window, ``no-job-data``;
- for a storage-bound job, each cause the mount's own state (or the job's timed checkpoint saves) shows
  is a finding with its fix.
"""

from __future__ import annotations

from typing import Any

from epochfs.stats import HistogramSnapshot

STORAGE_BOUND = 0.5  # of step time spent waiting for data
COMPUTE_BOUND = 0.2
GPU_IDLE = 50.0  # percent
HIT_RATIO = 0.85  # the alert's threshold
BACKEND_BUSY = 0.7  # of --backend-bandwidth
SLOW_BACKEND = 0.020  # seconds, median of a block request
SMALL_FILES = 1 << 20  # average object size below which small files dominate
BACKLOG_SECONDS = 60.0  # the oldest written file waiting this long for its upload
SLOW_SAVE = 30.0  # seconds a checkpoint save keeps the job from training
CACHE_TIER = 0.5  # of the bytes read that came from the cluster tier's members


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def job_view(status: dict[str, Any], job: str | None) -> dict[str, Any] | None:
    """The chosen job's ranks summed over the daemon's window (None: no reports there)."""
    ranks = [j for j in status.get("jobs", []) if job is None or j["job"] == job]
    ranks = [j for j in ranks if j["window"]["steps"] or j["window"].get("saves")]
    if not ranks:
        return None
    wait = sum(j["window"]["data_wait"] for j in ranks)
    compute = sum(j["window"]["compute"] for j in ranks)
    steps = sum(j["window"]["steps"] for j in ranks)
    gpus = [j["gpu_utilization"] for j in ranks if j["gpu_utilization"] is not None]
    saves = sum(j["window"].get("saves", 0) for j in ranks)
    save_seconds = sum(j["window"].get("save_seconds", 0.0) for j in ranks)
    return {"jobs": sorted({j["job"] for j in ranks}), "ranks": len(ranks), "steps": steps,
            "data_wait_fraction": _share(wait, wait + compute),
            "step_seconds": (wait + compute) / steps if steps else None, "gpu_utilization": sum(gpus) / len(gpus) if gpus else None,
            "checkpoint_save_seconds": save_seconds / saves if saves else None}


def verdict_of(view: dict[str, Any] | None) -> str:
    if view is None or view["data_wait_fraction"] is None:
        return "no-job-data"
    wait, gpu = view["data_wait_fraction"], view["gpu_utilization"]
    if wait > STORAGE_BOUND or (gpu is not None and gpu < GPU_IDLE and wait >= COMPUTE_BOUND):
        return "storage-bound"
    return "compute-bound" if wait < COMPUTE_BOUND else "balanced"


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
    return {"hit_ratio": _share(hit, hit + miss),
            "peer_role": p1.get("role"), "peer_share": _share(peer_in, hit + miss) if p1 else None,
            "peer_failures": failed,
            "backend_bytes_per_second": backend / seconds if seconds > 0 else 0.0,
            "backend_bandwidth_limit": after["backend"].get("bandwidth_limit"),
            "backend_median_seconds": HistogramSnapshot.from_dict(latency).quantile(0.5) if latency else None,
            "average_object_bytes": snap["bytes"] / snap["objects"] if snap["objects"] else None,
            "manifest_files": after["prefetch"]["files"], "plan_bytes": after["prefetch"]["plan_bytes"],
            "cache_capacity_bytes": after["store"]["capacity_bytes"],
            "writeback": after.get("writeback")}


def findings_of(m: dict[str, Any], view: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """What the mount's state shows that makes a job wait for data, each with its fix."""
    out = []

    def found(cause: str, evidence: str, fix: str) -> None:
        out.append({"cause": cause, "evidence": evidence, "fix": fix})

    if not m["manifest_files"]:
        found("no-manifest", "no epoch order was handed over: nothing is prefetched ahead of the reader",
              "wrap the sampler in epochfs.torch.EpochfsSampler, or run `epochfs prefetch MOUNT --manifest FILE` "
              "before each epoch")
    if m["hit_ratio"] is not None and m["hit_ratio"] < HIT_RATIO:
        found("low-hit-ratio", f"hit ratio {m['hit_ratio']:.0%} (under {HIT_RATIO:.0%})",
              "hand over the epoch's order so the first pass hits, and give the cache room for the working set "
              "(`epochfs plan` says how much)")
    if m["plan_bytes"] > m["cache_capacity_bytes"]:
        found("cache-too-small", f"the handed-over plan needs {m['plan_bytes']} bytes, the cache holds "
              f"{m['cache_capacity_bytes']}", f"mount with --cache-size of at least {m['plan_bytes']} bytes "
              "(or a larger cache disk)")
    limit = m["backend_bandwidth_limit"]
    if limit and m["backend_bytes_per_second"] > BACKEND_BUSY * limit:
        found("backend-saturated", f"the backend link is {m['backend_bytes_per_second'] / limit:.0%} busy "
              f"(over {BACKEND_BUSY:.0%} of --backend-bandwidth)",
              "share fetches across the nodes (--peer-listen) or cache more of the dataset: the link is the bound")
    if m["backend_median_seconds"] is not None and m["backend_median_seconds"] > SLOW_BACKEND:
        found("backend-latency", f"a block request takes {m['backend_median_seconds'] * 1000:.0f} ms (median)",
              "keep more requests in flight: --backend-concurrency and --readahead higher, or a manifest so the "
              "prefetcher fetches ahead")
    avg = m["average_object_bytes"]
    if avg is not None and avg < SMALL_FILES:
        found("small-files", f"objects average {avg / 1024:.0f} KiB: each costs a request and an open",
              "pack them into shards (WebDataset, TFRecord) or hand over the order so they are fetched ahead")
    share = m.get("peer_share")
    if share is not None and share >= CACHE_TIER:
        found("cache-tier", f"{share:.0%} of what this node reads comes from the cluster tier's "
              f"{'cache nodes' if m.get('peer_role') == 'client' else 'members'}",
              "if they are busy (`epochfs cluster status SOURCE --meta URL` shows their link load; "
              "EpochfsCacheNodesBusy fires past 70%), add a cache node: `epochfs serve SOURCE ... --rebalance`")
    if m.get("peer_failures"):
        found("cache-tier-failing", f"{m['peer_failures']} requests to the cluster tier failed (no answer in "
              "time, or one that did not check out) and went to the backend",
              "see `epochfs status` for the members bypassed and their logs; --peer-timeout bounds each wait")
    wb = m["writeback"]
    if wb and wb["pending_bytes"] and wb["oldest_pending_seconds"] > BACKLOG_SECONDS:
        found("writeback-backlog", f"{wb['pending_bytes']} bytes written wait for upload, the oldest "
              f"{wb['oldest_pending_seconds']:.0f} s", "uploads compete with reads for the link: cap them "
              "(--upload-bandwidth) or save checkpoints less often")
    save = view.get("checkpoint_save_seconds") if view else None
    if save is not None and save > SLOW_SAVE:
        found("slow-checkpoints", f"a checkpoint save takes {save:.0f} s as the job sees it",
              "save to an epochfs --writeback mount: saves at local-disk speed, uploaded in the background")
    return out


def diagnose(before: dict[str, Any], after: dict[str, Any], seconds: float, job: str | None = None) -> dict[str, Any]:
    """The doctor's answer (what ``epochfs doctor --json`` prints)."""
    view = job_view(after, job)
    verdict = verdict_of(view)
    mount = mount_view(before, after, seconds)
    return {"verdict": verdict, "job": view,
            "data_wait_fraction": view["data_wait_fraction"] if view else None,
            "mount": mount, "findings": findings_of(mount, view) if verdict == "storage-bound" else []}


COMPARED = [("data wait share", ("data_wait_fraction",), "{:.0%}"), ("step time, s", ("job", "step_seconds"), "{:.4f}"),
            ("GPU utilisation, %", ("job", "gpu_utilization"), "{:.0f}"), ("hit ratio", ("mount", "hit_ratio"), "{:.1%}"),
            ("backend bytes/s while doctor ran", ("mount", "backend_bytes_per_second"), "{:.0f}"),
            ("checkpoint save, s", ("job", "checkpoint_save_seconds"), "{:.2f}")]


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows (what, before, after) of two diagnoses (``--save``, then ``--compare``)."""
    def get(d: dict[str, Any], path: tuple[str, ...], fmt: str) -> str:
        for key in path:
            d = d.get(key) if isinstance(d, dict) else None  # type: ignore[assignment]
        return fmt.format(d) if isinstance(d, (int, float)) else "-"

    rows = [("verdict", before.get("verdict", "-"), after.get("verdict", "-"))]
    rows += [(what, get(before, path, fmt), get(after, path, fmt)) for what, path, fmt in COMPARED]
    return rows
