"""Markdown tables and PNG charts from a results JSON."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from workloads import load_text

ORDER = ["raw disk", "raw boto3", "JuiceFS", "s3fs", "rclone", "epochfs lru", "epochfs+manifest"]


def _table(results: dict[str, Any]) -> dict[tuple[str, str], dict[str, list[float]]]:
    cells: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for m in results["measurements"]:
        cells[(m["workload"], m["state"])][m["contender"]].append(m["value"])
    return cells


def _fmt(values: list[float]) -> str:
    if not values:
        return ""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.4g}"
    return f"{med:.4g} ({min(values):.4g}-{max(values):.4g})"


def _median(cells: Any, workload: str, state: str, contender: str) -> float | None:
    values = cells.get((workload, state), {}).get(contender)
    return statistics.median(values) if values else None


def ratios(results: dict[str, Any]) -> list[tuple[str, float | None]]:
    cells = _table(results)
    out = []
    for workload in ("large 1 stream MiB/s", "large 4 streams MiB/s", "100KiB files/s, 1 thread",
                     "100KiB files/s, 16 threads"):
        e = _median(cells, workload, "warm", "epochfs lru")
        d = _median(cells, workload, "warm", "raw disk")
        out.append((f"epochfs / raw disk, warm, {workload}", e / d if e and d else None))
        e_hot = _median(cells, workload, "hot", "epochfs lru")
        d_hot = _median(cells, workload, "hot", "raw disk")
        out.append((f"epochfs / raw disk page cache, hot, {workload}", e_hot / d_hot if e_hot and d_hot else None))
        ec = _median(cells, workload, "cold", "epochfs+manifest")
        b = _median(cells, workload, "cold", "raw boto3")
        out.append((f"epochfs+manifest / raw boto3, cold, {workload}", ec / b if ec and b else None))
        for state in ("cold", "warm"):
            peers = [v for v in (_median(cells, workload, state, p) for p in ("JuiceFS", "s3fs", "rclone")) if v]
            best = max(peers) if peers else None
            mine = max(v for v in (_median(cells, workload, state, p) for p in ("epochfs lru", "epochfs+manifest"))
                       if v) if any(_median(cells, workload, state, p) for p in ("epochfs lru", "epochfs+manifest")) else None
            out.append((f"epochfs / best peer, {state}, {workload}", mine / best if mine and best else None))
    for row in results.get("policy_study", []):
        out.append((f"achieved / optimal backend bytes, {row['policy']}, cache {row['cache_fraction']:.0%}",
                    row["achieved_over_optimal"]))
    return out


def write_report(results: dict[str, Any], stem: Path) -> None:
    cells = _table(results)
    contenders = [c for c in ORDER if any(c in v for v in cells.values())]
    lines = [f"# epochfs benchmarks, {results['date']}{' (quick)' if results['quick'] else ''}", ""]
    mach = results["machine"]
    lines += [f"Machine: {mach['cpus']} x {mach['cpu']}, {mach['memory_gib']} GiB, kernel {mach['kernel']}, "
              f"Python {mach['python']}; disk `{mach['disk']}`. Local SeaweedFS S3 endpoint on loopback. "
              f"Medians of {results['reps']} interleaved run(s), (min-max) when more than one. Page cache "
              "dropped before every cold and warm pass; *hot* reads again without dropping it.", "",
              load_text(mach.get("outside_load")), ""]
    lines += ["| workload | state | " + " | ".join(contenders) + " |", "|---|---|" + "---|" * len(contenders)]
    for (workload, state), by in sorted(cells.items(), key=lambda kv: (kv[0][0], ["cold", "warm", "hot", "-"].index(kv[0][1]))):
        lines.append(f"| {workload} | {state} | " + " | ".join(_fmt(by.get(c, [])) for c in contenders) + " |")
    lines += ["", "## Ratios", "", "| ratio | value |", "|---|---|"]
    lines += [f"| {name} | {v:.2f} |" if v is not None else f"| {name} | n/a |" for name, v in ratios(results)]
    tr = results.get("training")
    if tr:
        lines += ["", "## Training simulation (MLPerf Storage style)", "",
                  f"{tr['files']} files of 100 KiB, batches of {tr['batch']}, {tr['compute_seconds'] * 1000:.0f} ms "
                  f"of compute per batch ({tr['batch'] * 100 / 1024 / tr['compute_seconds']:.0f} MiB/s per "
                  f"accelerator), {tr['workers']} reader threads per accelerator, {tr['epochs']} epochs with a "
                  "fresh seeded shuffle, cold cache at the start. AU = compute time / wall time (first step "
                  "excluded).", "",
                  "| contender | added latency | accelerators | AU epoch 1 | AU epoch 2 | AU epoch 3 |",
                  "|---|---|---|---|---|---|"]
        for run in tr["runs"]:
            if "au_per_epoch" in run:
                lines.append(f"| {run['contender']} | {run['latency_ms']:g} ms | {run['accelerators']} | "
                             + " | ".join(f"{a:.1%}" for a in run["au_per_epoch"]) + " |")
        lines += ["", "| contender | added latency | most accelerators with AU >= 90% |", "|---|---|---|"]
        for run in tr["runs"]:
            if "max_accelerators_au90" in run:
                lines.append(f"| {run['contender']} | {run['latency_ms']:g} ms | {run['max_accelerators_au90']} |")
    po = results.get("policy_study")
    if po:
        lines += ["", "## Cache policy study", "",
                  "Three reshuffled epochs of 256 KiB files (one block each), read in order; backend MiB per epoch.",
                  "", "| cache | policy | epoch 1 | epoch 2 | epoch 3 | total | offline optimum | achieved / optimal |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in po:
            per = " | ".join(f"{b / 2**20:.1f}" for b in row["backend_bytes_per_epoch"])
            lines.append(f"| {row['cache_fraction']:.0%} | {row['policy']} | {per} | {row['backend_bytes'] / 2**20:.1f} | "
                         f"{row['optimum_bytes'] / 2**20:.1f} | {row['achieved_over_optimal']:.3f} |")
    ns = results.get("namespace")
    if ns:
        lines += ["", "## Shared metadata store (Redis)", "",
                  "| entries | publish (epochfs import) | mount, ready | daemon RSS |", "|---|---|---|---|"]
        for row in ns:
            lines.append(f"| {row['entries']:,} | {row['publish_seconds']:.1f} s | {row['mount_seconds']:.1f} s | "
                         f"{row['daemon_rss_mib']:.0f} MiB |")
    ov = results.get("latency_proxy_overhead")
    if ov:
        lines += ["", f"Latency proxy overhead at 0 ms: {ov['via_proxy_files_per_s']:.0f} files/s through it vs "
                  f"{ov['direct_files_per_s']:.0f} direct (1 thread, 100 KiB GETs)."]
    lines += ["", "## Contenders and their tuning", ""]
    lines += [f"- **{c['name']}**: {c['tuning']}" for c in results["contenders"].values()]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    _charts(results, cells, contenders, stem)


def _charts(results: dict[str, Any], cells: Any, contenders: list[str], stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    for ax, workload in zip(axes, ("large 1 stream MiB/s", "large 4 streams MiB/s", "100KiB files/s, 1 thread",
                                   "100KiB files/s, 16 threads"), strict=True):
        width = 0.27
        for i, state in enumerate(("cold", "warm", "hot")):
            vals = [_median(cells, workload, state, c) or 0 for c in contenders]
            ax.bar([x + (i - 1) * width for x in range(len(contenders))], vals, width, label=state)
        ax.set_title(workload)
        ax.set_xticks(range(len(contenders)), contenders, rotation=35, ha="right", fontsize=8)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(f"{stem}-throughput.png", dpi=90)
    plt.close(fig)

    tr = results.get("training")
    runs = [r for r in tr["runs"] if "au_per_epoch" in r] if tr else []
    if runs:  # (none when run with --latency-ms and no values)
        latencies = sorted({r["latency_ms"] for r in runs})
        fig, axes = plt.subplots(1, len(latencies), figsize=(7 * len(latencies), 4.5), squeeze=False)
        for ax, lat in zip(axes[0], latencies, strict=True):
            names = [c for c in ORDER if any(r["contender"] == c and r["latency_ms"] == lat for r in runs)]
            n_max = max(r["accelerators"] for r in runs if r["latency_ms"] == lat)
            for i, name in enumerate(names):
                r = next(r for r in runs if r["contender"] == name and r["latency_ms"] == lat
                         and r["accelerators"] == n_max)
                ax.bar([e + i * 0.15 for e in range(3)], [a * 100 for a in r["au_per_epoch"]], 0.15, label=name)
            ax.axhline(90, color="red", linestyle="--", linewidth=1)
            ax.set_title(f"AU per epoch, {n_max} accelerators, +{lat:g} ms")
            ax.set_xticks([e + 0.3 for e in range(3)], ["epoch 1", "epoch 2", "epoch 3"])
            ax.set_ylabel("AU %")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(f"{stem}-training.png", dpi=90)
        plt.close(fig)

    po = results.get("policy_study")
    if po:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = [f"{r['policy']}\n{r['cache_fraction']:.0%}" for r in po]
        ax.bar(range(len(po)), [r["backend_bytes"] / 2**20 for r in po], label="backend MiB (3 epochs)")
        ax.scatter(range(len(po)), [r["optimum_bytes"] / 2**20 for r in po], color="red", zorder=3,
                   label="offline optimum")
        ax.set_xticks(range(len(po)), labels)
        ax.legend()
        ax.set_title("Backend bytes over 3 reshuffled epochs")
        fig.tight_layout()
        fig.savefig(f"{stem}-policy.png", dpi=90)
        plt.close(fig)
