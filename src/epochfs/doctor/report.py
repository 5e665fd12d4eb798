"""The doctor's answer: the verdict, the findings and what an epoch and a day cost (``epochfs doctor
--json``), the before/after of ``--compare``, and the answer in words. Pure."""

from __future__ import annotations

from typing import Any

from epochfs.core.text import human, plural
from epochfs.doctor.cost import DAY, Cost, Prices, Usage, describe_dict, usage_of
from epochfs.doctor.findings import findings_of
from epochfs.doctor.views import (
    HIT_RATIO,
    checkpoint_view,
    describe_window,
    in_place,
    job_view,
    mount_view,
    phase_origins,
    verdict_of,
)


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
    # With no job reporting, the mount's own counters still judge it: a hit ratio under the alert's line
    # (EpochfsHitRatioLow) is a finding whether or not a job says it waited.
    cold = view is None and mount["hit_ratio"] is not None and mount["hit_ratio"] < HIT_RATIO
    findings = findings_of(mount, view) if troubled or cold or mount["errors"] else []
    return {"verdict": verdict, "job": view,
            "data_wait_fraction": view["data_wait_fraction"] if view else None,
            "judged_on": describe_window(view) if view else None,
            "mount": mount, "in_place": in_place(mount), "findings": findings,
            "checkpoints": checkpoint_view(view, checkpoints if checkpoints is not None else after,
                                           named=checkpoints is not None),
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


#: A difference of per-day costs under this share of them is within what two runs of one job differ by.
NOISE = 0.05


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows (what, before, after) of two diagnoses (``--save``, then ``--compare``); money is the per-day
    cost of the phase each was judged on, and the last row what the change saves per day."""
    def get(d: dict[str, Any], path: tuple[str, ...], fmt: str) -> str:
        v = _get(d, path)
        return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    def first(d: dict[str, Any]) -> str:
        return str(_get(d, ("job", "phases", "first", "verdict")) or "-")

    rows = [("verdict", str(before.get("verdict", "-")), str(after.get("verdict", "-"))),
            ("first epoch: verdict", first(before), first(after))]
    rows += [(what, get(before, path, fmt), get(after, path, fmt)) if path else (what, "", "")
             for what, path, fmt in COMPARED]
    b, a = _get(before, ("cost", "*", "day", "total_usd")), _get(after, ("cost", "*", "day", "total_usd"))
    if isinstance(b, (int, float)) and isinstance(a, (int, float)):
        if abs(b - a) < NOISE * max(abs(b), abs(a)):  # (one run's measurement cannot tell such a difference)
            rows.append(("saved per day, $", "", f"none to tell: within {NOISE:.0%} (${b - a:,.2f})"))
        else:
            rows.append(("saved per day, $", "", f"${b - a:,.2f}"))
    return rows


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if key == "*":  # the phase the diagnosis was judged on: the later epochs once there are any
            key = "later" if isinstance(d, dict) and isinstance(d.get("later"), dict) else "first"
        d = d.get(key) if isinstance(d, dict) else None
    return d


def describe_checkpoints(c: dict[str, Any]) -> str:
    """The checkpoint line of the text output: how long a save holds the job, and what is not yet durable."""
    parts = []
    if isinstance(c.get("save_seconds"), (int, float)):
        parts.append(f"a save holds the job {c['save_seconds']:.1f} s")
    if c.get("writeback"):
        pending, files = c.get("pending_bytes") or 0, int(c.get("pending_files") or 0)
        if pending or files:
            oldest = c.get("oldest_pending_seconds")
            parts.append(f"{plural(files, 'file')} ({human(pending)}) not yet in the backend"
                         + (f", the oldest waiting {oldest:.0f} s" if isinstance(oldest, (int, float)) else "")
                         + " (`epochfs sync` returns once they are)")
        else:
            parts.append("everything saved is in the backend")
        done = int(c.get("uploaded_files") or 0)
        if done:
            parts.append(f"{plural(done, 'file')} ({human(c.get('uploaded_bytes') or 0)}) uploaded since the "
                         "mount started")
        if c.get("upload_errors"):
            parts.append(f"{plural(int(c['upload_errors']), 'upload')} failed and retried")
    elif c.get("named"):
        parts.append("the checkpoint mount does not write back: saves wait for the backend")
    else:
        parts.append("the mount they go to is not known (`--checkpoints MOUNT` names it)")
    return "; ".join(parts)


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
        hit = (result.get("mount") or {}).get("hit_ratio")
        if isinstance(hit, (int, float)):
            low = (f", under the {HIT_RATIO:.0%} the EpochfsHitRatioLow alert fires at: reads wait for the backend"
                   if hit < HIT_RATIO else "")
            lines.append(f"  the mount's own counters: hit ratio {hit:.1%} by bytes{low}")
    elif wait is None:
        saves = view.get("checkpoint_save_seconds")
        took = f", a save taking {saves:.1f} s as the job sees it" if isinstance(saves, (int, float)) else ""
        lines.append(f"no-job-data: {', '.join(view['jobs'])} reported checkpoint saves only{took}: no training "
                     "steps (wrap the data loader, on the data mount, with epochfs.watch.watch; `epochfs doctor "
                     "DATA-MOUNT --checkpoints THIS-MOUNT` reads these saves with its steps)")
    else:
        gpu = view.get("gpu_utilization")
        gpu_text = f", GPU {gpu:.0f}% busy" if isinstance(gpu, (int, float)) else ""
        phases = view.get("phases") or {}
        cold = phases.get("first") if view.get("judged_on") != "first" else None
        also = (f"; the first epoch {cold['verdict']}: waited {cold['data_wait_fraction']:.0%}"
                if cold and cold["verdict"] != result["verdict"] else "")
        lines.append(f"{result['verdict']}: {', '.join(view['jobs'])} ({view['ranks']} rank(s)) waited for data "
                     f"{wait:.0%} of step time{gpu_text}, over {result.get('judged_on') or 'its reports'}{also}")
        if view.get("handed_over") is False:
            lines.append("  it read without handing over its epoch order: nothing was fetched ahead of it")
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
    ckpt = result.get("checkpoints")
    if isinstance(ckpt, dict):
        lines.append("  checkpoints: " + describe_checkpoints(ckpt))
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
